"""The engine on a hybrid model (Gated DeltaNet + gated attention, MoE with a gated shared expert):
greedy tokens and sampled log-probs equal transformers', the n samples of a prompt share its
prefill, preemption and abort free the recurrent state, refused settings say why, and a GRPO
step with R3 trains on the rollout's experts."""

from __future__ import annotations

import pytest
import torch

from tests.models.qwen_next_cases import hf_model, save_case
from tests.rollout.conftest import PROMPTS, engine_logprobs, hf_logprobs, make_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    path = save_case("qwen3_next", tmp_path_factory.mktemp("qwen3_next_engine"), peaky=True)
    return hf_model(path), str(path)


def _hf_greedy(hf, prompt, max_new_tokens):
    """transformers' argmax continuation, one full forward per token (no cache: a plain reference)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_batch_with_samples_matches_transformers(qwen3_next):
    hf, path = qwen3_next
    engine = make_engine(path)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outputs = engine.generate(PROMPTS + [PROMPTS[1]], [params] * 4 + [{**params, "n": 2}])
    expected = [_hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    assert [o["output_ids"] for o in outputs[:4]] == expected
    assert [o["output_ids"] for o in outputs[4:]] == [expected[1], expected[1]]  # forked samples
    assert len(engine.recurrent_states.slot_of) == 0  # every finished sample gave its slot back


def test_sampled_log_probs_are_log_softmax_at_temperature(qwen3_next):
    hf, path = qwen3_next
    engine = make_engine(path)
    outputs = engine.generate(
        [PROMPTS[1], PROMPTS[2]],
        [{"temperature": 0.7, "max_new_tokens": 10, "ignore_eos": True, "n": 3, "sampling_seed": 4}] * 2,
    )
    assert len({tuple(o["output_ids"]) for o in outputs[:3]}) > 1  # the samples differ after the shared prefill
    for index, output in enumerate(outputs):
        prompt = PROMPTS[1] if index < 3 else PROMPTS[2]
        reference = hf_logprobs(hf, prompt, output["output_ids"], 0.7)
        assert (engine_logprobs(output) - reference).abs().max() <= 1e-4


@pytest.mark.slow
def test_preemption_recomputes_the_recurrent_state_exactly(qwen3_next):
    _, path = qwen3_next
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    reference = make_engine(path).generate(PROMPTS, params)
    small = make_engine(path, kv_cache_tokens=72, block_size=8)  # 9 blocks for 4 sequences of up to 47 tokens
    outputs = small.generate(PROMPTS, params)
    assert small.scheduler.num_preemptions > 0
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in reference]
    assert not small.recurrent_states.slot_of


def test_abort_frees_the_recurrent_state(qwen3_next):
    _, path = qwen3_next
    engine = make_engine(path)
    engine.add_request("r", PROMPTS[1], {"temperature": 0, "max_new_tokens": 30, "n": 3})
    for _ in range(3):
        engine.step()
    assert len(engine.recurrent_states.slot_of) == 3
    engine.abort("r")
    assert not engine.recurrent_states.slot_of and not engine.recurrent_states.forks


def test_true_on_policy_and_speculative_decoding_are_refused_with_the_reason(qwen3_next, monkeypatch):
    from types import SimpleNamespace

    import miles_host.validation.host_checks as host_checks
    from miles_models import qwen_next

    from tests.models.qwen_next_cases import family_lookup

    _, path = qwen3_next
    monkeypatch.setattr(host_checks, "model_family_for", family_lookup)
    with pytest.raises(ValueError, match="true-on-policy.*Gated DeltaNet"):  # at validation
        qwen_next.miles_validate(SimpleNamespace(true_on_policy=True, hf_checkpoint=path), None)
    qwen_next.miles_validate(SimpleNamespace(true_on_policy=False, hf_checkpoint=path), None)
    with pytest.raises(ValueError, match="true-on-policy.*Gated DeltaNet"):
        make_engine(path, batch_invariant=True)
    with pytest.raises(ValueError, match="speculative decoding.*rolled back"):
        make_engine(path, decoding_strategy=lambda engine: None)


def test_the_graph_form_of_the_states_decodes_like_the_eager_one(qwen3_next, monkeypatch):
    """The decode graphs' gather/scatter by slot (:class:`GraphRecurrentStates`), run eagerly on CPU."""
    from miles_host.rollout.recurrent_graphs import GraphRecurrentStates
    from miles_host.rollout.recurrent_state import HybridAttention

    _, path = qwen3_next
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "n": 2}
    expected = make_engine(path).generate(PROMPTS, params)
    engine = make_engine(path)
    pool, eager_attach = engine.recurrent_states, engine.recurrent_states.attach

    def attach(attention, seqs, num_new):
        if any(n != 1 for n in num_new):
            return eager_attach(attention, seqs, num_new)
        return HybridAttention(attention, GraphRecurrentStates(pool, torch.tensor(pool.slots(seqs))))

    monkeypatch.setattr(pool, "attach", attach)
    got = engine.generate(PROMPTS, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
