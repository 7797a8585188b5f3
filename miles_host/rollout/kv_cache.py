"""The paged KV cache tensors and how many blocks fit.

Tensor legend: N = blocks, S = slots per block (block size), H = KV heads,
D = head dim.
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

# (num_kv_heads, k_head_dim, v_head_dim, sliding_window | None) per layer
LayerLayout = tuple[int, int, int, "int | None"]


def kv_bytes_per_token(layout: Seq[LayerLayout], dtype: torch.dtype) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(heads * (k_dim + v_dim) * element for heads, k_dim, v_dim, _ in layout)


class PagedKVCache:
    """Per-layer K and V caches of shape ``[N, S, H, D]``."""

    def __init__(
        self,
        layout: Seq[LayerLayout],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layout = list(layout)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_NSHD: list[torch.Tensor] = []
        self.v_NSHD: list[torch.Tensor] = []
        self.allocated = False
        self.allocate()

    def allocate(self) -> None:
        """(Re)allocate zeroed K/V tensors of the configured size (after :meth:`release`).

        The lists are filled in place: holders of ``k_NSHD`` / ``v_NSHD`` see the new tensors."""
        self.k_NSHD[:] = [
            torch.zeros(self.num_blocks, self.block_size, heads, k_dim, dtype=self.dtype, device=self.device)
            for heads, k_dim, _, _ in self.layout
        ]
        self.v_NSHD[:] = [
            torch.zeros(self.num_blocks, self.block_size, heads, v_dim, dtype=self.dtype, device=self.device)
            for heads, _, v_dim, _ in self.layout
        ]
        self.allocated = True

    def release(self) -> None:
        """Drop the K/V tensors (the lists are emptied in place); :meth:`allocate` brings them back."""
        self.k_NSHD.clear()
        self.v_NSHD.clear()
        self.allocated = False

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_NSHD + self.v_NSHD)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``source -> destination`` in every layer (copy-on-write)."""
        if not pairs:
            return
        device = self.k_NSHD[0].device
        source = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        destination = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for cache in self.k_NSHD + self.v_NSHD:
            cache.index_copy_(0, destination, cache.index_select(0, source))


def num_blocks_for_gpu(
    layout: Seq[LayerLayout],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    mem_fraction_static: float,
    activation_peak_bytes: int,
) -> int:
    """Blocks that fit in ``mem_fraction_static`` of the GPU after weights and activations.

    Like SGLang's ``mem_fraction_static``: the fraction of total device memory
    for weights plus KV cache; ``activation_peak_bytes`` (measured in a warm-up
    forward) is kept free on top of what is already in use.
    """
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * mem_fraction_static) - used - activation_peak_bytes
    per_block = kv_bytes_per_token(layout, dtype) * block_size
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(
            f"no room for a KV cache: mem_fraction_static={mem_fraction_static} of "
            f"{total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB after {used / 2**30:.2f} GiB "
            "in use and the activation reserve; raise mem_fraction_static or use a smaller model"
        )
    return int(num_blocks)
