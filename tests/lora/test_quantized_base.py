"""LoRA over a quantized base (``--precision int4`` / ``fp8`` with ``--lora-sync adapter``).

The trainer runs the recipe's training linears (INT4 QAT, FP8 GEMMs) with adapters next to
them; the engine's base linears are the recipe's rollout modules (INT4 / FP8 weights) with
the adapters next to them, ``quantized_base(x) + scaling * B (A x)``. After training steps and
an adapter-only sync, the log-probs of the engine's greedy tokens match a reference written
here from the formulas alone (float64: the base weights quantized and dequantized by plain
PyTorch, FP8 activations too, plus the low-rank update of the trainer's adapters)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_host.config import MilesConfig
from miles_host.lora import apply_lora, lora_modules
from miles_host.lora.layers import LoraOverBase
from miles_host.lora.sync import SyncSelection, is_adapter_tensor, prepare_engine_model, rollout_state
from miles_host.models import load_pretrained
from tests.lora.conftest import transformers
from tests.lora.test_engine_adapter import _log_probs, _nbytes

miles_int4 = pytest.importorskip("miles_int4")
miles_fp8 = pytest.importorskip("miles_fp8")

from miles_fp8 import recipe as fp8_recipe  # noqa: E402
from miles_int4 import plugin as int4_plugin  # noqa: E402
from miles_int4 import rollout as int4_rollout  # noqa: E402

#: hidden 128, intermediate 256: every decoder linear has 128-divisible dims (FP8 blocks, INT4 groups)
SHAPE = dict(vocab_size=99, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
             tie_word_embeddings=False)
PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 31))]
SAMPLING = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
QUANTIZED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

#: precision -> (trainer preparation, rollout preparation, weight-sync conversion)
RECIPES = {
    "int4": (int4_plugin.prepare_train_model, int4_rollout.prepare_rollout_model, int4_rollout.convert_for_rollout),
    "fp8": (fp8_recipe.prepare_train_model, fp8_recipe.prepare_rollout_model, fp8_recipe.convert_for_rollout),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random Qwen3 checkpoint with peaky logits (no near-ties for greedy decoding)."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.12 if parameter.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    path = tmp_path_factory.mktemp("lora_quantized")
    model.save_pretrained(path)
    return str(path)


def _config(path: str, precision: str) -> MilesConfig:
    config = MilesConfig(hf_checkpoint=path, lora_rank=4, lora_alpha=8, lora_sync="adapter", precision=precision)
    config.int4_target, config.int4_group_size, config.int4_rollout_gemm = "all", 128, "dequant"
    return config


# -- the reference: plain formulas ------------------------------------------------------------


def int4_dequantized(w: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Symmetric INT4 per (row, group of input columns): scale = bf16(amax / 7), q = round(w / scale) in [-8, 7]."""
    g = w.double().reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1, keepdim=True).float() / 7).to(torch.bfloat16).double()
    q = torch.where(scale == 0, torch.zeros_like(g), torch.round(g / scale).clamp(-8, 7))
    return (q * scale).reshape(w.shape)


def _fp8_blocks(t: torch.Tensor, rows: int) -> torch.Tensor:
    """E4M3 quantize-dequantize of ``t`` in ``rows`` x 128 blocks, scale = amax / 448 (float32)."""
    n, k = t.shape
    blocks = t.double().reshape(n // rows, rows, k // 128, 128)
    scale = (blocks.abs().amax(dim=(1, 3), keepdim=True).float().clamp(min=1e-12) / 448.0).double()
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * scale).reshape(n, k)


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Block-scaled FP8: activations in 1x128 groups, weights in 128x128 blocks."""
    x2 = x.reshape(-1, x.shape[-1])
    return (_fp8_blocks(x2, 1) @ _fp8_blocks(w, 128).t()).reshape(*x.shape[:-1], w.shape[0])


def reference_model(path: str, trainer_model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The plain float64 model whose quantized linears compute ``Q(W) x + scaling * B (A x)``
    (``Q``: the formulas above) with the trainer's frozen base and trained adapters."""
    model = load_pretrained(path, dtype=torch.float64, device="cpu")
    state = trainer_model.state_dict()
    for name, layer in lora_modules(trainer_model).items():
        plain = model.get_submodule(name)
        w = state[f"{name}.weight"].double()
        delta = torch.zeros_like(w)
        for part in layer.parts:
            b, a = state[f"{name}.lora_B.{part.key}"].double(), state[f"{name}.lora_A.{part.key}"].double()
            delta[part.start:part.stop] = layer.scaling * (b @ a)

        if precision == "int4":
            def forward(x, w=w, delta=delta):
                return F.linear(x, int4_dequantized(w) + delta)
        else:
            def forward(x, w=w, delta=delta):
                return fp8_linear(x, w) + F.linear(x, delta)
        plain.forward = forward
    return model


# -- trainer and engine -----------------------------------------------------------------------


def _trainer(path: str, config: MilesConfig) -> torch.nn.Module:
    model = load_pretrained(path, dtype=torch.float32, device="cpu")
    model = RECIPES[config.precision][0](model, config) or model
    apply_lora(model, config)
    return model


def _engine(path: str, config: MilesConfig, adapters: bool = True):
    from miles_host.rollout import Engine

    model = load_pretrained(path, dtype=torch.float32, device="cpu")
    model = RECIPES[config.precision][1](model, config) or model
    if adapters:
        model = prepare_engine_model(model, config)
    return Engine(model, kv_cache_tokens=512)


def _train(model, steps: int, seed: int) -> None:
    """``steps`` Adam steps of next-token loss on random sequences (moves every adapter)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(2, SHAPE["vocab_size"], (24,), generator=generator).tolist()
        loss = -_log_probs(model, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _sync(model, config, selection):
    """What the trainer's weight sync sends: the adapter-mode state, converted by the recipe, selected."""
    named = [(n, t.detach()) for n, t in rollout_state(model, None, config).items()]
    return selection.select(RECIPES[config.precision][2](named, config))


def _generate(engine):
    outputs = engine.generate(PROMPTS, SAMPLING)
    return [(o["output_ids"], torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64))
            for o in outputs]


#: log-prob tolerance against the float64 reference: INT4 multiplies exact dequantized weights
#: (float32 sums); FP8 quantizes activations too, where float32 and float64 inputs may round
#: to neighbouring E4M3 values
TOLERANCE = {"int4": 2e-4, "fp8": 5e-3}


@pytest.mark.parametrize("precision", sorted(RECIPES))
def test_quantized_base_engine_follows_the_adapter_syncs(checkpoint, precision):
    config = _config(checkpoint, precision)
    trainer_model = _trainer(checkpoint, config)
    lora_names = {n for n, p in trainer_model.named_parameters() if p.requires_grad}
    assert lora_names and all(is_adapter_tensor(n) for n in lora_names)

    engine = _engine(checkpoint, config)
    adapted = lora_modules(engine.model)
    assert sorted({name.rsplit(".", 1)[-1] for name in adapted}) == sorted(QUANTIZED)
    for layer in adapted.values():  # the recipe's rollout module, its weights quantized, adapters next to it
        assert isinstance(layer, LoraOverBase) and not any(p.requires_grad for n, p in layer.named_parameters()
                                                           if not n.startswith("lora_"))
        assert all(p.dtype == torch.float32 for p in layer.lora_A.values())
    assert all(isinstance(layer, LoraOverBase) for layer in lora_modules(trainer_model).values())
    base_only = _generate(_engine(checkpoint, config, adapters=False))

    selection = SyncSelection(config)
    _train(trainer_model, 3, seed=1)
    first = _sync(trainer_model, config, selection)
    engine.update_weights(first, weight_version=1)
    _train(trainer_model, 3, seed=2)
    second = _sync(trainer_model, config, selection)
    assert {n for n, _ in second} == lora_names  # the base never travels again
    assert _nbytes(second) == sum(p.numel() * p.element_size() for n, p in trainer_model.named_parameters()
                                  if n in lora_names) < _nbytes(first)
    engine.update_weights(second, weight_version=2)

    reference = reference_model(checkpoint, trainer_model, precision)
    for prompt, (tokens, log_probs), (base_tokens, base_log_probs) in zip(PROMPTS, _generate(engine), base_only):
        with torch.no_grad():
            want = _log_probs(reference, prompt + tokens)[len(prompt) - 1:]
        assert (log_probs - want).abs().max() <= TOLERANCE[precision]
        # the adapters matter: the quantized base alone samples or scores differently
        assert tokens != base_tokens or (log_probs - base_log_probs).abs().max() > 1e-2


@pytest.mark.parametrize("precision", sorted(RECIPES))
def test_trainer_and_engine_compute_the_same_forward(checkpoint, precision):
    """The trainer's forward (INT4 QAT: fake-quantized base; FP8: FP8 GEMMs on the master weights)
    plus adapters and the engine's quantized base plus adapters give the same log-probs (float32)."""
    config = _config(checkpoint, precision)
    trainer_model = _trainer(checkpoint, config)
    _train(trainer_model, 2, seed=3)
    engine = _engine(checkpoint, config)
    engine.update_weights(_sync(trainer_model, config, SyncSelection(config)), weight_version=1)
    (tokens, log_probs), = [_generate(engine)[0]]
    with torch.no_grad():
        want = _log_probs(trainer_model, PROMPTS[0] + tokens)[len(PROMPTS[0]) - 1:]
    assert (log_probs - want.double()).abs().max() <= 1e-4


def test_merged_sync_over_a_quantized_base_is_refused(checkpoint):
    config = _config(checkpoint, "int4")
    config.lora_sync = "merged"
    model = RECIPES["int4"][0](load_pretrained(checkpoint, dtype=torch.float32), config)
    with pytest.raises(ValueError, match="give --lora-sync adapter"):
        apply_lora(model, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", sorted(RECIPES))
def test_cuda_graph_decode_over_a_quantized_base_follows_adapter_syncs(checkpoint, precision):
    """bf16 engines on CUDA (INT4: the packed kernels): CUDA-graph decode over the quantized base plus
    adapters gives the eager engine's tokens and log-probs after each adapter-only sync (the fused
    adapter buffers the graphs captured are refreshed in place)."""
    from miles_host.rollout import Engine

    config = _config(checkpoint, precision)
    config.int4_rollout_gemm = "packed"

    def engine(**kwargs):
        model = load_pretrained(checkpoint, dtype=torch.bfloat16, device="cuda")
        model = RECIPES[precision][1](model, config) or model
        model = prepare_engine_model(model, config)
        return Engine(model, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096, block_size=4, **kwargs)

    graphs, eager = engine(), engine(enforce_eager=True)
    assert graphs.runner.graphs is not None
    fused = [b.data_ptr() for n, b in graphs.model.named_buffers() if ".lora_fused_" in n]
    assert fused
    trainer_model = _trainer(checkpoint, config)
    selection = SyncSelection(config)
    for version, seed in enumerate((1, 2), start=1):
        _train(trainer_model, 3, seed=seed)
        named = _sync(trainer_model, config, selection)
        graphs.update_weights(named, weight_version=version)
        eager.update_weights(named, weight_version=version)
        replays = graphs.runner.graphs.num_replays
        got, want = _generate(graphs), _generate(eager)
        assert graphs.runner.graphs.num_replays > replays
        for (tokens, log_probs), (eager_tokens, eager_log_probs) in zip(got, want):
            assert tokens == eager_tokens
            assert (log_probs - eager_log_probs).abs().max() <= 2e-2
    assert [b.data_ptr() for n, b in graphs.model.named_buffers() if ".lora_fused_" in n] == fused
