"""SGLang-shaped results of finished (or aborted, or rejected) requests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from miles_host.rollout.sequence import Sequence


def routed_experts_array(seq: Sequence) -> np.ndarray | None:
    """``[prompt + completion - 1, moe_layers, top_k]`` int32 expert ids (SGLang's layout).

    Every token but the last was forwarded once (or again after a preemption:
    later captures overwrite earlier ones). Chunks are numpy arrays (the
    engine's per-step copies) or tensors (a decoding strategy's).
    """
    if not seq.routed_expert_chunks:
        return None
    num_rows = len(seq) - 1
    _, first = seq.routed_expert_chunks[0]
    out = np.zeros((num_rows, *first.shape[1:]), dtype=np.int32)
    for start, chunk_TLK in seq.routed_expert_chunks:
        if isinstance(chunk_TLK, torch.Tensor):
            chunk_TLK = chunk_TLK.cpu().numpy()
        rows = chunk_TLK[: max(0, num_rows - start)]
        out[start:start + rows.shape[0]] = rows
    return out


def sequence_output(
    seq: Sequence,
    *,
    weight_version: Any,
    return_logprob: bool,
    return_routed_experts: bool,
    tokenizer: Any | None,
) -> dict[str, Any]:
    """The result dict of one sample, shaped like SGLang's ``/generate`` response."""
    output_ids = list(seq.output_ids)
    meta: dict[str, Any] = {
        "id": seq.rid,
        "index": seq.sample_index,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": seq.num_prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": seq.num_prompt_cached_tokens,
        "weight_version": weight_version,
    }
    meta.update(seq.spec_info)
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs, output_ids)]
    if return_routed_experts:
        meta["routed_experts"] = routed_experts_array(seq)
    result: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta}
    if tokenizer is not None:
        result["text"] = tokenizer.decode(output_ids)
    return result


def rejected_output(rid: str, message: str, num_prompt_tokens: int, weight_version: Any) -> dict[str, Any]:
    """The result of a request that failed validation: nothing generated, the reason in ``finish_reason``."""
    return {
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "index": 0,
            "finish_reason": {"type": "abort", "message": message},
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": weight_version,
            "output_token_logprobs": [],
        },
    }
