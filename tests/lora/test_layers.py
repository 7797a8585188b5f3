"""``LoraLinear`` against the plain formula in float64: the update lands on its part's rows
only (a part without adapter stays the base's), the merged weight computes the same, the
base gets no gradient, dropout touches the adapters' input only."""

from __future__ import annotations

import torch

from miles_host.lora.layers import LoraLinear, LoraPart, merged_weight

PARTS = [LoraPart("q_proj", "m.q_proj", 0, 4), LoraPart("v_proj", "m.v_proj", 8, 12)]  # k_proj (rows 4-8) not adapted


def _layer(dropout: float = 0.0) -> LoraLinear:
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 12, dtype=torch.float64)
    layer = LoraLinear(base, PARTS, rank=3, alpha=6, dropout=dropout)
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.normal_()
    return layer


def test_forward_and_merged_weight_match_the_formula():
    layer = _layer()
    x = torch.randn(5, 6, dtype=torch.float64)
    want = x @ layer.weight.T + layer.bias
    for part in PARTS:
        a, b = layer.lora_A[part.key], layer.lora_B[part.key]
        want[:, part.start : part.stop] += 2.0 * x @ a.T @ b.T
    assert torch.allclose(layer(x), want, rtol=0, atol=1e-12)
    merged = merged_weight(layer.weight, layer.parts, dict(layer.lora_A), dict(layer.lora_B), layer.scaling)
    assert torch.allclose(x @ merged.T + layer.bias, want, rtol=0, atol=1e-12)
    assert torch.equal(merged[4:8], layer.weight[4:8])


def test_one_part_over_every_row_matches_the_formula():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 12, dtype=torch.float64)
    layer = LoraLinear(base, [LoraPart("o_proj", "m.o_proj", 0, 12)], rank=3, alpha=6, dropout=0.0)
    with torch.no_grad():
        layer.lora_B["o_proj"].normal_()
    x = torch.randn(5, 6, dtype=torch.float64)
    a, b = layer.lora_A["o_proj"], layer.lora_B["o_proj"]
    assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias + 2.0 * x @ a.T @ b.T, rtol=0, atol=1e-12)


def test_a_fresh_adapter_changes_nothing_and_only_adapters_get_gradients():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 12, dtype=torch.float64)
    x = torch.randn(5, 6, dtype=torch.float64)
    want = base(x).detach()
    layer = LoraLinear(base, PARTS, rank=3, alpha=6, dropout=0.0)
    assert torch.equal(layer(x), want)  # B starts at zero
    layer(x).square().sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    assert all(b.grad is not None for b in layer.lora_B.values())


def test_dropout_reaches_the_adapters_input_only_and_only_in_training():
    layer = _layer(dropout=0.5)
    x = torch.randn(64, 6, dtype=torch.float64)
    base = x @ layer.weight.T + layer.bias
    layer.train()
    torch.manual_seed(1)
    out = layer(x)
    assert torch.allclose(out[:, 4:8], base[:, 4:8], rtol=0, atol=1e-12)  # rows without adapter: the base alone
    layer.eval()
    assert not torch.allclose(out, layer(x))  # training drew a dropout mask; eval draws none
    assert torch.equal(layer(x), layer(x))


def test_frozen_bases_stored_in_the_autocast_dtype_compute_the_same_bits():
    """A base weight stored in bf16 gives bit for bit the output and adapter gradients that
    autocast's per-forward cast of the float32 weight gives; a tied weight keeps its dtype."""
    from miles_host.lora.layers import store_frozen_bases_in

    torch.manual_seed(0)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(12, 6)
            self.proj = LoraLinear(torch.nn.Linear(6, 12), PARTS, rank=3, alpha=6, dropout=0.0)
            self.head = LoraLinear(torch.nn.Linear(6, 12, bias=False), PARTS[:1], rank=3, alpha=6, dropout=0.0)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.proj(self.embed(ids))[:, :6])

    model = Tied()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.randint(0, 12, (7,))

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids)
        out.float().square().sum().backward()
        return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    import copy

    cast_model = copy.deepcopy(model)
    assert store_frozen_bases_in(cast_model, torch.bfloat16) == 2  # proj's weight and bias; the tied head not
    assert cast_model.proj.weight.dtype == torch.bfloat16 and not cast_model.proj.weight.requires_grad
    assert cast_model.head.weight.dtype == torch.float32 and cast_model.head.weight is cast_model.embed.weight
    want, want_grads = run(model)
    got, got_grads = run(cast_model)
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)
