"""miles-spec (entry point ``spec``): speculative rollout with an online-trained draft.

Activated by ``--plugins spec`` or by slime's ``--sglang-speculative-algorithm``
/ ``--enable-mtp-training`` flags (declared by the host for slime compatibility).

- decoding strategy ``eagle`` (aliases ``mtp``, ``nextn``) for the embedded
  engine (:mod:`miles_spec.strategy`);
- loss term ``mtp`` (``--enable-mtp-training``, :mod:`miles_spec.training`);
- the native trainer, with the draft attached to the policy model when
  ``--enable-mtp-training`` (attached through ``miles_prepare_model`` while
  this plugin is active);
- ``spec/*`` metrics at the end of every step.
"""

from __future__ import annotations

from miles_host.records import DecodingStrategy, LossTerm

ALGORITHMS = ("eagle", "mtp", "nextn")


def miles_activate(args):
    """slime's speculative flags (``--sglang-speculative-algorithm``) switch the plugin on."""
    return bool(args.sglang_speculative_algorithm or args.enable_mtp_training)


def miles_configure(config):
    """``--sglang-speculative-num-steps`` defaults to 3 with a speculative algorithm of this plugin."""
    algorithm = (config.sglang_speculative_algorithm or "").lower()
    if algorithm in ALGORITHMS and config.sglang_speculative_num_steps is None:
        config.sglang_speculative_num_steps = 3


def check_speculative_flags(config, registries):
    """``DecodingStrategy.validate``: chain drafting only, ``num_draft_tokens == num_steps + 1``,
    no batch-invariant mode (the draft/verify passes do not use it)."""
    if config.true_on_policy:
        raise ValueError(
            "--true-on-policy with --sglang-speculative-algorithm is not supported yet: the draft/verify "
            "passes do not use the batch-invariant per-token path; drop one of the two"
        )
    steps = 3 if config.sglang_speculative_num_steps is None else config.sglang_speculative_num_steps
    if steps < 1:
        raise ValueError(f"--sglang-speculative-num-steps must be >= 1, got {steps}")
    if config.sglang_speculative_eagle_topk not in (None, 1):
        raise ValueError(
            f"--sglang-speculative-eagle-topk {config.sglang_speculative_eagle_topk}: only chain drafting "
            "(topk 1) is supported by the embedded engine; use --sglang-speculative-eagle-topk 1"
        )
    tokens = config.sglang_speculative_num_draft_tokens
    if tokens is not None and tokens != steps + 1:
        raise ValueError(
            f"--sglang-speculative-num-draft-tokens {tokens} with --sglang-speculative-num-steps {steps}: "
            f"with topk 1 the verified tokens are num_steps + 1 = {steps + 1}"
        )


def eagle_factory(engine, config):
    """``DecodingStrategy.factory``: the draft (MTP head or a separate model, restricted to the
    FR-Spec token map when one is given) and the strategy."""
    from miles_spec.draft import MTPDraft, ModelDraft, attach_mtp
    from miles_spec.hot_vocab import load_token_map
    from miles_spec.strategy import EagleStrategy

    vocab = engine.model.config.vocab_size
    token_map = load_token_map(config.sglang_speculative_token_map, vocab) if config.sglang_speculative_token_map else None
    if config.sglang_speculative_draft_model_path:
        from miles_host.models import load_pretrained

        reference = next(engine.model.parameters())
        draft_model = load_pretrained(
            config.sglang_speculative_draft_model_path, dtype=reference.dtype, device=reference.device
        )
        draft = ModelDraft(draft_model, vocab, token_map)
    else:
        attach_mtp(engine.model, config.mtp_num_layers or 1)
        draft = MTPDraft(engine.model, token_map)
    return EagleStrategy(
        engine, draft, num_steps=config.sglang_speculative_num_steps or 3,
        cpu_backup=bool(config.sglang_enable_draft_weights_cpu_backup),
    )


def miles_register_decoding_strategies():
    """EAGLE/MTP chain drafting verified in one policy forward."""
    description = "draft k tokens (MTP head or draft model), verify in one policy forward, speculative sampling"
    return [DecodingStrategy(name, description, factory=eagle_factory, validate=check_speculative_flags)
            for name in ALGORITHMS]


def _mtp_loss(model_outputs, loss_batch, config):
    from miles_spec.training import mtp_loss

    return mtp_loss(model_outputs, loss_batch, config)


def miles_register_loss_terms():
    """The draft's next-next-token loss (``--enable-mtp-training``)."""
    return [LossTerm("mtp", "draft head cross-entropy on rollout tokens", fn=_mtp_loss,
                     enabled=lambda config: bool(config.enable_mtp_training))]


def miles_prepare_model(model, role, config):
    """Attach the MTP draft to the trainer's policy before its optimizer is built
    (``--enable-mtp-training``), and keep the policy's hidden states for the loss."""
    if role == "train" and config.enable_mtp_training:
        from miles_spec.training import prepare_train_model

        prepare_train_model(model, config)


def miles_step_end(rollout_id, metrics, config):
    """``spec/accept_rate`` (accepted / drafted), ``spec/accept_len_mean`` (tokens per verify)."""
    from miles_spec.strategy import LIVE

    verify = drafted = accepted = 0
    for strategy in list(LIVE):
        counters = strategy.pop_counters()
        verify += counters.verify_steps
        drafted += counters.draft_tokens
        accepted += counters.accepted_tokens
    if verify:
        metrics["spec/accept_rate"] = accepted / drafted
        metrics["spec/accept_len_mean"] = 1.0 + accepted / verify
        metrics["spec/accept_length"] = metrics["spec/accept_len_mean"]
        metrics["spec/draft_tokens_per_step"] = drafted / verify
        metrics["spec/verify_steps"] = float(verify)
