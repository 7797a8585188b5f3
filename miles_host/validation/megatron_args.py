"""Megatron's architecture flags checked against ``--hf-checkpoint``'s config.

miles builds the model from the HF ``config.json`` through its model family adapter;
slime's ``MODEL_ARGS`` describe the same model to Megatron. Each architecture flag
the user gave is compared with what the adapter read (the records of
:mod:`miles_host.validation.megatron_arch`, one per flag): a disagreement is a
ValueError naming the flag, its value, the config key and the config's value.
Boolean switches (``--swiglu``, ``--qk-layernorm``, ...) whose absence also
describes the model are checked both ways once the script gives a full
``MODEL_ARGS`` block (:data:`MODEL_ARGS_BLOCK`).
Flags of features miles builds in no model (:data:`UNBUILT_FEATURES`) name the feature.

``--spec`` names the Megatron layer spec a slime script builds with; :data:`SPECS`
says which model types each known spec builds, and whether miles builds those.

:func:`check_megatron_training_args` refuses the ``PERF_ARGS`` values no backend
honours (nonzero dropout, an auxiliary loss, fp16, expert tensor parallelism, uneven
pipeline stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from miles_host.config_fields import flag_name
from miles_host.validation.megatron_arch import ARCHITECTURE_CHECKS, MOE_SWITCHES, SKIP, architecture_fields
from miles_host.validation.plugin_settings import user_set_fields

#: flags that describe a model miles does not build: field -> (the value of the models it builds, the feature)
UNBUILT_FEATURES: dict[str, tuple[Any, str]] = {
    "use_gated_attention": (False, "gated attention (Qwen3-Next, Qwen3.5)"),
    "attention_output_gate": (False, "an attention output gate (Qwen3-Next, Qwen3.5)"),
    "softmax_type": ("vanilla", "attention sinks (gpt-oss)"),
    "moe_latent_size": (None, "MoE latent projections (Nemotron-3)"),
    "custom_model_provider_path": (None, "a custom Megatron model provider (miles builds the model from "
                                         "--hf-checkpoint through its model family adapter)"),
}


def check_unbuilt_features(config: Any) -> None:
    """A flag of :data:`UNBUILT_FEATURES` set to another value names the feature miles does not build."""
    for name, (value, feature) in UNBUILT_FEATURES.items():
        if getattr(config, name) != value:
            raise ValueError(f"{flag_name(name)} {_shown(getattr(config, name))} describes {feature}, a model miles "
                             "cannot build; use a model of an installed family (miles plugins), or drop the flag")


@dataclass(frozen=True)
class LayerSpec:
    """A Megatron layer spec of slime's scripts: the HF model types it builds (empty: any),
    and whether a model family of miles builds them."""

    model_types: tuple[str, ...]
    description: str
    miles_builds: bool = True


#: ``(module, function)`` of ``--spec`` -> what it builds (upstream miles' ``miles_plugins.models.*``
#: specs are slime's ``slime_plugins.models.*``: :data:`SPEC_PACKAGES`)
SPECS: dict[tuple[str, str], LayerSpec] = {
    ("slime_plugins.models.glm4", "get_glm_spec"): LayerSpec(("glm4",), "GLM-4 dense (sandwich norms)"),
    ("slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"): LayerSpec(("minimax_m2",), "MiniMax-M2"),
    ("slime_plugins.models.glm5.glm5", "get_glm5_spec"): LayerSpec(
        ("glm_moe_dsa",), "GLM-5 (DeepSeek sparse attention)", miles_builds=False),
    ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"): LayerSpec(
        ("qwen3_next",), "Qwen3-Next (gated delta-net linear attention)", miles_builds=False),
    ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"): LayerSpec(
        ("qwen3_5", "qwen3_5_moe"), "Qwen3.5 (gated delta-net linear attention)", miles_builds=False),
    ("slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider"): LayerSpec(
        ("qwen3_5_moe",), "Qwen3.5-VL (vision, gated delta-net linear attention)", miles_builds=False),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec"): LayerSpec(
        (), "Megatron-Core's GPT decoder block (any model miles builds)"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"): LayerSpec(
        (), "Megatron-Core's local GPT layer (any model miles builds)"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec"): LayerSpec(
        (), "Megatron-Core's TransformerEngine GPT layer (any model miles builds)"),
}


#: packages whose ``models.*`` specs are the same (slime's and upstream miles' plugin packages)
SPEC_PACKAGES = ("slime_plugins.", "miles_plugins.")


def spec_key(spec: list[str]) -> tuple[str, ...]:
    """``--spec MODULE FUNCTION`` as a :data:`SPECS` key (``miles_plugins.`` read as ``slime_plugins.``)."""
    key = tuple(spec)
    if key and key[0].startswith(SPEC_PACKAGES[1]):
        key = (SPEC_PACKAGES[0] + key[0][len(SPEC_PACKAGES[1]):], *key[1:])
    return key


def _hf_value(hf: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    """``(key, value)`` of the first of ``keys`` in the HF config (dotted: nested); else the first key."""
    for key in keys:
        node: Any = hf
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return key, node
    return keys[0], "(absent)"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off (not given)"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    return str(value)


def _same(given: Any, expected: Any) -> bool:
    """Switches compare as booleans, numbers within float rounding (1e-6 vs 1e-06), the rest exactly."""
    if isinstance(expected, bool):
        return bool(given) == expected
    numbers = (int, float)
    if isinstance(given, numbers) and isinstance(expected, numbers) and not isinstance(given, bool):
        return math.isclose(float(given), float(expected), rel_tol=1e-6, abs_tol=1e-12)
    return given == expected


#: flags every MODEL_ARGS block of slime's scripts gives: with all of them, the switches' absence counts
MODEL_ARGS_BLOCK = ("num_layers", "hidden_size", "num_attention_heads")


def architecture_mismatches(config: Any, native: Any, given: set[str]) -> list[str]:
    """One message per architecture flag that disagrees with the native config (empty: all agree)."""
    complete = set(MODEL_ARGS_BLOCK) <= given
    moe_described = "num_experts" in given
    hf = native.hf_config
    path = getattr(config, "hf_checkpoint", None) or "the checkpoint"
    problems = []
    for check in ARCHITECTURE_CHECKS:
        considered = check.field in given or bool(given & set(check.also_when)) or (
            check.absent_counts and complete and (check.field not in MOE_SWITCHES or moe_described))
        if not considered:
            continue
        expected = check.expected(native, config)
        if expected is SKIP:
            continue
        actual = check.actual(config, native) if check.actual is not None else getattr(config, check.field)
        if _same(actual, expected):
            continue
        key, raw = _hf_value(hf, check.keys)
        problems.append(
            f"{flag_name(check.field)} {_shown(actual)} disagrees with --hf-checkpoint {path}: its config.json has "
            f"{key} = {raw}, which is {flag_name(check.field)} {_shown(expected)}"
        )
    return problems


def _family_installed(model_types: tuple[str, ...]) -> bool:
    from miles_host.plugin_manager import model_family_for

    for model_type in model_types:
        try:
            model_family_for(model_type)
            return True
        except ValueError:
            continue
    return False


def check_spec(config: Any, model_type: str) -> None:
    """``--spec MODULE FUNCTION`` names a spec of :data:`SPECS` that builds ``model_type`` (the
    checkpoint's); a spec of a model no installed family builds says so."""
    if not config.spec:
        return
    key, given = spec_key(config.spec), " ".join(config.spec)
    known = "; ".join(f"{' '.join(k)} ({spec.description})" for k, spec in SPECS.items())
    if len(key) != 2 or key not in SPECS:
        raise ValueError(f"--spec {given}: not a layer spec miles knows; known: {known}")
    spec = SPECS[key]
    if not spec.model_types or model_type in spec.model_types:
        return
    if spec.miles_builds or _family_installed(spec.model_types):
        raise ValueError(
            f"--spec {given} builds {spec.description} (model_type {'/'.join(spec.model_types)}), but "
            f"--hf-checkpoint is model_type {model_type}; drop --spec or give the matching checkpoint"
        )
    raise ValueError(
        f"--spec {given} builds {spec.description}, a model miles cannot build (no installed model family "
        f"handles model_type {'/'.join(spec.model_types)}); --hf-checkpoint is model_type {model_type}: drop "
        "--spec, or use a model of an installed family (miles plugins)"
    )


def check_megatron_model_args(config: Any, registries: Any) -> None:
    """Host check: the Megatron architecture flags the user gave describe ``--hf-checkpoint``'s model."""
    check_unbuilt_features(config)
    given = user_set_fields(config)
    if not (given & set(architecture_fields())) and not config.spec:
        return
    if config.hf_checkpoint is None:
        return  # check_required_inputs names the missing flag
    from miles_host.models.loading import native_config, read_hf_config
    from miles_host.plugin_manager import model_family_for

    hf = read_hf_config(config.hf_checkpoint)
    check_spec(config, hf.get("model_type", ""))
    native = native_config(hf, model_family_for(hf["model_type"]))
    problems = architecture_mismatches(config, native, given)
    if problems:
        raise ValueError(
            "the Megatron architecture flags disagree with the checkpoint (miles builds the model from its "
            "config.json; fix or drop these flags):\n  " + "\n  ".join(problems)
        )


#: PERF_ARGS values that ask for something no backend of miles does: field -> (value miles trains with, why)
REQUIRED_VALUES: dict[str, tuple[Any, str]] = {
    "attention_dropout": (0.0, "miles trains without dropout"),
    "hidden_dropout": (0.0, "miles trains without dropout"),
    "moe_aux_loss_coeff": (0.0, "miles adds no load-balancing loss (the RL loss alone trains the router)"),
    "moe_router_bias_update_rate": (0.0, "miles keeps the checkpoint's expert-score bias fixed"),
    "fp16": (False, "miles trains in bf16 (autocast over float32 masters), with no fp16 loss scaling; use --bf16"),
    "expert_tensor_parallel_size": (1, "experts are never tensor-parallel split in miles"),
}


def check_megatron_training_args(config: Any, registries: Any) -> None:
    """Host check: the ``PERF_ARGS`` values miles can honour (see :data:`REQUIRED_VALUES`), and
    pipeline stage sizes that are the even split, unless the training backend builds uneven
    stages (``--train-backend megatron``: it checks them itself)."""
    given = user_set_fields(config)
    for name, (value, why) in REQUIRED_VALUES.items():
        if name in given and getattr(config, name) != value:
            instead = "drop it" if isinstance(value, bool) else f"give {flag_name(name)} {_shown(value)} or drop it"
            raise ValueError(f"{flag_name(name)} {_shown(getattr(config, name))}: {why}; {instead}")
    # a backend that builds uneven stages checks them itself (TrainBackend.honoured_flags)
    honoured = set(registries.train_backends.get(config.train_backend).honoured_flags) if registries else set()
    stages = {name: getattr(config, name) for name in ("decoder_first_pipeline_num_layers",
                                                       "decoder_last_pipeline_num_layers") if name not in honoured}
    if all(value is None for value in stages.values()):
        return
    pp = int(config.pipeline_model_parallel_size)
    layers = config.num_layers
    if layers is None and config.hf_checkpoint is not None:
        from miles_host.models.loading import read_hf_config

        layers = read_hf_config(config.hf_checkpoint).get("num_hidden_layers")
    even = layers // pp if layers is not None and pp > 1 and layers % pp == 0 else None
    for name, value in stages.items():
        if value is not None and value != even:
            raise ValueError(
                f"{flag_name(name)} {value}: pipeline stages here are even, {layers} layers over "
                f"--pipeline-model-parallel-size {pp}"
                + (f" ({even} each); give {even} or drop the flag" if even else
                   "; uneven stages are not supported: drop the flag (and use a pipeline size that divides the layers)")
            )
