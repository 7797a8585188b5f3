"""The embedded OPD teacher (``--opd-type embedded``, and upstream's ``megatron``): a
second, frozen model in this process that scores the student's samples with the
trainer's packed log-prob forward (:meth:`~miles_host.models.CausalLM.packed_log_probs`,
as the reference model's log-probs are computed), at ``--rollout-temperature`` as the
student's log-probs are.

``--opd-teacher-load`` is an HF-format model directory, or a miles ``--save`` directory
whose trainer weights (at its latest iteration or ``--opd-teacher-ckpt-step``) are loaded
into the student's architecture (``--hf-checkpoint``), as upstream loads its Megatron
teacher checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_host.checkpoint import has_checkpoint, load_checkpoint, read_checkpoint
from miles_host.devices import resolve_device, resolve_dtype
from miles_host.models import ForwardContext, PackedAttention, load_pretrained
from miles_host.sample import Sample
from miles_host.trainer import PackedBatch, micro_batches


def load_teacher_model(config: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The frozen teacher of ``--opd-teacher-load`` on ``device`` in ``dtype``."""
    path = config.opd_teacher_load
    if not has_checkpoint(str(path)):
        model = load_pretrained(path, dtype=dtype, device=str(device))
    else:
        if config.opd_teacher_ckpt_step is not None:
            state = read_checkpoint(Path(path) / f"iter_{config.opd_teacher_ckpt_step:07d}")
        else:
            state = load_checkpoint(path)
        model = load_pretrained(config.hf_checkpoint, dtype=dtype, device=str(device))
        try:
            model.load_state_dict(state["trainer"]["model"])
        except RuntimeError as error:
            raise ValueError(
                f"--opd-teacher-load {path}: its trainer weights do not fit the student's architecture "
                f"(--hf-checkpoint {config.hf_checkpoint}); a --save directory as teacher must come from a run of "
                f"this model, else give the teacher's HF directory ({error})") from error
    model.requires_grad_(False)
    return model.eval()


class EmbeddedTeacher:
    """Teacher log-probs from a frozen model in this process."""

    def __init__(self, config: Any):
        self.config = config
        self.device = resolve_device(config)
        self.model = load_teacher_model(config, self.device, resolve_dtype(config, self.device))

    @torch.no_grad()
    def log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Per sample, the teacher's log-prob of each response token given the tokens before it."""
        out: list[list[float]] = []
        for micro in micro_batches(samples, self.config):
            batch = PackedBatch.from_samples(micro, self.device)
            ctx = ForwardContext(attention=PackedAttention(batch.cu_seqlens))
            log_probs_T, _ = self.model.packed_log_probs(
                batch.input_ids_T, batch.positions_T, batch.cu_seqlens, batch.target_ids_T,
                temperature=self.config.rollout_temperature or 1.0, ctx=ctx)
            response = log_probs_T[batch.response_index_R].float().cpu()
            out.extend(part.tolist() for part in torch.split(response, batch.response_lengths))
        return out
