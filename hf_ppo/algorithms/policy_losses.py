"""The policy-loss family beside PPO's clipped surrogate (`ppo_math.policy_loss`): the importance ratio, the
per-token losses of CISPO, SAPO, GMPO, GPG, Clip-Cov and KL-Cov, and the rollout corrections for a sampler whose
numerics differ from the training model's. Tensors and floats in, tensors out; mask True = a real response token.
"""

from __future__ import annotations

import math

import torch

from .masked import as_bool_mask, masked_mean

def importance_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """The policy ratio on each token from log_ratio = logp - logp_old (batch, len) -> (batch, len).

    "token": PPO's exp(log_ratio_t); "sequence": GSPO's (Zheng et al. 2025) one ratio per response,
    exp(mean over its real tokens of log_ratio), on each of its tokens."""
    if level == "sequence":
        return torch.exp(masked_mean(log_ratio, mask, dim=1)).unsqueeze(1).expand_as(log_ratio)
    if level == "token":
        return torch.exp(log_ratio)
    raise ValueError(f"Unknown importance_sampling_level {level!r}: choose 'token' or 'sequence'.")


# ---- Policy losses beside PPO's clipped surrogate (`policy_loss`): each gives per-token losses (batch, len) and a
# (batch, len) bool of the tokens its clipping or selection touched; `aggregate_loss` reduces them as PPO's are.
POLICY_LOSSES = ("ppo", "cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov")


def cispo_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_max: float = 5.0,
                    importance_sampling_level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025; TRL's `loss_type="cispo"`): the importance weight is clipped and
    stop-gradient, and multiplies the REINFORCE term, so every token keeps a gradient (PPO's clip zeroes it):

    l_t = -sg(min(r_t, clip_max)) * A_t * logp_t,  r_t = pi / pi_old.

    `clip_max` is the cap on the weight itself (ScaleRL's and TRL's epsilon_max, recommended 5.0; MiniMax-M1's
    1 + eps_high with no lower bound). Returns (per-token loss, tokens whose weight was capped)."""
    ratio = importance_ratio(logprobs - old_logprobs, mask, importance_sampling_level)
    weight = ratio.clamp(max=clip_max).detach()
    return -weight * advantages * logprobs, (ratio > clip_max).detach()


def sapo_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, temperature_pos: float = 1.0, temperature_neg: float = 1.05,
                   importance_sampling_level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025; TRL's `loss_type="sapo"`): a smooth gate replaces
    the hard clip,

    l_t = -f(r_t) * A_t,  f(r) = 4 / tau * sigmoid(tau * (r - 1)),  tau = tau_pos if A_t > 0 else tau_neg,

    whose gradient is the ratio's at r = 1 and fades as r leaves it (faster for tau_neg > tau_pos: the paper's 1.0
    and 1.05). Nothing is clipped: the second result is all False."""
    ratio = importance_ratio(logprobs - old_logprobs, mask, importance_sampling_level)
    tau = torch.where(advantages > 0, torch.full_like(ratio, temperature_pos), torch.full_like(ratio, temperature_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * advantages, torch.zeros_like(mask, dtype=torch.bool)


def gmpo_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, cliprange_low: float = 0.4,
                   cliprange_high: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """GMPO (Geometric-Mean Policy Optimization, Zhao et al. 2025): the geometric mean of the token ratios of a
    response, each clipped in log space to [-eps_low, eps_high] (the paper's (e^-0.4, e^0.4)) on the side PPO's
    min picks:

    c_t = sgn(A_t) * min(sgn(A_t) * log r_t, sgn(A_t) * clip(log r_t, -eps_low, eps_high));
    l_t = -A_t * exp(mean over the response's real tokens of c_t)

    (the response's loss on each of its tokens: with a sequence-level advantage, `seq_mean_token_mean` gives the
    paper's mean over responses). Returns (per-token loss, tokens whose log-ratio was clipped)."""
    log_ratio = logprobs - old_logprobs
    clipped = log_ratio.clamp(-cliprange_low, cliprange_high)
    sign = torch.where(advantages >= 0, torch.ones_like(log_ratio), -torch.ones_like(log_ratio))
    bounded = sign * torch.minimum(sign * log_ratio, sign * clipped)
    sequence_ratio = torch.exp(masked_mean(bounded, mask, dim=1)).unsqueeze(1)
    return -advantages * sequence_ratio, (bounded != log_ratio).detach()


def gpg_per_token(logprobs: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Group Policy Gradient, Chu et al. 2025): the plain policy gradient, no ratio and no clip,
    l_t = -A_t * logp_t (its value is not PPO's; its gradient is -A_t * grad logp_t). Nothing is clipped."""
    return -advantages * logprobs, torch.zeros_like(logprobs, dtype=torch.bool)


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each real token's centred product (A_t - mean A) * (logp_t - mean logp), the means over the batch's real tokens
    (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning Language Models": the covariance that drives the
    entropy's change). (batch, len) -> (batch, len), detached, 0 at masked positions."""
    mask = as_bool_mask(mask)
    logprobs = logprobs.detach()
    cov = (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))
    return torch.where(mask, cov, torch.zeros_like(cov))


def clip_cov_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, cliprange_low: float = 0.2, cliprange_high: float = 0.2,
                       ratio: float = 2e-4, cov_low: float = 1.0,
                       cov_high: float = 5.0, generator: torch.Generator | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-Cov (Cui et al. 2025): PPO's clipped loss, except that max(1, floor(ratio * N)) tokens (N real tokens)
    drawn at random among those whose covariance (`token_covariance`) lies in (cov_low, cov_high) and that PPO did
    not clip lose their gradient (loss 0), against entropy collapse. The paper's r = 2e-4, (1, 5).
    Returns (per-token loss, the tokens PPO clipped or this detached)."""
    mask = as_bool_mask(mask)
    ppo_ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ppo_ratio
    clipped = -advantages * ppo_ratio.clamp(1.0 - cliprange_low, 1.0 + cliprange_high)
    per_token = torch.maximum(unclipped, clipped)
    by_clip = (clipped > unclipped) & mask
    cov = token_covariance(logprobs, advantages, mask)
    candidates = torch.nonzero((mask & ~by_clip & (cov > cov_low) & (cov < cov_high)).flatten()).squeeze(1)
    count = min(max(1, int(ratio * int(mask.sum()))), candidates.numel())
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count].to(candidates.device)]
    detached = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    detached[chosen] = True
    detached = detached.reshape(mask.shape)
    return torch.where(detached, torch.zeros_like(per_token), per_token), (by_clip | detached).detach()


def kl_cov_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, ratio: float = 2e-3, coef: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A_t * r_t on every token, plus coef * |log r_t| on the
    max(1, floor(ratio * N)) real tokens of largest covariance (`token_covariance`), which pulls exactly those tokens
    back to pi_old. The paper's k = 2e-3 (Qwen2.5-7B; 2e-4 at 32B) and beta = 1.
    Returns (per-token loss, the tokens that carry the KL term)."""
    mask = as_bool_mask(mask)
    log_ratio = logprobs - old_logprobs
    per_token = -advantages * torch.exp(log_ratio)
    cov = torch.where(mask, token_covariance(logprobs, advantages, mask), torch.full_like(log_ratio, -math.inf))
    count = min(max(1, int(ratio * int(mask.sum()))), int(mask.sum()))
    selected = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    selected[torch.topk(cov.flatten(), count).indices] = True
    selected = selected.reshape(mask.shape) & mask
    return per_token + torch.where(selected, coef * log_ratio.abs(), torch.zeros_like(log_ratio)), selected


# ---- Rollout corrections: a sampler (vLLM) whose numerics differ from the training model's ------------------------
def truncated_importance_weights(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"; TRL's and verl's correction for a vLLM sampler):

    w_t = min(pi_old(a_t) / pi_sampler(a_t), cap) = min(exp(logp_old_t - logp_sampler_t), cap),

    the tokens having been drawn by the sampler, whose numerics differ from the training model's. logprobs,
    sampling_logprobs (B, R) -> w (B, R), detached (a weight on each token's policy loss, never differentiated).
    """
    return torch.exp(logprobs - sampling_logprobs).clamp(max=cap).detach()


ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_correction_weights(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: str = "token_truncate", clip_max: float | None = None,
                               clip_min: float | None = None) -> torch.Tensor:
    """Importance weights that correct for a sampler whose numerics differ from the training model's (TRL's
    `vllm_importance_sampling_mode`; verl's `rollout_is` token/sequence levels and `rollout_rs` rejection).

    The ratio is pi_old / pi_sampler: per token, w_t = exp(logp_old_t - logp_sampler_t), or per response ("sequence_*"),
    w = exp(sum over its real tokens of (logp_old_t - logp_sampler_t)) (the probability ratio of the whole response)
    on each of its tokens. "*_truncate": w clipped to [clip_min, clip_max] (`truncated_importance_weights` is
    token_truncate without a floor); "*_mask": w kept where clip_min <= w <= clip_max, else 0 (the token, or the
    whole response, is rejected: it leaves the loss but still counts in its mean, as in TRL). A bound left None does
    not bind. logprobs, sampling_logprobs, mask (B, R) -> (B, R), detached.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"Unknown rollout correction mode {mode!r}: choose one of {', '.join(ROLLOUT_CORRECTIONS)}.")
    mask = as_bool_mask(mask)
    log_ratio = torch.where(mask, logprobs - sampling_logprobs, torch.zeros_like(logprobs))
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(logprobs)
    weights = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return weights.clamp(min=clip_min, max=clip_max).detach()
    keep = torch.ones_like(mask)
    if clip_min is not None:
        keep = keep & (weights >= clip_min)
    if clip_max is not None:
        keep = keep & (weights <= clip_max)
    return torch.where(keep, weights, torch.zeros_like(weights)).detach()
