"""Advantage estimators (``--advantage-estimator``).

Each estimator is ``fn(inputs: AdvantageInputs, config) -> list[Tensor]``: one
per-token advantage tensor ``[L_i]`` per sample, before any global whitening.
:data:`ADVANTAGE_ESTIMATORS` holds their records (whitening, critic, policy loss);
:func:`compute_advantages` runs one, whitens when its record or the config asks, and
also returns the value targets (``returns``).

Semantics follow slime (``slime/ray/rollout.py::_post_process_rewards`` for the
group normalisation, ``slime/utils/ppo_utils.py`` for the token-level returns):

- ``grpo`` / ``gspo`` / ``cispo``: ``(r - mean_group) / (std_group + 1e-6)`` with the
  unbiased group std, broadcast over the response; ``--disable-grpo-std-normalization``
  (Dr.GRPO) drops the division. GSPO and CISPO differ from GRPO only in the loss.
- ``reinforce_plus_plus``: token rewards ``-kl_coef * kl_t`` on loss-masked tokens
  plus the sample reward on the last loss-masked token, discounted returns with
  ``gamma``, then whitened over all loss-masked tokens of the batch.
- ``reinforce_plus_plus_baseline``: ``(r - mean_group) - kl_coef * kl_t``, whitened.
- ``rloo``: ``r_i - mean_{j != i} r_j`` (not in slime; REINFORCE leave-one-out).
- ``ppo``: GAE(``gamma``, ``lambd``) over the critic ``values`` of the loss-masked
  tokens (masked-out tokens are skipped, as verl does), token rewards as for
  ``reinforce_plus_plus``; ``returns = advantages + values``.

Config fields read (slime spellings): ``gamma``, ``lambd``, ``kl_coef``,
``disable_grpo_std_normalization``, ``disable_rewards_normalization`` (group
estimators use the raw reward: no group mean subtracted, no std division) and
``normalize_advantages``.

A group of one sample has no baseline: ``grpo``, ``rloo`` and ``reinforce_plus_plus_baseline``
give it advantage 0 (slime turns std normalisation off for ``n_samples_per_prompt=1``).
The KL of loss-masked-out tokens (tool outputs, which the policy did not sample) is
ignored in reward shaping, and the final reward lands on the last loss-masked token,
as slime's REINFORCE++ does, and PPO's bootstrapping ends there (slime's PPO path uses
the final token, the same token in single-turn RL).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from miles_host.algorithms.losses import cispo_policy_loss, gspo_policy_loss
from miles_host.algorithms.masked_ops import masked_whiten
from miles_host.records import AdvantageEstimator

GRPO_STD_EPS = 1e-6
DISCOUNT_CHUNK = 128


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator sees for one batch of ``S`` samples.

    ``rewards`` ``[S]`` float; ``group_index`` ``[S]`` long (samples of one prompt share
    it; any values, any order); ``response_lengths`` ``L_i``; per-sample ``[L_i]``
    tensors: ``loss_masks`` (None: all ones), ``token_kl`` (policy-vs-reference KL
    per token, needed when ``kl_coef != 0``), ``values`` (critic values, for ``ppo``).
    """

    rewards: torch.Tensor
    group_index: torch.Tensor
    response_lengths: Sequence[int]
    values: Sequence[torch.Tensor] | None = None
    token_kl: Sequence[torch.Tensor] | None = None
    loss_masks: Sequence[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        num_samples = len(self.response_lengths)
        if self.rewards.shape != (num_samples,) or self.group_index.shape != (num_samples,):
            raise ValueError(
                f"rewards {tuple(self.rewards.shape)} and group_index {tuple(self.group_index.shape)} "
                f"must both be [{num_samples}], one entry per response length"
            )
        for field_name in ("values", "token_kl", "loss_masks"):
            _check_per_token(field_name, getattr(self, field_name), self.response_lengths)

    def masks(self) -> list[torch.Tensor]:
        """The loss masks in the rewards' dtype (all ones when none were given)."""
        if self.loss_masks is None:
            return [self.rewards.new_ones(length) for length in self.response_lengths]
        return [mask.to(self.rewards.dtype) for mask in self.loss_masks]

    def kl(self, kl_coef: float) -> list[torch.Tensor]:
        """The per-token KL in the rewards' dtype (zeros when ``kl_coef`` is 0 and none given)."""
        if self.token_kl is None:
            if kl_coef != 0:
                raise ValueError("kl_coef != 0 needs token_kl (per-token KL to the reference model)")
            return [self.rewards.new_zeros(length) for length in self.response_lengths]
        return [kl.detach().to(self.rewards.dtype) for kl in self.token_kl]


def _check_per_token(name: str, tensors, response_lengths: Sequence[int]) -> None:
    if tensors is None:
        return
    shapes = [tuple(t.shape) for t in tensors]
    expected = [(length,) for length in response_lengths]
    if shapes != expected:
        raise ValueError(f"{name} shapes {shapes} must match response_lengths {list(response_lengths)}")


@dataclass(frozen=True)
class AdvantageOutputs:
    """Per-sample ``[L_i]`` advantages (whitened if asked) and value targets ``returns``."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------


def _broadcast(per_sample_S: torch.Tensor, response_lengths: Sequence[int]) -> list[torch.Tensor]:
    return [value * per_sample_S.new_ones(length) for value, length in zip(per_sample_S, response_lengths)]


def group_statistics(rewards_S: torch.Tensor, group_index_S: torch.Tensor):
    """Per sample: its group's mean, unbiased std (0 for a singleton) and size, each ``[S]``
    in float64 (in float32 the squared deviation of a reward of 1e20 or more overflows, the
    std becomes inf and every advantage of the group 0)."""
    rewards_S = rewards_S.double()
    _, inverse_S = torch.unique(group_index_S, return_inverse=True)
    num_groups = int(inverse_S.max().item()) + 1 if len(inverse_S) else 0
    counts_G = torch.bincount(inverse_S, minlength=num_groups).to(rewards_S.dtype)
    mean_G = rewards_S.new_zeros(num_groups).index_add(0, inverse_S, rewards_S) / counts_G
    squared_error_S = (rewards_S - mean_G[inverse_S]) ** 2
    variance_G = rewards_S.new_zeros(num_groups).index_add(0, inverse_S, squared_error_S)
    variance_G = variance_G / (counts_G - 1).clamp_min(1)
    return mean_G[inverse_S], variance_G.sqrt()[inverse_S], counts_G[inverse_S]


def discounted_cumsum(values_BT: torch.Tensor, discount: float) -> torch.Tensor:
    """``out[:, t] = sum_{k >= t} discount**(k - t) * values[:, k]`` for a ``[B, T]`` tensor.

    A chunked scan (as slime's ``chunked_discounted_returns``): a ``[C, C]`` matrix of
    discount powers inside each chunk of ``C`` tokens, a carry between chunks.
    """
    num_rows, num_steps = values_BT.shape
    offsets = torch.arange(DISCOUNT_CHUNK, device=values_BT.device)
    exponent_CC = offsets[:, None] - offsets[None, :]  # k - t
    power_CC = torch.where(
        exponent_CC >= 0,
        torch.tensor(discount, dtype=values_BT.dtype, device=values_BT.device) ** exponent_CC.clamp_min(0),
        torch.zeros((), dtype=values_BT.dtype, device=values_BT.device),
    )
    out_BT = torch.empty_like(values_BT)
    carry_B = values_BT.new_zeros(num_rows)  # out[:, end] of the chunk to the right
    for end in range(num_steps, 0, -DISCOUNT_CHUNK):
        start = max(0, end - DISCOUNT_CHUNK)
        width = end - start
        local_BC = values_BT[:, start:end] @ power_CC[:width, :width]
        carry_weight_C = torch.tensor(discount, dtype=values_BT.dtype) ** torch.arange(width, 0, -1)
        out_BT[:, start:end] = local_BC + carry_B[:, None] * carry_weight_C.to(values_BT.device)
        carry_B = out_BT[:, start]
    return out_BT


def _pad(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    max_length = max((len(t) for t in tensors), default=0)
    padded = like.new_zeros(len(tensors), max_length)
    for row, tensor in enumerate(tensors):
        padded[row, : len(tensor)] = tensor
    return padded


def _unpad(padded_BT: torch.Tensor, response_lengths: Sequence[int]) -> list[torch.Tensor]:
    return [padded_BT[row, :length] for row, length in enumerate(response_lengths)]


def shaped_token_rewards(inputs: AdvantageInputs, kl_coef: float) -> list[torch.Tensor]:
    """``-kl_coef * kl_t`` on loss-masked tokens, plus the sample reward on the last one."""
    token_rewards = []
    for index, (kl, mask) in enumerate(zip(inputs.kl(kl_coef), inputs.masks())):
        kept = mask.nonzero()
        if len(kept) == 0:
            raise ValueError(f"sample {index} has no loss-masked token to carry its reward")
        rewards = -kl_coef * kl * mask
        rewards[kept[-1, 0]] += inputs.rewards[index]
        token_rewards.append(rewards)
    return token_rewards


def gae(
    token_rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    gamma: float,
    lambd: float,
    masks: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation per sample over its loss-masked tokens.

    On the masked-in tokens ``t_1 < ... < t_K`` of a sample: ``delta_k = r_k + gamma *
    V_{k+1} - V_k`` with ``V_{K+1} = 0``, ``A_k = delta_k + gamma * lambd * A_{k+1}``.
    A masked-out token (tool output, a tail the policy did not sample) has neither a
    value nor a TD error in the recursion, as in verl's ``compute_gae_advantage_return``:
    bootstrapping ends at the last trained token, and its advantage is 0. ``masks`` None:
    every token counts. Returns ``(advantages, returns)`` with ``returns = A + V``,
    lists of ``[L_i]``.
    """
    like = token_rewards[0]
    if masks is None:
        masks = [like.new_ones(len(r)) for r in token_rewards]
    kept = [mask.nonzero()[:, 0] for mask in masks]
    values = [v.detach().to(like.dtype) for v in values]
    rewards_BK = _pad([r[k] for r, k in zip(token_rewards, kept)], like)
    values_BK = _pad([v[k] for v, k in zip(values, kept)], like)
    next_values_BK = torch.nn.functional.pad(values_BK[:, 1:], (0, 1))  # padding is 0
    advantages_BK = discounted_cumsum(rewards_BK + gamma * next_values_BK - values_BK, gamma * lambd)
    advantages = []
    for row, (reward, index) in enumerate(zip(token_rewards, kept)):
        advantage = torch.zeros_like(reward)
        advantage[index] = advantages_BK[row, : len(index)]
        advantages.append(advantage)
    return advantages, [a + v for a, v in zip(advantages, values)]


# ----------------------------------------------------------------------------
# estimators
# ----------------------------------------------------------------------------


def grpo_advantages(inputs: AdvantageInputs, config) -> list[torch.Tensor]:
    """GRPO: group-normalised reward broadcast over the response (also GSPO, CISPO)."""
    rewards = inputs.rewards
    if not config.disable_rewards_normalization:
        mean, std, _ = group_statistics(rewards, inputs.group_index)
        rewards = rewards - mean
        if not config.disable_grpo_std_normalization:
            rewards = rewards / (std + GRPO_STD_EPS)
    return _broadcast(rewards.to(inputs.rewards.dtype), inputs.response_lengths)


def check_group_baseline(config, registries=None) -> None:
    """``validate`` of the estimators whose baseline is the mean reward of the prompt's group
    (GRPO, GSPO, CISPO, REINFORCE++-baseline): a prompt's only sample is its own baseline and
    every advantage is 0, unless ``--disable-rewards-normalization`` trains on the raw reward."""
    if config.n_samples_per_prompt < 2 and not config.disable_rewards_normalization:
        _refuse_one_sample(config, ", or --disable-rewards-normalization to use the raw reward")


def check_leave_one_out(config, registries=None) -> None:
    """``validate`` of RLOO: the baseline is the other samples of the prompt, there must be some."""
    if config.n_samples_per_prompt < 2:
        _refuse_one_sample(config, "")


def _refuse_one_sample(config, alternative: str) -> None:
    """ValueError when the user gave ``--n-samples-per-prompt 1``; a warning when it is the
    default (a run that sets nothing about sampling is told, not refused)."""
    message = (
        f"--advantage-estimator {config.advantage_estimator} compares each sample with the other samples of its "
        f"prompt: --n-samples-per-prompt 1 makes every advantage 0 and nothing is learned; give "
        f"--n-samples-per-prompt 2 or more{alternative}"
    )
    if config.disable_compute_advantages_and_returns or config.loss_type == "sft_loss":
        return  # the loss reads no advantages
    recorded = config.user_set  # the fields the user gave (None: a config built in Python)
    default = type(config).__dataclass_fields__["n_samples_per_prompt"].default
    if "n_samples_per_prompt" in (recorded or ()) or (recorded is None and config.n_samples_per_prompt != default):
        raise ValueError(message)
    print(f"miles: warning: {message} (1 is the default)", file=sys.stderr)


def rloo_advantages(inputs: AdvantageInputs, config) -> list[torch.Tensor]:
    """RLOO: ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean)``; 0 for a singleton group."""
    mean, _, count = group_statistics(inputs.rewards, inputs.group_index)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    return _broadcast((scale * (inputs.rewards - mean)).to(inputs.rewards.dtype), inputs.response_lengths)


def reinforce_plus_plus_returns(inputs: AdvantageInputs, config) -> list[torch.Tensor]:
    """REINFORCE++: discounted returns of the KL-shaped token rewards (unwhitened)."""
    token_rewards = shaped_token_rewards(inputs, config.kl_coef)
    returns_BT = discounted_cumsum(_pad(token_rewards, inputs.rewards), config.gamma)
    return _unpad(returns_BT, inputs.response_lengths)


def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs, config) -> list[torch.Tensor]:
    """REINFORCE++-baseline: ``(r - mean_group) - kl_coef * kl_t`` (unwhitened)."""
    rewards = inputs.rewards
    if not config.disable_rewards_normalization:
        rewards = (rewards - group_statistics(rewards, inputs.group_index)[0]).to(inputs.rewards.dtype)
    kl_coef = config.kl_coef
    per_token = _broadcast(rewards, inputs.response_lengths)
    return [advantage - kl_coef * kl for advantage, kl in zip(per_token, inputs.kl(kl_coef))]


def ppo_advantages(inputs: AdvantageInputs, config) -> list[torch.Tensor]:
    """PPO: GAE over the critic values with the KL-shaped token rewards."""
    if inputs.values is None:
        raise ValueError("advantage estimator 'ppo' needs critic values (AdvantageInputs.values)")
    token_rewards = shaped_token_rewards(inputs, config.kl_coef)
    advantages, _ = gae(token_rewards, inputs.values, config.gamma, config.lambd, inputs.masks())
    return advantages


AdvantageEstimatorFn = Callable[[AdvantageInputs, object], list[torch.Tensor]]

#: ``--advantage-estimator`` -> the host's estimator records (``miles_host.builtin.advantages``
#: registers them): what each computes, whether the host whitens it, whether it needs a
#: critic, and which policy loss it pairs with. The records are the one place that says so.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    record.name: record
    for record in (
        AdvantageEstimator(
            "grpo", "group-normalised rewards (Dr.GRPO with --disable-grpo-std-normalization)", fn=grpo_advantages,
            validate=check_group_baseline,
        ),
        AdvantageEstimator(
            "gspo", "GRPO advantages with GSPO's sequence-level ratio in the loss",
            fn=grpo_advantages, policy_loss=gspo_policy_loss, validate=check_group_baseline,
        ),
        AdvantageEstimator(
            "cispo", "GRPO advantages with CISPO's clipped-IS-weight policy loss",
            fn=grpo_advantages, policy_loss=cispo_policy_loss, validate=check_group_baseline,
        ),
        # slime requires --normalize-advantages for the REINFORCE++ family: always whitened here
        AdvantageEstimator(
            "reinforce_plus_plus", "discounted returns with KL shaping, globally whitened",
            fn=reinforce_plus_plus_returns, whiten=True,
        ),
        AdvantageEstimator(
            "reinforce_plus_plus_baseline", "group-mean baseline, globally whitened",
            fn=reinforce_plus_plus_baseline_advantages, whiten=True, validate=check_group_baseline,
        ),
        AdvantageEstimator("rloo", "leave-one-out baseline", fn=rloo_advantages, validate=check_leave_one_out),
        AdvantageEstimator("ppo", "GAE over a learned critic (--gamma, --lambd)", fn=ppo_advantages, needs_critic=True),
    )
}


def normalize_advantages(advantages: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Whiten all tokens of the batch together with masked statistics (``--normalize-advantages``)."""
    lengths = [len(a) for a in advantages]
    flat = masked_whiten(torch.cat(list(advantages)), torch.cat(list(loss_masks)).to(advantages[0].dtype))
    return list(flat.split(lengths))


def _value_targets(estimator: AdvantageEstimator, advantages, inputs: AdvantageInputs) -> list[torch.Tensor]:
    if not estimator.needs_critic:
        return list(advantages)
    return [a + v.detach().to(a.dtype) for a, v in zip(advantages, inputs.values)]


def compute_advantages(estimator: AdvantageEstimator | str, inputs: AdvantageInputs, config,
                       token_penalties: Sequence[torch.Tensor] | None = None) -> AdvantageOutputs:
    """Run ``estimator`` (a record, or the name of one of :data:`ADVANTAGE_ESTIMATORS`) and
    whiten when its record (``whiten``) or ``config.normalize_advantages`` asks.

    ``returns`` are the unwhitened advantages (slime's convention), plus the critic
    values for an estimator whose record ``needs_critic``. ``token_penalties`` (per
    sample ``[L_i]``, e.g. the OPD reverse KL of :mod:`miles_host.opd.penalty`) are
    subtracted from the advantages after the estimator and before whitening, as upstream
    miles applies its OPD penalty; the returns keep the estimator's values.
    """
    if isinstance(estimator, str):
        if estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"unknown advantage estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}"
            )
        estimator = ADVANTAGE_ESTIMATORS[estimator]
    raw = estimator.fn(inputs, config)
    returns = _value_targets(estimator, raw, inputs)
    if token_penalties is not None:
        _check_per_token("token_penalties", token_penalties, inputs.response_lengths)
        raw = [a - p.detach().to(a.dtype) for a, p in zip(raw, token_penalties)]
    if estimator.whiten or config.normalize_advantages:
        return AdvantageOutputs(normalize_advantages(raw, inputs.masks()), returns)
    return AdvantageOutputs(list(raw), returns)
