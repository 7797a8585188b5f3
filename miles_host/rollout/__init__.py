"""The embedded rollout engine (continuous batching over a paged KV cache).

Modules, nano-vllm style: :mod:`.sampling_params` (request knobs),
:mod:`.sequence` (per-sample state), :mod:`.block_manager` (paged KV blocks,
prefix cache, copy-on-write), :mod:`.scheduler` (continuous batching),
:mod:`.model_runner` (forward, CUDA graphs, sampling), :mod:`.attention` /
:mod:`miles_host.kernels.paged_attention` (the paged attention kernel), :mod:`.sampler`, :mod:`.engine`.
"""

from miles_host.rollout.config import EngineConfig
from miles_host.rollout.engine import Engine
from miles_host.rollout.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]
