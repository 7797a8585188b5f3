"""The embedded rollout backend: the in-process engine behind the rollout manager.

A rollout backend offers a small request-level interface that the rollout
manager drives: ``submit`` requests, ``step`` until enough groups finished,
``abort`` the rest, ``update_weights`` between steps.
"""

from __future__ import annotations

import gc
from typing import Any

from miles_host.devices import resolve_device, resolve_dtype  # noqa: F401 - re-exported
from miles_host.lora.sync import prepare_engine_model
from miles_host.offload import settle
from miles_host.protocols import RolloutBackendBase
from miles_host.routing import RoutingHooks
from miles_host.sglang_embedded import engine_kwargs_from_config


#: share of GPU memory for the engine's weights + KV cache when the trainer shares the GPU
DEFAULT_COLOCATED_MEM_FRACTION = 0.3


class EmbeddedRolloutBackend(RolloutBackendBase):
    """The in-process engine (``miles_host.rollout.Engine``) as a rollout backend."""

    releases_memory = True
    reports_token_weight_versions = True

    def __init__(self, config: Any, manager: Any, model_path: str | None = None):
        from miles_host.rollout import Engine

        self.config = config
        device = resolve_device(config)
        # the --sglang-* flags with a meaning for the engine (miles_host.sglang_embedded)
        engine_kwargs: dict[str, Any] = {"moe_kernel": config.moe_kernel, **engine_kwargs_from_config(config)}
        if config.true_on_policy:
            engine_kwargs["batch_invariant"] = True
        if "mem_fraction_static" not in engine_kwargs and device.type == "cuda":
            # the trainer shares this GPU in the embedded setup: leave it most of the memory
            engine_kwargs["mem_fraction_static"] = DEFAULT_COLOCATED_MEM_FRACTION
        algorithm = (config.sglang_speculative_algorithm or "plain").lower()
        strategy = manager.registries.decoding_strategies.get(algorithm)
        if strategy.factory is not None:  # plain decoding is the engine's own loop
            engine_kwargs["decoding_strategy"] = lambda engine: strategy.factory(engine, config)
        precision = manager.registries.precisions.get(config.precision)

        def prepare(model):
            if precision.prepare_rollout_model is not None:
                model = precision.prepare_rollout_model(model, config) or model
            model = prepare_engine_model(model, config)  # --lora-sync adapter: the trainer's LoRA layers, unmerged
            manager.hook.miles_prepare_model(model=model, role="rollout", config=config)
            return model
        self.engine = Engine.from_pretrained(
            model_path or config.hf_checkpoint,
            dtype=resolve_dtype(config, device),
            device=str(device),
            routing_hooks=RoutingHooks(manager.hook),
            prepare_model=prepare,  # before CUDA-graph capture and KV sizing
            **engine_kwargs,
        )

    @property
    def weight_version(self) -> Any:
        """Version of the weights the engine samples with."""
        return self.engine.weight_version

    def submit(self, rid: str, input_ids: list[int], sampling_params: dict, return_routed_experts: bool = False) -> None:
        """Queue a request (``sampling_params["n"]`` samples). Raises ValueError if bad."""
        if self.engine is None:
            raise RuntimeError("the embedded rollout engine was closed with its run (Run.close); start a new run")
        self.engine.add_request(
            rid, input_ids, sampling_params, return_logprob=True, return_routed_experts=return_routed_experts
        )

    def step(self) -> list[dict]:
        """Advance generation; outputs of samples that finished in this step."""
        return self.engine.step()

    def has_unfinished(self) -> bool:
        """True while some submitted sample is still generating."""
        return self.engine.has_unfinished()

    def abort_all(self) -> list[dict]:
        """Abort everything in flight; their partial outputs."""
        return self.engine.abort(None)

    def update_weights(self, named_tensors, weight_version: Any = None) -> Any:
        """Load new weights in place; returns the new version."""
        return self.engine.update_weights(named_tensors, weight_version=weight_version)

    def release_memory_occupation(self, tags=None) -> None:
        """Free the idle engine's KV cache (and weights: tag ``weights``) for the trainer (``--colocate``)."""
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None) -> None:
        """Take the released memory back before generating."""
        self.engine.resume_memory_occupation(tags)

    def close(self) -> None:
        """Abort what is in flight and drop the engine: its weights, KV cache and decode graphs
        go back to the device's allocator and driver, for whatever this process runs next (a
        second run, a benchmark's next case). Idempotent."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        engine.abort(None)
        device = engine.device
        del engine
        gc.collect()  # the engine's modules and graphs hold reference cycles
        settle(device)
