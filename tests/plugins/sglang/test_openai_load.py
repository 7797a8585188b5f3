"""The OpenAI routes under load: 128 chat completions from 64 concurrent ``AsyncOpenAI``
clients (a quarter streamed), none lost or mixed up. The engine is batch-invariant and
each prompt has its own seed, so each answer must equal its prompt's answer when it ran
alone. Every handler awaits the engine without holding a thread-pool thread (Starlette's
pool has 40), which this load would otherwise exhaust."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

from tests.agentic.chat_fixtures import build_chat_model  # noqa: E402
from tests.plugins.sglang.conftest import serve  # noqa: E402

CLIENTS, PER_CLIENT, PROMPTS = 64, 2, 8
MAX_TOKENS = 6


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Count {i % PROMPTS} please."}]


async def ask(client, model: str, i: int) -> tuple[str, str | None, int]:
    # sampled with the prompt's own seed: distinct answers, each reproducible whatever else runs
    kwargs = dict(model=model, messages=messages(i), max_tokens=MAX_TOKENS, temperature=1.0, seed=i % PROMPTS)
    if i % 4 == 0:
        stream = await client.chat.completions.create(stream=True, **kwargs)
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, -1
    response = await client.chat.completions.create(**kwargs)
    return response.choices[0].message.content or "", response.choices[0].finish_reason, response.usage.completion_tokens


def test_128_chat_completions_from_64_clients(tmp_path):
    model_dir = build_chat_model(tmp_path / "model")
    handle = serve(model_dir, engine_kwargs={"batch_invariant": True})
    model = str(model_dir)

    async def run():
        alone = openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reference = [await ask(alone, model, i) for i in range(1, PROMPTS + 1)]  # non-streamed, one at a time
        await alone.close()
        clients = [openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                   for _ in range(CLIENTS)]

        async def client_task(c: int):
            return [(i, await ask(clients[c], model, i)) for i in range(c * PER_CLIENT, (c + 1) * PER_CLIENT)]

        try:
            answers = await asyncio.gather(*(client_task(c) for c in range(CLIENTS)))
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        return {(i % PROMPTS): ref for i, ref in zip(range(1, PROMPTS + 1), reference)}, \
            [item for per_client in answers for item in per_client]

    try:
        reference, answers = asyncio.run(run())
    finally:
        handle.shutdown()
    assert sorted(i for i, _ in answers) == list(range(CLIENTS * PER_CLIENT))
    assert len({text for text, _, _ in reference.values()}) > 1  # the prompts' answers tell them apart
    for i, (text, finish, completion_tokens) in answers:
        ref_text, ref_finish, ref_tokens = reference[i % PROMPTS]
        assert (text, finish) == (ref_text, ref_finish), i
        assert completion_tokens in (-1, ref_tokens)
