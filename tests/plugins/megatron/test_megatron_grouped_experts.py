"""``GroupedSequentialMLP``: the megatron backend's routed experts as grouped GEMMs; and
``OneRankTokenDispatcher``, the dispatch of their tokens without host reads (reference:
Megatron's own ``MoEAllGatherTokenDispatcher`` on the same routing, bit for bit).

The reference is Megatron-Core's own ``SequentialMLP.forward`` on the same module (its
per-expert ``MLP``s), on the experts of the tiny Qwen3-MoE the trainer tests build: the
same output and parameter gradients in float32 (tight) and under CPU bf16 autocast
(loose), with uneven tokens per expert and an expert that gets none.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("transformers")

from tests.plugins.megatron.test_megatron_trainer import MODELS, make_trainer  # noqa: E402
from tests.plugins.megatron.conftest import save_models  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(one_rank_group):
    """(see conftest: no process group left behind)"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("megatron_grouped_experts"), {"qwen3_moe": MODELS["qwen3_moe"]})


@pytest.fixture(scope="module")
def trainer(models):
    """The megatron trainer (kept for the module: its DDP's gradient hooks go with it)."""
    return make_trainer(models, "qwen3_moe", "megatron")


@pytest.fixture(scope="module")
def experts(trainer):
    """The first MoE layer's experts of the megatron trainer's model (4 experts, hidden 64, I 32, SwiGLU)."""
    return trainer.model.gpt.decoder.layers[0].mlp.experts


def _run(module, forward, x_NH, tokens_per_expert, probs_N):
    """Output and the gradients of x, probs and every expert weight (``forward``: which forward).
    The trainer's model is in Megatron's DDP: the weight gradients land in ``main_grad``."""
    parameters = dict(module.named_parameters())
    for p in parameters.values():
        p.main_grad.zero_()
    x_NH = x_NH.clone().requires_grad_(True)
    probs_N = probs_N.clone().requires_grad_(True)
    out_NH, bias = forward(module, x_NH, tokens_per_expert, probs_N)
    assert bias is None
    out_NH.float().pow(2).sum().backward()
    grads = {name: p.main_grad.clone() for name, p in parameters.items()}
    return out_NH.detach(), x_NH.grad, probs_N.grad, grads


def _inputs(counts):
    generator = torch.Generator().manual_seed(0)
    rows = sum(counts)
    return (torch.randn(rows, 64, generator=generator), torch.tensor(counts),
            torch.rand(rows, generator=generator))


def _grouped(module, x, counts, probs):
    return module.grouped_forward(x, counts, probs), None


def _sequential(module, x, counts, probs):
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP.forward(module, x, counts, probs)


def _assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Within bf16 rounding: 2% of each element, or 2% of the tensor's largest element."""
    expected = expected.float()
    atol = 2e-2 * float(expected.abs().max())
    assert atol > 0, msg
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=atol, msg=msg)


# uneven groups, one expert gets no token; groups whose sizes are multiples of the row alignment
@pytest.mark.parametrize("counts", [[5, 1, 0, 11], [16, 0, 32, 16]])
def test_grouped_forward_equals_sequential_mlp_float32(experts, counts):
    from miles_megatron.grouped_experts import GroupedSequentialMLP

    assert type(experts) is GroupedSequentialMLP and experts.covered
    x, counts_E, probs = _inputs(counts)
    want = _run(experts, _sequential, x, counts_E, probs)
    got = _run(experts, _grouped, x, counts_E, probs)
    for expected, actual in zip(want[:3], got[:3]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert got[3].keys() == want[3].keys() and len(got[3]) == 8
    empty = f"local_experts.{counts.index(0)}."
    assert all(float(grad.abs().max()) > 0 for name, grad in want[3].items() if not name.startswith(empty))
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], rtol=1e-5, atol=1e-5, msg=name)
    assert float(got[3][f"{empty}linear_fc1.weight"].abs().max()) == 0.0  # no token, no gradient


def test_grouped_forward_equals_sequential_mlp_under_bf16_autocast(experts):
    x, counts_E, probs = _inputs([7, 0, 19, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _run(experts, _sequential, x, counts_E, probs)
        got = _run(experts, _grouped, x, counts_E, probs)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for expected, actual in zip(want[:3], got[:3]):
        _assert_close_bf16(actual, expected)
    for name in want[3]:
        assert got[3][name].dtype == torch.float32  # float32 masters get float32 gradients
        if ".1." not in name:  # expert 1 gets no token
            _assert_close_bf16(got[3][name], want[3][name], msg=name)


def test_experts_impl_picks_the_forward(experts, monkeypatch):
    """``loop`` runs SequentialMLP's forward, ``grouped`` the grouped one, ``auto`` the loop on the CPU."""
    from miles_megatron.grouped_experts import GroupedSequentialMLP

    calls = []

    def recorded(self, x_NH, tokens_per_expert, probs_N):
        calls.append("grouped")
        return torch.zeros_like(x_NH)

    monkeypatch.setattr(GroupedSequentialMLP, "grouped_forward", recorded)
    x, counts_E, probs = _inputs([3, 2, 0, 1])
    for impl, expected in (("loop", []), ("auto", []), ("grouped", ["grouped"])):
        calls.clear()
        monkeypatch.setattr(experts, "experts_impl", impl)
        with torch.no_grad():
            out, _ = experts(x, counts_E, probs)
        assert calls == expected, impl
        assert (out.abs().max() == 0) == (impl == "grouped")


@pytest.mark.parametrize("change", [dict(add_bias_linear=True), dict(moe_apply_probs_on_input=True),
                                    dict(bias_activation_fusion=True), dict(delay_wgrad_compute=True), "expert_tp"])
def test_what_the_grouped_forward_does_not_compute_keeps_the_loop(experts, change):
    import copy

    from miles_megatron.grouped_experts import grouped_forward_covers

    assert grouped_forward_covers(experts.config, 1)
    if change == "expert_tp":
        assert not grouped_forward_covers(experts.config, 2)
        return
    config = copy.copy(experts.config)
    for name, value in change.items():
        setattr(config, name, value)
    assert not grouped_forward_covers(config, 1)


def _fresh_copy(experts, device):
    """A new ``GroupedSequentialMLP`` with ``experts``' config, groups and weights on ``device``, outside
    Megatron's DDP (its gradients in ``.grad``)."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from miles_megatron.grouped_experts import GroupedSequentialMLP

    groups = SimpleNamespace(ep=experts.ep_group, expt_tp=experts.tp_group, expt_dp=experts.dp_group)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    copy = GroupedSequentialMLP(experts.num_local_experts, experts.config, submodules, groups, experts_impl="auto")
    copy.load_state_dict(experts.state_dict())
    return copy.to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_forward_equals_sequential_mlp_on_cuda_bf16(experts):
    """On CUDA under bf16 autocast ``auto`` takes the grouped forward (sm90/sm100: ``_grouped_mm``'s
    bf16 kernel) and it gives SequentialMLP's output and gradients within bf16 rounding."""
    from miles_host.kernels.moe_train import uses_grouped_experts

    module = _fresh_copy(experts, "cuda")
    x, counts_E, probs = (t.cuda() for t in _inputs([37, 0, 200, 3]))
    fc1 = module.local_experts[0].linear_fc1.weight.unsqueeze(0)

    def run(forward):
        module.zero_grad(set_to_none=True)
        x_NH, probs_N = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if torch.cuda.get_device_capability()[0] in (9, 10):
                assert uses_grouped_experts(module.experts_impl, x_NH, fc1)
            out_NH, _ = forward(module, x_NH, counts_E.cpu(), probs_N)
            out_NH.float().pow(2).sum().backward()  # (as the trainer: Megatron's linears take bf16 gradients)
        return out_NH.detach().float(), x_NH.grad, {n: p.grad for n, p in module.named_parameters()}

    want, got = run(_sequential), run(_grouped)
    _assert_close_bf16(got[0], want[0])
    _assert_close_bf16(got[1], want[1])
    for name in want[2]:
        if ".1." in name:  # expert 1 gets no token: SequentialMLP leaves no gradient, the grouped one zeros
            assert want[2][name] is None or float(want[2][name].abs().max()) == 0.0
            assert float(got[2][name].abs().max()) == 0.0
        else:
            _assert_close_bf16(got[2][name], want[2][name], msg=name)


def test_weight_gradients_go_straight_into_main_grad(experts):
    """In the DDP without overlapped reduction the grouped forward's weight gradients are added
    to ``main_grad`` by its stacks' backward: the sums the DDP's per-parameter hooks make, bit for
    bit, and no parameter's gradient hook runs."""
    assert experts.weight_grads_into_main_grad  # (the trainer wraps without --overlap-grad-reduce)
    x, counts_E, probs = _inputs([5, 1, 0, 11])
    calls = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: calls.append(p)) for p in experts.parameters()]
    try:
        direct = _run(experts, _grouped, x, counts_E, probs)
        assert not calls
        experts.weight_grads_into_main_grad = False
        hooked = _run(experts, _grouped, x, counts_E, probs)
        assert len(calls) == len(list(experts.parameters()))
    finally:
        experts.weight_grads_into_main_grad = True
        for handle in handles:
            handle.remove()
    views = [view for _, view in experts._main_grad_views.values()]
    assert len(views) == 2 and all(view is not None and view.reversed for view in views)  # (Megatron's layout)
    for got, want in zip(direct[:3], hooked[:3]):
        assert torch.equal(got, want)
    assert direct[3].keys() == hooked[3].keys()
    for name in direct[3]:
        assert torch.equal(direct[3][name], hooked[3][name]), name
    assert any(grad.abs().max() > 0 for grad in direct[3].values())


def test_stacks_reused_within_a_scope(experts, monkeypatch):
    """Inside ``expert_stacks_reused`` the stacks are built once for several passes, with the
    same outputs and gradients (``main_grad`` sums over the passes) as stacks built per pass;
    a pass without gradients reads them too."""
    from miles_megatron import grouped_experts

    x, counts_E, probs = _inputs([5, 1, 0, 11])
    plain = [_run(experts, _grouped, x, counts_E, probs) for _ in range(2)]
    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    with grouped_experts.expert_stacks_reused():
        reused = [_run(experts, _grouped, x, counts_E, probs) for _ in range(2)]
        with torch.no_grad():
            no_grad = experts.grouped_forward(x, counts_E, probs)
    assert len(stacks) == 2  # (fc1 and fc2, once)
    assert grouped_experts._REUSED_STACKS is None  # (the scope's stacks dropped)
    for got, want in zip(reused, plain):
        for a, b in zip(got[:3], want[:3]):
            assert torch.equal(a, b)
        assert all(torch.equal(got[3][name], want[3][name]) for name in want[3])
    assert torch.equal(no_grad, plain[0][0])


def test_evenly_spaced_main_grads_are_one_view():
    from miles_megatron.grouped_experts import evenly_spaced

    buffer = torch.zeros(40)
    chunks = [buffer[start:start + 6].view(2, 3) for start in (2, 12, 22, 32)]  # spacing 10, 6 used
    for order, reversed_ in ((chunks, False), (chunks[::-1], True)):
        grads = evenly_spaced(order)
        assert grads is not None and grads.reversed == reversed_
        values = torch.arange(24, dtype=torch.bfloat16).view(4, 2, 3)
        grads.add_(values)
        for tensor, value in zip(order, values):
            assert torch.equal(tensor, value.float())
        assert float(buffer.sum()) == float(values.float().sum())  # nothing between the tensors written
        buffer.zero_()
    assert evenly_spaced([buffer[0:6].view(2, 3), buffer[10:16].view(2, 3), buffer[24:30].view(2, 3)]) is None  # uneven
    assert evenly_spaced([buffer[0:6].view(2, 3), buffer[3:9].view(2, 3)]) is None  # overlapping
    assert evenly_spaced([buffer[0:6].view(2, 3), torch.zeros(2, 3)]) is None  # two storages


# ---------------------------------------------------------------- the one-rank dispatcher

def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    experts = scores.topk(top_k, dim=1).indices
    if num_tokens > 3:
        experts[:3] = torch.arange(top_k)  # several tokens on the same experts; others may get none
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, experts, True)
    probs = torch.zeros(num_tokens, num_experts).scatter_(1, experts, torch.rand(num_tokens, top_k, generator=generator))
    return routing_map, probs


def _dispatch_and_combine(dispatcher, hidden, routing_map, probs):
    hidden = hidden.detach().requires_grad_()
    hidden_states, probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    hidden_states, probs = dispatcher.token_dispatch(hidden_states, probs)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
    scale_N1 = torch.arange(1, rows.shape[0] + 1, dtype=rows.dtype).unsqueeze(1)  # a different factor per row
    combined = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(rows * scale_N1)))
    combined.backward(torch.ones_like(combined))
    return rows.detach(), tokens_per_expert, row_probs, combined.detach(), hidden.grad


def test_one_rank_dispatch_is_megatrons_all_gather_dispatch(trainer):
    """Rows, counts and probabilities as Megatron's; the combine and the sort's gradient as
    Megatron's and a float64 sum (each token's rows scaled by their row numbers)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from miles_megatron.dispatcher import OneRankTokenDispatcher

    moe = trainer.model.gpt.decoder.layers[0].mlp
    ours = moe.token_dispatcher
    assert type(ours) is OneRankTokenDispatcher  # the trainer's layers got it
    megatrons = MoEAllGatherTokenDispatcher.__new__(MoEAllGatherTokenDispatcher)
    megatrons.__dict__.update(ours.__dict__)
    num_experts, top_k = moe.config.num_moe_experts, moe.config.moe_router_topk
    for num_tokens, seed in ((1, 0), (7, 1), (40, 2)):
        routing_map, probs = _routing(num_tokens, num_experts, top_k, seed)
        hidden = torch.randn(num_tokens, 1, moe.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        got = _dispatch_and_combine(ours, hidden, routing_map, probs)
        want = _dispatch_and_combine(megatrons, hidden, routing_map, probs)
        assert got[1].device == hidden.device and want[1].device.type == "cpu"
        assert torch.equal(got[1].cpu(), want[1])
        for a, b in zip(got[:1] + got[2:3], want[:1] + want[2:3]):
            assert a.shape == b.shape and torch.equal(a, b)
        # float64: token t's rows are where the map puts its experts, expert-major
        rows_of_token = [[] for _ in range(num_tokens)]
        row = 0
        for expert in range(num_experts):
            for token in range(num_tokens):
                if routing_map[token, expert]:
                    rows_of_token[token].append(row)
                    row += 1
        factor_T = torch.tensor([sum(r + 1 for r in rows) for rows in rows_of_token], dtype=torch.float64)
        want_combined = hidden.squeeze(1).double() * factor_T.unsqueeze(1)
        want_grad = factor_T.view(-1, 1, 1).expand_as(hidden)
        for combined, grad in ((got[3], got[4]), (want[3], want[4])):
            assert torch.allclose(combined.squeeze(1).double(), want_combined, rtol=1e-6, atol=1e-5)
            assert torch.allclose(grad.double(), want_grad, rtol=0, atol=1e-5)
        assert torch.allclose(got[3], want[3], rtol=1e-6, atol=1e-6) and torch.allclose(got[4], want[4], rtol=0, atol=1e-6)


def test_where_megatrons_dispatcher_stays(trainer):
    from miles_megatron.dispatcher import applies

    dispatcher = trainer.model.gpt.decoder.layers[0].mlp.token_dispatcher
    config = dispatcher.config
    assert applies(dispatcher)
    for field, value in (("moe_expert_capacity_factor", 1.0), ("moe_permute_fusion", True),
                         ("moe_router_padding_for_quantization", True), ("moe_shared_expert_overlap", True)):
        original = getattr(config, field)
        setattr(config, field, value)
        try:
            assert not applies(dispatcher), field
        finally:
            setattr(config, field, original)
    dispatcher.ep_size = 2
    try:
        assert not applies(dispatcher)
    finally:
        dispatcher.ep_size = 1


def _routed_experts_pass(moe, hidden, routing_map, probs):
    """The MoE layer's dispatch, experts and combine (``routed_experts_compute``) forward and
    backward: the output and the gradients of the hidden states, the probabilities and every
    expert weight (``main_grad``)."""
    for p in moe.experts.parameters():
        p.main_grad.zero_()
    hidden = hidden.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    dispatcher = moe.token_dispatcher
    hidden_states, row_probs = dispatcher.token_dispatch(*dispatcher.dispatch_preprocess(hidden, routing_map, probs))
    output, _ = moe.routed_experts_compute(hidden_states, row_probs)
    combined = dispatcher.combine_postprocess(dispatcher.token_combine(output))
    combined.float().pow(2).sum().backward()
    return combined.detach(), hidden.grad, probs.grad, {n: p.main_grad.clone() for n, p in moe.experts.named_parameters()}


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_the_dispatch_into_the_padded_layout_is_the_two_step_one(trainer, monkeypatch, num_tokens):
    """Grouped experts take the dispatcher's rows in their padded layout (one reordering each
    way): the output and every gradient equal the dispatch to expert-sorted rows followed by
    the experts' own padding, bit for bit (tokens on one expert, experts with none)."""
    from miles_host.kernels.moe_train import ExpertLayout

    moe = trainer.model.gpt.decoder.layers[0].mlp
    assert moe.token_dispatcher.grouped_experts is moe.experts
    monkeypatch.setattr(moe.experts, "experts_impl", "grouped")  # (``auto`` keeps the loop on the CPU)
    routing_map, probs = _routing(num_tokens, moe.config.num_moe_experts, moe.config.moe_router_topk, num_tokens)
    hidden = torch.randn(num_tokens, 1, moe.config.hidden_size, generator=torch.Generator().manual_seed(num_tokens))
    handed = []
    forward = type(moe.experts).forward
    monkeypatch.setattr(type(moe.experts), "forward",
                        lambda self, x, counts, p: handed.append(type(counts)) or forward(self, x, counts, p))
    padded = _routed_experts_pass(moe, hidden, routing_map, probs)
    monkeypatch.setattr(moe.token_dispatcher, "grouped_experts", None)
    two_step = _routed_experts_pass(moe, hidden, routing_map, probs)
    assert handed == [ExpertLayout, torch.Tensor]
    for got, want in zip(padded[:3], two_step[:3]):
        assert torch.equal(got, want)
    assert any(float(grad.abs().max()) > 0 for grad in padded[3].values())
    for name in two_step[3]:
        assert torch.equal(padded[3][name], two_step[3][name]), name
