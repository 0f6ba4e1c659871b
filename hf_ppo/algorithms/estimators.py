"""Step 8 of a rollout: the advantage estimators, one function each behind one interface.

An estimator maps a rollout's shaped scores (B,), per-token KL (B, R), response mask (B, R) and the critic's
values (B, R) (None for a critic-free estimator) to the per-token `rewards`, `non_score_rewards`, `advantages` and
`returns` (B, R), 0 at masked positions. The B rows are grouped by prompt: with `k = num_generations` responses per
prompt, rows `i*k .. i*k+k-1` answer prompt `i` (`trainer.data.RolloutRepeatSampler` lays them out so). rloo and
grpo also take `index` (B,), each row's group id (verl's uid): the rollout passes it, so a row that left the update
(a NaN/inf score) leaves only itself, and its group's other rows keep training as a smaller group (a group of one
passes its score through).

Where the KL penalty enters, as each method's paper / reference implementation does it:

- gae (PPO, Ziegler et al. 2019; Huang et al. 2024): -kl_coef * KL_t in every token's reward, GAE with the critic.
- rloo (Ahmadian et al. 2024; TRL's RLOO): in the reward, at the sequence level: R_i = score_i - kl_coef *
  sum_t KL_t, then the leave-one-out baseline; every token of a response gets its R_i - baseline.
- any of them with `use_kl_loss` (`estimate`): the KL leaves the reward and becomes grpo's loss term.
- grpo (Shao et al. 2024): a loss term, kl_coef * KL_k3(policy || reference) per token, added to the PPO loss in
  the update (`kl_in_loss`); the advantages use the scores alone. `non_score_rewards` still holds -kl_coef * KL_t,
  so `objective/non_score_reward` and `objective/rlhf_reward` report the penalised objective (the KL measured with
  `kl_estimator`, the loss term's being k3).
- reinforce_pp (Hu 2025): in every token's reward (like gae), returns summed to the end, whitened over the batch.
- auto (EVPO, Pan et al. 2026): as gae's, in every token's reward; the group baseline, when it is chosen, compares
  the KL-penalised sequence returns R_i = sum_t r_t (rloo's R_i, with gae's per-token rewards).

`rewards` is what the advantages were computed from (per token, the score at the last real token); `returns` is
the critic's target for gae, and for the critic-free estimators the return each response's advantage starts from
(R_i on every real token for rloo and grpo, the reward-to-go G_t for reinforce_pp): logged, never trained on.
Adding an estimator is one function with this signature and one `ESTIMATORS` entry.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .advantages import grpo_advantages_by_index, rloo_advantages_by_index
from .ppo_math import (
    compute_gae,
    compute_rewards,
    explained_variance,
    group_centred,
    grpo_advantages,
    length_adaptive_lam,
    masked_sum,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
)


class EstimatorSettings(NamedTuple):
    """Step 8's settings: the PPOConfig fields the estimators read (`PPOConfig.estimator_settings` builds it), with
    `kl_coef` the KL controller's current coefficient (the trainer replaces it each iteration: `_replace`)."""

    kl_coef: float
    num_generations: int = 1
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    scale_rewards: bool | str = True  # grpo: True / "group", "batch" or False / "none" (TRL's values)
    lam_critic: float | None = None  # None: lam
    lam_length_alpha: float | None = None  # None: lam for the actor; else VAPO's per-row length-adaptive lambda
    advantage_estimator: str = "gae"  # the ESTIMATORS entry that runs
    kl_estimator: str = "k1"  # how the per-token KL of the penalty is estimated (`ppo_math.kl_estimate`)
    use_kl_loss: bool = False  # the KL leaves the reward for a loss term in the update (`estimate`)
    auto_ev_threshold: float = 0.0  # auto: GAE where the batch's explained variance is above it, else the group's


def gae(scores, kl, mask, values, s: EstimatorSettings, step_rewards=None) -> dict[str, torch.Tensor]:
    """PPO's estimator: KL-penalised per-token rewards (plus an environment's per-position `step_rewards` (B, R)),
    optional reward whitening (no mean shift), GAE with the critic's values, advantage whitening over the batch's
    real tokens (returns keep the raw advantages).

    Decoupled GAE (VAPO, Yue et al. 2025): the critic's returns are GAE(`lam_critic`) advantages + values, the actor's
    advantages GAE(`lam`); with `lam_critic` None (or equal to `lam`) one GAE serves both. VAPO's length-adaptive
    lambda (`lam_length_alpha` = alpha): the actor's advantages use, in place of `lam`, each row's own lambda
    1 - 1 / (alpha * its number of real response tokens) (`ppo_math.length_adaptive_lam`); the critic's returns stay
    GAE(`lam_critic`, or `lam` when that is None)."""
    if values is None:
        raise ValueError("advantage_estimator='gae' needs a critic's values: this model has no critic.")
    rewards, non_score_rewards = compute_rewards(scores, kl, mask, s.kl_coef)
    if step_rewards is not None:
        rewards = rewards + torch.where(mask, step_rewards, torch.zeros_like(step_rewards))
    if s.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = compute_gae(rewards, values, mask, s.gamma, s.lam)
    if s.lam_critic is not None and s.lam_critic != s.lam:
        returns = compute_gae(rewards, values, mask, s.gamma, s.lam_critic)[1]
    if s.lam_length_alpha is not None:  # only the actor's lambda adapts to the length; the returns stay as above
        advantages = compute_gae(rewards, values, mask, s.gamma, length_adaptive_lam(mask, s.lam_length_alpha))[0]
    whitened = masked_whiten(advantages, mask) if s.whiten_advantages else advantages
    return {"rewards": rewards, "non_score_rewards": non_score_rewards, "advantages": whitened, "returns": returns}


def rloo(scores, kl, mask, values, s: EstimatorSettings, index=None) -> dict[str, torch.Tensor]:
    """RLOO: R_i = score_i - kl_coef * sum_t KL_t; A_i = R_i - mean of the other k-1 responses' R; A_i on every real
    token, whitened over the batch's real tokens when `whiten_advantages` (TRL's `normalize_advantages`).
    `index` (B,): each row's group id (`advantages.rloo_advantages_by_index`: groups of any size, a group of one
    passes its R through); None: k consecutive rows."""
    rewards, non_score_rewards = compute_rewards(scores, kl, mask, s.kl_coef)
    sequence_returns = masked_sum(rewards, mask, dim=1)
    baselined = rloo_advantages(sequence_returns, s.num_generations) if index is None \
        else rloo_advantages_by_index(sequence_returns, index)
    advantages = sequence_to_token_advantages(baselined, mask)
    advantages = masked_whiten(advantages, mask) if s.whiten_advantages else advantages
    return {"rewards": rewards, "non_score_rewards": non_score_rewards, "advantages": advantages,
            "returns": sequence_to_token_advantages(sequence_returns, mask)}


def grpo(scores, kl, mask, values, s: EstimatorSettings, index=None) -> dict[str, torch.Tensor]:
    """GRPO: A_i = (score_i - group mean) / (group std + eps), or without the division when `scale_rewards=False`
    (Dr. GRPO), on every real token. The KL penalty is a loss term (`kl_in_loss`), not part of the reward; the group
    normalisation is the whole normalisation (`whiten_advantages` does not apply). `index` (B,): each row's group id
    (`advantages.grpo_advantages_by_index`: groups of any size, a group of one passes its score through); None: k
    consecutive rows."""
    rewards, _ = compute_rewards(scores, torch.zeros_like(kl), mask, 0.0)
    non_score_rewards = torch.where(mask, -s.kl_coef * kl, torch.zeros_like(kl))
    advantages = grpo_advantages(scores, s.num_generations, scale_rewards=s.scale_rewards) if index is None \
        else grpo_advantages_by_index(scores, index, scale_rewards=s.scale_rewards)
    return {"rewards": rewards, "non_score_rewards": non_score_rewards,
            "advantages": sequence_to_token_advantages(advantages, mask),
            "returns": sequence_to_token_advantages(scores, mask)}


def reinforce_pp(scores, kl, mask, values, s: EstimatorSettings) -> dict[str, torch.Tensor]:
    """REINFORCE++ (`ppo_math.reinforce_pp_advantages`, discounted by `gamma`); with k >= 2 responses per prompt
    REINFORCE++-baseline (the group mean off each score first). Its batch whitening is part of the method (`whiten_advantages` does not apply)."""
    k = s.num_generations if s.num_generations > 1 else None
    advantages, returns = reinforce_pp_advantages(scores, kl, mask, s.kl_coef, k=k, gamma=s.gamma)
    centred = scores if k is None else group_centred(scores, k)
    rewards, non_score_rewards = compute_rewards(centred, kl, mask, s.kl_coef)
    return {"rewards": rewards, "non_score_rewards": non_score_rewards, "advantages": advantages, "returns": returns}


def critic_explains(values, returns, mask, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """EVPO's gate (Pan et al. 2026, arXiv 2604.19485): whether the critic's values (B, R) lower the variance of the
    advantages below a baseline that ignores the state. EV = 1 - Var(R - V) / Var(R) over the real tokens of `mask`
    (B, R) (`ppo_math.explained_variance`), R the Monte-Carlo returns (B, R); the paper proves the critic reduces the
    variance exactly when EV > 0 (at EV <= 0 it adds more noise than the state signal it captures). Returns (uses
    the critic: a bool tensor (), EV: a float tensor ()), strictly above `threshold` (the paper's 0 by default); a
    batch without a real token, or a NaN value, has a NaN EV and falls to the group baseline.
    Example: R = [1, 0, 1, 0] at the last tokens, V = [0.9, 0.1, 0.8, 0.2]: Var(R - V) = 0.025, Var(R) = 0.25,
    EV = 0.9 -> True; V = [0.5, 0.5, 0.5, 0.5]: EV = 0 -> False (no better than the mean)."""
    ev = explained_variance(values, returns, mask)
    ev = torch.where(mask.any(), ev, torch.full_like(ev, float("nan")))  # no real token: no evidence either way
    return ev > threshold, ev


def auto(scores, kl, mask, values, s: EstimatorSettings, step_rewards=None) -> dict[str, torch.Tensor]:
    """EVPO (Pan et al. 2026): each batch, the advantages of gae where the critic explains the batch's returns
    (`critic_explains`: explained variance of the values against the Monte-Carlo returns (GAE with lambda 1)
    above `s.auto_ev_threshold`), else the group baseline of grpo over the `num_generations` responses to each
    prompt (`ppo_math.grpo_advantages` of the KL-penalised sequence returns R_i = sum_t r_t, `scale_rewards` as
    grpo's, the same on every real token). The paper's other arm is a batch mean; a group mean is the sharper
    baseline with k >= 2 responses per prompt (GRPO's). Either way the critic trains on gae's `returns`, so it keeps
    learning while the group baseline stands in for it. The choice is one tensor op (no host sync); `stats` reports it:
    `objective/auto_uses_gae` (1 gae, 0 the group's) and `objective/auto_explained_variance`."""
    if values is None:
        raise ValueError("advantage_estimator='auto' needs a critic's values: this model has no critic.")
    out = gae(scores, kl, mask, values, s, step_rewards=step_rewards)
    monte_carlo = compute_gae(out["rewards"], values, mask, s.gamma, 1.0)[1]  # lambda 1: the reward-to-go
    uses_gae, ev = critic_explains(values, monte_carlo, mask, s.auto_ev_threshold)
    group = grpo_advantages(masked_sum(out["rewards"], mask, dim=1), s.num_generations, scale_rewards=s.scale_rewards)
    advantages = torch.where(uses_gae, out["advantages"], sequence_to_token_advantages(group, mask))
    return {**out, "advantages": advantages,
            "stats": {"objective/auto_uses_gae": uses_gae.float(), "objective/auto_explained_variance": ev}}


class Estimator(NamedTuple):
    """An advantage estimator: `compute(scores, kl, mask, values, settings)` -> {rewards, non_score_rewards,
    advantages, returns} (and, for `auto`, `stats`: its own metrics, scalar tensors); whether it needs a critic's
    values; whether its KL penalty is a loss term; whether it compares the responses to one prompt though it has a
    critic (a NaN score then takes its whole group out of the update: `rollout.steps.unscored_rows`); whether it
    takes `index=` (B,), each row's group id, for groups of any size (`by_index`: the rollout then groups by prompt
    index, so a row that leaves the update leaves its group alone, not the whole group)."""

    compute: Callable[..., dict[str, torch.Tensor]]
    needs_critic: bool
    kl_in_loss: bool
    compares_groups: bool = False  # with a critic: auto's group baseline; without one, every estimator with k > 1
    by_index: bool = False


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(gae, needs_critic=True, kl_in_loss=False),
    "rloo": Estimator(rloo, needs_critic=False, kl_in_loss=False, by_index=True),
    "grpo": Estimator(grpo, needs_critic=False, kl_in_loss=True, by_index=True),
    "reinforce_pp": Estimator(reinforce_pp, needs_critic=False, kl_in_loss=False),
    "auto": Estimator(auto, needs_critic=True, kl_in_loss=False, compares_groups=True),
}


def kl_loss_coef(s: EstimatorSettings) -> float:
    """The coefficient of the KL loss term in the update: `s.kl_coef` for an estimator whose KL is a loss term (or any
    estimator with `use_kl_loss`), else 0."""
    return s.kl_coef if s.use_kl_loss or ESTIMATORS[s.advantage_estimator].kl_in_loss else 0.0


def estimate(scores, kl, mask, values, s: EstimatorSettings, **extra) -> dict[str, torch.Tensor]:
    """Run `s.advantage_estimator`. With `s.use_kl_loss` the KL leaves the reward for a loss term in the update (verl's
    and OpenRLHF's `use_kl_loss`): the estimator sees no KL, and `non_score_rewards` still reports -kl_coef * KL_t,
    as grpo's do. `extra`: the estimator's own keyword arguments (gae's `step_rewards`, rloo's and grpo's `index`)."""
    estimator = ESTIMATORS[s.advantage_estimator]
    if not s.use_kl_loss or estimator.kl_in_loss:
        return estimator.compute(scores, kl, mask, values, s, **extra)
    out = estimator.compute(scores, torch.zeros_like(kl), mask, values, s, **extra)
    return {**out, "non_score_rewards": torch.where(mask, -s.kl_coef * kl, torch.zeros_like(kl))}
