"""``Sample``: one prompt + one response, everything an RL step needs about it.

Same fields as slime's ``Sample`` (slime's fields plus group_index, index,
label, response_length, weight_versions, spec_info). JSON-serialisable without
loss, so a rollout can be dumped, inspected and replayed; MoE routes
(``rollout_routed_experts``, ``[len(tokens) - 1, num_moe_layers, topk]``) are kept
as a compact unsigned integer array (1 or 2 bytes per id) and written as base64.
"""

from __future__ import annotations

import base64
import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


class Status(str, enum.Enum):
    """Lifecycle of a sample."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def compact_expert_ids(routed: Any) -> np.ndarray | None:
    """Routed expert ids as the smallest unsigned array that holds them (uint8 or
    uint16). Accepts nested lists, numpy arrays or torch tensors; 3-D required."""
    if routed is None:
        return None
    if hasattr(routed, "detach"):
        routed = routed.detach().cpu().numpy()
    array = np.asarray(routed)
    if array.size == 0:
        return array.astype(np.uint8).reshape(array.shape)
    if array.ndim != 3:
        raise ValueError(
            "rollout_routed_experts must have shape [len(tokens) - 1, num_moe_layers, topk], "
            f"got an array of shape {array.shape}"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"rollout_routed_experts must hold integer expert ids, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > np.iinfo(np.uint16).max:
        raise ValueError(f"expert ids must be in [0, 65535], got range [{low}, {high}]")
    return array.astype(np.uint8 if high <= np.iinfo(np.uint8).max else np.uint16)


def _encode_experts(array: np.ndarray) -> dict[str, Any]:
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
    }


def _decode_experts(payload: Any) -> np.ndarray | None:
    if payload is None:
        return None
    if isinstance(payload, dict):
        raw = base64.b64decode(payload["data"])
        return np.frombuffer(raw, dtype=np.dtype(payload["dtype"])).reshape(payload["shape"]).copy()
    return compact_expert_ids(payload)


def weight_version_number(version: Any) -> int | None:
    """A weight version as a number of training steps: ints as they are, SGLang's decimal
    strings (``"12"``) parsed; anything else (a user's label) is None."""
    if isinstance(version, bool) or version is None:
        return None
    if isinstance(version, int):
        return version
    text = str(version).strip()
    return int(text) if text.isdigit() else None


def output_token_versions(meta: dict, num_tokens: int) -> list:
    """The weight version (:func:`weight_version_number`) of each of an engine output's
    ``num_tokens`` tokens: from its ``weight_version_spans`` (``[[first output index, version],
    ...]``, the embedded engine's record when weights changed mid-request) when present, else
    its ``weight_version``."""
    spans = meta.get("weight_version_spans")
    if not spans:
        return [weight_version_number(meta.get("weight_version"))] * num_tokens
    versions: list = []
    for (start, version), following in zip(spans, [*spans[1:], [num_tokens, None]]):
        end = min(int(following[0]), num_tokens)
        versions.extend([weight_version_number(version)] * max(0, end - max(int(start), len(versions))))
    return versions + [weight_version_number(spans[-1][1])] * (num_tokens - len(versions))


@dataclass
class Sample:
    """A prompt and one sampled response, with what training needs about it."""

    prompt: str | list[dict] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    reward: float | dict | None = None
    loss_mask: list[int] | None = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: np.ndarray | None = None
    group_index: int | None = None
    index: int | None = None
    label: Any = None
    response_length: int = 0
    weight_versions: list[int] = field(default_factory=list)
    #: per response token: the weight version that generated it (None: not sampled by the policy)
    token_weight_versions: list = field(default_factory=list)
    spec_info: dict = field(default_factory=dict)
    #: per response token: the OPD teacher's log-prob of it (``--use-opd``; None: not scored)
    teacher_log_probs: list[float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            self.status = Status(self.status)
        self.rollout_routed_experts = compact_expert_ids(self.rollout_routed_experts)

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest weights that generated one of its tokens (None: no token carries a version)."""
        versions = [v for v in self.token_weight_versions if v is not None]
        return min(versions) if versions else None

    def get_reward_value(self, args: Any) -> Any:
        """The reward the advantages use, as slime's ``Sample.get_reward_value``: the
        ``--reward-key`` entry of a dict reward, else the reward (for slime-contract functions)."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    @property
    def prompt_length(self) -> int:
        """Tokens before the response."""
        return len(self.tokens) - self.response_length

    def validate(self) -> None:
        """Check that the fields agree; ValueError naming the field otherwise."""
        if not isinstance(self.tokens, list) or not all(isinstance(t, int) for t in self.tokens):
            raise ValueError("Sample.tokens must be a list of int token ids")
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(
                f"Sample.response_length ({self.response_length}) must be between 0 and "
                f"len(tokens) ({len(self.tokens)})"
            )
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != self.response_length:
                raise ValueError(
                    f"Sample.{name} has {len(value)} entries but response_length is {self.response_length}"
                )
        if self.token_weight_versions and len(self.token_weight_versions) != self.response_length:
            raise ValueError(
                f"Sample.token_weight_versions has {len(self.token_weight_versions)} entries but response_length "
                f"is {self.response_length}"
            )
        if self.loss_mask is not None and any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("Sample.loss_mask must hold only 0 and 1")
        if self.rollout_log_probs is not None:
            bad = [i for i, lp in enumerate(self.rollout_log_probs) if not (lp <= 0.0) or math.isnan(lp)]
            if bad:
                raise ValueError(
                    f"Sample.rollout_log_probs must be finite and <= 0; bad at positions {bad[:5]}"
                )
        routed = self.rollout_routed_experts
        if routed is not None and routed.size and routed.shape[0] != len(self.tokens) - 1:
            raise ValueError(
                f"Sample.rollout_routed_experts has {routed.shape[0]} rows but len(tokens) - 1 is "
                f"{len(self.tokens) - 1} (one row per token whose successor is predicted)"
            )
        if isinstance(self.reward, float) and math.isnan(self.reward):
            raise ValueError("Sample.reward is NaN")
        if not isinstance(self.status, Status):
            raise ValueError(f"Sample.status must be a Status, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_dict` restores an equal Sample."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "status":
                value = value.value
            elif f.name == "rollout_routed_experts":
                value = None if value is None else _encode_experts(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Sample field(s) {unknown}; known fields: {sorted(known)}")
        values = dict(data)
        if "status" in values:
            values["status"] = Status(values["status"])
        if "rollout_routed_experts" in values:
            values["rollout_routed_experts"] = _decode_experts(values["rollout_routed_experts"])
        return cls(**values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "rollout_routed_experts":
                if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                    return False
            elif a != b:
                return False
        return True
