"""The plugin's flags, read from a run config (defaults when a flag is absent)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_int4.quant import GROUP_SIZES
from miles_int4.targets import TARGETS

ROLLOUT_GEMMS = ("auto", "packed", "dequant")


@dataclass(frozen=True)
class Int4Settings:
    """``--int4-group-size``, ``--int4-target``, ``--int4-rollout-gemm``, validated."""

    group_size: int = 128
    target: str = "experts"
    rollout_gemm: str = "auto"

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--int4-group-size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.target not in TARGETS:
            raise ValueError(f"--int4-target must be one of {TARGETS}, got {self.target!r}")
        if self.rollout_gemm not in ROLLOUT_GEMMS:
            raise ValueError(f"--int4-rollout-gemm must be one of {ROLLOUT_GEMMS}, got {self.rollout_gemm!r}")


def int4_settings(config: Any) -> Int4Settings:
    """The int4 flags of ``config`` (a MilesConfig or any object with those attributes)."""
    defaults = Int4Settings()
    return Int4Settings(
        group_size=int(getattr(config, "int4_group_size", defaults.group_size)),
        target=getattr(config, "int4_target", defaults.target),
        rollout_gemm=getattr(config, "int4_rollout_gemm", defaults.rollout_gemm),
    )
