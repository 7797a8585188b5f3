"""``--lora-sync adapter``: the engine runs the trainer's LoRA layers unmerged over a base
that only the first sync carries.

After a few training steps (non-zero adapters), an engine fed the adapters alone gives the
tokens (temperature 0) and log-probs (float32 tolerance) of an engine fed the merged
weights, both matching a float64 teacher-forced reference of the trainer's model; the
adapter-only syncs hold exactly the ``lora_A`` / ``lora_B`` tensors."""

from __future__ import annotations

import pytest
import torch

from miles_host.config import MilesConfig
from miles_host.lora import apply_lora, lora_modules
from miles_host.lora.sync import SyncSelection, is_adapter_tensor, prepare_engine_model, rollout_state
from miles_host.models import load_pretrained
from tests.lora.conftest import CASES, COMMON, transformers

PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 31)), [7] * 11]
SAMPLING = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def peaky_checkpoint(request, tmp_path_factory):
    """A random checkpoint of the case with peaky logits (no near-ties for greedy decoding)."""
    config_name, model_name, extra = CASES[request.param]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **extra))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.15 if parameter.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    path = tmp_path_factory.mktemp(f"peaky_{request.param}")
    model.save_pretrained(path)
    return str(path)


def _config(path: str, mode: str) -> MilesConfig:
    return MilesConfig(hf_checkpoint=path, lora_rank=4, lora_alpha=8, lora_sync=mode)


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of ``ids[1:]`` (one packed sequence)."""
    from miles_host.models import PackedAttention
    from miles_host.models.context import ForwardContext

    parameter = next(model.parameters())
    tokens = torch.tensor(ids, device=parameter.device)
    cu = torch.tensor([0, len(ids)], dtype=torch.int32, device=parameter.device)
    targets = torch.cat([tokens[1:], tokens.new_zeros(1)])
    log_probs, _ = model.packed_log_probs(tokens, torch.arange(len(ids), device=parameter.device), cu, targets,
                                          ctx=ForwardContext(attention=PackedAttention(cu)))
    return log_probs[:-1]


def _train(model, steps: int, seed: int) -> None:
    """``steps`` Adam steps of next-token loss on random sequences (moves every adapter)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(2, COMMON["vocab_size"], (24,), generator=generator).tolist()
        loss = -_log_probs(model, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _engine(path: str, config: MilesConfig | None = None):
    from miles_host.rollout import Engine

    model = load_pretrained(path, dtype=torch.float32, device="cpu")
    if config is not None:
        model = prepare_engine_model(model, config)
    return Engine(model, kv_cache_tokens=1024)


def _tokens_and_log_probs(engine) -> list[tuple[list[int], torch.Tensor]]:
    outputs = engine.generate(PROMPTS, SAMPLING)
    return [(o["output_ids"], torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64))
            for o in outputs]


def _nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def test_merged_and_adapter_engines_agree_and_later_syncs_carry_the_adapters_only(peaky_checkpoint):
    path = peaky_checkpoint
    adapter_config, merged_config = _config(path, "adapter"), _config(path, "merged")
    trainer_model = load_pretrained(path, dtype=torch.float32, device="cpu")
    apply_lora(trainer_model, adapter_config)
    lora_names = {n for n, p in trainer_model.named_parameters() if p.requires_grad}
    assert lora_names and all(is_adapter_tensor(n) for n in lora_names)

    adapter_engine, merged_engine = _engine(path, adapter_config), _engine(path)
    assert {n for n, _ in adapter_engine.model.named_parameters() if is_adapter_tensor(n)} == lora_names
    assert not adapter_engine.model.training
    selection = SyncSelection(adapter_config)

    _train(trainer_model, 3, seed=1)
    first = selection.select(rollout_state(trainer_model, None, adapter_config))
    assert {n for n, _ in first} == set(trainer_model.state_dict())  # base and adapters, unmerged
    assert selection.last.bytes == _nbytes(trainer_model.state_dict().items())
    adapter_engine.update_weights(first, weight_version=1)

    _train(trainer_model, 3, seed=2)  # the adapters move on; the base does not
    second = selection.select(rollout_state(trainer_model, None, adapter_config))
    assert {n for n, _ in second} == lora_names
    lora_bytes = sum(p.numel() * p.element_size() for n, p in trainer_model.named_parameters() if n in lora_names)
    assert selection.last.bytes == lora_bytes < _nbytes(first) / 10
    assert selection.pop_metrics() == {"perf/weight_sync_tensors": float(len(lora_names)),
                                       "perf/weight_sync_bytes": float(lora_bytes)}
    adapter_engine.update_weights(second, weight_version=2)
    merged_engine.update_weights(rollout_state(trainer_model, None, merged_config), weight_version=2)
    assert all(p.abs().max() > 0 for n, p in adapter_engine.model.named_parameters() if ".lora_B." in n)

    reference = load_pretrained(path, dtype=torch.float64, device="cpu")
    apply_lora(reference, adapter_config)
    reference.load_state_dict({k: v.double() for k, v in trainer_model.state_dict().items()})
    base = _tokens_and_log_probs(_engine(path))
    adapted = _tokens_and_log_probs(adapter_engine)
    merged = _tokens_and_log_probs(merged_engine)
    for prompt, (tokens, log_probs), (merged_tokens, merged_log_probs), (base_tokens, base_log_probs) in zip(
            PROMPTS, adapted, merged, base):
        assert tokens == merged_tokens
        assert (log_probs - merged_log_probs).abs().max() <= 1e-5
        with torch.no_grad():
            want = _log_probs(reference, prompt + tokens)[len(prompt) - 1:]
        assert (log_probs - want).abs().max() <= 1e-4
        # the adapters matter: the base model samples or scores differently
        assert tokens != base_tokens or (log_probs - base_log_probs).abs().max() > 1e-3


def test_the_merged_mode_sends_the_whole_model_every_time(peaky_checkpoint):
    config = _config(peaky_checkpoint, "merged")
    model = load_pretrained(peaky_checkpoint, dtype=torch.float32, device="cpu")
    plain = set(model.state_dict())
    apply_lora(model, config)
    selection = SyncSelection(config)
    for _ in range(2):
        named = selection.select(rollout_state(model, None, config))
        assert {n for n, _ in named} == plain
    assert not lora_modules(prepare_engine_model(load_pretrained(peaky_checkpoint, dtype=torch.float32), config))
    assert selection.pop_metrics()["perf/weight_sync_bytes"] == _nbytes(named)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_follows_adapter_syncs_in_place(peaky_checkpoint):
    """CUDA-graph decode over the adapter layers: a sync copies new adapters into the captured
    parameters, and the replayed graphs compute with them (eager adapter engine: same tokens,
    log-probs within 1e-5; merged eager engine: same tokens)."""
    from miles_host.rollout import Engine

    path = peaky_checkpoint
    adapter_config, merged_config = _config(path, "adapter"), _config(path, "merged")
    torch.cuda.empty_cache()  # the engines size their KV caches from the GPU's free memory: earlier tests' cache out

    def engine(config, **kwargs):
        model = load_pretrained(path, dtype=torch.float32, device="cuda")
        if config is not None:
            model = prepare_engine_model(model, config)
        return Engine(model, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4, **kwargs)

    graphs, eager, merged = engine(adapter_config), engine(adapter_config, enforce_eager=True), engine(None, enforce_eager=True)
    assert graphs.runner.graphs is not None
    trainer_model = load_pretrained(path, dtype=torch.float32, device="cpu")
    apply_lora(trainer_model, adapter_config)
    before = [p.data_ptr() for n, p in graphs.model.named_parameters() if is_adapter_tensor(n)]
    for version, seed in enumerate((1, 2), start=1):
        _train(trainer_model, 3, seed=seed)
        state = rollout_state(trainer_model, None, adapter_config)
        adapters = [(n, t) for n, t in state.items() if is_adapter_tensor(n)]
        graphs.update_weights(adapters, weight_version=version)
        eager.update_weights(adapters, weight_version=version)
        merged.update_weights(rollout_state(trainer_model, None, merged_config), weight_version=version)
        replays = graphs.runner.graphs.num_replays
        got, want, plain = (_tokens_and_log_probs(e) for e in (graphs, eager, merged))
        assert graphs.runner.graphs.num_replays > replays
        for (tokens, log_probs), (eager_tokens, eager_log_probs), (merged_tokens, _) in zip(got, want, plain):
            assert tokens == eager_tokens == merged_tokens
            assert (log_probs - eager_log_probs).abs().max() <= 1e-5
    assert [p.data_ptr() for n, p in graphs.model.named_parameters() if is_adapter_tensor(n)] == before
