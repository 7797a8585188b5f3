"""One PyTorch model implementation for training and rollout.

Public API:

- :func:`load_pretrained` / :func:`save_pretrained`: HF checkpoint directories
  <-> :class:`CausalLM`, through the model-family plugins.
- :class:`CausalLM`: ``forward_hidden`` / ``compute_logits`` (engine),
  ``packed_log_probs`` (trainer), ``forward`` (padded-batch convenience),
  ``attention_layout`` (KV-cache sizing).
- :class:`PackedAttention`, :class:`ContiguousKVCache`: attention contexts.
- :class:`ModelConfig` and its parts; :class:`ForwardContext`.
"""

from miles_host.models.attention import ContiguousKVCache, PackedAttention
from miles_host.models.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from miles_host.models.context import AttentionContext, ForwardContext, RoutingContext
from miles_host.models.generate import greedy_generate
from miles_host.models.loading import load_pretrained, save_pretrained
from miles_host.models.logprobs import chunked_log_probs, token_log_probs
from miles_host.models.model import CausalLM

__all__ = [
    "AttentionContext",
    "CausalLM",
    "ContiguousKVCache",
    "ForwardContext",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "PackedAttention",
    "RopeConfig",
    "RoutingContext",
    "chunked_log_probs",
    "greedy_generate",
    "load_pretrained",
    "save_pretrained",
    "token_log_probs",
]
