"""Sampling frequencies follow softmax(logits / T) truncated by top-k / top-p / min-p."""

from __future__ import annotations

import pytest
import torch

from miles_host.rollout.sampler import SamplingBatch, sample
from miles_host.rollout.sampling_params import SamplingParams
from tests.rollout.conftest import make_engine


def reference_distribution(logits_V: torch.Tensor, temperature: float, top_k: int = -1,
                           top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """SGLang's truncation written out in float64, one token at a time."""
    probs = torch.softmax(logits_V.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order):
        p = probs[token].item()
        ok = (top_k <= 0 or rank < top_k) and mass <= top_p and p >= min_p * probs[order[0]].item()
        keep[token] = ok or rank == 0
        mass += p
    truncated = torch.where(keep, probs, torch.zeros_like(probs))
    return truncated / truncated.sum()


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square test; bins with tiny expectation are pooled."""
    total = counts.sum().item()
    expected = expected_probs * total
    assert counts[expected_probs == 0].sum() == 0, "sampled a token the truncation removes"
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    expect = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if expect[-1] < 5:  # the pooled remainder is too small to test: drop it
        observed, expect = observed[:-1], expect[:-1]
    statistic = ((observed - expect) ** 2 / expect).sum()
    dof = len(expect) - 1
    assert dof >= 3, "too few tokens survive truncation for a meaningful test"
    return torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2).item()


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, top_k=6),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=20, top_p=0.9),
]


@pytest.mark.parametrize("case", CASES)
def test_sampler_frequencies_match_the_truncated_softmax(case):
    torch.manual_seed(0)
    logits_V = torch.randn(64) * 0.8
    rows = 20000
    params = [SamplingParams(**case)] * rows
    torch.manual_seed(123)
    batch = SamplingBatch.build(params, [None] * rows, [[]] * rows, torch.device("cpu"))
    tokens, logprobs = sample(logits_V.expand(rows, -1).contiguous(), batch)
    counts = torch.bincount(tokens, minlength=64)
    expected = reference_distribution(logits_V, **case)
    assert chi_square_p_value(counts, expected) > 1e-3
    # logprobs are of the untruncated tempered distribution
    full = torch.log_softmax(logits_V / case["temperature"], dim=-1)
    assert torch.allclose(logprobs, full[tokens], atol=1e-6)


def test_engine_samples_follow_the_model_distribution(qwen3_dense):
    """One step sampled many times through the engine (n samples share the prompt) vs HF logits."""
    hf_model, path = qwen3_dense
    prompt = [5, 9, 17, 33, 2, 8]
    case = dict(temperature=0.8, top_p=0.95, top_k=40)
    engine = make_engine(path, max_num_seqs=512)
    torch.manual_seed(7)
    outputs = engine.generate([prompt] * 8, {**case, "max_new_tokens": 1, "n": 500})
    tokens = torch.tensor([o["output_ids"][0] for o in outputs])
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1]
    expected = reference_distribution(logits, **case)
    counts = torch.bincount(tokens, minlength=logits.shape[0])
    assert chi_square_p_value(counts, expected) > 1e-3


def test_sampling_seed_makes_a_request_reproducible(qwen3_dense):
    _, path = qwen3_dense
    params = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 42, "n": 2}
    first = make_engine(path).generate([[1, 2, 3]], params)
    second = make_engine(path).generate([[9, 9], [1, 2, 3]], [params, params])[2:]
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second]
    assert first[0]["output_ids"] != first[1]["output_ids"]  # the n samples differ


def test_invalid_sampling_params_are_value_errors():
    for bad in [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -3}, {"min_p": 2},
                {"n": 0}, {"max_new_tokens": -1}, {"stop": [""]}, {"temprature": 1.0}]:
        with pytest.raises(ValueError, match="sampling"):
            SamplingParams.from_any(bad)


def test_seeded_uniform_is_splitmix64_and_uniform():
    from miles_host.rollout.sampler import _splitmix64, seeded_uniform

    # splitmix64's published first output from state 0 (Vigna's reference implementation)
    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    values = torch.tensor([seeded_uniform(s, i, p) for s in range(20) for i in range(5) for p in range(200)],
                          dtype=torch.float64)
    assert values.min() >= 0.0 and values.max() < 1.0
    assert torch.equal(values * 2**24, (values * 2**24).round())  # exact in float32
    counts = torch.histc(values, bins=20, min=0.0, max=1.0)
    assert chi_square_p_value(counts, torch.full((20,), 1 / 20, dtype=torch.float64)) > 1e-3
    assert seeded_uniform(7, 0, 3) == seeded_uniform(7, 0, 3) != seeded_uniform(7, 1, 3) != seeded_uniform(7, 0, 4)


@pytest.mark.parametrize("case", CASES[1:3])
def test_seeded_uniforms_sample_the_truncated_softmax(case):
    """The engine's per-request uniforms (seed, sample index, position) drive the same inverse-CDF draw."""
    from miles_host.rollout.sampler import seeded_uniform

    torch.manual_seed(0)
    logits_V = torch.randn(64) * 0.8
    rows = 20000
    params = [SamplingParams(**case)] * rows
    batch = SamplingBatch.build(params, [None] * rows, [[]] * rows, torch.device("cpu"))
    uniforms = torch.tensor([seeded_uniform(1000 + r, 0, r % 7) for r in range(rows)], dtype=torch.float32)
    tokens, _ = sample(logits_V.expand(rows, -1).contiguous(), batch, uniforms)
    counts = torch.bincount(tokens, minlength=64)
    assert chi_square_p_value(counts, reference_distribution(logits_V, **case)) > 1e-3


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_any_batch(qwen3_dense):
    _, path = qwen3_dense
    seeded = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}
    other = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}
    alone = make_engine(path).generate([[4, 8, 15]], seeded)[0]["output_ids"]
    crowd = make_engine(path, max_num_seqs=3).generate(
        [[1, 2], [4, 8, 15], [9, 9, 9, 9], [3]], [other, seeded, other, other]
    )[1]["output_ids"]
    assert alone == crowd


def test_vectorised_seeded_uniforms_equal_the_scalar_formula():
    from miles_host.rollout.sampler import seeded_uniform, seeded_uniforms

    cases = [(s, i, p) for s in (0, 1, 7, 2**63 + 5, 2**64 - 1, -3) for i in (0, 1, 15) for p in (0, 1, 511, 10**9)]
    got = seeded_uniforms(*map(list, zip(*cases)))
    assert got.dtype.name == "float32"
    assert got.tolist() == [seeded_uniform(*case) for case in cases]


@pytest.mark.parametrize("vocab", [7, 1024, 1500, 151936])
def test_inverse_cdf_is_the_float64_scan(vocab):
    """The two-level inverse CDF draws the token a float64 single scan gives (targets away
    from a boundary by more than float32 rounding), never a zero-weight token, and falls
    back to the heaviest token when the target reaches the total."""
    from miles_host.rollout.sampler import inverse_cdf

    generator = torch.Generator().manual_seed(vocab)
    weights_BV = torch.rand(64, vocab, generator=generator) ** 4
    weights_BV[weights_BV < 0.3] = 0.0  # many zero-weight tokens, some whole chunks empty
    weights_BV[:, -1] += 0.05            # (a distribution has a positive token)
    weights_BV[1, : vocab // 2] = 0.0
    weights_BV[2] = 0.0
    weights_BV[2, vocab - 1] = 1.0      # only the last token
    uniforms_B = torch.rand(64, generator=generator)
    uniforms_B[:3] = torch.tensor([0.0, 0.5, 0.999999])
    got_B = inverse_cdf(weights_BV, uniforms_B)
    cdf_BV = weights_BV.double().cumsum(-1)
    targets_B = uniforms_B.double() * cdf_BV[:, -1]
    expected_B = (cdf_BV <= targets_B[:, None]).sum(-1)
    gap_B = (cdf_BV - targets_B[:, None]).abs().min(-1).values / cdf_BV[:, -1]
    clear_B = gap_B > 2e-6
    assert clear_B.sum() > 32
    assert torch.equal(got_B[clear_B], expected_B[clear_B])
    assert bool((weights_BV.gather(1, got_B[:, None]) > 0).all())
    assert got_B[2] == vocab - 1
    assert inverse_cdf(weights_BV[:1], torch.ones(1))[0] == weights_BV[0].argmax()
