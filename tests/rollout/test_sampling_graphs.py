"""Graphed sampling of small decode batches (:mod:`miles_host.rollout.sampling_graphs`): the
static-buffer sampler draws what the eager sampler draws for every sampling mode (CPU, the
body the graph captures), and on a GPU the engine's tokens with the graphs equal those without
them, logprobs to the rounding of an LM head over the padded batch."""

from __future__ import annotations

import pytest
import torch

from miles_host.rollout.sampler import SamplingBatch, sample_with_distribution
from miles_host.rollout.sampling_graphs import MAX_GRAPHED_BATCH, SamplingGraphs, SamplingMode
from miles_host.rollout.sampling_params import SamplingParams
from tests.rollout.conftest import PROMPTS, engine_logprobs, load

HIDDEN, VOCAB = 16, 3000  # a vocabulary over the inverse CDF's chunk: its two-level search runs

#: one batch per sampling mode: greedy, unit temperature, tempered with each truncation, mixed
MODES = {
    "greedy": [dict(temperature=0.0)] * 3,
    "unit": [dict(temperature=1.0)] * 3,
    "top_k": [dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_k=5), dict(temperature=0.9)],
    "top_p": [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_p=0.5), dict(temperature=1.1)],
    "min_p": [dict(temperature=1.0, min_p=0.05), dict(temperature=0.6, min_p=0.2), dict(temperature=1.0)],
    "mixed": [dict(temperature=0.0), dict(temperature=0.7, top_k=50, top_p=0.95, min_p=0.01), dict(temperature=1.0)],
}


def _batch(settings: list[dict]) -> SamplingBatch:
    params = [SamplingParams(**s) for s in settings]
    return SamplingBatch.build(params, [None] * len(params), [[] for _ in params], torch.device("cpu"))


@pytest.mark.parametrize("name", sorted(MODES))
def test_the_static_sampler_draws_what_the_eager_sampler_draws(name):
    torch.manual_seed(0)
    weight_VH = torch.randn(VOCAB, HIDDEN) * 0.5
    graphs = SamplingGraphs(lambda h: h @ weight_VH.T, sizes=[1, 2, 4, 8], hidden_size=HIDDEN,
                            dtype=torch.float32, device=torch.device("cpu"))
    # an earlier, larger batch leaves its settings in the padding rows: they must not leak
    graphs._load_settings(_batch(MODES["top_k"] * 2), 6)
    batch = _batch(MODES[name])
    mode = SamplingMode.of(batch)
    assert mode is not None
    n = len(MODES[name])
    size = graphs.padded_size(n)
    for _ in range(5):
        hidden_BH, uniforms_B = torch.randn(n, HIDDEN), torch.rand(n)
        graphs._load_settings(batch, n)
        graphs.hidden_BH[:n].copy_(hidden_BH)
        graphs.uniforms_B[:n].copy_(uniforms_B)
        tokens_B, logprob_B = graphs._body(size, mode)
        # the LM head over the padded rows, as the graph runs it (a GEMM's rounding may depend on its rows)
        logits_BV = (graphs.hidden_BH[:size] @ weight_VH.T)[:n]
        expected_B, logprobs_BV = sample_with_distribution(logits_BV, batch, uniforms_B)
        assert torch.equal(tokens_B[:n], expected_B)
        assert torch.equal(logprob_B[:n], logprobs_BV.gather(1, expected_B[:, None]).squeeze(1))


def test_batches_the_graphs_leave_to_the_eager_sampler():
    graphs = SamplingGraphs(lambda h: h, sizes=[1, 8, 64, 128], hidden_size=4, dtype=torch.float32,
                            device=torch.device("cpu"))
    assert graphs.sizes == [1, 8, 64] and graphs.padded_size(65) is None and MAX_GRAPHED_BATCH == 64
    banned = SamplingBatch.build([SamplingParams(temperature=1.0)], [None], [[3]], torch.device("cpu"))
    assert not graphs.accepts(banned) and SamplingMode.of(banned) is None
    assert graphs.accepts(_batch(MODES["mixed"]))
    # without uniform numbers only an all-greedy batch is graphed
    assert graphs.sample(torch.zeros(1, 4), _batch(MODES["unit"][:1]), None) is None


#: decode batches of each mode; seeded (the RL case) and unseeded, unequal lengths so rows shift
GPU_SAMPLING = [
    [{"temperature": 0.8, "top_p": 0.9, "top_k": 30, "max_new_tokens": n, "ignore_eos": True, "n": 2,
      "sampling_seed": 7} for n in (40, 7, 23, 33)],
    [{"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 3}] * 4,
    [{"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}] * 4,
    [{"temperature": 0.6, "min_p": 0.1, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 11},
     {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
     {"temperature": 1.2, "top_k": 5, "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 5},
     {"temperature": 1.0, "min_new_tokens": 5, "max_new_tokens": 20, "sampling_seed": 2}],
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(len(GPU_SAMPLING)))
def test_gpu_graphed_sampling_gives_the_eager_tokens_and_logprobs(qwen3_dense, case):
    from miles_host.rollout import Engine

    _, path = qwen3_dense
    engines = [Engine(load(path).cuda(), max_num_seqs=8, mem_fraction_static=0.3, max_kv_cache_tokens=4096,
                      block_size=4) for _ in range(2)]
    graphed, eager = engines
    assert graphed.runner.sampling_graphs is not None
    eager.runner.sampling_graphs = None
    got = graphed.generate(PROMPTS, GPU_SAMPLING[case])
    expected = eager.generate(PROMPTS, GPU_SAMPLING[case])
    assert graphed.runner.sampling_graphs.num_replays > 0
    for a, b in zip(got, expected):  # the LM head runs over the padded batch in the graph: rounding only
        assert a["output_ids"] == b["output_ids"]
        assert (engine_logprobs(a) - engine_logprobs(b)).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_few_row_log_softmax_is_torchs_to_rounding():
    from miles_host.rollout.sampler import LOGSUMEXP_MAX_ROWS, log_softmax_rows

    logits = torch.randn(LOGSUMEXP_MAX_ROWS, 151_936, device="cuda") * 4
    logits[0, :100] = float("-inf")
    got, expected = log_softmax_rows(logits), torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(got.isinf(), expected.isinf())
    finite = ~expected.isinf()
    assert (got.double()[finite] - expected[finite]).abs().max() < 2e-5
