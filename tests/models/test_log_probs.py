"""The chunked training forward: gradients equal the unchunked computation."""

from __future__ import annotations

import pytest
import torch

from miles_host.models import ForwardContext, PackedAttention, chunked_log_probs, load_pretrained, token_log_probs

from .conftest import family_lookup, prompts_batch
from .test_hf_parity import _packed


def test_chunked_log_probs_matches_full_softmax_float64():
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(21, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 21, (13,))
    grads = []
    for chunked in (True, False):
        if chunked:
            lp, ent = chunked_log_probs(hidden, weight, targets, temperature=0.8, logit_softcap=3.0,
                                        chunk_size=4, return_entropy=True)
        else:
            logits = torch.tanh((hidden @ weight.T) / 3.0) * 3.0
            lp, ent = token_log_probs(logits.double(), targets, temperature=0.8, return_entropy=True)
            lp, ent = lp.double(), ent.double()
        loss = (lp * torch.linspace(-1, 1, 13, dtype=lp.dtype)).sum() + (ent * 0.3).sum()
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
        if chunked:
            first = (lp.detach(), ent.detach())
        else:
            torch.testing.assert_close(first[0].double(), lp.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(first[1].double(), ent.detach(), atol=1e-5, rtol=0)
    for chunked_grad, full_grad in zip(*grads):
        torch.testing.assert_close(chunked_grad, full_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "gemma2", "qwen2"])
def test_parameter_gradients_match_unchunked(case, checkpoints):
    """d(sum of weighted log-probs + entropy)/d(params): chunked == full-logits autograd."""
    input_ids, attention_mask = prompts_batch(seed=3)
    input_ids_T, positions_T, cu_seqlens, targets_T = _packed(input_ids, attention_mask)
    model = load_pretrained(checkpoints[case], family=family_lookup).train()
    weights_T = torch.linspace(-1.0, 1.0, targets_T.shape[0])
    params = [p for p in model.parameters() if p.requires_grad]

    log_probs_T, entropy_T = model.packed_log_probs(
        input_ids_T, positions_T, cu_seqlens, targets_T, temperature=0.9, chunk_size=5, return_entropy=True
    )
    chunked = torch.autograd.grad((log_probs_T * weights_T).sum() + 0.1 * entropy_T.sum(), params)

    ctx = ForwardContext(attention=PackedAttention(cu_seqlens))
    logits_TV = model.compute_logits(model.forward_hidden(input_ids_T, positions_T, ctx))
    full_T, full_entropy_T = token_log_probs(logits_TV, targets_T, temperature=0.9, return_entropy=True)
    torch.testing.assert_close(log_probs_T, full_T, atol=1e-5, rtol=0)
    full = torch.autograd.grad((full_T * weights_T).sum() + 0.1 * full_entropy_T.sum(), params)
    for chunk_grad, full_grad in zip(chunked, full):
        torch.testing.assert_close(chunk_grad, full_grad, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in chunked)


def test_gradient_checkpointing_gives_same_gradients(checkpoints):
    input_ids, attention_mask = prompts_batch(seed=4)
    batch = _packed(input_ids, attention_mask)
    model = load_pretrained(checkpoints["qwen3"], family=family_lookup).train()
    grads = []
    for flag in (False, True):
        model.gradient_checkpointing = flag
        log_probs_T, _ = model.packed_log_probs(*batch)
        grads.append(torch.autograd.grad(log_probs_T.sum(), list(model.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_under_bf16_autocast_matches_float64_and_runs_bf16_gemms():
    """fp32 masters under bf16 autocast (the trainer on GPU): the backward's GEMMs run in bf16
    like the forward's, and the gradients agree with the float64 formula within bf16 error."""
    torch.manual_seed(0)
    hidden = torch.randn(3000, 256, device="cuda", requires_grad=True)
    weight = (torch.randn(5000, 256, device="cuda") * 0.05).requires_grad_(True)
    targets = torch.randint(0, 5000, (3000,), device="cuda")
    coef = torch.linspace(-1, 1, 3000, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _ = chunked_log_probs(hidden, weight, targets, chunk_size=1024)
        loss = (lp * coef).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
        torch.cuda.synchronize()
    gemms = [e.key for e in trace.key_averages() if "gemm" in e.key.lower() or "nvjet" in e.key.lower()]
    assert gemms and not any("f32f32" in key for key in gemms), gemms
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ref_lp, _ = token_log_probs(h64 @ w64.T, targets)
    ref_h, ref_w = torch.autograd.grad((ref_lp.double() * coef.double()).sum(), (h64, w64))
    assert grad_hidden.dtype == hidden.dtype and grad_weight.dtype == weight.dtype
    for got, ref in ((grad_hidden, ref_h), (grad_weight, ref_w)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("frozen", [False, True])
def test_under_autocast_the_head_is_cast_once_to_what_autocast_computes_with(frozen):
    """Under bf16 autocast an fp32 head (trainable, or frozen: LoRA's, a reference model's) gives
    the bits of a head already stored in bf16, the cast autocast does for each chunk's GEMM; the
    frozen head's cast is made once per pass, not once per chunk."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 32).bfloat16()
    weight = torch.randn(100, 32).requires_grad_(not frozen)
    targets = torch.randint(0, 100, (37,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = chunked_log_probs(hidden, weight.detach().bfloat16(), targets, chunk_size=8, return_entropy=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as trace:
            got = chunked_log_probs(hidden, weight, targets, chunk_size=8, return_entropy=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    casts = [e for e in trace.events() if e.name == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == [100, 32]]
    assert len(casts) == 1, [e.input_shapes for e in casts]
