"""The PPO critic: the shared model body with a scalar value head.

``V(s_t)`` for response token ``t`` is read at the position whose logits predict
``t`` (the state before it), so values line up with the policy's log-probs.
The body starts from ``--critic-load`` (default: the policy checkpoint) and the
head from zero, so the first values are 0.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_host.algorithms.value import clipped_value_loss
from miles_host.models.context import ForwardContext, RoutingContext
from miles_host.routing import RoutingHooks


class Critic(torch.nn.Module):
    """Value model = CausalLM body + ``Linear(hidden, 1)``, with its own optimizer (the policy's kind)."""

    def __init__(self, config: Any, manager: Any, device: torch.device):
        super().__init__()
        from miles_host.models import load_pretrained

        path = config.critic_load or config.hf_checkpoint
        self.body = load_pretrained(path, dtype=torch.float32, device=str(device), routing_hooks=RoutingHooks(manager.hook))
        self.value_head = torch.nn.Linear(self.body.config.hidden_size, 1, device=device)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.config = config
        from miles_host.optimizer import build_optimizer

        # the policy's --optimizer and weight-decay groups, on the device
        self.optimizer = build_optimizer(self.named_parameters(), config,
                                         lr=config.critic_lr if config.critic_lr is not None else config.lr)

    def values(self, batch: Any) -> torch.Tensor:
        """``[R]`` values of the batch's response tokens."""
        from miles_host.models import PackedAttention

        ctx = ForwardContext(attention=PackedAttention(batch.cu_seqlens), routing=RoutingContext(phase="critic"))
        hidden_TH = self.body.forward_hidden(batch.input_ids_T, batch.positions_T, ctx)
        return self.value_head(hidden_TH[batch.response_index_R]).squeeze(-1).float()

    def loss(self, batch: Any, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor):
        """Clipped value loss of one micro-batch (``--value-clip``)."""
        return clipped_value_loss(
            self.values(batch), old_values, returns, loss_mask, batch.response_lengths, self.config.value_clip, self.config
        )

    def checkpoint_state(self) -> dict:
        return {"model": self.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
