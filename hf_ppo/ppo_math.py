"""The PPO-for-language-models math as small pure functions: tensors and floats in, tensors out.

Conventions: `mask` is a bool tensor, True = a real response token; shapes are `(batch, response_len)` unless said.
The masked statistics also take a 0/1 float or integer mask (TRL's convention) and give the same result.
Values at masked positions never change a result. References: Schulman et al. 2017 (PPO), Schulman et al. 2016
(GAE), Ziegler et al. 2019 (KL penalty, adaptive controller), Huang et al. 2024 (the N+ implementation details).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ---- Masked statistics ------------------------------------------------------------------------------------------
def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """`mask` as bool: a bool mask as it is; a 0/1 float or integer mask (TRL's convention) converted.

    Any other value is an error rather than a weight: these are selections, and treating 0.5 as "selected" (or as
    half a token) would silently change every statistic. Only non-bool masks pay for the check.
    """
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("A mask must hold only 0 and 1 (or True/False); to weight entries, multiply the values "
                         "by the weights and pass a 0/1 mask.")
    return mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask); masked entries (even NaN/inf) contribute exactly 0. `mask`: bool or 0/1."""
    mask = as_bool_mask(mask)
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    masked = torch.where(mask, values, zeros)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the True entries of `mask` (over `dim`, or all entries). 0 where nothing is selected."""
    mask = as_bool_mask(mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the True entries of `mask`, with Bessel's correction when `unbiased` (n / (n - 1))."""
    mask = as_bool_mask(mask)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries; with `shift_mean=False` the mean is added back (scale only).

    Masked positions are returned as 0. Used for advantages (shift) and, optionally, rewards (no shift: N+ paper).
    """
    mask = as_bool_mask(mask)
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


# ---- Log-probabilities, entropy, KL ----------------------------------------------------------------------------
def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token] for each position.

    logits: (batch, len, vocab), tokens: (batch, len) -> (batch, len), float32. Dividing by the sampling temperature
    makes these the log-probs of the distribution that was actually sampled from (N+ paper), for policy and
    reference alike. Computed as gather - logsumexp, so no (batch, len, vocab) log-softmax tensor is kept.
    """
    logits = logits.float() / temperature
    chosen = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) at each position: (batch, len, vocab) -> (batch, len)."""
    logits = logits.float() / temperature
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens sampled from the policy.

    k1 = logp - logp_ref (unbiased, can be negative); k2 = (logp - logp_ref)^2 / 2 (biased, low variance);
    k3 = (r - 1) - log r with r = p_ref / p (unbiased and non-negative; Schulman 2020, "Approximating KL").
    Shapes: (batch, len) -> (batch, len).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"Unknown KL estimator {estimator!r}: choose 'k1', 'k2' or 'k3'.")


# ---- Rewards and advantages -----------------------------------------------------------------------------------
def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True entry in each row of `mask` (batch, len) -> (batch,); 0 for an all-False row."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=1)


def compute_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * KL at every real token, plus the scalar score at the last real token.

    scores: (batch,), kl and mask: (batch, len). Returns (rewards, non_score_rewards), both (batch, len) and 0 at
    masked positions. The score lands on the last *real* token (the stop token when there is one), never on a pad
    slot after it (the bug of the removed TRL trainer, issues 1893 / 3750).
    """
    non_score = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))
    rewards = non_score.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    has_token = mask.any(dim=1)
    rewards[rows, last_token_index(mask)] += torch.where(has_token, scores.to(rewards.dtype), torch.zeros_like(scores, dtype=rewards.dtype))
    return rewards, non_score


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};  returns R_t = A_t + V_t.
    The episode ends at the last real token (V after it is 0). rewards, values, mask: (batch, len) ->
    (advantages, returns), (batch, len), 0 at masked positions. Example: rewards [0, 0, 1], values 0.5, gamma 1,
    lam 0.95 -> advantages [0.45125, 0.475, 0.5].
    """
    zeros = torch.zeros_like(values)
    rewards = torch.where(mask, rewards, zeros)
    values = torch.where(mask, values, zeros)
    last_adv = torch.zeros_like(values[:, 0])
    advantages = []
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else zeros[:, 0]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_adv = delta + gamma * lam * last_adv
        last_adv = torch.where(mask[:, t], last_adv, zeros[:, 0])
        advantages.append(last_adv)
    advantages = torch.stack(advantages[::-1], dim=1)
    returns = torch.where(mask, advantages + values, zeros)
    return advantages, returns


# ---- Losses ---------------------------------------------------------------------------------------------------
def _reduce(per_token: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None) -> torch.Tensor:
    """Masked sum divided by `normalizer` (default: the number of real tokens, i.e. a masked mean)."""
    if normalizer is None:
        return masked_mean(per_token, mask)
    return masked_sum(per_token, mask) / normalizer


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate objective (Schulman et al. 2017), as a loss to minimise.

    ratio = exp(logp - logp_old);  loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)).
    All inputs (batch, len). `normalizer` replaces the token count of the mean (pass the token count of the whole
    minibatch so gradient accumulation over micro-batches gives the same gradient). Returns (loss, clip fraction,
    approx KL = mean((logp - logp_old)^2) / 2); the last two are detached metrics.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = _reduce(torch.maximum(unclipped, clipped), mask, normalizer)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
        approxkl = 0.5 * masked_mean(log_ratio**2, mask)
    return loss, clipfrac, approxkl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2) / 2.

    All inputs (batch, len). Returns (loss, clip fraction = share of tokens where the clipped term was larger).
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * _reduce(torch.maximum(unclipped_loss, clipped_loss), mask, normalizer)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_loss > unclipped_loss).float(), mask)
    return loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over real tokens: 1 is a perfect critic, 0 no better than a constant."""
    var_returns = masked_var(returns, mask, unbiased=False)
    return 1 - masked_var(returns - values, mask, unbiased=False) / var_returns.clamp(min=1e-8)


# ---- KL coefficient controllers (Ziegler et al. 2019) ------------------------------------------------------------
class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Proportional controller: beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon).

    `n_steps` is the number of episodes (responses) since the last update (Ziegler et al. 2019, section 2.2;
    their defaults: init 0.2, target 6, horizon 10000).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        super().__init__(init_kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


class RunningMoments:
    """Running mean and std of scalar scores across batches (for PPO-max reward normalisation; Zheng et al. 2023).

    Uses the parallel-variance update of Chan et al., so the result equals the statistics of all scores seen.
    """

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.detach().double().flatten()
        n = xs.numel()
        if n == 0:
            return
        batch_mean, batch_var = xs.mean().item(), xs.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def normalize(self, xs: torch.Tensor, clip: float | None = None) -> torch.Tensor:
        """(xs - mean) / std, then clipped to [-clip, clip] when `clip` is given."""
        out = (xs - self.mean) / max(self.std, 1e-8)
        return out.clamp(-clip, clip) if clip is not None else out

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
