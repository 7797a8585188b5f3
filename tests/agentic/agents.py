"""Agent loops of the session tests, written with the official ``openai`` client against the
session URL (``--custom-generate-function-path tests.agentic.agents.<name>``)."""

from __future__ import annotations

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate an arithmetic expression",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]
#: what the "tool" answers every turn (kept in the sample, never trained)
TOOL_OUTPUT = "result: 42"
#: per trajectory: (session_url, final messages, [(reply content, logprobs the client got)])
SEEN: list = []


def _client(sample):
    from openai import OpenAI

    return OpenAI(base_url=sample.metadata["session_url"], api_key="none", max_retries=0)


def two_turns_with_tool_output(args, sample, sampling_params, session):
    """Ask, append the reply and a tool answer, ask again: two model turns."""
    client = _client(sample)
    messages = [{"role": "user", "content": sample.prompt}]
    replies = []
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                               logprobs=True)
        message = reply.choices[0].message
        replies.append((message.content, [entry.logprob for entry in reply.choices[0].logprobs.content]))
        messages.append({"role": "assistant", "content": message.content or ""})
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": TOOL_OUTPUT})
    SEEN.append((sample.metadata["session_url"], messages[:-1], replies))


def edits_its_history(args, sample, sampling_params, session):
    """Rewrites the model's first reply before the second turn: a prefix mismatch."""
    client = _client(sample)
    messages = [{"role": "user", "content": sample.prompt}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages.append({"role": "assistant", "content": "[edited]"})
    messages.append({"role": "user", "content": "again"})
    try:
        client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    except Exception as error:  # noqa: BLE001 - an agent that swallows the refusal still fails its sample
        sample.metadata["agent_saw"] = f"{type(error).__name__}: {error}"
    return reply and None


async def async_streaming_agent(args, sample, sampling_params, session):
    """The async client, streaming: two turns, the tool answer between them."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=sample.metadata["session_url"], api_key="none", max_retries=0)
    messages = [{"role": "user", "content": sample.prompt}]
    streamed = []
    for _ in range(2):
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                      stream=True, stream_options={"include_usage": True})
        content, usage = "", None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                content += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        streamed.append((content, usage.completion_tokens))
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": TOOL_OUTPUT})
    sample.metadata["streamed"] = streamed


def calls_the_calculator(args, sample, sampling_params, session):
    """A tool-running loop: each tool call the model makes is evaluated and answered (two turns)."""
    client = _client(sample)
    messages = [{"role": "user", "content": sample.prompt}]
    calls = []
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            expression = __import__("json").loads(call.function.arguments)["expression"]
            calls.append((reply.choices[0].finish_reason, call.function.name, expression))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})  # noqa: S307
    sample.metadata["calls"] = calls


def one_turn_long_on_later_groups(args, sample, sampling_params, session):
    """One turn: 3 tokens for groups 0 and 1, 40 for later ones (aborted when the batch is full)."""
    client = _client(sample)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample.prompt}],
                                   max_tokens=3 if sample.group_index < 2 else 40)
