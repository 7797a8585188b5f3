"""The sglang backend colocated (``--colocate`` / ``--offload-rollout``) against ``miles serve``:
SGLang's memory endpoints in slime's order around the weight push, generation after the resume,
and the pushed weights the ones generating (transformers' greedy tokens of the same weights)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from miles_host.cli.main import main
from miles_host.phases import PhasePlan, Phases
from miles_host.protocols import TrainerBase
from miles_sglang.backend import SGLangRolloutBackend
from miles_sglang.client import SGLangClient
from miles_sglang.weights import family_and_config, native_to_hf
from tests.loop.conftest import base_args, read_metrics
from tests.plugins.sglang.conftest import http, make_engine, serve
from tests.plugins.sglang.test_backend import GREEDY, backend_config, drain

transformers = pytest.importorskip("transformers")

#: the memory calls of one colocated step, as slime makes them (train.py: offload, onload weights,
#: update_weights, onload cuda_graph, onload kv_cache)
SLIME_ORDER = [
    ("GET", "/flush_cache", None),
    ("POST", "/release_memory_occupation", ["weights", "cuda_graph", "kv_cache"]),
    ("POST", "/resume_memory_occupation", ["weights"]),
    ("POST", "/update_weights_from_tensor", None),
    ("POST", "/resume_memory_occupation", ["cuda_graph"]),
    ("POST", "/resume_memory_occupation", ["kv_cache"]),
]
_WATCHED = {path for _, path, _ in SLIME_ORDER}


@pytest.fixture
def wire(monkeypatch):
    """Every memory, flush and weight request the backend sends: (method, path, tags)."""
    calls = []
    request = SGLangClient.request

    def recording(self, method, path, body=None, **kwargs):
        if path in _WATCHED:
            calls.append((method, path, body.get("tags") if isinstance(body, dict) and "tags" in body else None))
        return request(self, method, path, body, **kwargs)

    monkeypatch.setattr(SGLangClient, "request", recording)
    return calls


def _transformers_greedy(model_path, hf_named, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of the HF model with ``hf_named`` loaded: the independent reference."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    state = model.state_dict()
    for name, tensor in hf_named:
        state[name] = tensor
    model.load_state_dict(state)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_colocated_step_releases_resumes_and_generates_with_pushed_weights(dense_model, wire):
    handle = serve(dense_model)
    backend = SGLangRolloutBackend(backend_config(handle.url, dense_model, update_weight_buffer_size=1 << 30))
    # --colocate --offload-rollout: the engines release their KV cache and weights while training
    phases = Phases(PhasePlan(rollout_tags=("kv_cache", "weights"), empty_train_cache=True), TrainerBase(), backend)
    prompt = [2, 3, 4]
    try:
        phases.to_train()
        assert handle.state.released_tags == {"weights", "cuda_graph", "kv_cache"}
        assert handle.state.worker.engine.released_tags == {"weights", "kv_cache"}  # the engine's own offload
        status, answer = http(handle.url, "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
        assert status == 400 and "released" in json.dumps(answer)

        torch.manual_seed(3)
        native = [(n, t + 0.3 * torch.randn_like(t)) for n, t in make_engine(dense_model).model.state_dict().items()]
        assert phases.to_rollout(lambda: backend.update_weights(native, weight_version=1)) == 1
        assert wire == SLIME_ORDER
        assert handle.state.released_tags == set() and not handle.state.worker.engine.released_tags

        backend.submit("after", prompt, GREEDY)
        (output,) = drain(backend)
        assert output["meta_info"]["weight_version"] == "1"
        family, config = family_and_config(str(dense_model))
        new_tokens = GREEDY["max_new_tokens"]
        pushed = _transformers_greedy(dense_model, native_to_hf(native, family, config), prompt, new_tokens)
        original = _transformers_greedy(dense_model, [], prompt, new_tokens)
        assert output["output_ids"] == pushed
        assert pushed != original  # the push changed what greedy decoding gives
    finally:
        backend.shutdown()
        handle.shutdown()


def test_colocate_alone_keeps_the_weights_resident(dense_model, wire):
    """``--colocate`` without ``--offload-rollout``: the KV cache (and its CUDA graph memory) only."""
    handle = serve(dense_model)
    backend = SGLangRolloutBackend(backend_config(handle.url, dense_model))
    phases = Phases(PhasePlan(rollout_tags=("kv_cache",), empty_train_cache=True), TrainerBase(), backend)
    try:
        phases.to_train()
        assert handle.state.worker.engine.released_tags == {"kv_cache"}
        phases.to_rollout(lambda: 0.0)
        assert [(p, t) for _, p, t in wire if p != "/flush_cache"] == [
            ("/release_memory_occupation", ["cuda_graph", "kv_cache"]),
            ("/resume_memory_occupation", ["cuda_graph"]),
            ("/resume_memory_occupation", ["kv_cache"]),
        ]
        backend.submit("x", [2, 3], GREEDY)
        (output,) = drain(backend)
        assert output["output_ids"] == make_engine(dense_model).generate([2, 3], GREEDY)[0]["output_ids"]
    finally:
        backend.shutdown()
        handle.shutdown()


def test_serve_refuses_what_sglang_refuses(fresh_server):
    url = fresh_server.url
    assert http(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 400  # never released
    assert http(url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    status, answer = http(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "released already" in json.dumps(answer)
    assert http(url, "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
    assert http(url, "/resume_memory_occupation", {})[0] == 400  # all tags: weights, cuda_graph were not released
    assert http(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert http(url, "/get_server_info")[1]["internal_states"][0]["released_tags"] == []


def test_colocated_run_through_miles_serve(dense_model, addition_data, tmp_path, wire):
    """``miles run --rollout-backend sglang --colocate --offload-rollout``: two steps, each with the
    memory calls in slime's order around its weight push."""
    handle = serve(dense_model)
    try:
        out = tmp_path / "run"
        code = main([*base_args(dense_model, addition_data, out), "--num-rollout", "2", "--colocate",
                     "--offload-rollout", "--rollout-backend", "sglang", "--sglang-url", handle.url])
        assert code == 0
        assert [m["rollout/failed_samples"] for m in read_metrics(out)] == [0, 0]
        pushes = [i for i, call in enumerate(wire) if call[1] == "/update_weights_from_tensor"]
        assert pushes[0] == 0 and len(pushes) == 3  # the start's push (nothing released yet), then one a step
        for push in pushes[1:]:  # one bucket each (the tiny model fits the default buffer)
            assert wire[push - 3:push + 3] == SLIME_ORDER
        assert len(wire) == 1 + 2 * len(SLIME_ORDER)
        assert http(handle.url, "/get_model_info")[1]["weight_version"] == "2"
    finally:
        handle.shutdown()


@pytest.mark.parametrize("flags, saver", [
    ({"colocate": True}, True), ({"offload_rollout": True}, True), ({}, False),
])
def test_launched_sglang_servers_get_the_memory_saver_when_colocated(flags, saver):
    from miles_sglang.launcher import server_command
    from tests.plugins.sglang.test_launcher import _config

    command = server_command(_config(**flags), 30001, "sglang")
    assert ("--enable-memory-saver" in command) is saver
    miles_serve = server_command(_config(rollout_num_gpus_per_engine=1, **flags), 30002, "miles")
    assert "--enable-memory-saver" not in miles_serve


def test_servers_started_elsewhere_are_warned_about_once(capsys):
    from miles_sglang import flag_checks

    flag_checks._warned.discard("--colocate")
    config = SimpleNamespace(colocate=True, offload_rollout=False, sglang_url=["http://127.0.0.1:1"],
                             sglang_router_ip=None)
    assert flag_checks.check_colocated_servers(config) == ["--colocate"]
    assert flag_checks.check_colocated_servers(config) == []
    assert capsys.readouterr().err.count("only if they were started with --enable-memory-saver") == 1
    assert flag_checks.check_colocated_servers(SimpleNamespace(colocate=True, offload_rollout=True, sglang_url=None,
                                                               sglang_router_ip=None)) == []  # miles launches them
