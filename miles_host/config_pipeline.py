"""Megatron-LM's virtual pipeline flags (interleaved 1F1B), its spellings and defaults.

Each pipeline rank holds ``V`` model chunks (virtual stages) instead of one contiguous
slice of the layers; Megatron-Core's interleaved schedule runs them, with a smaller
pipeline bubble. ``--virtual-pipeline-model-parallel-size V`` (the spelling of slime's and
many Megatron launch scripts; Megatron-LM's ``--num-virtual-stages-per-pipeline-rank``)
gives ``V``; ``--num-layers-per-virtual-pipeline-stage L`` gives it as
``layers / (pipeline size x L)``. Honoured by ``--train-backend megatron``
(:mod:`miles_megatron.pipeline`); the native trainers run no pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_host.config_fields import flag, optional_int

_GROUP = "parallel"


@dataclass
class VirtualPipelineArgs:
    """Virtual pipeline stages per pipeline rank (see module doc)."""

    virtual_pipeline_model_parallel_size: int | None = flag(None, "model chunks (virtual pipeline stages) per pipeline rank: Megatron's interleaved 1F1B schedule (--train-backend megatron)", type=optional_int, aliases=["--num-virtual-stages-per-pipeline-rank"], group=_GROUP)
    num_layers_per_virtual_pipeline_stage: int | None = flag(None, "decoder layers of each virtual pipeline stage (the virtual pipeline size is layers / (pipeline size x this))", type=optional_int, group=_GROUP)
