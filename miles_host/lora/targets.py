"""Which linears can carry adapters, under their HF module names, and which the flags pick.

The native model fuses HF linears (``q/k/v -> qkv_proj``, ``gate/up -> gate_up_proj``); the
model family's weight mapping says how. :func:`adaptable_modules` asks it: the native weight's
row numbers go through ``convert_native_tensor`` and come back split and renamed, so each HF
linear is found with the rows of the native linear it owns. Linear modules of the decoder
qualify: ``torch.nn.Linear`` and a precision recipe's quantized linears (modules with integer
``in_features`` / ``out_features``, :func:`is_quantized_linear`); the lm head is read as a
matrix, not called; MoE routers are no linears.

The routed experts' stacked 3-D weights (``experts.gate_up_proj``, ``experts.down_proj``) are
candidates too, saved as PEFT's ``target_parameters`` (:mod:`~miles_host.lora.experts`). Names
pick them as upstream miles' do: ``all-linear`` includes them (upstream's HF defaults for an MoE
model, its ``mlp`` group), ``gate_up_proj`` / ``down_proj`` / ``experts.down_proj`` / a full path
match by suffix (``down_proj`` also names a dense MLP's), ``gate_proj`` and ``up_proj`` given
together (or ``linear_fc1``) pick the packed ``gate_up_proj`` stack, and ``experts`` names both
stacks (``--exclude-modules experts`` leaves the routed experts out).

Matching follows PEFT's rules on those HF paths: a name matches a module whose path equals
it or ends with ``.<name>``; ``all-linear`` is every adaptable module but the output layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from miles_host.lora.experts import experts_parts, is_experts
from miles_host.lora.layers import LoraAdapters, LoraLinear, LoraPart

ALL_LINEAR = "all-linear"
#: spellings upstream miles also accepts: its other names of all-linear, and Megatron's
#: module names (its scripts' ``--target-modules linear_qkv,linear_proj``) as the HF names they fuse
ALIASES = {
    "all": (ALL_LINEAR,),
    "all_linear": (ALL_LINEAR,),
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
#: native modules that never carry adapters: the output layer (PEFT's all-linear skips it;
#: the model reads its weight directly) and the multi-token-prediction layers (no HF modules)
_NEVER = ("lm_head", "mtp.")


@dataclass(frozen=True)
class Candidate:
    """An HF linear (or, ``experts``: a routed experts' stacked parameter) that can carry an
    adapter: inside native module ``native`` at ``part``."""

    native: str
    part: LoraPart
    experts: bool = False

    def picked_by(self, name: str) -> bool:
        """Whether list entry ``name`` picks this candidate (PEFT's suffix rule; an expert stack
        also by its module's name, ``experts``)."""
        if self.experts and matches(self.part.hf_module.rsplit(".", 1)[0], name):
            return True
        return matches(self.part.hf_module, name)


def split_names(text: str | list[str] | None) -> list[str]:
    """``--target-modules`` / ``--exclude-modules`` as a list (comma-separated, blanks dropped,
    :data:`ALIASES` expanded)."""
    if text is None:
        return []
    items = text if isinstance(text, (list, tuple)) else text.split(",")
    names = [name for item in items if item.strip() for name in ALIASES.get(item.strip(), (item.strip(),))]
    return list(dict.fromkeys(names))


def _row_parts(family: Any, native_weight: str, out_features: int, config: Any) -> list[tuple[str, int, int]] | None:
    """``(hf_weight_name, start, stop)`` of each HF tensor the native weight splits into;
    None when the family does not map it or a part is not a whole, contiguous row range."""
    probe = torch.arange(out_features, dtype=torch.float64)[:, None].expand(out_features, 2)
    try:
        if family.convert_native_tensor is not None:
            pieces = family.convert_native_tensor(native_weight, probe, config)
        else:
            pieces = [(family.native_to_hf(native_weight) if family.native_to_hf else native_weight, probe)]
    except (ValueError, RuntimeError):
        return None
    out = []
    for hf_name, piece in pieces:
        if piece.dim() != 2 or piece.shape[1] != 2 or not torch.equal(piece[:, 0], piece[:, 1]):
            return None  # split along the input features: not a row slice
        rows = piece[:, 0].long()
        start, stop = int(rows[0]), int(rows[-1]) + 1
        if stop - start != rows.numel() or not torch.equal(rows, torch.arange(start, stop)):
            return None
        out.append((hf_name, start, stop))
    return out


def adaptable_modules(model: torch.nn.Module, family: Any) -> list[Candidate]:
    """Every HF linear (and routed-experts stack) of ``model`` that can carry an adapter, in module order."""
    found = []
    for name, module in model.named_modules():
        if any(name == n or name.startswith(n) for n in _NEVER):
            continue
        if is_experts(module) and family.convert_native_tensor is not None:
            found += [Candidate(name, part, experts=True) for part in experts_parts(family, name, module, model.config)]
            continue
        if not _is_linear(module):
            continue
        parts = _row_parts(family, f"{name}.weight", module.out_features, model.config)
        for hf_weight, start, stop in parts or ():
            hf_module = hf_weight.removesuffix(".weight")
            found.append(Candidate(name, LoraPart(hf_module.rsplit(".", 1)[-1], hf_module, start, stop)))
    return found


def is_quantized_linear(module: torch.nn.Module) -> bool:
    """A linear module other than a plain ``torch.nn.Linear`` (a precision recipe's INT4 / FP8
    linear, training or rollout side): adapters go next to it (``adapt_in_place``)."""
    if type(module) in (torch.nn.Linear, LoraLinear) or isinstance(module, LoraAdapters):
        return False
    if isinstance(module, torch.nn.Linear):
        return True
    return isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int)


def _is_linear(module: torch.nn.Module) -> bool:
    return type(module) in (torch.nn.Linear, LoraLinear) or is_quantized_linear(module)


def quantized_linears(model: torch.nn.Module) -> list[str]:
    """Native names of the model's quantized linear modules (:func:`is_quantized_linear`)."""
    return [name for name, module in model.named_modules() if is_quantized_linear(module)]


def matches(path: str, name: str) -> bool:
    """PEFT's rule for a list entry: the module path equals ``name`` or ends with ``.name``."""
    return path == name or path.endswith("." + name)


def select(candidates: list[Candidate], targets: Iterable[str], excludes: Iterable[str]) -> list[Candidate]:
    """The candidates ``targets`` pick (``all-linear``: all) minus those ``excludes`` names.

    ValueError when a target or exclude name matches no adaptable module (a typo adapts
    nothing silently otherwise), listing the names that exist."""
    targets, excludes = list(targets), list(excludes)
    packed = _packed(targets)
    picking = targets + list(packed)
    picks = {t: any(c.picked_by(t) for c in candidates) for t in picking}
    unmatched = [t for t in targets if t != ALL_LINEAR and not picks[t]
                 and not any(picks[p] for p, pair in packed.items() if t in pair)]
    unmatched += [e for e in excludes if not any(c.picked_by(e) for c in candidates)]
    if unmatched:
        raise ValueError(
            f"--target-modules/--exclude-modules: {', '.join(unmatched)} matches no adaptable module of this model; "
            f"{available_names(candidates)}"
        )
    chosen = [c for c in candidates if ALL_LINEAR in targets or any(c.picked_by(t) for t in picking)]
    return [c for c in chosen if not any(c.picked_by(e) for e in excludes)]


def _packed(targets: list[str]) -> dict[str, tuple[str, str]]:
    """``<prefix>gate_up_proj`` for each ``<prefix>gate_proj`` given with its ``<prefix>up_proj``
    (upstream's expansion to the packed expert stack), with the pair it comes from."""
    out = {}
    for gate in targets:
        if gate.rsplit(".", 1)[-1] == "gate_proj":
            prefix = gate.removesuffix("gate_proj")
            if f"{prefix}up_proj" in targets:
                out[f"{prefix}gate_up_proj"] = (gate, f"{prefix}up_proj")
    return out


def available_names(candidates: list[Candidate]) -> str:
    """The adaptable names, for error messages: the leaf names and one full path as an example."""
    if not candidates:
        return "the model has no adaptable linear modules"
    leaves = list(dict.fromkeys(c.part.key for c in candidates if not c.experts))
    leaves += list(dict.fromkeys(f"experts.{c.part.key}" for c in candidates if c.experts))
    leaves += ["experts (both stacks of the routed experts)"] if any(c.experts for c in candidates) else []
    return (f"the names available are {', '.join(leaves)} (PEFT's names; also all-linear, or a full module path "
            f"such as {candidates[0].part.hf_module})")


def family_of(model: torch.nn.Module) -> Any:
    """The model-family record of a native model (its HF names)."""
    from miles_host.models.loading import default_family_lookup

    return default_family_lookup(model.config.model_type)


def candidates_of(model: torch.nn.Module) -> list[Candidate]:
    """The HF linears of ``model`` that can carry adapters."""
    return adaptable_modules(model, family_of(model))
