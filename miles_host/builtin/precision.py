"""Built-in plugin: the plain ``bf16`` precision (dense linears in the model dtype:
bf16 on GPU, float32 on CPU), which every other precision recipe replaces."""

from __future__ import annotations

from miles_host.kernels import fused_sampler, invariant_experts, moe_grouped, pdl, small_m_gemm, split_k, switches
from miles_host.models import self_attention
from miles_host.records import Precision


def _unchanged(model, config):
    return model


def _pass_through(named_tensors, config):
    return named_tensors


def miles_process_start(config):
    """The host's kernel switches (``--split-k-reduce``, ``--small-m-gemm``, ``--pdl``, ``--sampler-kernel``,
    ``--moe-combine``, ``--moe-gemv-tokens``, ``--moe-invariant-decode``, ``--mla-kv-cache``) from the config,
    in every process."""
    switches.apply_config(config, [split_k.REDUCE, small_m_gemm.SMALL_M, pdl.PDL, fused_sampler.SAMPLER,
                                   moe_grouped.COMBINE, moe_grouped.GEMV_TOKENS, invariant_experts.DECODE,
                                   self_attention.LATENT_CACHE])


def miles_register_precisions():
    """The default precision recipe."""
    return [
        Precision(
            "bf16",
            "dense linears in the model dtype; weights synced as they are",
            prepare_train_model=_unchanged,
            prepare_rollout_model=_unchanged,
            convert_for_rollout=_pass_through,
        )
    ]
