"""GPU memory sizing of the embedded engine: the activation peak a KV-cache budget must leave free.

The engine measures it once at start-up, on the device, with a scratch KV cache and model
runner (CUDA only: on CPU the KV cache is sized in tokens)."""

from __future__ import annotations

import torch

from miles_host.rollout.config import EngineConfig
from miles_host.rollout.kv_cache import PagedKVCache
from miles_host.rollout.model_runner import ModelRunner
from miles_host.rollout.sampling_params import SamplingParams
from miles_host.rollout.scheduler import ScheduledBatch
from miles_host.rollout.sequence import Sequence


def _blocks(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def measure_activation_peak(model: torch.nn.Module, cfg: EngineConfig, device: torch.device, layout) -> int:
    """Peak activation bytes of the largest prefill and of sampling a full decode batch."""
    tokens = cfg.max_num_batched_tokens
    seq_len = min(tokens, cfg.max_model_len - 1)
    num_seqs = max(1, tokens // seq_len)
    # every sequence's last block may be partly filled: size the scratch cache per sequence
    blocks = num_seqs * _blocks(seq_len, cfg.block_size) + 1
    scratch = PagedKVCache(layout, blocks, cfg.block_size, cfg.kv_cache_dtype, device)
    runner = ModelRunner(
        model, scratch, device=device, attention_backend=cfg.attention_backend,
        max_num_seqs=cfg.max_num_seqs, max_model_len=tokens + cfg.block_size,
        fused_kernels=cfg.fused_kernels,
    )
    seqs, next_block = [], 1
    for i in range(num_seqs):
        seq = Sequence(rid=f"warmup-{i}", token_ids=[0] * seq_len, num_prompt_tokens=seq_len,
                       params=SamplingParams(temperature=1.0, top_p=0.9, top_k=50))
        need = _blocks(seq_len, cfg.block_size)
        seq.block_table = list(range(next_block, next_block + need))
        next_block += need
        seqs.append(seq)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.run(ScheduledBatch(sequences=seqs, is_prefill=True, samplers=seqs,
                              sample_from=list(range(len(seqs)))), want_routes=False)
    vocab = model.config.vocab_size
    logits = torch.empty(cfg.max_num_seqs, vocab, dtype=torch.float32, device=device)
    # sampling a full decode batch: sort + a few [B, V] float32 temporaries
    peak = max(torch.cuda.max_memory_allocated(device) - before, 8 * logits.numel() * 4)
    del logits, scratch, runner
    torch.cuda.empty_cache()
    return int(peak * 1.1) + (256 << 20)
