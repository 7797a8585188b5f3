"""Per-sequence recurrent state of linear-attention (Gated DeltaNet) layers in the engine.

Hybrid models (Qwen3-Next, Qwen3.5) keep keys and values only for their full-attention
layers (the paged KV cache); each linear-attention layer instead carries, per sequence, a
conv state (the last ``W - 1`` inputs of its short convolution) and a delta-rule state
(``[Hv, K, V]`` float32). :class:`RecurrentStatePool` holds them in slots, one slot per
live sequence:

- a sequence gets a slot when its prefill is scheduled and starts from zero states (the
  prefix cache is off for these models: a cached prefix would come without its state);
- the ``n > 1`` samples of a prompt share its prefill: each gets its own slot at the fork
  and the prefill writes its final state into the parent's and every child's slot;
- finish, abort and preemption free the slot (a preempted sequence is recomputed from its
  tokens, state included);
- decode CUDA graphs gather and scatter the states of their rows by slot (:mod:`.recurrent_graphs`);
  padded rows use the reserved :data:`PADDING_SLOT`.

:class:`HybridBlockManager` ties slots to the block manager's allocate / fork / free, and
:meth:`RecurrentStatePool.attach` gives a forward's attention context the
:class:`~miles_host.models.gated_deltanet.RecurrentStates` of its sequences. Speculative
decoding (a rejected draft cannot be taken back out of a recurrent state) and the
batch-invariant mode do not cover these layers; the engine refuses them with the reason.

Tensor legend: S sequences of the forward, P pool slots, C conv channels, W conv width,
H value heads, K key head dim, V value head dim.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence as Seq

import torch

from miles_host.models.gated_deltanet import TRUE_ON_POLICY_REFUSAL, linear_attention_layers
from miles_host.rollout.block_manager import BlockManager
from miles_host.rollout.sequence import Sequence

logger = logging.getLogger(__name__)


#: the slot no sequence gets: padded rows of a CUDA-graph batch read and write it
PADDING_SLOT = 0


class RecurrentStatePool:
    """Conv and delta-rule states of every linear-attention layer, in ``num_slots`` slots
    (slot :data:`PADDING_SLOT` reserved)."""

    def __init__(self, layers: dict, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        self.layers = dict(layers)
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = max(int(num_slots), 2)
        #: bumped whenever the state tensors are replaced (growth, reallocation): graphs captured over
        #: the old tensors are stale (:mod:`.recurrent_graphs` recaptures)
        self.generation = 0
        self.conv_PCw: dict[int, torch.Tensor] = {}
        self.ssm_PHKV: dict[int, torch.Tensor] = {}
        self.slot_of: dict[Sequence, int] = {}
        self.forks: dict[Sequence, list[Sequence]] = {}
        self._free: list[int] = []
        self.allocate()

    @classmethod
    def for_engine(cls, model: torch.nn.Module, config: Any, decoding_strategy: Any = None) -> "RecurrentStatePool | None":
        """The pool of ``model``'s linear-attention layers (None when it has none), sized for
        ``config.max_num_seqs`` sequences; ValueError for engine settings these layers exclude."""
        layers = linear_attention_layers(model)
        if not layers:
            return None
        if config.batch_invariant:
            raise ValueError(TRUE_ON_POLICY_REFUSAL)
        if decoding_strategy is not None:
            raise ValueError(
                "speculative decoding is not supported for models with Gated DeltaNet (linear attention) layers: "
                "verifying a draft advances each sequence's recurrent state, which cannot be rolled back to the "
                "accepted prefix; run without the speculative decoding plugin"
            )
        dtype = next(model.parameters()).dtype
        return cls(layers, config.max_num_seqs + 2, dtype, config.device)

    # ------------------------------------------------------------------ memory

    def allocate(self) -> None:
        """(Re)allocate zeroed state tensors for ``num_slots`` slots (every slot free)."""
        for index, linear in self.layers.items():
            (channels, width), (heads, key_dim, value_dim) = linear.state_shapes()
            self.conv_PCw[index] = torch.zeros(self.num_slots, channels, width, dtype=self.dtype, device=self.device)
            self.ssm_PHKV[index] = torch.zeros(
                self.num_slots, heads, key_dim, value_dim, dtype=torch.float32, device=self.device
            )
        self._free = list(range(self.num_slots - 1, PADDING_SLOT, -1))
        self.generation += 1
        self.slot_of.clear()
        self.forks.clear()

    def release(self) -> None:
        """Drop the state tensors (an idle engine releasing its memory); :meth:`allocate` brings them back."""
        self.conv_PCw.clear()
        self.ssm_PHKV.clear()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.conv_PCw.values(), *self.ssm_PHKV.values()])

    def slots(self, seqs: Seq[Sequence]) -> list[int]:
        """The slots of ``seqs`` (RuntimeError naming those without one)."""
        missing = [seq.rid for seq in seqs if seq not in self.slot_of]
        if missing:
            raise RuntimeError(f"sequences {missing} have no recurrent-state slot (the block manager assigns them)")
        return [self.slot_of[seq] for seq in seqs]

    def bytes_per_sequence(self) -> int:
        """State bytes one sequence holds across the linear-attention layers."""
        return self.num_bytes // self.num_slots if self.conv_PCw else 0

    def _grow(self) -> None:
        """Double the slots (more live samples than ``max_num_seqs``: a large ``n``), keeping the states."""
        old = self.num_slots
        self.num_slots = 2 * old
        for store in (self.conv_PCw, self.ssm_PHKV):
            for index, tensor in store.items():
                store[index] = torch.cat((tensor, torch.zeros_like(tensor)), dim=0)
        self._free = list(range(self.num_slots - 1, old - 1, -1)) + self._free
        self.generation += 1
        logger.info("recurrent state pool grown to %d slots (%.1f MiB)", self.num_slots, self.num_bytes / 2**20)

    # ------------------------------------------------------------------ slots

    def assign(self, seq: Sequence) -> None:
        """Give ``seq`` a slot (it starts from zero states at its next prefill)."""
        if seq in self.slot_of:
            return
        if not self._free:
            self._grow()
        self.slot_of[seq] = self._free.pop()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` gets a slot that ``parent``'s coming prefill fills with the same state."""
        self.assign(child)
        self.forks.setdefault(parent, []).append(child)

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s slot (finish, abort, preemption)."""
        slot = self.slot_of.pop(seq, None)
        if slot is not None:
            self._free.append(slot)
        self.forks.pop(seq, None)

    def attach(self, attention: Any, seqs: Seq[Sequence], num_new: Seq[int]) -> "HybridAttention":
        """``attention`` with the recurrent states of a forward over ``seqs`` (``num_new`` tokens each)."""
        return HybridAttention(attention, RecurrentBatch(self, seqs, num_new))


class RecurrentBatch:
    """The :class:`~miles_host.models.gated_deltanet.RecurrentStates` of one forward."""

    def __init__(self, pool: RecurrentStatePool, seqs: Seq[Sequence], num_new: Seq[int]):
        self.pool = pool
        self.lengths = [int(n) for n in num_new]
        device = pool.device
        slots = pool.slots(seqs)
        self.slots_S = torch.tensor(slots, dtype=torch.long, device=device)
        fresh = [len(seq) == n for seq, n in zip(seqs, self.lengths)]
        self.keep_S = None if not any(fresh) else torch.tensor([not f for f in fresh], device=device)
        rows = list(range(len(seqs)))
        for row, seq in enumerate(seqs):  # the n > 1 samples forked from this prefill
            for child in pool.forks.pop(seq, []):
                if child in pool.slot_of:
                    rows.append(row)
                    slots.append(pool.slot_of[child])
        self.write_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=device)

    def _masked(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_S is None:
            return x
        return x * self.keep_S.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)

    def read(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [S, C, W - 1], delta rule [S, H, K, V])``; zeros for sequences starting now."""
        conv = self.pool.conv_PCw[layer_index].index_select(0, self.slots_S)
        ssm = self.pool.ssm_PHKV[layer_index].index_select(0, self.slots_S)
        return self._masked(conv), self._masked(ssm)

    def write(self, layer_index: int, conv_SCw: torch.Tensor, ssm_SHKV: torch.Tensor) -> None:
        """Store the states after this forward (into forked children's slots too)."""
        for store, value in ((self.pool.conv_PCw, conv_SCw), (self.pool.ssm_PHKV, ssm_SHKV)):
            target = store[layer_index]
            target.index_copy_(0, self.write_slots, value.detach().index_select(0, self.write_rows).to(target.dtype))


class HybridAttention:
    """An engine step's attention context plus the recurrent states of its sequences."""

    def __init__(self, inner: Any, recurrent_states: RecurrentBatch):
        self.inner = inner
        self.recurrent_states = recurrent_states

    def attend(self, layer_index: int, q_THD, k_THD, v_THD, **kwargs):
        """The full-attention layers' paged attention (unchanged)."""
        return self.inner.attend(layer_index, q_THD, k_THD, v_THD, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class HybridBlockManager(BlockManager):
    """A block manager that also hands out recurrent-state slots (prefix caching off)."""

    def __init__(self, num_blocks: int, block_size: int, pool: RecurrentStatePool):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.pool = pool

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        super().allocate(seq, use_cache=False)
        self.pool.assign(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self.pool.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.pool.free(seq)
