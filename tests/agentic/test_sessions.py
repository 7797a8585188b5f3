"""Rollout sessions: an unmodified agent loop with the official openai client drives a
trajectory of the real engine; the sample holds exactly the engine's token ids and
log-probs, trains only the generated tokens, and a prompt that breaks the recorded prefix
is refused naming the turn (or retokenized / dropped, as configured)."""

from __future__ import annotations

import pytest

from miles_host.agentic.sessions import SessionPrefixMismatch, Trajectory, mismatch_policy
from miles_host.config import MilesConfig
from miles_host.data import PromptDataset, PromptRecord
from miles_host.plugin_manager import MilesPluginManager
from miles_host.records import RewardFunction
from miles_host.registry import Registry
from miles_host.reward import RewardScorer
from miles_host.rollout_backend import EmbeddedRolloutBackend
from miles_host.rollout_manager import RolloutManager
from miles_host.sample import Sample, Status
from tests.agentic import agents

# -- the token record, without a server -------------------------------------------


def test_a_trajectory_trains_generated_tokens_only():
    trajectory = Trajectory()
    assert trajectory.begin_turn([5, 6, 7]) == [5, 6, 7]
    trajectory.record_output([8, 9], [-0.1, -0.2], {"type": "stop", "matched": 9})
    assert trajectory.begin_turn([5, 6, 7, 8, 9, 10, 11]) == [5, 6, 7, 8, 9, 10, 11]  # template + tool tokens
    trajectory.record_output([12], [-0.3], {"type": "length", "length": 1})
    sample = trajectory.fill_sample(Sample(tokens=[5, 6, 7]), lambda ids: ",".join(map(str, ids)))
    assert sample.tokens == [5, 6, 7, 8, 9, 10, 11, 12] and sample.prompt_length == 3
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert sample.response == "8,9,10,11,12" and sample.status is Status.TRUNCATED
    sample.validate()


def test_a_prefix_mismatch_is_refused_naming_the_turn():
    trajectory = Trajectory(mismatch_policy("error"))
    trajectory.begin_turn([5, 6])
    trajectory.record_output([8, 9], [-0.1, -0.2], None)
    with pytest.raises(SessionPrefixMismatch, match="turn 2: .* first difference at token 3"):
        trajectory.begin_turn([5, 6, 8, 4, 10])
    with pytest.raises(SessionPrefixMismatch, match="turn 2"):
        trajectory.fill_sample(Sample(), str)


@pytest.mark.parametrize("policy", ["retokenize", "drop"])
def test_retokenize_keeps_the_shared_prefix_and_drop_trains_nothing(policy):
    trajectory = Trajectory(mismatch_policy(policy))
    trajectory.begin_turn([5, 6])
    trajectory.record_output([8, 9], [-0.1, -0.2], None)
    trajectory.begin_turn([5, 6, 8, 4, 10])  # the second generated token re-rendered as 4
    trajectory.record_output([11], [-0.5], None)
    sample = trajectory.fill_sample(Sample(), str)
    assert sample.tokens == [5, 6, 8, 4, 10, 11]
    assert sample.rollout_log_probs == [-0.1, 0.0, 0.0, -0.5]
    assert sample.loss_mask == ([1, 0, 0, 1] if policy == "retokenize" else [0, 0, 0, 0])
    assert "turn 2" in sample.metadata["session_mismatches"][0]
    assert ("session_dropped" in sample.metadata) == (policy == "drop")


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        mismatch_policy("ignore")


# -- the server over the real engine -------------------------------------------


class Recorder:
    """Wraps the backend's step and abort: every output the engine returned, by request id."""

    def __init__(self, backend):
        self.outputs: dict[str, dict] = {}
        step = backend.step

        def recording_step():
            outputs = step()
            for output in outputs:
                self.outputs[output["meta_info"]["id"]] = output
            return outputs

        backend.step = recording_step


def session_manager(model, generate, **flags):
    config = MilesConfig(**{"hf_checkpoint": str(model), "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                            "rollout_max_response_len": 8, "rm_type": "length", "custom_generate_function_path": generate,
                            "use_session_server": True, "apply_chat_template": True, "rollout_temperature": 1.0,
                            "max_failed_sample_fraction": 1.0, "device": "cpu", **flags})
    plugins = MilesPluginManager()
    plugins.activate()
    registry = Registry("reward function")
    registry.add(RewardFunction("length", fn=lambda sample, config: float(sample.response_length)), "test", "test")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    backend = EmbeddedRolloutBackend(config, plugins)
    prompts = [PromptRecord(f"{i}+{i}=?", str(2 * i), {}, i) for i in range(8)]
    manager = RolloutManager(config, backend, tokenizer, RewardScorer(config, registry), PromptDataset(prompts, False, 0))
    return manager, Recorder(backend), tokenizer


def test_session_samples_hold_the_engine_tokens_and_mask_the_tool_output(chat_model):
    manager, recorder, tokenizer = session_manager(chat_model, "tests.agentic.agents.two_turns_with_tool_output")
    agents.SEEN.clear()
    try:
        groups, stats = manager.generate(0)
    finally:
        manager.session_server.stop()
    assert stats.failed_samples == 0, stats.first_failure
    samples = [s for g in groups for s in g]
    assert len(samples) == 4 and len(agents.SEEN) == 4
    tool_ids = tokenizer(agents.TOOL_OUTPUT, add_special_tokens=False)["input_ids"]
    for sample in samples:
        # the engine's outputs of this trajectory, in order (request ids: custom-r0-g<g>-s<position>-0-t<turn>)
        prefix = f"custom-r0-g{sample.group_index}-s{sample.index % 2}-0-t"
        turns = [recorder.outputs[prefix + str(k)] for k in (1, 2)]
        generated = [t for output in turns for t in output["output_ids"]]
        log_probs = [entry[0] for output in turns for entry in output["meta_info"]["output_token_logprobs"]]
        response = sample.tokens[sample.prompt_length:]
        assert [t for t, m in zip(response, sample.loss_mask) if m] == generated  # exactly the sampled ids
        assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m] == log_probs
        assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
        # the reference: the chat template as text (jinja), tokenized: the first prompt, and the whole sequence
        url, messages, replies = next(seen for seen in agents.SEEN if seen[0].endswith(f"/sessions/{sample.metadata['session_id']}/v1"))
        first = tokenizer(tokenizer.apply_chat_template(messages[:1], tools=agents.TOOLS, add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False)["input_ids"]
        assert sample.tokens[:sample.prompt_length] == first
        last_prompt = tokenizer(tokenizer.apply_chat_template(messages[:3], tools=agents.TOOLS,
                                                              add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)["input_ids"]
        assert sample.tokens == last_prompt + turns[1]["output_ids"]
        # the tool output sits in the sample, not trained
        start = next(i for i in range(len(response)) if response[i:i + len(tool_ids)] == tool_ids)
        assert sample.loss_mask[start:start + len(tool_ids)] == [0] * len(tool_ids)
        # the client got the engine's log-probs
        assert [lp for _, lps in replies for lp in lps] == pytest.approx(log_probs)
        assert sample.metadata["session_turns"] == 2 and "session_url" not in sample.metadata
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
        sample.validate()


@pytest.mark.parametrize("policy", ["error", "retokenize", "drop"])
def test_an_agent_that_edits_its_history(chat_model, policy):
    manager, _, _ = session_manager(chat_model, "tests.agentic.agents.edits_its_history",
                                    session_prefix_mismatch=policy)
    try:
        groups, stats = manager.generate(0)
    finally:
        manager.session_server.stop()
    samples = [s for g in groups for s in g]
    if policy == "error":
        assert stats.failed_samples == 4
        for sample in samples:
            assert sample.status is Status.FAILED
            assert "SessionPrefixMismatch: turn 2: the rendered prompt does not start" in sample.metadata["failure"]
            assert "BadRequestError" in sample.metadata["agent_saw"] and "turn 2" in sample.metadata["agent_saw"]
    else:
        assert stats.failed_samples == 0
        for sample in samples:
            assert sample.metadata["session_turns"] == 2 and "turn 2" in sample.metadata["session_mismatches"][0]
            assert (sum(sample.loss_mask) == 0) == (policy == "drop")


#: the whole tool call as one token of the successor model (the chat template's rendering of it)
CALL = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


def test_a_tool_call_is_parsed_answered_and_its_output_not_trained(tmp_path):
    from tests.agentic.chat_fixtures import build_successor_model

    # greedy: after the generation prompt's last "\n" the model writes CALL, then <|im_end|>
    model = build_successor_model(tmp_path / "model", ["\n", CALL, "<|im_end|>"])
    manager, recorder, tokenizer = session_manager(model, "tests.agentic.agents.calls_the_calculator",
                                                   rollout_temperature=0.0)
    try:
        groups, stats = manager.generate(0)
    finally:
        manager.session_server.stop()
    assert stats.failed_samples == 0, stats.first_failure
    call_id, eos = tokenizer.convert_tokens_to_ids(CALL), tokenizer.eos_token_id
    for sample in (s for g in groups for s in g):
        assert sample.metadata["calls"] == [("tool_calls", "calculator", "2+3")] * 2  # parsed, as OpenAI sends it
        assert "session_mismatches" not in sample.metadata  # the template renders the call back to the same ids
        response = sample.tokens[sample.prompt_length:]
        assert [t for t, m in zip(response, sample.loss_mask) if m] == [call_id, eos, call_id, eos]
        not_trained = tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if not m], skip_special_tokens=False)
        assert "<tool_response>\n5\n</tool_response>" in not_trained  # the tool's answer
        prefix = f"custom-r0-g{sample.group_index}-s{sample.index % 2}-0-t"
        assert [recorder.outputs[prefix + str(k)]["output_ids"] for k in (1, 2)] == [[call_id, eos]] * 2


def test_models_and_unknown_sessions_answer_like_openai(chat_model):
    import openai

    manager, _, _ = session_manager(chat_model, "tests.agentic.agents.two_turns_with_tool_output")
    server = manager.sessions()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/sessions/nope/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no open session 'nope'"):
            client.models.list()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        server.stop()


def test_use_session_server_needs_a_custom_generate_function():
    with pytest.raises(ValueError, match="--use-session-server serves the trajectories"):
        MilesConfig(use_session_server=True)


def test_routes_of_earlier_turns_are_kept_and_each_turn_adds_its_new_rows():
    def routes(rows, value):  # [rows, 1 layer, top-1]
        import numpy as np

        return np.full((rows, 1, 1), value)

    trajectory = Trajectory()
    trajectory.begin_turn([5, 6, 7])
    trajectory.record_output([8, 9], [-0.1, -0.2], None, routed_experts=routes(4, 1))  # 3 + 2 tokens: 4 rows
    trajectory.begin_turn([5, 6, 7, 8, 9, 10])
    trajectory.record_output([11], [-0.3], None, routed_experts=routes(6, 2))  # prefill re-routes rows 0-3
    sample = trajectory.fill_sample(Sample(), str)
    assert sample.rollout_routed_experts[:, 0, 0].tolist() == [1, 1, 1, 1, 2, 2]
    assert sample.rollout_routed_experts.shape[0] == len(sample.tokens) - 1


def test_an_async_agent_streaming_through_the_session(chat_model):
    manager, recorder, tokenizer = session_manager(chat_model, "tests.agentic.agents.async_streaming_agent")
    try:
        groups, stats = manager.generate(0)
    finally:
        manager.session_server.stop()
    assert stats.failed_samples == 0, stats.first_failure
    for sample in (s for g in groups for s in g):
        prefix = f"custom-r0-g{sample.group_index}-s{sample.index % 2}-0-t"
        turns = [recorder.outputs[prefix + str(k)]["output_ids"] for k in (1, 2)]
        assert [t for t, m in zip(sample.tokens[sample.prompt_length:], sample.loss_mask) if m] == turns[0] + turns[1]
        assert [n for _, n in sample.metadata["streamed"]] == [len(ids) for ids in turns]  # usage of each turn
        for (content, _), ids in zip(sample.metadata["streamed"], turns):
            eos = tokenizer.eos_token_id
            assert content == tokenizer.decode(ids[:-1] if ids[-1] == eos else ids, skip_special_tokens=False)


def test_under_partial_rollout_an_aborted_session_trajectory_starts_again(chat_tokenizer):
    from tests.agentic.scripted import make_manager

    manager, _ = make_manager("tests.agentic.agents.one_turn_long_on_later_groups",
                              lambda sample, config: float(sample.index), step_s=0.005, partial_rollout=True,
                              over_sampling_batch_size=4, use_session_server=True, rollout_max_response_len=64)
    manager.tokenizer = chat_tokenizer
    try:
        groups0, stats0 = manager.generate(0)
        buffered = [s for g in manager.buffer for s in g]
        assert stats0.buffered_samples == 4
        # aborted mid-turn (under a loaded machine possibly before its first token)
        assert all(s.status is Status.ABORTED and s.response_length < 40 for s in buffered)
        groups1, _ = manager.generate(1)
    finally:
        manager.session_server.stop()
    assert [g[0].group_index for g in groups1] == [2, 3]
    for sample in (s for g in groups1 for s in g):
        # generated again from the prompt in a new session: 40 tokens of one turn, not the aborted ones plus more
        assert sample.status is Status.TRUNCATED and sample.metadata["session_turns"] == 1
        assert sample.response_length == sum(sample.loss_mask) == 40
