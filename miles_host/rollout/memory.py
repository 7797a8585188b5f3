"""Releasing an idle engine's memory between rollouts, as SGLang's
``release_memory_occupation`` / ``resume_memory_occupation`` do (``--colocate``,
``--offload-rollout``), so a trainer on the same device can use it.

Tags (SGLang's):

- ``kv_cache``: the paged KV cache is freed, and with it the decode CUDA graphs (their
  kernels hold the cache's addresses); the prefix cache is forgotten. Resuming
  allocates a cache of the same number of blocks and captures the graphs again.
- ``weights``: parameters and buffers move to (pinned) host memory and back.

While anything is released the engine refuses requests. Weight updates still work:
they land in the kept device weights, or in the host copies when ``weights`` is
released. After a resume results are identical to never having released (greedy,
and seeded sampling, which draws from (seed, sample, position) alone).

A decoding strategy with memory of its own (a draft model, its KV cache) takes part
through optional ``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)``
methods of the same meaning.
"""

from __future__ import annotations

import logging
from typing import Iterable

from miles_host import offload

logger = logging.getLogger(__name__)

TAGS = ("kv_cache", "weights")


def memory_tags(tags: Iterable[str] | None) -> frozenset[str]:
    """``tags`` checked (None: all of them)."""
    chosen = frozenset(TAGS if tags is None else tags)
    unknown = sorted(chosen - set(TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; the tags are {list(TAGS)}")
    return chosen


class MemoryOccupation:
    """Mixin of :class:`~miles_host.rollout.engine.Engine`: release / resume its memory."""

    #: what is released now (a subset of :data:`TAGS`)
    released_tags: frozenset[str] = frozenset()
    #: the decode graphs went with the KV cache and come back with it
    _graphs_released: bool = False

    def check_resident(self) -> None:
        """Raise ``RuntimeError`` when the engine cannot generate because memory is released."""
        if self.released_tags:
            raise RuntimeError(
                f"the rollout engine's memory is released ({', '.join(sorted(self.released_tags))}): "
                "call resume_memory_occupation() before generating"
            )

    def release_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """Free the ``tags`` (default: KV cache and weights) of an idle engine."""
        tags = memory_tags(tags) - self.released_tags
        if not tags:
            return
        if self.has_unfinished():
            raise RuntimeError(
                "release_memory_occupation needs an idle engine: requests are in flight (abort or finish them first)"
            )
        strategy_release = getattr(self.strategy, "release_memory_occupation", None)
        if strategy_release is not None:
            strategy_release(tags)
        if "kv_cache" in tags:
            self.flush_cache()  # the cached prefixes' K/V are about to go
            self._graphs_released = self.runner.graphs is not None
            self.runner.release_graphs()  # captured over the cache's addresses
            self.kv_cache.release()
            if getattr(self, "recurrent_states", None) is not None:
                self.recurrent_states.release()
        if "weights" in tags:
            offload.move_modules([self.model], "cpu")
        self.released_tags = self.released_tags | tags
        offload.settle(self.device)

    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """Bring back the released ``tags`` (default: everything released)."""
        tags = memory_tags(tags) & self.released_tags
        if not tags:
            return
        if "weights" in tags:
            offload.move_modules([self.model], self.device)
        if "kv_cache" in tags:
            self.kv_cache.allocate()
            if getattr(self, "recurrent_states", None) is not None:
                self.recurrent_states.allocate()
        self.released_tags = self.released_tags - tags
        if getattr(self, "_graphs_released", False) and not self.released_tags:
            self._capture_graphs()  # needs the cache and the weights in place
        strategy_resume = getattr(self.strategy, "resume_memory_occupation", None)
        if strategy_resume is not None:
            strategy_resume(tags)
        offload.settle(self.device)

    def _capture_graphs(self) -> None:
        """The decode graphs again, over the new cache and weights, as :class:`ModelRunner` captured them."""
        self._graphs_released = False
        self.runner.capture_graphs(" after resume_memory_occupation")
