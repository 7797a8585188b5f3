"""CUDA graphs of a small decode batch's sampling: LM head, log-softmax, truncation and the
inverse-CDF draw replayed as one graph.

At small batch sizes a decode step is host-bound: the forward is one graph replay, but the
sampling that follows is some thirty eager kernels (log-softmax, the two-level CDF search,
gathers), each a Python call and a launch, and the host time they take is longer than the
GPU time of the whole step. Here that work is captured once per padded batch size and
*sampling mode* — the Python-level branches of :func:`~miles_host.rollout.sampler.sample_with_distribution`
(all greedy, some greedy, unit temperature, which of top-k / top-p / min-p truncate) — over
static input buffers: the hidden states, the rows' temperature, greedy flag, top-k, top-p,
min-p and their uniform numbers. The per-row settings are copied in when the batch's
:class:`~miles_host.rollout.sampler.SamplingBatch` changes (it is reused while the same
requests decode together); the uniforms every step.

The graph runs the same kernels on the same inputs as the eager sampler, so the tokens and
logprobs are the eager ones; with ``--sampler-kernel triton`` (the default) the modes without truncation
draw by :func:`~miles_host.kernels.fused_sampler.fused_sample` instead (two launches; the
same tokens up to float32 rounding at the CDF's steps). Batches with logits processing
(penalties, grammars, logit bias), banned tokens (``min_new_tokens``), no uniform numbers
given (the rows' generators draw them) or more than :data:`MAX_GRAPHED_BATCH` rows sample
eagerly, as does batch-invariant mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from miles_host.kernels import fused_sampler
from miles_host.rollout.sampler import SamplingBatch, sample_with_distribution

#: the largest padded batch whose sampling is graphed: beyond it a step is GPU-bound and the
#: graph's [batch, vocab] float32 buffers would cost more memory than its launches cost time
MAX_GRAPHED_BATCH = 64


@dataclass(frozen=True)
class SamplingMode:
    """The Python-level branches of the sampler a batch takes (one graph per mode and size)."""

    all_greedy: bool
    any_greedy: bool
    all_unit_temperature: bool
    top_k: bool
    top_p: bool
    min_p: bool

    @classmethod
    def of(cls, batch: SamplingBatch) -> "SamplingMode | None":
        """The batch's mode, or None when its sampling cannot be graphed (logits processing,
        banned tokens)."""
        if batch.processing is not None or any(batch.banned):
            return None
        return cls(batch.all_greedy, batch.any_greedy, batch.all_unit_temperature,
                   batch.top_k_B is not None, batch.top_p_B is not None, batch.min_p_B is not None)


class SamplingGraphs:
    """Captured sampling graphs over static buffers (see the module doc).

    ``logits(hidden_BH)`` is the runner's LM head; ``sizes`` the decode graphs' padded batch
    sizes (those up to :data:`MAX_GRAPHED_BATCH` are used); ``pool`` the decode graphs'
    memory pool, shared.
    """

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor], *, sizes: list[int], hidden_size: int,
                 dtype: torch.dtype, device: torch.device, pool=None):
        self.logits = logits
        self.sizes = [s for s in sizes if s <= MAX_GRAPHED_BATCH]
        self.pool = pool
        bs = max(self.sizes, default=0)
        self.hidden_BH = torch.zeros(bs, hidden_size, dtype=dtype, device=device)
        self.temperature_B = torch.ones(bs, dtype=torch.float32, device=device)
        self.greedy_B = torch.ones(bs, dtype=torch.bool, device=device)
        self.top_k_B = torch.zeros(bs, dtype=torch.long, device=device)
        self.top_p_B = torch.ones(bs, dtype=torch.float32, device=device)
        self.min_p_B = torch.zeros(bs, dtype=torch.float32, device=device)
        self.uniforms_B = torch.zeros(bs, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, SamplingMode], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, SamplingMode], tuple[torch.Tensor, torch.Tensor]] = {}
        self._settings: SamplingBatch | None = None  # the batch whose settings the buffers hold
        self.num_replays = 0

    def padded_size(self, batch_size: int) -> int | None:
        for size in self.sizes:
            if size >= batch_size:
                return size
        return None

    def accepts(self, batch: SamplingBatch) -> bool:
        """Whether ``batch``'s sampling can be graphed (its size is checked by :meth:`padded_size`)."""
        return SamplingMode.of(batch) is not None

    def sample(self, hidden_BH: torch.Tensor, batch: SamplingBatch,
               uniforms_B: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(token ids [B], their logprobs [B])`` of the rows of ``hidden_BH`` by a replayed
        graph, or None when this batch samples eagerly (its mode or size is not graphed)."""
        n = hidden_BH.shape[0]
        size = self.padded_size(n)
        mode = SamplingMode.of(batch)
        if size is None or mode is None or (uniforms_B is None and not mode.all_greedy):
            return None
        if batch is not self._settings:
            self._load_settings(batch, n)
        self.hidden_BH[:n].copy_(hidden_BH)
        if not mode.all_greedy:
            self.uniforms_B[:n].copy_(uniforms_B)
        key = (size, mode)
        if key not in self.graphs:
            self._capture(size, mode)
        self.graphs[key].replay()
        self.num_replays += 1
        tokens_B, logprob_B = self.outputs[key]
        return tokens_B[:n], logprob_B[:n]

    def _load_settings(self, batch: SamplingBatch, n: int) -> None:
        """Copy the rows' settings into the static buffers (the rows past ``n`` keep older
        settings: their draws are discarded)."""
        self.temperature_B[:n].copy_(batch.temperature_B)
        self.greedy_B[:n].copy_(batch.greedy_B)
        for source, target in ((batch.top_k_B, self.top_k_B), (batch.top_p_B, self.top_p_B),
                               (batch.min_p_B, self.min_p_B)):
            if source is not None:
                target[:n].copy_(source)
        self._settings = batch

    def _static_batch(self, size: int, mode: SamplingMode) -> SamplingBatch:
        return SamplingBatch(
            temperature_B=self.temperature_B[:size], greedy_B=self.greedy_B[:size],
            top_k_B=self.top_k_B[:size] if mode.top_k else None, top_p_B=self.top_p_B[:size] if mode.top_p else None,
            min_p_B=self.min_p_B[:size] if mode.min_p else None, generators=[None] * size,
            all_greedy=mode.all_greedy, banned=[[] for _ in range(size)], any_greedy=mode.any_greedy,
            all_unit_temperature=mode.all_unit_temperature,
        )

    def _body(self, size: int, mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._static_batch(size, mode)
        logits_BV = self.logits(self.hidden_BH[:size])
        if not (mode.top_k or mode.top_p or mode.min_p) and fused_sampler.enabled(logits_BV):
            return fused_sampler.fused_sample(logits_BV, batch.temperature_B, batch.greedy_B, self.uniforms_B[:size],
                                              unit_temperature=mode.all_unit_temperature)
        tokens_B, logprobs_BV = sample_with_distribution(logits_BV, batch, self.uniforms_B[:size])
        return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)

    @torch.no_grad()
    def _capture(self, size: int, mode: SamplingMode) -> None:
        """Capture the sampling of ``size`` rows in ``mode``. Thread-local capture: another
        thread (a trainer beside a fully asynchronous producer) may use the GPU meanwhile."""
        stream = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=self.hidden_BH.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            self._body(size, mode)  # warm-up: allocator, lazy kernels
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
            self.outputs[(size, mode)] = self._body(size, mode)
        self.graphs[(size, mode)] = graph
