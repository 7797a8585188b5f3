"""HF <-> native weight-name mapping shared by every family adapter.

A family describes its checkpoint layout as a list of :class:`Rule`: one native
tensor and the HF tensors that make it up. Templates use ``{i}`` for the layer
and ``{e}`` for the expert index. A rule with several HF parts fuses them along
``dim`` (``q/k/v -> qkv_proj``, ``gate/up -> gate_up_proj``); an ``experts``
rule stacks per-expert HF tensors into a native ``[E, ...]`` tensor. Loading
writes each HF tensor straight into its slice of the native parameter, so no
second full copy of the weights is ever made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

Index = tuple | None


@dataclass(frozen=True)
class Rule:
    """One native tensor and the HF tensor(s) it is made of.

    ``sizes(config)`` gives the part sizes along ``dim`` (None: equal parts);
    ``load_only`` rules accept an alternative HF layout (e.g. transformers'
    in-memory fused experts) and are never used when saving.
    """

    native: str
    hf: tuple[str, ...]
    dim: int = 0
    sizes: Callable[[Any], tuple[int, ...]] | None = None
    experts: bool = False
    load_only: bool = False


def _regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(pattern)


class WeightMap:
    """Converts tensors between HF names and native names with a rule table."""

    def __init__(self, rules: Iterable[Rule], ignore: Iterable[str] = (r".*rotary_emb\.inv_freq",)):
        self.rules = list(rules)
        self._hf = [(rule, part, _regex(t)) for rule in self.rules for part, t in enumerate(rule.hf)]
        self._native = [(rule, _regex(rule.native)) for rule in self.rules if not rule.load_only]
        self._ignore = [re.compile(p) for p in ignore]

    # -- names only ------------------------------------------------------------

    def hf_to_native(self, name: str) -> str | None:
        """The native tensor an HF tensor belongs to.

        None for tensors to ignore (rotary buffers); an unknown name comes back
        unchanged, so the loader reports it as unexpected.
        """
        if any(p.fullmatch(name) for p in self._ignore):
            return None
        for rule, _, regex in self._hf:
            match = regex.fullmatch(name)
            if match:
                return rule.native.format(i=match.groupdict().get("i"))
        return name

    def native_to_hf(self, name: str) -> str:
        """The first HF name of a native tensor (for messages; fused tensors have more)."""
        for rule, regex in self._native:
            match = regex.fullmatch(name)
            if match:
                return rule.hf[0].format(i=match.groupdict().get("i"), e=0)
        return name

    # -- tensors ---------------------------------------------------------------

    def convert_hf_tensor(self, name: str, tensor: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor, Index]] | None:
        """``[(native_name, tensor, index)]`` where ``index`` selects the slice it fills.

        ``[]`` for tensors to ignore; None when no rule knows the name (the
        loader then renames with :meth:`hf_to_native`, which keeps the name,
        and reports it as unexpected).
        """
        if any(p.fullmatch(name) for p in self._ignore):
            return []
        for rule, part, regex in self._hf:
            match = regex.fullmatch(name)
            if not match:
                continue
            groups = match.groupdict()
            native = rule.native.format(i=groups.get("i"))
            lead: tuple = (int(groups["e"]),) if rule.experts else ()
            if len(rule.hf) == 1:
                return [(native, tensor, lead or None)]
            sizes = rule.sizes(config) if rule.sizes else (tensor.shape[rule.dim],) * len(rule.hf)
            offset = sum(sizes[:part])
            index = lead + (slice(None),) * rule.dim + (slice(offset, offset + sizes[part]),)
            return [(native, tensor, index)]
        return None

    def convert_native_tensor(self, name: str, tensor: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs for one native tensor (views; split and unstacked)."""
        for rule, regex in self._native:
            match = regex.fullmatch(name)
            if not match:
                continue
            layer = match.groupdict().get("i")
            experts = range(tensor.shape[0]) if rule.experts else [None]
            out = []
            for expert in experts:
                t = tensor[expert] if expert is not None else tensor
                if len(rule.hf) == 1:
                    out.append((rule.hf[0].format(i=layer, e=expert), t))
                    continue
                sizes = rule.sizes(config) if rule.sizes else (t.shape[rule.dim] // len(rule.hf),) * len(rule.hf)
                for template, part in zip(rule.hf, t.split(list(sizes), dim=rule.dim)):
                    out.append((template.format(i=layer, e=expert), part))
            return out
        raise ValueError(f"no HF name for native tensor {name!r}")


class MTPWeightMap(WeightMap):
    """DeepSeek-style MTP layers: HF ``model.layers.{L + j}.*`` <-> native ``mtp.{j}.*``.

    The decoder-layer part of an MTP layer uses the regular rules; the MTP-only
    tensors (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.*``,
    ``embed_tokens``) are renamed here.
    """

    EXTRA = {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "head_norm.weight",
        "shared_head.head.weight": "head.weight",
        "embed_tokens.weight": "embed_tokens.weight",
    }
    _HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    _NATIVE_MTP = re.compile(r"mtp\.(\d+)\.(.+)")

    def convert_hf_tensor(self, name, tensor, config):
        match = self._HF_LAYER.fullmatch(name)
        if match and int(match.group(1)) >= config.num_layers:
            j, rest = int(match.group(1)) - config.num_layers, match.group(2)
            if rest in self.EXTRA:
                return [(f"mtp.{j}.{self.EXTRA[rest]}", tensor, None)]
            out = super().convert_hf_tensor(f"model.layers.{j}.{rest}", tensor, config)
            if out is None:
                return None
            return [(f"mtp.{native[len('layers.'):]}", t, index) for native, t, index in out]
        return super().convert_hf_tensor(name, tensor, config)

    def convert_native_tensor(self, name, tensor, config):
        match = self._NATIVE_MTP.fullmatch(name)
        if not match:
            return super().convert_native_tensor(name, tensor, config)
        j, rest = int(match.group(1)), match.group(2)
        prefix = f"model.layers.{config.num_layers + j}."
        for hf_rest, native_rest in self.EXTRA.items():
            if rest == native_rest:
                return [(prefix + hf_rest, tensor)]
        out = super().convert_native_tensor(f"layers.{j}.{rest}", tensor, config)
        return [(prefix + hf[len(f"model.layers.{j}.") :], t) for hf, t in out]


# ----------------------------------------------------------------------------
# the standard decoder layout (Llama and everything derived from it)
# ----------------------------------------------------------------------------

L = "model.layers.{i}."


def _qkv_sizes(config: Any) -> tuple[int, int, int]:
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return q, kv, kv


def common_rules() -> list[Rule]:
    """Embeddings, final norm and lm head."""
    return [
        Rule("embed_tokens.weight", ("model.embed_tokens.weight",)),
        Rule("norm.weight", ("model.norm.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ]


def norm_rules(style: str = "llama") -> list[Rule]:
    """Per-layer norms. ``gemma``/``glm4``: sandwich norms with their HF names."""
    names = {
        "llama": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
        "gemma": {
            "attn_norm": "input_layernorm",
            "post_attn_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm",
        },
        "glm4": {
            "attn_norm": "input_layernorm",
            "post_attn_norm": "post_self_attn_layernorm",
            "mlp_norm": "post_attention_layernorm",
            "post_mlp_norm": "post_mlp_layernorm",
        },
    }[style]
    return [Rule(f"layers.{{i}}.{native}.weight", (f"{L}{hf}.weight",)) for native, hf in names.items()]


def gqa_rules(qkv_sizes: Callable[[Any], tuple[int, ...]] = _qkv_sizes) -> list[Rule]:
    """q/k/v fused into ``qkv_proj`` (weight and bias), o_proj, q/k norms; ``qkv_sizes(config)``:
    the rows of q, k and v (a q_proj that also emits an output gate has twice the q rows)."""
    rules = []
    for kind in ("weight", "bias"):
        parts = tuple(f"{L}self_attn.{p}_proj.{kind}" for p in "qkv")
        rules.append(Rule(f"layers.{{i}}.attn.qkv_proj.{kind}", parts, sizes=qkv_sizes))
        rules.append(Rule(f"layers.{{i}}.attn.o_proj.{kind}", (f"{L}self_attn.o_proj.{kind}",)))
    rules += [
        Rule("layers.{i}.attn.q_norm.weight", (f"{L}self_attn.q_norm.weight",)),
        Rule("layers.{i}.attn.k_norm.weight", (f"{L}self_attn.k_norm.weight",)),
    ]
    return rules


def mla_rules() -> list[Rule]:
    """DeepSeek latent attention (with or without q_lora_rank)."""
    names = {
        "q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj",
        "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
        "o_proj": "o_proj",
    }
    return [
        Rule(f"layers.{{i}}.attn.{native}.{kind}", (f"{L}self_attn.{hf}.{kind}",))
        for native, hf in names.items()
        for kind in ("weight", "bias")
    ]


def mlp_rules(prefix: str = "mlp", native: str = "layers.{i}.mlp", hf_fused: bool = False) -> list[Rule]:
    """A gated MLP: HF gate/up (or fused ``gate_up_proj``) and down projections."""
    rules = []
    for kind in ("weight", "bias"):
        if hf_fused:
            rules.append(Rule(f"{native}.gate_up_proj.{kind}", (f"{L}{prefix}.gate_up_proj.{kind}",)))
        else:
            parts = (f"{L}{prefix}.gate_proj.{kind}", f"{L}{prefix}.up_proj.{kind}")
            rules.append(Rule(f"{native}.gate_up_proj.{kind}", parts))
        rules.append(Rule(f"{native}.down_proj.{kind}", (f"{L}{prefix}.down_proj.{kind}",)))
    return rules


def moe_rules(
    prefix: str = "mlp",
    expert_names: tuple[str, str, str] = ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    shared: str | None = None,
    shared_gate: str | None = None,
    expert_bias: str | None = None,
) -> list[Rule]:
    """Router, per-expert HF tensors stacked into 3-D native experts, shared experts.

    Also accepts transformers' fused in-memory layout (``experts.gate_up_proj``
    ``[E, 2I, H]`` and ``experts.down_proj``) when loading.
    """
    gate, up, down = expert_names
    base = "layers.{i}.mlp"
    rules = [
        Rule(f"{base}.router.weight", (f"{L}{prefix}.gate.weight",)),
        Rule(
            f"{base}.experts.gate_up_proj",
            (f"{L}{prefix}.experts.{{e}}.{gate}", f"{L}{prefix}.experts.{{e}}.{up}"),
            experts=True,
        ),
        Rule(f"{base}.experts.down_proj", (f"{L}{prefix}.experts.{{e}}.{down}",), experts=True),
        Rule(f"{base}.experts.gate_up_proj", (f"{L}{prefix}.experts.gate_up_proj",), load_only=True),
        Rule(f"{base}.experts.down_proj", (f"{L}{prefix}.experts.down_proj",), load_only=True),
        Rule(f"{base}.experts.gate_up_proj", (f"{L}mlp.experts.gate_up_proj",), load_only=True),
        Rule(f"{base}.experts.down_proj", (f"{L}mlp.experts.down_proj",), load_only=True),
    ]
    if expert_bias:
        rules.append(Rule(f"{base}.router.expert_bias", (f"{L}{prefix}.{expert_bias}",)))
    if shared:
        rules += mlp_rules(f"{prefix}.{shared}", native=f"{base}.shared_experts")
    if shared_gate:
        rules.append(Rule(f"{base}.shared_gate.weight", (f"{L}{prefix}.{shared_gate}.weight",)))
    return rules
