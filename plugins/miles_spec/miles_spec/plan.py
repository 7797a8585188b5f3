"""The host side of one speculative step: which draft entries are forwarded, the positions
and KV slots of every forward, and the step's uniform numbers (numpy, built once per step).

A sequence of length ``n`` (tokens ``x_0 .. x_{n-1}``, K/V cached for ``x_0 .. x_{n-2}``) is
either a *fixed* row or a *prompt* row:

- fixed: the step before was a verify; the draft's pending entries are the ``kept``
  entries ``first .. n - 2`` (``first`` is that step's ``n - 1``, ``1 <= kept <= J``), whose
  hidden states are that verify's rows ``source .. source + kept - 1`` of the strategy's
  slab. The *fixed extend* forwards all ``J`` entries ``first .. first + K`` (entry ``t``:
  token ``x_{t+1}`` at position ``t + offset``), a fixed shape per sequence; the entries past
  the kept ones are garbage that nothing reads: attention is causal, and their lookahead
  slots are written again (by this step's draft steps or the next extend) before any
  kept entry can see them.
- prompt: the pending entries came from a prefill (any number): extended eagerly; in the
  fixed extend the row is padding (slot 0 of the reserved block 0, ``J`` slots of context).

Then ``K - 1`` draft steps write entries ``n - 1 .. n + K - 3`` (positions ``+ offset``) and
the verify writes the policy's positions ``n - 1 .. n - 1 + K``; the scheduler's lookahead
(``K`` slots) makes every one of these slots writable.

Array legend: B sequences, J = K + 1, C = K - 1 draft steps, R = 2K + 1 uniforms, W blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from miles_spec.sampling import step_uniforms


@dataclass
class StepPlan:
    """Host inputs of one step (int64 unless noted); prompt rows are padding in ``ext_*``."""

    fixed: list[int]
    prompt: list[int]
    kept_B: np.ndarray              # pending entries of fixed rows (1..J), 0 for prompt rows
    ext_ids_BJ: np.ndarray
    ext_positions_BJ: np.ndarray
    ext_slots_BJ: np.ndarray
    ext_sources_BJ: np.ndarray      # slab rows of the entries' hidden states
    ext_context_B: np.ndarray
    ext_last_B: np.ndarray          # flat row b * J + kept - 1 of the last pending entry
    chain_positions_BC: np.ndarray
    chain_slots_BC: np.ndarray
    chain_context_BC: np.ndarray
    last_ids_B: np.ndarray
    ver_positions_BJ: np.ndarray
    ver_slots_BJ: np.ndarray
    ver_context_B: np.ndarray
    uniforms_BR: np.ndarray         # float64 (float32 values)


def build_plan(seqs, fixed_state: list[tuple[int, int] | None], num_steps: int, offset: int,
               block_size: int) -> StepPlan:
    """The plan of ``seqs``; ``fixed_state[b]``: ``(first, first slab row)`` of a fixed row, None
    for a prompt row."""
    k, j_count = num_steps, num_steps + 1
    n_B = np.array([len(seq) for seq in seqs], dtype=np.int64)
    fixed = [b for b, state in enumerate(fixed_state) if state is not None]
    prompt = [b for b, state in enumerate(fixed_state) if state is None]
    first_B = n_B - 1 - offset  # prompt rows: any in-window value, masked below
    source_B = np.zeros(len(seqs), dtype=np.int64)
    for b in fixed:
        first_B[b], source_B[b] = fixed_state[b]
    j_J = np.arange(j_count)
    ext_positions_BJ = first_B[:, None] + offset + j_J
    chain_positions_BC = (n_B - 1 + offset)[:, None] + np.arange(k - 1)
    ver_positions_BJ = (n_B - 1)[:, None] + j_J
    slots = _slot_lookup(seqs, np.minimum(ext_positions_BJ[:, 0], n_B - 1), n_B - 1 + k, block_size)
    is_fixed_B1 = np.zeros((len(seqs), 1), dtype=bool)
    is_fixed_B1[fixed] = True
    kept_B = np.where(is_fixed_B1[:, 0], n_B - 1 - first_B, 0)
    return StepPlan(
        fixed=fixed, prompt=prompt, kept_B=kept_B,
        ext_ids_BJ=_ext_ids(seqs, fixed, first_B, kept_B, j_count),
        ext_positions_BJ=np.where(is_fixed_B1, ext_positions_BJ, 0),
        ext_slots_BJ=np.where(is_fixed_B1, slots(ext_positions_BJ), 0),
        ext_sources_BJ=np.where(is_fixed_B1, source_B[:, None] + j_J, 0),
        ext_context_B=np.where(is_fixed_B1[:, 0], first_B + j_count + offset, j_count),
        ext_last_B=np.arange(len(seqs)) * j_count + np.maximum(kept_B - 1, 0),
        chain_positions_BC=chain_positions_BC, chain_slots_BC=slots(chain_positions_BC),
        chain_context_BC=chain_positions_BC + 1,
        last_ids_B=np.array([seq.token_ids[-1] for seq in seqs], dtype=np.int64),
        ver_positions_BJ=ver_positions_BJ, ver_slots_BJ=slots(ver_positions_BJ), ver_context_B=n_B + k,
        uniforms_BR=step_uniforms(seqs, k),
    )


def _slot_lookup(seqs, lowest_B: np.ndarray, highest_B: np.ndarray, block_size: int):
    """A function from positions ``[B, X]`` (each row within ``lowest_B .. highest_B``) to KV slots,
    over a window of each sequence's block table."""
    first_block_B = lowest_B // block_size
    width = int((highest_B // block_size - first_block_B).max(initial=0)) + 1
    blocks_BW = np.zeros((len(seqs), width), dtype=np.int64)
    for b, seq in enumerate(seqs):
        window = seq.block_table[first_block_B[b]:first_block_B[b] + width]
        blocks_BW[b, :len(window)] = window

    def slots(positions_BX: np.ndarray) -> np.ndarray:
        index_BX = positions_BX // block_size - first_block_B[:, None]
        return np.take_along_axis(blocks_BW, index_BX, axis=1) * block_size + positions_BX % block_size

    return slots


def _ext_ids(seqs, fixed: list[int], first_B: np.ndarray, kept_B: np.ndarray, j_count: int) -> np.ndarray:
    """``[B, J]`` input tokens of the fixed extend: ``x_{t+1}`` of the kept entries, else 0."""
    ids_BJ = np.zeros((len(seqs), j_count), dtype=np.int64)
    for b in fixed:
        first = int(first_B[b])
        ids_BJ[b, :kept_B[b]] = seqs[b].token_ids[first + 1:first + 1 + int(kept_B[b])]
    return ids_BJ
