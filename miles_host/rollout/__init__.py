"""The embedded rollout engine (continuous batching over a paged KV cache).

Modules, nano-vllm style: :mod:`.sampling_params` (request knobs),
:mod:`.sequence` (per-sample state), :mod:`.block_manager` (paged KV blocks,
prefix cache, copy-on-write), :mod:`.scheduler` (continuous batching),
:mod:`.model_runner` (forward, CUDA graphs, sampling), :mod:`.attention` /
:mod:`miles_host.kernels.paged_attention` (the paged attention kernel), :mod:`.sampler`, :mod:`.engine`.
SGLang's request features: :mod:`.penalties` (penalties and ``logit_bias``), :mod:`.grammar`
(constrained decoding through xgrammar), :mod:`.logprobs` (top / requested-id / prompt
logprobs), :mod:`.stopping`, :mod:`.outputs` (stop trimming, SGLang's ``meta_info`` layout),
:mod:`.request_checks`.
"""

from miles_host.rollout.config import EngineConfig
from miles_host.rollout.engine import Engine
from miles_host.rollout.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]
