"""Decode CUDA graphs of hybrid models: the paged KV cache's graphs plus each row's recurrent-state slot.

:class:`RecurrentDecodeGraphs` stages one more int64 field per row, the row's slot in the
:class:`~miles_host.rollout.recurrent_state.RecurrentStatePool` (padded rows: the reserved
padding slot), and captures the forward with a :class:`GraphRecurrentStates` that gathers the
rows' conv and delta-rule states by those slots and scatters the new ones back, all on the
device. When the pool replaces its tensors (growth past its slots, a memory release), the
graphs captured over the old ones are dropped and captured again at their next use.
"""

from __future__ import annotations

import torch

from miles_host.rollout.cuda_graphs import DecodeGraphs
from miles_host.rollout.recurrent_state import PADDING_SLOT, HybridAttention, RecurrentStatePool
from miles_host.rollout.sequence import Sequence

#: the staged field after the base class's four (token ids, positions, cache slots, context lengths)
STATE_SLOT = DecodeGraphs.num_fields


class GraphRecurrentStates:
    """The recurrent states of a captured decode step: one token per row, rows' slots on the device."""

    def __init__(self, pool: RecurrentStatePool, slots_S: torch.Tensor):
        self.pool = pool
        self.slots_S = slots_S
        self.lengths = [1] * slots_S.shape[0]

    def read(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [S, C, W - 1], delta rule [S, H, K, V])`` of the rows."""
        return (self.pool.conv_PCw[layer_index].index_select(0, self.slots_S),
                self.pool.ssm_PHKV[layer_index].index_select(0, self.slots_S))

    def write(self, layer_index: int, conv_SCw: torch.Tensor, ssm_SHKV: torch.Tensor) -> None:
        """Store the rows' new states (padded rows all write the padding slot)."""
        for store, value in ((self.pool.conv_PCw, conv_SCw), (self.pool.ssm_PHKV, ssm_SHKV)):
            target = store[layer_index]
            target.index_copy_(0, self.slots_S, value.to(target.dtype))


class RecurrentDecodeGraphs(DecodeGraphs):
    """:class:`~miles_host.rollout.cuda_graphs.DecodeGraphs` that also carry the rows' recurrent state."""

    num_fields = DecodeGraphs.num_fields + 1

    def __init__(self, *args, pool: RecurrentStatePool, **kwargs):
        self.recurrent_pool = pool
        self.generation = pool.generation
        super().__init__(*args, **kwargs)

    def _attention(self, size: int):
        # captured with every field zero: the padding slot (PADDING_SLOT == 0)
        states = GraphRecurrentStates(self.recurrent_pool, self._field(STATE_SLOT, size))
        return HybridAttention(super()._attention(size), states)

    def _stage(self, seqs: list[Sequence], size: int) -> int:
        num_pairs = super()._stage(seqs, size)
        start = STATE_SLOT * self.max_bs
        self.host_np[start:start + len(seqs)] = self.recurrent_pool.slots(seqs)
        self.host_np[start + len(seqs):start + size] = PADDING_SLOT
        return num_pairs

    def replay(self, seqs, capture_routes, ids_override=None):
        if self.generation != self.recurrent_pool.generation:  # the pool's tensors were replaced
            self.graphs.clear()
            self.outputs.clear()
            self.generation = self.recurrent_pool.generation
        return super().replay(seqs, capture_routes, ids_override)
