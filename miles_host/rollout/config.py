"""Engine configuration: one dataclass, defaults resolved from the model and device."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_host.models.mlp import MOE_KERNELS

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn", "triton_invariant")


@dataclass
class EngineConfig:
    """Knobs of the embedded engine (SGLang spellings where SGLang has one).

    ``mem_fraction_static``: fraction of GPU memory for weights + KV cache (CUDA).
    ``kv_cache_tokens``: KV-cache size in tokens on CPU (GPU: sized from memory,
    optionally capped by ``max_kv_cache_tokens``). ``max_num_seqs``: sequences per
    step. ``max_num_batched_tokens``: prefill tokens per step (one longer prompt
    still runs alone). ``batch_invariant``: results of a request independent of
    the batch (on CPU each sequence is forwarded and sampled alone, token by token;
    on CUDA batches run batch-invariant kernels with the ``triton_invariant``
    attention backend; no cross-request prefix cache). ``enforce_eager``: no CUDA graphs.
    ``cuda_graph_batch_sizes``: the decode batch sizes CUDA graphs are captured for (default:
    1, 2, 4, 8 and every 16th up to ``max_num_seqs``; larger batches decode eagerly).
    ``fused_kernels``: the Triton norm/rotary/activation kernels of
    :mod:`miles_host.kernels` in every forward (default: on CUDA with triton; the
    batch-invariant forward always uses them where usable, trainer included).
    ``overlap_schedule``: launch each plain decode step before reading the previous
    one's tokens (:mod:`miles_host.rollout.overlap`; default: on CUDA, as SGLang's).
    ``moe_kernel``: the routed experts' path, ``fused`` (one routing launch, one grouped
    GEMM per projection and one combine; :mod:`miles_host.kernels.moe_grouped`, where
    Triton runs) or ``loop`` (one expert at a time). The batch-invariant mode keeps its
    fixed-order loop either way.
    """

    device: torch.device
    kv_cache_dtype: torch.dtype
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    mem_fraction_static: float = 0.85
    kv_cache_tokens: int = 16384
    max_kv_cache_tokens: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    batch_invariant: bool = False
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_batch_sizes: list[int] | None = None
    attention_backend: str = "torch"
    fused_kernels: bool | None = None
    overlap_schedule: bool | None = None
    moe_kernel: str = "fused"

    def __post_init__(self) -> None:
        if self.moe_kernel not in MOE_KERNELS:
            raise ValueError(f"moe_kernel must be one of {MOE_KERNELS} (--moe-kernel), got {self.moe_kernel!r}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graph_batch_sizes is not None and not all(s >= 1 for s in self.cuda_graph_batch_sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be >= 1, got {self.cuda_graph_batch_sizes}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend != "torch" and self.device.type != "cuda":
            raise ValueError(f"attention_backend={self.attention_backend!r} needs a CUDA device; use 'torch' on CPU")
        if self.batch_invariant and self.device.type == "cuda" and self.attention_backend != "triton_invariant":
            raise ValueError(
                f"batch_invariant on CUDA needs attention_backend='triton_invariant' (got {self.attention_backend!r}): "
                "the other kernels pick their reduction order from the batch; leave attention_backend unset"
            )
        if self.attention_backend == "flash_attn" and self.block_size % 256:
            raise ValueError("flash-attn's paged kernel needs block_size to be a multiple of 256")
        from miles_host.kernels import fused_kernels_usable

        if self.overlap_schedule is None:
            self.overlap_schedule = self.device.type == "cuda"
        if self.fused_kernels is None:
            self.fused_kernels = fused_kernels_usable(self.device)
        elif self.fused_kernels and not fused_kernels_usable(self.device):
            raise ValueError("fused_kernels=True needs a CUDA device and triton; leave it unset to choose automatically")

    @property
    def use_cuda_graph(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager


def default_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """flash-attn when importable (fp16/bf16), else Triton on CUDA, else the PyTorch reference."""
    if device.type != "cuda":
        return "torch"
    if dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    if importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def eos_ids_of(model_config: Any) -> list[int]:
    """EOS ids from the generation config, else the HF config."""
    for source in (getattr(model_config, "generation_config", None) or {}, getattr(model_config, "hf_config", None) or {}):
        eos = source.get("eos_token_id")
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def resolve_config(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    attention_backend: str | None = None,
    eos_token_ids: list[int] | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_tokens: int | None = None,
    **rest: Any,
) -> EngineConfig:
    """Fill an :class:`EngineConfig` from the model (dtype, device, context length, EOS ids).

    ``dtype``/``device`` given here move the model there first.
    """
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    parameter = next(model.parameters())
    device = parameter.device
    model_config = model.config
    hf = getattr(model_config, "hf_config", None) or {}
    if max_model_len is None:
        max_model_len = int(hf.get("max_position_embeddings") or 4096)
    kv_cache_dtype = kv_cache_dtype or parameter.dtype
    if attention_backend is None and rest.get("batch_invariant") and device.type == "cuda":
        attention_backend = "triton_invariant"
    if attention_backend is None and device.type == "cuda" and (
        getattr(model_config, "attn_sinks", False) or getattr(model_config, "attention_chunk_size", None)
    ):
        attention_backend = "triton"  # flash-attn has neither sink logits nor chunk masks
    backend = attention_backend or default_attention_backend(device, kv_cache_dtype)
    if block_size is None:
        block_size = 256 if backend == "flash_attn" else 16
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 16384 if device.type == "cuda" else 4096
    if kv_cache_tokens is None:
        kv_cache_tokens = max(4 * max_num_batched_tokens, 16384)
    return EngineConfig(
        device=device, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
        eos_token_ids=list(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model_config),
        block_size=block_size, attention_backend=backend, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_tokens=kv_cache_tokens, **rest,
    )
