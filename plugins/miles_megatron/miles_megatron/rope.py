"""The rope of a GQA model (not MLA: :mod:`miles_megatron.mla`) on Megatron-Core's ``RotaryEmbedding``.

- partial rotary (GLM-4/4.5 ``partial_rotary_factor``, Phi's ``rotary_dim``): the native
  ``rope.rotary_dim`` is the number of leading dims of each query/key head that rotate, the
  rest pass through unchanged; Megatron's ``GPTModel(rotary_percent=...)`` builds its
  frequencies over ``int(kv_channels * rotary_percent)`` dims and rotates the leading ones
  the same way (transformers' ``apply_rotary_pos_emb`` with ``cos.shape[-1] < head_dim``).
  The frequencies are ``theta ** (-2i / rotary_dim)`` in both.
- rotated pairs: halves (``rotate_half``, Llama/Qwen/GLM-4.5) by default; interleaved pairs
  ``(x0, x1), (x2, x3) ...`` (GLM-4 dense, GPT-J) as ``TransformerConfig.rotary_interleaved``,
  whose frequencies Megatron repeats pairwise as transformers' ``repeat_interleave(2)``.
- rope scaling other than ``default`` is refused by the caller (Megatron's GPT rope
  has no llama3 / yarn / linear variant on this path); the native config already keeps
  the rotary dim even and at most the head dim.
"""

from __future__ import annotations

from typing import Any


def rotary_percent(config: Any) -> float:
    """``GPTModel``'s ``rotary_percent`` for a native config (1.0: the whole head rotates).

    Megatron reads it only as ``int(kv_channels * rotary_percent)``: where the plain ratio
    would round below the rotary dim in floating point (30 of 44), half a dim is added."""
    rotary_dim, head_dim = config.rope.rotary_dim, config.head_dim
    percent = rotary_dim / head_dim
    return percent if int(head_dim * percent) == rotary_dim else (rotary_dim + 0.5) / head_dim


def rope_config_kwargs(config: Any) -> dict[str, Any]:
    """``TransformerConfig`` arguments of the rope (the pair layout)."""
    return {"rotary_interleaved": bool(config.rope.interleaved)}
