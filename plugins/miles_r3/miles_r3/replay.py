"""Laying recorded expert ids out in the packed token order of a training batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class TrackedBatch:
    """A training batch whose per-token agreement the dashboard shows: its samples, their
    packed offsets, and per packed token the sum over replayed layers of "the router chose the
    replayed experts" (each forward of a layer adds one; recomputation adds to both sums)."""

    routing: Any
    samples: list
    cu_seqlens: list[int]
    agree_T: torch.Tensor | None = None
    layers: int = 0


@dataclass
class ReplayState:
    """Per-run plugin state: R2 recordings and agreement counters of one step."""

    mode: str = "r3"
    #: agreeing / compared token-layers of the step: device tensors once a train pass replayed
    agree: int | torch.Tensor = 0
    total: int | torch.Tensor = 0
    pending: list = field(default_factory=list)
    recorded: dict = field(default_factory=dict)
    #: --use-miles-dashboard: id(routing context) -> its batch, for per-token agreement
    tracked: dict = field(default_factory=dict)

    def reset_step(self) -> None:
        self.agree = self.total = 0
        self.pending.clear()
        self.recorded.clear()
        self.tracked.clear()

    def track_tokens(self, routing: Any, samples: list, cu_seqlens: list[int]) -> None:
        """Count this training batch's agreement per token as well."""
        self.tracked[id(routing)] = TrackedBatch(routing, list(samples), list(cu_seqlens))

    def count_tokens(self, routing: Any, agree_T: torch.Tensor) -> None:
        """One replayed layer's per-token agreement (a no-op for untracked batches)."""
        batch = self.tracked.get(id(routing))
        if batch is not None:
            agree_T = agree_T.float()
            batch.agree_T = agree_T if batch.agree_T is None else batch.agree_T + agree_T
            batch.layers += 1

    def write_token_agreement(self, key: str) -> None:
        """Each tracked sample's ``metadata[key]``: per response token, the share of MoE layers
        whose training router chose the replayed experts at the position that generated it
        (the token before it); one host read per batch."""
        for batch in self.tracked.values():
            if batch.agree_T is None:
                continue
            share_T = (batch.agree_T / batch.layers).cpu().tolist()
            for sample, start, end in zip(batch.samples, batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
                first = end - sample.response_length - 1  # the input position of the first response token
                sample.metadata[key] = share_T[first : end - 1]
        self.tracked.clear()

    def collect_recorded(self) -> None:
        """R2: split the old-logprob passes' captures per sample, ``[len-1, layers, k]``."""
        for routing, samples, cu_seqlens, moe_layers in self.pending:
            stacked_TLK = torch.stack([routing.captured[layer].cpu() for layer in moe_layers], dim=1)
            for sample, start, end in zip(samples, cu_seqlens[:-1], cu_seqlens[1:]):
                self.recorded[id(sample)] = stacked_TLK[start : end - 1].numpy()
        self.pending.clear()


def check_routes(sample: Any, routes: np.ndarray, num_layers: int, topk: int) -> None:
    """The routes of ``sample`` must be ``[len(tokens) - 1, num_layers, topk]``."""
    expected = (len(sample.tokens) - 1, num_layers, topk)
    if tuple(routes.shape) != expected:
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}): rollout_routed_experts has shape "
            f"{tuple(routes.shape)} but the sample and model need {expected} "
            "([len(tokens) - 1, MoE layers, top-k])"
        )


def replay_ids_for_batch(
    samples: list[Any], routes: list[np.ndarray | None], moe_layers: list[int], topk: int, device: torch.device
) -> dict[int, torch.Tensor]:
    """``{layer index: [T, topk]}`` ids for the packed batch; -1 where nothing was
    recorded (the last token of each sequence, whose successor is not predicted)."""
    per_sample = []
    for sample, sample_routes in zip(samples, routes):
        rows = np.full((len(sample.tokens), len(moe_layers), topk), -1, dtype=np.int64)
        if sample_routes is None:
            raise ValueError(
                f"sample {sample.index} (group {sample.group_index}) has no rollout_routed_experts to replay; "
                "was it generated with routing capture on (--plugins r3)?"
            )
        check_routes(sample, np.asarray(sample_routes), len(moe_layers), topk)
        rows[:-1] = np.asarray(sample_routes, dtype=np.int64)
        per_sample.append(rows)
    packed_TLK = torch.from_numpy(np.concatenate(per_sample, axis=0)).to(device)
    return {layer: packed_TLK[:, position].contiguous() for position, layer in enumerate(moe_layers)}
