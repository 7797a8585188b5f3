"""gpt_oss, llama4_text and glm4_moe_lite against transformers (float32, CPU, tiny configs).

The configs exercise each family's quirks: gpt-oss' sink logits, alternating
sliding windows shorter than the sequences, router and expert biases and an
active SwiGLU clamp; Llama-4's chunked local attention (chunks shorter than the
sequences), a NoPE global layer with temperature tuning, the L2 q/k norm and MoE
layers interleaved with dense ones, with a shared expert; GLM-4.7-Flash's MLA
with DeepSeek-style routing and ``mlp_layer_types``. Per type: logits, a bit-exact
HF -> miles -> HF weight round trip, the engine's greedy tokens and its
log-probs at temperature 0.7, ``--true-on-policy`` (the trainer's batch-invariant
log-probs equal the engine's bit for bit), and (slow) a GRPO step with R3 and
``--true-on-policy``. Also: Llama-4's multimodal checkpoint layout,
its experts on the grouped-GEMM training path, the SDPA form of sink attention against
float64, the Triton paged kernel's sinks/chunks under the interpreter and compiled for
sm_90, and (GPU) the engine on CUDA.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from miles_host.models import ForwardContext, PackedAttention, load_pretrained, save_pretrained
from miles_host.models.moe_variants import VariantExperts
from miles_models import glm_lite, gpt_oss, llama4

from .conftest import BASE, hf_logits, prompts_batch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

CASES: dict[str, dict] = {
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.6, swiglu_alpha=1.702,
    ),
    "llama4_text": dict(
        no_rope_layers=[1, 0], attention_chunk_size=4, interleave_moe_layer_step=2,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, intermediate_size_mlp=96,
        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
    ),
    "glm4_moe_lite": dict(
        head_dim=None, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, mlp_layer_types=["dense", "sparse"], q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1,
    ),
}
#: the family records, straight from the plugin modules
FAMILIES = {
    model_type: record
    for module in (gpt_oss, llama4, glm_lite)
    for record in module.miles_register_model_families()
    for model_type in record.model_types
}


def family_lookup(model_type: str):
    return FAMILIES[model_type]


def build(model_type: str, vocab_size: int = BASE["vocab_size"], eos_token_id: int = BASE["eos_token_id"]):
    """A random tiny transformers model: peaky weights (greedy meets no near-ties), every bias
    and sink perturbed so that zero initialisations hide nothing."""
    kwargs = {**BASE, **CASES[model_type], "vocab_size": vocab_size, "eos_token_id": eos_token_id}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k != "head_dim"}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(sum(map(ord, model_type)))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("sinks"):
                tensor.normal_(0.0, 1.0)
            elif "bias" in name or tensor.dim() == 1:
                tensor.add_(torch.randn_like(tensor) * 0.1)
            else:
                tensor.normal_(0.0, 0.12)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(model_type: str):
        if model_type not in cache:
            model = build(model_type)
            path = tmp_path_factory.mktemp(model_type)
            model.save_pretrained(path)
            cache[model_type] = (model, path)
        return cache[model_type]

    return get


TYPES = sorted(CASES)


def test_the_quirks_are_configured(checkpoints):
    gpt = load_pretrained(checkpoints("gpt_oss")[1], family=family_lookup).config
    assert gpt.attn_sinks and gpt.layer_types == ["sliding_attention", "full_attention"] and gpt.sliding_window == 4
    assert gpt.moe.router_bias and gpt.moe.expert_biases and gpt.moe.swiglu_limit == 0.6
    llama = load_pretrained(checkpoints("llama4_text")[1], family=family_lookup).config
    assert llama.layer_types == ["chunked_attention", "full_attention"] and llama.attention_chunk_size == 4
    assert llama.nope_layers == [False, True]
    assert llama.moe_layers == [False, True] and llama.moe.shared_intermediate_size == 32
    assert llama.qk_norm == "l2" and llama.attn_temperature == (2.0, 0.5)
    # the published config.json (transformers 4 layout): yarn in rope_scaling, truncate off
    published = {k: v for k, v in json.loads((checkpoints("gpt_oss")[1] / "config.json").read_text()).items()
                 if k != "rope_parameters"}
    published.update(rope_theta=150000.0, rope_scaling={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096})
    rope = gpt_oss.config_from_hf(published).rope
    assert (rope.rope_type, rope.factor, rope.theta, rope.truncate) == ("yarn", 32.0, 150000.0, False)
    glm = load_pretrained(checkpoints("glm4_moe_lite")[1], family=family_lookup).config
    assert glm.mla is not None and glm.moe_layers == [False, True] and glm.moe.routed_scaling_factor == 1.8


@pytest.mark.parametrize("model_type", TYPES)
def test_logits_match_transformers(model_type, checkpoints):
    _, path = checkpoints(model_type)
    input_ids, attention_mask = prompts_batch(lengths=(13, 6, 9))
    reference = hf_logits(path, input_ids, attention_mask)
    model = load_pretrained(path, family=family_lookup)
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
    valid = attention_mask.bool()
    assert (logits[valid] - reference[valid]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("model_type", TYPES)
def test_weights_round_trip_bit_for_bit(model_type, checkpoints, tmp_path):
    _, path = checkpoints(model_type)
    save_pretrained(load_pretrained(path, family=family_lookup), tmp_path, family=family_lookup)
    original = safetensors.load_file(str(path / "model.safetensors"))
    saved = safetensors.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    hf_config = json.loads((path / "config.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text()) == {**hf_config, "dtype": "float32"}


def test_multimodal_llama4_loads_and_saves_its_language_model(checkpoints, tmp_path):
    """A ``llama4`` (Llama4ForConditionalGeneration) checkpoint: text_config and ``language_model.*``
    weights; the vision tensors are skipped on load and not written on save."""
    _, text_path = checkpoints("llama4_text")
    text = safetensors.load_file(str(text_path / "model.safetensors"))
    multimodal = {f"language_model.{name}": tensor for name, tensor in text.items()}
    vision = {"vision_model.patch_embedding.linear.weight": torch.randn(8, 4),
              "multi_modal_projector.linear_1.weight": torch.randn(4, 8)}
    source = tmp_path / "source"
    source.mkdir()
    safetensors.save_file({**multimodal, **vision}, str(source / "model.safetensors"))
    text_config = json.loads((text_path / "config.json").read_text())
    hf_config = {"model_type": "llama4", "text_config": text_config, "vision_config": {"hidden_size": 8}}
    (source / "config.json").write_text(json.dumps(hf_config))
    model = load_pretrained(source, family=family_lookup)
    reference = load_pretrained(text_path, family=family_lookup)
    input_ids, attention_mask = prompts_batch(lengths=(13, 6, 9))
    with torch.no_grad():
        assert torch.equal(model(input_ids, attention_mask), reference(input_ids, attention_mask))
    save_pretrained(model, tmp_path / "saved", family=family_lookup)
    saved = safetensors.load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(multimodal)
    assert all(torch.equal(saved[name], tensor) for name, tensor in multimodal.items())
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["text_config"] == text_config


@pytest.mark.parametrize("model_type, feature", [("gpt_oss", "attention sinks"), ("llama4_text", "chunked local")])
def test_the_megatron_backend_refuses_the_variants_by_name(model_type, feature, checkpoints):
    weights = pytest.importorskip("miles_megatron.weights")
    config = load_pretrained(checkpoints(model_type)[1], family=family_lookup).config
    with pytest.raises(ValueError, match=feature):
        weights.megatron_transformer_config_kwargs(config)


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_variant_experts_train_on_grouped_gemms(model_type, checkpoints):
    """gpt-oss' experts (biases, clamped SwiGLU) and Llama-4's plain experts on router-scaled inputs
    take the grouped-GEMM training path: logits follow transformers, gradients (expert biases
    included) the per-expert loop's."""
    from .test_hf_parity import _packed
    from .test_moe_train import _loss_and_grads

    def _set_experts_impl(model, impl):
        experts = [m for m in model.modules() if isinstance(m, VariantExperts)]
        for module in experts:
            module.experts_impl = impl
        return len(experts)

    _, path = checkpoints(model_type)
    input_ids, attention_mask = prompts_batch(lengths=(13, 6, 9), seed=11)
    reference = hf_logits(path, input_ids, attention_mask)
    model = load_pretrained(path, family=family_lookup)
    assert _set_experts_impl(model, "grouped") >= 1
    logits = model(input_ids, attention_mask)
    valid = attention_mask.bool()
    assert logits.requires_grad and (logits.detach()[valid] - reference[valid]).abs().max().item() <= 1e-4
    batch = _packed(input_ids, attention_mask)
    log_probs, grads = _loss_and_grads(model, batch)
    _set_experts_impl(model, "loop")
    log_probs_loop, grads_loop = _loss_and_grads(model, batch)
    torch.testing.assert_close(log_probs, log_probs_loop, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_loop.keys() and any(".router." in name for name in grads)
    if model_type == "gpt_oss":
        assert any(name.endswith("experts.gate_up_proj_bias") for name in grads)
        assert any(name.endswith("experts.down_proj_bias") for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_loop[name], rtol=1e-4, atol=1e-6, msg=name)


FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mxfp4_reference(blocks, scales):
    """The MXFP4 decoding written out: per byte its low then high nibble, times 2 ** (scale - 127)."""
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, rows, groups * width * 2, dtype=torch.float64)
    for e, r, gr, b in torch.cartesian_prod(*(torch.arange(n) for n in blocks.shape)).tolist():
        byte, factor = int(blocks[e, r, gr, b]), 2.0 ** (int(scales[e, r, gr]) - 127)
        out[e, r, gr * 2 * width + 2 * b] = FP4[byte & 15] * factor
        out[e, r, gr * 2 * width + 2 * b + 1] = FP4[byte >> 4] * factor
    return out


def test_gpt_oss_mxfp4_experts_load_dequantized_and_save_unquantized(checkpoints, tmp_path):
    """OpenAI's checkpoint layout: ``{proj}_blocks`` / ``{proj}_scales`` per expert projection (rows =
    output features). Loaded, they equal the same weights stored unquantized in transformers' layout;
    saved, they are written unquantized, without the MXFP4 quantization_config."""
    _, path = checkpoints("gpt_oss")
    dense = safetensors.load_file(str(path / "model.safetensors"))
    hf_config = json.loads((path / "config.json").read_text())
    g = torch.Generator().manual_seed(5)
    quantized, unquantized = dict(dense), dict(dense)
    for name in [n for n in dense if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = dense[name].shape  # transformers' layout: [E, in, out]
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(121, 126, (experts, outputs, inputs // 32), generator=g, dtype=torch.uint8)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        unquantized[name] = _mxfp4_reference(blocks, scales).transpose(1, 2).float().contiguous()
    for directory, tensors, config in (
        ("mxfp4", quantized, {**hf_config, "quantization_config": {"quant_method": "mxfp4"}}),
        ("dense", unquantized, hf_config),
    ):
        (tmp_path / directory).mkdir()
        safetensors.save_file(tensors, str(tmp_path / directory / "model.safetensors"))
        (tmp_path / directory / "config.json").write_text(json.dumps(config))
    model = load_pretrained(tmp_path / "mxfp4", family=family_lookup)
    reference = load_pretrained(tmp_path / "dense", family=family_lookup)
    for (name, ours), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(ours, expected), name
    save_pretrained(model, tmp_path / "saved", family=family_lookup)
    saved = safetensors.load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(unquantized)
    assert all(torch.equal(saved[name], tensor) for name, tensor in unquantized.items())
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


PROMPTS = [[5, 9, 17, 33, 2, 71, 8], list(range(10, 23)), [100, 3]]


@pytest.mark.parametrize("model_type", TYPES)
def test_engine_greedy_tokens_and_logprobs_match_transformers(model_type, checkpoints):
    """The paged engine's (and the contiguous reference cache's) greedy tokens are transformers';
    the engine's sampled tokens' log-probs at T=0.7 are transformers' log_softmax."""
    from tests.rollout.conftest import engine_logprobs, hf_logprobs
    from miles_host.rollout import Engine

    from miles_host.models import greedy_generate

    hf_model, path = checkpoints(model_type)
    model = load_pretrained(path, family=family_lookup)
    engine = Engine(model, kv_cache_tokens=512, block_size=4)
    greedy = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    contiguous_cache = greedy_generate(model, PROMPTS, max_new_tokens=10, eos_token_id=None)
    for prompt, output, reference_cache in zip(PROMPTS, greedy, contiguous_cache):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=10, min_new_tokens=10, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert output["output_ids"] == expected and reference_cache == expected
    sampled = engine.generate(PROMPTS, {"temperature": 0.7, "max_new_tokens": 10, "ignore_eos": True,
                                        "sampling_seed": 3})
    for prompt, output in zip(PROMPTS, sampled):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"], temperature=0.7)
        assert (engine_logprobs(output) - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_true_on_policy_log_probs_are_bitwise_the_engines(model_type, checkpoints):
    """Batch-invariant mode (``--true-on-policy``) with sinks, windows and chunks: the trainer's
    per-token log-probs of sampled responses equal the engine's bit for bit."""
    _check_true_on_policy(load_pretrained(checkpoints(model_type)[1], family=family_lookup),
                          kv_cache_tokens=256, block_size=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_true_on_policy_on_cuda_with_sinks_and_chunks(model_type, checkpoints):
    """The invariant Triton kernel (engine) and the invariant packed attention (trainer) with sinks / chunks."""
    model = load_pretrained(checkpoints(model_type)[1], family=family_lookup).cuda()
    _check_true_on_policy(model, max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096)


def _check_true_on_policy(model, **engine_kwargs):
    """Sampled responses' log-probs: the batch-invariant engine's equal the batch-invariant trainer's."""
    from miles_host.rollout import Engine

    engine = Engine(model, batch_invariant=True, **engine_kwargs)
    prompts = PROMPTS[:2]
    outputs = engine.generate(prompts, {"temperature": 0.7, "max_new_tokens": 6, "ignore_eos": True,
                                        "sampling_seed": 1})
    sequences = [prompt + output["output_ids"] for prompt, output in zip(prompts, outputs)]
    device = next(model.parameters()).device
    input_ids_T = torch.tensor([token for sequence in sequences for token in sequence], device=device)
    positions_T = torch.cat([torch.arange(len(sequence)) for sequence in sequences]).to(device)
    targets_T = torch.cat([torch.tensor(sequence[1:] + [0]) for sequence in sequences]).to(device)
    cu_seqlens = torch.tensor([0, len(sequences[0]), len(sequences[0]) + len(sequences[1])], dtype=torch.int32,
                              device=device)
    ctx = ForwardContext(PackedAttention(cu_seqlens), batch_invariant=True)
    with torch.no_grad():
        log_probs_T, _ = model.packed_log_probs(input_ids_T, positions_T, cu_seqlens, targets_T, temperature=0.7,
                                                ctx=ctx)
    for s, (prompt, output) in enumerate(zip(prompts, outputs)):
        first = int(cu_seqlens[s]) + len(prompt) - 1
        trainer = log_probs_T[first : first + len(output["output_ids"])].cpu()
        engine_side = torch.tensor([entry[0] for entry in output["meta_info"]["output_token_logprobs"]])
        assert torch.equal(trainer, engine_side)


@pytest.mark.parametrize("window, chunk", [(None, None), (3, None), (None, 4)])
def test_sink_attention_through_sdpa_matches_the_float64_formula(window, chunk):
    """The training/prefill form (one extra key per query head) against the softmax with a sink
    column in float64: outputs and gradients of q, k, v and the sinks (GQA, a mask)."""
    from miles_host.models.attention import attention_mask_LM
    from miles_host.models.attention_variants import attend_dense_with_sinks

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 9, 16, generator=g, requires_grad=True) for heads in (4, 2, 2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    mask = attention_mask_LM(9, 9, 0, window, torch.device("cpu"), chunk)
    out = attend_dense_with_sinks(q, k, v, mask, sinks, scale=0.3)
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    scores = (q64 @ k64.repeat_interleave(2, dim=1).transpose(2, 3) * 0.3).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(torch.cat((scores, s64.view(1, 4, 1, 1).expand(2, 4, 9, 1)), dim=-1), dim=-1)[..., :-1]
    expected = probs @ v64.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    for ours, reference in ((q, q64), (k, k64), (v, v64), (sinks, s64)):
        torch.testing.assert_close(ours.grad.double(), reference.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sink_attention_through_sdpa_on_cuda_in_bf16():
    """gpt-oss' shapes (head dim 64, GQA 8) in bf16 on the GPU's SDPA kernels against float64, backward included."""
    from miles_host.models.attention import attention_mask_LM
    from miles_host.models.attention_variants import attend_dense_with_sinks

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, 512, 64, generator=g, device="cuda").bfloat16().requires_grad_()
               for heads in (64, 8, 8))
    sinks = torch.randn(64, generator=g, device="cuda").bfloat16().requires_grad_()
    mask = attention_mask_LM(512, 512, 0, 128, q.device)
    out = attend_dense_with_sinks(q, k, v, mask, sinks, scale=0.125)
    q64, k64, v64, s64 = (t.detach().double() for t in (q, k, v, sinks))
    scores = (q64 @ k64.repeat_interleave(8, dim=1).transpose(2, 3) * 0.125).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(torch.cat((scores, s64.view(1, 64, 1, 1).expand(1, 64, 512, 1)), dim=-1), dim=-1)[..., :-1]
    torch.testing.assert_close(out.double(), probs @ v64.repeat_interleave(8, dim=1), atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, sinks))


def test_paged_kernel_sinks_and_chunks_under_the_triton_interpreter(request):
    """The Triton paged attention with sinks / chunk masks (prefill, decode, split decode) against the
    reference, in a fresh interpreter process (``tests/rollout/interpreted_sink_chunk_attention.py``)."""
    from pathlib import Path

    from tests.plugins.triton_interpret import run_interpreted

    run_interpreted(Path(__file__).parents[1] / "rollout" / "interpreted_sink_chunk_attention.py", request)


def test_paged_kernel_with_sinks_and_chunks_compiles_for_sm90():
    import re

    from miles_host.kernels import paged_attention
    from tests.plugins.triton_sm90 import compile_sm90
    from tests.rollout.test_triton_attention import _signature

    pointers = ["Q", "K_cache", "V_cache", "Out", "block_tables", "context_lens", "cu_seqlens_q", "tile_seq",
                "tile_q_start"]
    types = {**{name: "*i32" for name in pointers}, "Q": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16",
             "Out": "*bf16", "Partial_acc": "*fp32", "Partial_ml": "*fp32", "Counters": "*i32",
             "scale": "fp32", "softcap": "fp32", "Sinks": "*fp32"}
    signature = _signature(paged_attention._paged_attention_kernel, types)
    constexprs = dict(GROUP=8, GROUP_PAD=8, BLOCK_M=2, PAGE=16, BLOCK_N=32, D=64, D_PAD=64, DV=64, DV_PAD=64,
                      SPLITS=4, USE_SOFTCAP=False, USE_WINDOW=True, IEEE=False, USE_SINKS=True, USE_CHUNK=True)
    ptx = compile_sm90(paged_attention._paged_attention_kernel, signature, constexprs, 4, 2,
                       unaligned=("scale", "softcap", "window", "attn_chunk"))
    assert "mma" in ptx and re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_engine_on_cuda_runs_sinks_and_chunks_on_the_triton_kernel(model_type, checkpoints):
    """On CUDA the engine picks the Triton kernel (sinks / chunk masks), captures its decode graphs,
    and its greedy tokens and log-probs follow transformers (float32)."""
    from tests.rollout.conftest import engine_logprobs, hf_logprobs
    from miles_host.rollout import Engine

    hf_model, path = checkpoints(model_type)
    engine = Engine(load_pretrained(path, family=family_lookup).cuda(), max_num_seqs=8, mem_fraction_static=0.3,
                    max_kv_cache_tokens=4096)
    assert engine.config.attention_backend == "triton"
    assert engine.runner.graphs, "CUDA graphs were not captured"
    outputs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    for prompt, output in zip(PROMPTS, outputs):
        reference = hf_logprobs(hf_model, prompt, output["output_ids"])
        assert (engine_logprobs(output) - reference).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_grpo_step_with_routing_replay(model_type, tmp_path):
    """One GRPO rollout + train step through the CLI with R3 and --true-on-policy: the replayed
    routes agree and the trainer's log-probs equal the engine's bit for bit."""
    from miles_host.cli.main import main
    from tests.true_on_policy.conftest import MIXED_PROMPTS, QUICKSTART_MODEL, TOKENIZER_FILES

    quick = json.loads((QUICKSTART_MODEL / "config.json").read_text())
    model_dir = tmp_path / "model"
    build(model_type, vocab_size=quick["vocab_size"], eos_token_id=quick["eos_token_id"]).save_pretrained(model_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(QUICKSTART_MODEL / name, model_dir / name)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input": p, "label": a}) + "\n" for p, a in MIXED_PROMPTS[:4]))
    out = tmp_path / "out"
    args = [
        "run", "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--input-key", "input",
        "--label-key", "label", "--rm-type", "exact", "--advantage-estimator", "grpo",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
        "--num-rollout", "1", "--lr", "1e-3", "--device", "cpu", "--dtype", "float32",
        "--output-dir", str(out), "--no-progress", "--plugins", "r3",
        "--true-on-policy",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert trained and all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in trained)
    assert all(r["r3/expert_agreement"] == 1.0 for r in trained)
