"""A decode on the GPU for the GPU tests of the decode kernels (:mod:`tests.kernels.test_pdl`,
:mod:`tests.kernels.test_fused_sampler`): the ``small`` Qwen3-MoE shape of ``bench/moe.py``
(small-M projections, fused router and experts, split-KV attention) in CUDA graphs."""

from __future__ import annotations

import torch

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def decode(params: dict = GREEDY) -> dict:
    """Tokens and log-probs of three prompts (batches 1 and 3), 24 tokens each, with ``params``."""
    from bench.moe_models import build_model
    from miles_host.rollout import Engine

    engine = Engine(build_model("small", torch.bfloat16, "cuda"), tokenizer=None, max_num_seqs=4, max_model_len=256,
                    max_kv_cache_tokens=4096)
    assert engine.runner.graphs is not None
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 500, (3, 40), generator=generator).tolist()
    outputs = engine.generate(prompts[:1], params) + engine.generate(prompts, params)
    result = {"tokens": [o["output_ids"] for o in outputs],
              "logprobs": [[entry[0] for entry in o["meta_info"]["output_token_logprobs"]] for o in outputs]}
    del engine
    torch.cuda.empty_cache()
    return result
