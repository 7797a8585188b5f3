"""On-policy distillation (OPD, upstream miles' ``--use-opd``): the student rolls out, a
teacher scores the student's sampled tokens, and the per-token reverse KL
(student log-prob - teacher log-prob) times ``--opd-kl-coef`` is subtracted from the
advantages, with the RL reward or alone.

- :mod:`miles_host.opd.teachers`: ``--opd-type`` records and the scoring of each step's
  samples (``Sample.teacher_log_probs``) after generation, before training;
- :mod:`miles_host.opd.embedded`: the in-process teacher (``embedded``; upstream's ``megatron``);
- :mod:`miles_host.opd.served`: a ``miles serve`` / SGLang teacher (``sglang``);
- :mod:`miles_host.opd.penalty`: the advantage penalty and the ``opd/*`` metrics;
- :mod:`miles_host.opd.checks`: the flags' validation.

The flags are :class:`miles_host.config_opd.OpdArgs`.
"""
