"""Online draft training: the MTP loss term and the trainer that owns the draft.

The draft head learns, on every rollout batch, to predict ``x_{t+2}`` from the
policy's (detached) final hidden state ``h_t`` and the embedding of
``x_{t+1}``, with cross-entropy on positions whose ``x_{t+2}`` is a trained
response token, scaled by ``--mtp-loss-scaling-factor``. The policy's shared
embedding and lm head are detached in this loss, so the RL update of the
policy is unchanged by it (the draft only follows the policy); the draft's
gradients do enter the trainer's global grad-norm clipping.

The hidden states come from the trainer's own forward (a forward hook on the
policy's final norm keeps the last one), so no second policy forward is run.
The draft is a submodule (``mtp.*``) of the trainer's model, so
``named_weights_for_rollout`` carries it to the engine at every weight sync.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from miles_host.models.attention import PackedAttention
from miles_host.models.logprobs import chunked_log_probs

from miles_spec.draft import MTPDraft, attach_mtp

#: trainer model (by id) -> its hidden-state capture
_CAPTURES: "dict[int, HiddenCapture]" = {}


class HiddenCapture:
    """Keeps the policy's last final-norm output (detached) of the trainer's model."""

    def __init__(self, model: torch.nn.Module):
        self.model_ref = weakref.ref(model)
        self.hidden_TH: torch.Tensor | None = None
        model.norm.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        self.hidden_TH = output.detach()


def prepare_train_model(model: torch.nn.Module, config: Any) -> HiddenCapture | None:
    """Attach a fresh draft to the trainer's model if its checkpoint had none (before
    the optimizer is built, so the draft is optimized) and keep its hidden states.

    A training backend with its own model classes provides the draft itself through
    ``attach_mtp_draft(num_layers)`` / ``has_mtp_draft`` / ``mtp_draft_log_probs(batch,
    rows_R, targets_R)`` (the megatron backend: Megatron-Core's MTP layer)."""
    if hasattr(model, "attach_mtp_draft"):
        model.attach_mtp_draft(config.mtp_num_layers or 1)
        return None
    attach_mtp(model, config.mtp_num_layers or 1)
    capture = HiddenCapture(model)
    _CAPTURES[id(model)] = capture
    return capture


def mtp_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``t`` of the packed batch that train the draft and their targets ``x_{t+2}``."""
    rows, targets = [], []
    cu = batch.cu_seqlens.tolist()
    for sample, start, end in zip(batch.samples, cu[:-1], cu[1:]):
        first_response = end - sample.response_length
        mask = list(sample.loss_mask) or [1] * sample.response_length
        for t in range(max(start, first_response - 2), end - 2):
            if mask[t + 2 - first_response]:
                rows.append(t)
                targets.append(sample.tokens[t + 2 - start])
    device = batch.input_ids_T.device
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(targets, dtype=torch.long, device=device)


def mtp_loss(model_outputs: dict, loss_batch: Any, config: Any) -> tuple[torch.Tensor, dict]:
    """The MTP draft loss of one micro-batch (a :class:`~miles_host.records.LossTerm` fn)."""
    batch = model_outputs["batch"]
    model = model_outputs.get("model")
    if getattr(model, "has_mtp_draft", False):  # a backend-owned draft (see prepare_train_model)
        return _loss_of(lambda rows_R, targets_R: model.mtp_draft_log_probs(batch, rows_R, targets_R),
                        batch, model.parameters(), config)
    hidden_TH = model_outputs.get("hidden")
    capture = _CAPTURES.get(id(model)) if model is not None else None
    if hidden_TH is None and capture is not None:
        hidden_TH = capture.hidden_TH
    if model is None or hidden_TH is None or len(model.mtp) == 0:
        raise ValueError(
            "--enable-mtp-training: the trainer's model has no draft; use the native trainer "
            "(the spec plugin attaches the draft there) or a checkpoint with MTP layers"
        )
    if hidden_TH.shape[0] != batch.input_ids_T.shape[0]:
        raise RuntimeError("MTP loss: the kept hidden states are not those of this micro-batch")

    def native_log_probs(rows_R: torch.Tensor, targets_R: torch.Tensor) -> torch.Tensor:
        draft = MTPDraft(model)
        feature_TH = draft.features(hidden_TH.detach(), batch.target_ids_T, batch.positions_T,
                                    PackedAttention(batch.cu_seqlens), detach_shared=True)
        normed_RH = draft.layer.head_norm(feature_TH[rows_R])
        log_probs_R, _ = chunked_log_probs(
            normed_RH, model.lm_head_weight.detach(), targets_R, logit_softcap=model.config.final_logit_softcap
        )
        return log_probs_R

    return _loss_of(native_log_probs, batch, model.mtp.parameters(), config)


def _loss_of(log_probs_fn, batch: Any, draft_parameters, config: Any) -> tuple[torch.Tensor, dict]:
    """Mean next-next-token cross-entropy of the draft over the trained rows, scaled."""
    rows_R, targets_R = mtp_targets(batch)
    if rows_R.numel() == 0:  # nothing to train: a zero that still reaches the draft's parameters
        return sum(p.sum() * 0 for p in draft_parameters) + torch.zeros((), device=batch.input_ids_T.device), \
            {"loss": 0.0}
    loss = -log_probs_fn(rows_R, targets_R).mean()
    return loss * config.mtp_loss_scaling_factor, {"loss": float(loss.detach()), "tokens": float(rows_R.numel())}
