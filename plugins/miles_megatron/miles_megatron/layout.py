"""Packed sequences <-> Megatron's padded ``[S, B]`` layout (sbhd).

The host packs a micro-batch as one flat ``[T]`` token list (``cu_seqlens``);
Megatron's local layer spec (no TransformerEngine) runs ``[S, B, H]`` batches.
Sequences are right-padded to the longest: under a causal mask a real token never
attends to the padding after it, so every real token computes what it would alone.
Megatron flattens ``[S, B]`` position-major (row ``s * B + b``) wherever it works
per token (the MoE router among them): :attr:`PaddedLayout.megatron_row_T` is,
for each packed token, its row in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_host.devices import host_to_device, host_values


@dataclass
class PaddedLayout:
    """Where each of the ``T`` packed tokens sits in an ``[S, B]`` batch."""

    seq_len: int
    batch: int
    #: ``[T]``: row of each packed token in Megatron's ``s * B + b`` order
    megatron_row_T: torch.Tensor

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, device: torch.device, multiple: int = 1,
                        at_least: tuple[int, int] = (0, 0)) -> "PaddedLayout":
        """``multiple``: the padded sequence length is a multiple of it (sequence parallelism);
        ``at_least``: the smallest ``(S, B)`` (ranks whose MoE layers exchange tokens run equal
        shapes; the extra sequences are all padding)."""
        bounds = host_values(cu_seqlens).long()  # (a packed batch's: its host copy, no device read)
        lengths = bounds[1:] - bounds[:-1]
        sequences = int(lengths.numel())
        batch = max(sequences, at_least[1])
        seq_len = max(int(lengths.max()) if sequences else 0, at_least[0])
        seq_len = -(-seq_len // multiple) * multiple
        sequence_T = torch.repeat_interleave(torch.arange(sequences), lengths)
        position_T = torch.arange(int(bounds[-1])) - bounds[:-1][sequence_T]
        return cls(seq_len, batch, host_to_device(position_T * batch + sequence_T, device))

    @property
    def rows(self) -> int:
        return self.seq_len * self.batch

    def to_sb(self, values_T: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``[T, ...]`` packed values -> ``[S, B, ...]`` (padding = ``fill``)."""
        out = values_T.new_full((self.rows, *values_T.shape[1:]), fill)
        out[self.megatron_row_T] = values_T
        return out.view(self.seq_len, self.batch, *values_T.shape[1:])

    def from_sb(self, values_SB: torch.Tensor) -> torch.Tensor:
        """``[S, B, ...]`` -> the ``[T, ...]`` packed tokens (padding dropped)."""
        return values_SB.reshape(self.rows, *values_SB.shape[2:])[self.megatron_row_T]

    def causal_mask(self) -> torch.Tensor:
        """``[1, 1, S, S]`` boolean, True where attention is masked (Megatron's convention)."""
        ones = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool, device=self.megatron_row_T.device)
        return torch.triu(ones, diagonal=1)[None, None]
