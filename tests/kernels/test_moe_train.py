"""The grouped-GEMM training experts (:mod:`miles_host.kernels.moe_train`) against a float64
per-expert reference: outputs and the gradients of x, both weight stacks and the gate weights
(gpt-oss' experts: both biases too, with the clamped SwiGLU).

CPU: ``torch._grouped_mm``'s CPU kernel (and the pure-torch loop) in float32.
GPU (marked ``gpu``): the bf16 sm90 kernel, no host sync in forward + backward, autocast with
float32 master weights. ``python -m pytest tests/kernels/test_moe_train.py -m gpu -v``
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_host.kernels import moe_train
from miles_host.kernels.eager_ops import clamped_swiglu
from miles_host.models.config import EXPERTS_IMPLS, MoEConfig
from miles_host.models.mlp import Experts, routed_forward


def reference(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI):
    """``sum_k w[t, k] * down[e](silu(gate[e] x) * up[e] x)``, one expert at a time, float64."""
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float64)
    for expert in range(gate_up_E2IH.shape[0]):
        tokens, slots = torch.nonzero(ids_TK == expert, as_tuple=True)
        gate, up = (x_TH[tokens] @ gate_up_E2IH[expert].t()).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ down_EHI[expert].t()
        y_TH = y_TH.index_add(0, tokens, out * weights_TK[tokens, slots][:, None])
    return y_TH


def draw(num_tokens, top_k, num_experts, hidden=32, inter=24, experts_used=None, seed=0):
    """Random inputs; ids drawn from ``experts_used`` (default all), distinct per token."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts_used if experts_used is not None else range(num_experts))
    rows = [pool[torch.randperm(len(pool), generator=generator)[:top_k]] for _ in range(num_tokens)]
    ids_TK = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)
    return dict(
        x_TH=torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float64),
        ids_TK=ids_TK,
        weights_TK=torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64),
        gate_up_E2IH=torch.randn(num_experts, 2 * inter, hidden, generator=generator, dtype=torch.float64) / hidden**0.5,
        down_EHI=torch.randn(num_experts, hidden, inter, generator=generator, dtype=torch.float64) / inter**0.5,
    )


DIFFERENTIABLE = ("x_TH", "weights_TK", "gate_up_E2IH", "down_EHI")

CASES = {
    "ragged": dict(num_tokens=37, top_k=3, num_experts=8),
    "empty experts": dict(num_tokens=20, top_k=2, num_experts=8, experts_used=[1, 2, 6]),
    "all tokens on one expert": dict(num_tokens=19, top_k=1, num_experts=6, experts_used=[4]),
    "one token": dict(num_tokens=1, top_k=4, num_experts=16),
    "more experts than pairs": dict(num_tokens=3, top_k=2, num_experts=64),
    "one expert": dict(num_tokens=9, top_k=1, num_experts=1),
}


def grads_of(fn, inputs, grad_TH):
    leaves = {name: inputs[name].detach().clone().requires_grad_(name in DIFFERENTIABLE)
              if inputs[name].is_floating_point() else inputs[name] for name in inputs}
    y_TH = fn(**leaves)
    y_TH.backward(grad_TH.to(y_TH.dtype))
    return y_TH.detach(), {name: leaves[name].grad for name in DIFFERENTIABLE}


def assert_close_rel(actual, expected, tol, what):
    error = (actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)
    assert error <= tol, f"{what}: relative error {error:.2e} > {tol:.0e}"


def grouped(dtype, **inputs):
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return moe_train.grouped_experts(**cast, act=F.silu)


def use_grouped_mm(mm: str, monkeypatch) -> None:
    """``mm``: ``_grouped_mm`` (torch's CPU kernel; skip where torch has none) or ``loop`` (the emulation)."""
    if mm == "loop":
        monkeypatch.setattr(moe_train, "grouped_mm", moe_train.grouped_mm_loop)
    elif not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mm", ["_grouped_mm", "loop"])
def test_gradients_match_float64_reference(case, mm, monkeypatch):
    use_grouped_mm(mm, monkeypatch)
    inputs = draw(**CASES[case])
    grad_TH = torch.randn(inputs["x_TH"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    y_ref, grads_ref = grads_of(reference, inputs, grad_TH)
    y, grads = grads_of(lambda **kw: grouped(torch.float32, **kw), inputs, grad_TH)
    assert y.dtype == torch.float32
    assert_close_rel(y, y_ref, 1e-5, "output")
    for name in DIFFERENTIABLE:
        assert grads[name] is not None, name
        assert_close_rel(grads[name], grads_ref[name], 1e-5, f"grad {name}")
    unused = sorted(set(range(inputs["gate_up_E2IH"].shape[0])) - set(inputs["ids_TK"].unique().tolist()))
    assert grads["gate_up_E2IH"][unused].abs().sum() == 0 and grads["down_EHI"][unused].abs().sum() == 0


#: gpt-oss' clamp, small enough that many O(1) pre-activations lie beyond it
LIMIT, ALPHA = 0.7, 1.702
GPT_OSS_DIFFERENTIABLE = (*DIFFERENTIABLE, "gate_up_bias_E2I", "down_bias_EH")


def gpt_oss_reference(x_TH, ids_TK, weights_TK, gate_up_E2IH, down_EHI, gate_up_bias_E2I, down_bias_EH):
    """``sum_k w[t, k] * (down[e] swiglu_clamped(gate[e] x + b, up[e] x + b) + b_down[e])``, float64, per expert."""
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float64)
    for expert in range(gate_up_E2IH.shape[0]):
        tokens, slots = torch.nonzero(ids_TK == expert, as_tuple=True)
        gate, up = (x_TH[tokens] @ gate_up_E2IH[expert].t() + gate_up_bias_E2I[expert]).chunk(2, dim=-1)
        out = clamped_swiglu(gate, up, LIMIT, ALPHA) @ down_EHI[expert].t() + down_bias_EH[expert]
        y_TH = y_TH.index_add(0, tokens, out * weights_TK[tokens, slots][:, None])
    return y_TH


def draw_gpt_oss(seed=0, **case):
    inputs = draw(**case, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    num_experts, two_inter, hidden = inputs["gate_up_E2IH"].shape
    inputs["gate_up_bias_E2I"] = torch.randn(num_experts, two_inter, generator=generator, dtype=torch.float64) * 0.5
    inputs["down_bias_EH"] = torch.randn(num_experts, hidden, generator=generator, dtype=torch.float64) * 0.5
    return inputs


def grouped_gpt_oss(dtype, gate_up_bias_E2I, down_bias_EH, **inputs):
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return moe_train.grouped_experts(**cast, act=F.silu, biases=(gate_up_bias_E2I.to(dtype), down_bias_EH.to(dtype)),
                                     swiglu_limit=LIMIT, swiglu_alpha=ALPHA)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mm", ["_grouped_mm", "loop"])
def test_gpt_oss_gradients_match_float64_reference(case, mm, monkeypatch):
    """Expert biases and the clamped SwiGLU: output and the gradients of x, gate weights, both
    stacks and both biases (unused experts' bias gradients exactly zero)."""
    use_grouped_mm(mm, monkeypatch)
    inputs = draw_gpt_oss(**CASES[case])
    grad_TH = torch.randn(inputs["x_TH"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    leaves = {name: value.detach().clone().requires_grad_(name in GPT_OSS_DIFFERENTIABLE)
              if value.is_floating_point() else value for name, value in inputs.items()}
    gate_up = (leaves["x_TH"] @ leaves["gate_up_E2IH"][0].t()).detach()
    assert gate_up.numel() == 0 or (gate_up.abs() > LIMIT).any()  # the clamp is active
    y_ref = gpt_oss_reference(**leaves)
    grads_ref = torch.autograd.grad(y_ref, [leaves[n] for n in GPT_OSS_DIFFERENTIABLE], grad_TH)
    y = grouped_gpt_oss(torch.float32, **leaves)
    grads = torch.autograd.grad(y, [leaves[n] for n in GPT_OSS_DIFFERENTIABLE], grad_TH.float())
    assert y.dtype == torch.float32
    assert_close_rel(y.detach(), y_ref.detach(), 1e-5, "output")
    for name, grad, grad_ref in zip(GPT_OSS_DIFFERENTIABLE, grads, grads_ref):
        assert_close_rel(grad, grad_ref, 1e-5, f"grad {name}")
    used = inputs["ids_TK"].unique()
    unused = sorted(set(range(inputs["gate_up_E2IH"].shape[0])) - set(used.tolist()))
    named_grads = dict(zip(GPT_OSS_DIFFERENTIABLE, grads))
    for name in ("gate_up_bias_E2I", "down_bias_EH"):
        assert named_grads[name][unused].abs().sum() == 0, name


def _gpt_oss_experts(hidden, num_experts, top_k, inter, limit, device="cpu"):
    from miles_host.models.moe_variants import VariantExperts

    moe = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, expert_biases=True,
                    swiglu_limit=limit, swiglu_alpha=ALPHA, experts_impl="grouped")
    experts = VariantExperts(hidden, moe, "silu")
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape) * (0.5 if param.dim() == 2 else param.shape[-1] ** -0.5))
    return experts.to(device)


def _impl_results(experts, x_TH, ids_TK, weights_TK, impls, autocast_dtype=None):
    """Output and the gradients of x, gate weights, both stacks and both biases under each ``experts_impl``."""
    results = {}
    for impl in impls:
        experts.experts_impl = impl
        experts.zero_grad()
        x_TH.grad = weights_TK.grad = None
        autocast = autocast_dtype is not None
        with torch.autocast(x_TH.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast):
            y = experts(x_TH, ids_TK, weights_TK)
        y.float().square().sum().backward()
        results[impl] = [y.detach().float(), x_TH.grad, weights_TK.grad, experts.gate_up_proj.grad,
                         experts.down_proj.grad, experts.gate_up_proj_bias.grad, experts.down_proj_bias.grad]
    return results


def test_gpt_oss_experts_module_grouped_matches_loop():
    """``VariantExperts`` (biases, clamp) with ``experts_impl`` grouped vs loop: same output and gradients."""
    torch.manual_seed(6)
    experts = _gpt_oss_experts(32, 8, 2, 16, LIMIT)
    x_TH = torch.randn(23, 32, requires_grad=True)
    ids_TK = torch.stack([torch.randperm(8)[:2] for _ in range(23)])
    weights_TK = torch.rand(23, 2, requires_grad=True)
    results = _impl_results(experts, x_TH, ids_TK, weights_TK, ("grouped", "loop"))
    for name, grouped_t, loop_t in zip(("y", "x", "w", "gate_up", "down", "gate_up_bias", "down_bias"),
                                       results["grouped"], results["loop"]):
        assert grouped_t is not None and loop_t is not None, name
        torch.testing.assert_close(grouped_t, loop_t, rtol=1e-5, atol=1e-5, msg=name)


def test_no_tokens():
    inputs = draw(num_tokens=0, top_k=2, num_experts=4)
    y = grouped(torch.float32, **inputs)
    assert y.shape == (0, 32)


def test_layout_places_every_pair_once_in_its_expert_group():
    ids_TK = draw(num_tokens=29, top_k=3, num_experts=8, experts_used=[0, 3, 4, 7])["ids_TK"]
    layout = moe_train.expert_layout(ids_TK, 8, align=16)
    num_rows = 29 * 3 + 8 * 15
    assert layout.num_rows == num_rows and layout.offsets_E[-1].item() == num_rows
    ends = layout.offsets_E.tolist()
    starts = [0, *ends[:-1]]
    assert all(start % 16 == 0 for start in starts)
    rows = layout.pair_row_TK.reshape(-1)
    assert rows.unique().numel() == rows.numel()  # each pair its own row
    for (token, slot), row in zip(torch.cartesian_prod(torch.arange(29), torch.arange(3)).tolist(), rows.tolist()):
        expert = ids_TK[token, slot].item()
        assert starts[expert] <= row < ends[expert]
        assert layout.row_token_R[row].item() == token
    padding = torch.ones(num_rows, dtype=torch.bool)
    padding[rows] = False
    assert torch.all(layout.row_token_R[padding] == 29)  # padding rows read the zero row


def test_routed_forward_and_grouped_path_agree_through_experts_module():
    """``Experts`` with ``experts_impl`` grouped vs loop: same output and gradients (float32)."""
    torch.manual_seed(3)
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=16, experts_impl="grouped")
    experts = Experts(32, moe, "silu")
    experts.reset_parameters()
    x_TH = torch.randn(21, 32, requires_grad=True)
    ids_TK = torch.stack([torch.randperm(8)[:2] for _ in range(21)])
    weights_TK = torch.rand(21, 2, requires_grad=True)
    results = {}
    for impl in ("grouped", "loop"):
        experts.experts_impl = impl
        experts.zero_grad()
        x_TH.grad = weights_TK.grad = None
        y = experts(x_TH, ids_TK, weights_TK)
        y.square().sum().backward()
        results[impl] = [y.detach(), x_TH.grad, weights_TK.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    for grouped_t, loop_t in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(grouped_t, loop_t, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference branch is not this module's
        expected = routed_forward(x_TH, ids_TK, weights_TK, 8, experts.expert_mlp)
    torch.testing.assert_close(results["grouped"][0], expected, rtol=1e-5, atol=1e-5)


def test_experts_impl_choices():
    assert set(moe_train.EXPERTS_IMPLS) == set(EXPERTS_IMPLS)
    with pytest.raises(ValueError, match="experts_impl"):
        MoEConfig(num_experts=4, top_k=2, intermediate_size=8, experts_impl="fast")
    x_TH, gate_up = torch.zeros(2, 16), torch.zeros(4, 16, 16)
    assert not moe_train.uses_grouped_experts("auto", x_TH, gate_up)  # CPU: the per-expert loop
    assert moe_train.uses_grouped_experts("grouped", x_TH, gate_up)
    assert not moe_train.uses_grouped_experts("loop", x_TH, gate_up)


# -- GPU -------------------------------------------------------------------------------------

def _cuda_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


gpu = pytest.mark.skipif(not _cuda_sm90(), reason="needs a CUDA GPU of compute capability 9.x or 10.x")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["qwen3_30b_a3b_dims", "ragged", "empty experts", "all tokens on one expert"])
def test_gpu_grouped_mm_matches_reference(case):
    shapes = {
        "qwen3_30b_a3b_dims": dict(num_tokens=256, top_k=8, num_experts=32, hidden=2048, inter=768),
        "ragged": dict(num_tokens=300, top_k=4, num_experts=16, hidden=256, inter=128),
        "empty experts": dict(num_tokens=200, top_k=2, num_experts=32, hidden=128, inter=64, experts_used=[0, 5, 31]),
        "all tokens on one expert": dict(num_tokens=333, top_k=1, num_experts=8, hidden=128, inter=64, experts_used=[7]),
    }[case]
    inputs = draw(**shapes, seed=1)
    grad_TH = torch.randn(inputs["x_TH"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y_ref, grads_ref = grads_of(reference, inputs, grad_TH)
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    cuda_grad_TH = grad_TH.cuda()  # host-to-device copies synchronize: all of them before the check
    assert moe_train.uses_grouped_experts("auto", cuda_inputs["x_TH"].bfloat16(), cuda_inputs["gate_up_E2IH"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in forward or backward raises
    try:
        y, grads = grads_of(lambda **kw: grouped(torch.bfloat16, **kw), cuda_inputs, cuda_grad_TH)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.dtype == torch.bfloat16
    assert_close_rel(y.cpu(), y_ref, 1e-2, "output")
    for name in DIFFERENTIABLE:
        assert_close_rel(grads[name].cpu(), grads_ref[name], 1.5e-2, f"grad {name}")


@pytest.mark.gpu
@gpu
def test_gpu_autocast_float32_masters_match_loop():
    """The trainer's setting (float32 weights, bf16 autocast): grouped vs the per-expert loop."""
    torch.manual_seed(4)
    moe = MoEConfig(num_experts=32, top_k=4, intermediate_size=128)
    experts = Experts(256, moe, "silu").cuda()
    experts.reset_parameters()
    x_TH = torch.randn(512, 256, device="cuda", requires_grad=True)
    ids_TK = torch.stack([torch.randperm(32)[:4] for _ in range(512)]).cuda()
    weights_TK = torch.rand(512, 4, device="cuda", requires_grad=True)
    results = {}
    for impl in ("auto", "loop"):
        experts.experts_impl = impl
        experts.zero_grad()
        x_TH.grad = weights_TK.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = experts(x_TH, ids_TK, weights_TK)
        y.float().square().sum().backward()
        results[impl] = [y.detach().float(), x_TH.grad, weights_TK.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    for name, grouped_t, loop_t in zip(("y", "x", "w", "gate_up", "down"), results["auto"], results["loop"]):
        assert grouped_t.dtype == loop_t.dtype, name
        assert_close_rel(grouped_t.cpu(), loop_t.double().cpu(), 2e-2, name)


@pytest.mark.gpu
@gpu
def test_gpu_gpt_oss_experts_grouped_match_loop():
    """gpt-oss' experts (biases, clamped SwiGLU at limit 7) in the trainer's setting (float32 masters,
    bf16 autocast): grouped GEMMs and the per-expert loop against the float64 loop on the CPU, output
    and every gradient incl. the biases. The bf16 loop itself is several percent off in the gradients
    that pass through the clamped SwiGLU at pre-activations of O(10) (x, gate_up: ~8% on the CPU), so
    the grouped path must be as close as the loop is, not close to the loop."""
    torch.manual_seed(7)
    experts = _gpt_oss_experts(256, 32, 4, 128, 7.0, device="cuda")
    with torch.no_grad():  # pre-activations of O(10): the limit clamps a good share of them
        experts.gate_up_proj.mul_(10.0)
    x_TH = torch.randn(512, 256, device="cuda", requires_grad=True)
    ids_TK = torch.stack([torch.randperm(32)[:4] for _ in range(512)]).cuda()
    weights_TK = torch.rand(512, 4, device="cuda", requires_grad=True)
    assert moe_train.uses_grouped_experts("auto", x_TH.bfloat16(), experts.gate_up_proj)
    results = _impl_results(experts, x_TH, ids_TK, weights_TK, ("auto", "loop"), autocast_dtype=torch.bfloat16)
    exact = _gpt_oss_experts(256, 32, 4, 128, 7.0).double()
    exact.load_state_dict({name: t.double().cpu() for name, t in experts.state_dict().items()})
    exact.experts_impl = "loop"
    x64, w64 = (t.detach().double().cpu().requires_grad_() for t in (x_TH, weights_TK))
    y64 = exact(x64, ids_TK.cpu(), w64)
    y64.square().sum().backward()
    expected = [y64.detach(), x64.grad, w64.grad, exact.gate_up_proj.grad, exact.down_proj.grad,
                exact.gate_up_proj_bias.grad, exact.down_proj_bias.grad]
    for name, grouped_t, loop_t, exact_t in zip(("y", "x", "w", "gate_up", "down", "gate_up_bias", "down_bias"),
                                                results["auto"], results["loop"], expected):
        assert grouped_t.dtype == loop_t.dtype, name
        loop_error = ((loop_t.double().cpu() - exact_t).norm() / exact_t.norm()).item()
        assert_close_rel(grouped_t.cpu(), exact_t, max(1.5 * loop_error, 2e-2), name)


@pytest.mark.slow
def test_grouped_path_compiles_without_graph_breaks():
    """``--train-compile``: the grouped path traces as one graph with dynamic T (bf16, as on the GPU)
    and computes what eager computes, gradients included."""
    from miles_host.models.mlp import MoE

    torch.manual_seed(5)
    layer = MoE(32, MoEConfig(num_experts=8, top_k=2, intermediate_size=16, experts_impl="grouped"), "silu", 0)
    layer.router.reset_parameters()
    layer.experts.reset_parameters()
    layer = layer.bfloat16()
    compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
    for num_tokens in (40, 17):
        x_TH = torch.randn(num_tokens, 32, dtype=torch.bfloat16, requires_grad=True)
        results = []
        for module in (layer, compiled):
            layer.zero_grad()
            x_TH.grad = None
            y_TH = module(x_TH)
            y_TH.float().square().sum().backward()
            results.append([y_TH.detach(), x_TH.grad, *(p.grad for p in layer.parameters())])
        for eager_t, compiled_t in zip(*results):
            torch.testing.assert_close(compiled_t, eager_t, rtol=0, atol=0)
