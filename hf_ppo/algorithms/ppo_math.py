"""The PPO-for-language-models math as small pure functions: tensors and floats in, tensors out.

Conventions: `mask` is a bool tensor, True = a real response token; shapes are `(batch, response_len)` unless said.
The masked statistics also take a 0/1 float or integer mask (TRL's convention) and give the same result.
Values at masked positions never change a result. References: Schulman et al. 2017 (PPO), Schulman et al. 2016
(GAE), Ziegler et al. 2019 (KL penalty, adaptive controller), Huang et al. 2024 (the N+ implementation details);
the critic-free estimators and loss variants cite their own papers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

# The masked statistics (`masked`), the group advantages (`advantages`) and the policy-loss family (`policy_losses`)
# live in their own modules. Besides the names used here, ppo_math hands on those the package has always read from it.
from .advantages import (
    SCALE_REWARDS,
    group_centred,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
    uniform_groups,
)
from .masked import as_bool_mask, masked_mean, masked_sum, masked_var, masked_whiten
from .policy_losses import (
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    cispo_per_token,
    clip_cov_per_token,
    gmpo_per_token,
    gpg_per_token,
    importance_ratio,
    kl_cov_per_token,
    rollout_correction_weights,
    sapo_per_token,
)


# ---- Log-probabilities, entropy, KL ----------------------------------------------------------------------------
# The default memory budget of the vocabulary-wide fp32 work below (log-probs, entropy): 256 MiB. A (batch, len,
# vocab) fp32 tensor is never made whole: at a 128k vocabulary, 32 x 257 positions would be 4.2 GB.
LOGITS_MEMORY_BYTES = 256 * 2**20


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                         memory_bytes: int = LOGITS_MEMORY_BYTES) -> torch.Tensor:
    """log softmax(logits / temperature)[token] for each position.

    logits: (batch, len, vocab), tokens: (batch, len) -> (batch, len), float32. Dividing by the sampling temperature
    makes these the log-probs of the distribution that was actually sampled from (N+ paper), for policy and
    reference alike. Computed as gather - logsumexp, in chunks of positions whose fp32 work fits `memory_bytes`
    (`over_positions`), so no (batch, len, vocab) fp32 tensor is made, in the forward or the backward.
    """

    def chunk(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        scaled = rows.float() / temperature
        return torch.gather(scaled, -1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)

    return over_positions(chunk, logits, tokens, fp32_copies=3, memory_bytes=memory_bytes)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        memory_bytes: int = LOGITS_MEMORY_BYTES) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) at each position: (batch, len, vocab) -> (batch, len), in
    chunks of positions whose fp32 work fits `memory_bytes`."""

    def chunk(rows: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(rows.float() / temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    return over_positions(chunk, logits, fp32_copies=5, memory_bytes=memory_bytes)


def over_positions(fn, logits: torch.Tensor, *per_position: torch.Tensor, fp32_copies: int,
                   memory_bytes: int) -> torch.Tensor:
    """`fn(logit_rows (n, vocab), *rows (n,)) -> (n,)` applied to every position of `logits` (batch, len, vocab)
    -> (batch, len), a chunk of positions at a time.

    A chunk holds as many positions as `fp32_copies` fp32 vocabulary vectors each fit in `memory_bytes` (the chunk
    follows from the budget and the vocabulary, at least one position): whole rows of the batch when a row fits,
    else a part of one row. Chunks are views (no copy of `logits`); with gradients each chunk is recomputed in the
    backward (activation checkpointing), so autograd keeps only the views, never the chunks' fp32 intermediates.
    The chunks are cut with `split` alone, whose backward writes every chunk's gradient into ONE tensor of the
    logits' size (indexing a row, `logits[b]`, would make a zero-filled tensor of the whole logits' size per row).
    """
    batch, length, vocab = logits.shape
    rows = max(1, memory_bytes // (fp32_copies * 4 * vocab))
    if batch * length <= rows:
        return fn(logits, *per_position)
    recompute = torch.is_grad_enabled() and logits.requires_grad

    def run(*piece):
        return torch.utils.checkpoint.checkpoint(fn, *piece, use_reentrant=False) if recompute else fn(*piece)

    if rows >= length:  # whole rows per chunk
        per_chunk = rows // length
        pieces = zip(logits.split(per_chunk), *(t.split(per_chunk) for t in per_position))
        return torch.cat([run(*piece) for piece in pieces])
    out = []  # a row is larger than the budget: each row, a chunk of positions at a time
    for row in zip(logits.split(1), *(t.split(1) for t in per_position)):
        pieces = zip(*(t.squeeze(0).split(rows) for t in row))
        out.append(torch.cat([run(*piece) for piece in pieces]).unsqueeze(0))
    return torch.cat(out)


# KL estimators of the penalty and the loss term (`kl_estimate`), and verl's names for them (`kl_penalty` /
# `kl_loss_type`), accepted as aliases. k3's stability clamps are verl's: the log-ratio to +-20, the estimate to +-10.
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+", "abs")
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+"}
K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def kl_estimator_name(name: str) -> str:
    """hf_ppo's name of a KL estimator given by its name or by verl's (`KL_ALIASES`); an unknown name is an error."""
    canonical = KL_ALIASES.get(name, name)
    if canonical not in KL_ESTIMATORS:
        raise ValueError(f"Unknown KL estimator {name!r}: choose one of {', '.join(KL_ESTIMATORS)} (or verl's names "
                         f"{', '.join(KL_ALIASES)}).")
    return canonical


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens sampled from the policy.

    With d = logp - logp_ref (Schulman 2020, "Approximating KL Divergence"):
    k1 = d (unbiased, can be negative); k2 = d^2 / 2 (biased, low variance); abs = |d| (verl's `abs`);
    k3 = (r - 1) - log r with r = p_ref / p = exp(-d) (unbiased, non-negative), computed as verl does for stability:
    log r clamped to [-20, 20] and k3 to [-10, 10] (`K3_LOG_RATIO_CLAMP`, `K3_CLAMP`), so one token the policy all
    but rules out (d = -25) gives 10, not 7e10; a clamped token has no gradient.
    k3+ (verl's straight-through estimator): k3's value with k2's gradient, d k2 / d logp = d, whose expectation
    under the policy is the gradient of KL(pi || pi_ref) (k3's own gradient, 1 - r, is the forward KL's).
    verl's names are accepted (`KL_ALIASES`). Shapes: (batch, len) -> (batch, len).
    """
    estimator = kl_estimator_name(estimator)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "abs":
        return log_ratio.abs()
    log_r = (-log_ratio).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log r = logp_ref - logp
    k3 = (torch.expm1(log_r) - log_r).clamp(-K3_CLAMP, K3_CLAMP)  # r - 1 - log r
    if estimator == "k3":
        return k3
    k2 = 0.5 * log_ratio**2  # k3+: the value k3's, the gradient k2's
    return k3.detach() + (k2 - k2.detach())


def kl_loss_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                      old_logprobs: torch.Tensor | None = None, estimator: str = "k3") -> torch.Tensor:
    """The KL-to-reference loss term per token: `estimator`'s estimate of the current policy (GRPO's k3, Shao et al.
    2024, eq. 4; verl's `kl_loss_type`), or with `old_logprobs` that estimate times the importance ratio pi/pi_old
    (DeepSeek-V3.2, sec. 3.1).

    k3's value is unbiased for KL(pi || pi_ref) but its gradient is not: d k3 / d logp = 1 - p_ref/p, whose
    expectation is the gradient of the forward KL. Two fixes: k3+ (k3's value, k2's gradient (logp - logp_ref) *
    grad logp, the unbiased gradient of the reverse KL on-policy), or k3 times the (differentiable) ratio, whose
    gradient at any pi_old is ratio * (logp - logp_ref) * grad logp, the importance-weighted unbiased gradient. The
    ratio is per token, whatever the policy loss's `importance_sampling_level`. Shapes: (batch, len) -> (batch, len).
    """
    kl = kl_estimate(logprobs, ref_logprobs, estimator)
    return kl if old_logprobs is None else torch.exp(logprobs - old_logprobs) * kl


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
    slot after it (the bug of the removed TRL trainer, issues 1893 / 3750). `mask`: bool or 0/1 (`as_bool_mask`).
    """
    mask = as_bool_mask(mask)
    non_score = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))
    rewards = non_score.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    has_token = mask.any(dim=1)
    rewards[rows, last_token_index(mask)] += torch.where(has_token, scores.to(rewards.dtype), torch.zeros_like(scores, dtype=rewards.dtype))
    return rewards, non_score


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty_factor`: (batch,) -> (batch,) <= 0.

    With L_max = `max_length` and L_cache = `buffer_length`: 0 for a length |y| <= L_max - L_cache, then linear,
    ((L_max - L_cache) - |y|) / L_cache, reaching -1 at |y| = L_max (and staying there beyond). Example: L_max 8,
    L_cache 4, factor 0.5, lengths [3, 4, 6, 8] -> [0, 0, -0.25, -0.5].
    """
    over = (lengths.float() - (max_length - buffer_length)) / buffer_length  # > 0 inside the buffer
    return -penalty_factor * over.clamp(min=0.0, max=1.0)


def length_adaptive_lam(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda (Yue et al. 2025), one per row: mask (batch, len) -> (batch,).

    lambda_i = 1 - 1 / (alpha * l_i), where l_i is the number of real response tokens of row i (mask True: padding
    and an environment's tokens between policy turns are not counted), clamped at 0: a response shorter than
    1 / alpha tokens gets lambda 0 (one-step TD), never a negative lambda; an empty row gets 0 too. Longer responses
    get a lambda nearer 1, so the score at their end still reaches their first tokens. Example: alpha 0.5, lengths
    [2, 4, 8] -> [0, 0.5, 0.75].
    """
    lengths = as_bool_mask(mask).sum(dim=1).to(torch.float32)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(min=0.0)


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the policy's tokens, in order.

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next;  returns R_t = A_t + V_t, where
    "next" is the next real (mask True) position: masked positions are no time steps. After a response's last real
    token V_next = 0 (the episode ends); between two policy turns of a multi-turn sample (an environment's tokens
    masked out) the environment segment is skipped, so the last token before it bootstraps from the first policy
    token after it. rewards, values, mask: (batch, len) -> (advantages, returns), (batch, len), 0 at masked
    positions. Example: rewards [0, 0, 1], values 0.5, gamma 1, lam 0.95 -> advantages [0.45125, 0.475, 0.5];
    the same with an environment token in the middle (mask [1, 0, 1, 1]) -> [0.45125, 0, 0.475, 0.5].
    `lam` is one float, or a (batch,) tensor with each row's own lambda (`length_adaptive_lam`). `mask`: bool or 0/1
    (`as_bool_mask`).
    """
    mask = as_bool_mask(mask)
    zeros = torch.zeros_like(values[:, 0])
    if isinstance(lam, torch.Tensor):
        lam = lam.to(device=values.device, dtype=values.dtype)
    next_value, last_adv = zeros, zeros
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * last_adv
        # A masked position carries the next policy token's value and advantage back unchanged.
        last_adv = torch.where(real, adv, last_adv)
        next_value = torch.where(real, values[:, t], next_value)
        advantages.append(torch.where(real, adv, zeros))
    advantages = torch.stack(advantages[::-1], dim=1)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def reinforce_pp_advantages(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float, k: int | None = None,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu 2025), and with `k` REINFORCE++-baseline.

    1. With `k` (the baseline variant), each score first loses its group's mean: R_i - mean_group(R), k consecutive
       rows per prompt. 2. Per-token rewards r_t = -kl_coef * KL_t, plus the (centred) score at the last real token
       (`compute_rewards`; the paper uses the k1 estimator: pass KL_t = logp - logp_ref). 3. Returns
       G_t = sum_{s >= t} gamma^(s - t) r_s over the real positions (masked ones are no time steps, as in
       `compute_gae`; gamma = 1 is the paper's plain sum; verl's `gamma`), no critic. 4. Advantages = G whitened over every real token of the batch
       (`masked_whiten`: mean and unbiased std of the whole batch, not per group).
    scores: (batch,); kl, mask: (batch, len) -> (advantages, returns), both (batch, len), 0 at masked positions.
    The whitening is over what is passed: in data-parallel training pass the gathered batch for a global one.
    """
    if k is not None:
        scores = group_centred(scores, k)
    mask = as_bool_mask(mask)
    rewards, _ = compute_rewards(scores, kl, mask, kl_coef)
    running, returns = torch.zeros_like(rewards[:, 0]), []
    for t in reversed(range(rewards.shape[1])):  # G_t = r_t + gamma * G_next, G_next the next real position's
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns.append(torch.where(mask[:, t], running, torch.zeros_like(running)))
    returns = torch.stack(returns[::-1], dim=1)
    return masked_whiten(returns, mask), returns


# ---- Losses ---------------------------------------------------------------------------------------------------
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo")
# verl's spellings of the modes that mean the same here (`loss_agg_mode`).
LOSS_AGGREGATION_ALIASES = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
                            "seq-mean-token-sum": "seq_mean_token_sum"}
# A name hf_ppo used for another reduction than verl's: refused, so a saved config that names it never changes scale
# in silence.
RENAMED_LOSS_AGGREGATIONS = {
    name: (f"loss_aggregation={name!r} is no longer accepted: hf_ppo's mode of that name (each response's token sum "
           "/ response_length, averaged over responses) is now 'dr_grpo' (TRL's name; the same numbers), while "
           "verl's seq-mean-token-sum-norm sums over the responses instead of averaging (a loss N times larger with "
           "N responses). Set loss_aggregation='dr_grpo' to keep the run as it was.")
    for name in ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm")}


def loss_aggregation_name(name: str) -> str:
    """hf_ppo's name of a loss aggregation given by its name or verl's (`LOSS_AGGREGATION_ALIASES`); a renamed or
    unknown name is an error naming the fix."""
    if name in RENAMED_LOSS_AGGREGATIONS:
        raise ValueError(RENAMED_LOSS_AGGREGATIONS[name])
    canonical = LOSS_AGGREGATION_ALIASES.get(name, name)
    _check_aggregation(canonical)
    return canonical


def loss_normalizer(mask: torch.Tensor, loss_aggregation: str = "token_mean") -> torch.Tensor:
    """What `aggregate_loss` divides by for these rows: their real-token count for `token_mean`, their number of
    sequences with at least one real token for the seq-mean variants. mask: (batch, len) -> scalar (>= 1).

    For exact gradient accumulation, compute it once on the whole minibatch and pass it to every micro-batch.
    """
    mask = as_bool_mask(mask)
    if loss_aggregation == "token_mean":
        return mask.sum().clamp(min=1)
    _check_aggregation(loss_aggregation)
    return mask.any(dim=1).sum().clamp(min=1)


def _check_aggregation(loss_aggregation: str) -> None:
    if loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"Unknown loss_aggregation {loss_aggregation!r}: choose one of {', '.join(LOSS_AGGREGATIONS)}.")


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_aggregation: str = "token_mean",
    normalizer: float | torch.Tensor | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (batch, len) to a scalar (verl's names; Liu et al. 2025 for the last one).

    - token_mean: sum_{i,t} l_it / N, N = the number of real tokens (PPO's usual mean; long responses weigh more).
    - seq_mean_token_mean: sum_i (sum_t l_it / |y_i|) / N, N = the number of sequences (GRPO's original: each
      response weighs the same, so a token of a short response weighs more than one of a long response).
    - seq_mean_token_sum: sum_i (sum_t l_it) / N, N = the number of sequences (verl's seq-mean-token-sum: each
      response's token sum, averaged over responses; a loss on the scale of a response's length).
    - dr_grpo: sum_i (sum_t l_it / max_length) / N, N = the number of sequences (Dr. GRPO, TRL's `dr_grpo`: a
      constant divisor, no length bias); `max_length` defaults to `len`, pass the generation budget
      (`response_length`). verl's seq-mean-token-sum-norm is this times N (it sums over responses): not offered.
    `normalizer` replaces N (default: `loss_normalizer(mask, loss_aggregation)` of these rows): pass the whole
    minibatch's, so the losses of its micro-batches sum to the minibatch loss and accumulation is exact.
    """
    if loss_aggregation == "token_mean":
        if normalizer is None:
            return masked_mean(per_token, mask)
        return masked_sum(per_token, mask) / normalizer
    _check_aggregation(loss_aggregation)
    mask = as_bool_mask(mask)
    if loss_aggregation == "seq_mean_token_mean":
        per_sequence = masked_sum(per_token, mask, dim=1) / mask.sum(dim=1).clamp(min=1)
    elif loss_aggregation == "seq_mean_token_sum":
        per_sequence = masked_sum(per_token, mask, dim=1)
    else:
        per_sequence = masked_sum(per_token, mask, dim=1) / (max_length if max_length is not None else mask.shape[1])
    if normalizer is None:
        normalizer = loss_normalizer(mask, loss_aggregation)
    return per_sequence.sum() / normalizer


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    normalizer: float | torch.Tensor | None = None,
    *,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    loss_aggregation: str = "token_mean",
    max_length: int | None = None,
    importance_sampling_level: str = "token",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate objective (Schulman et al. 2017), as a loss to minimise, with its common variants.

    ratio = exp(logp - logp_old);  loss_t = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)).
    eps_low / eps_high default to `cliprange`; a larger eps_high is DAPO's "clip-higher" (Yu et al. 2025).
    `dual_clip` = c > 1 (Ye et al. 2020): where A < 0, loss_t = min(loss_t, -c * A), bounding the step a very
    unlikely token with a negative advantage can cause (None: off).
    `importance_sampling_level="sequence"` (GSPO, Zheng et al. 2025; TRL GRPO's name): one ratio per response,
    s_i = exp(mean over its real tokens of (logp - logp_old)), on each of its tokens, clipped like a token's (GSPO's
    clip ranges are ~1e3 times smaller, e.g. 3e-4 / 4e-4); "token": PPO's per-token ratio.
    All inputs (batch, len). The per-token losses are reduced by `aggregate_loss` (`loss_aggregation`, `normalizer`,
    `max_length`): pass the whole minibatch's `loss_normalizer` so gradient accumulation over micro-batches gives the
    same gradient. `token_weights` (batch, len), detached: each token's loss is multiplied by its weight before the
    reduction (truncated importance sampling, `truncated_importance_weights`); None: 1. Returns (loss, clip fraction,
    approx KL = mean((logp - logp_old)^2) / 2); the last two are detached token means.
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = logprobs - old_logprobs
    ratio = importance_ratio(log_ratio, mask, importance_sampling_level)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = aggregate_loss(per_token, mask, loss_aggregation, normalizer, max_length)
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
    *,
    loss_aggregation: str = "token_mean",
    max_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2) / 2.

    All inputs (batch, len). Reduced like the policy loss (`aggregate_loss`), so one normalizer serves the whole
    PPO loss and `vf_coef` keeps its weight relative to the policy term under every aggregation. Returns (loss,
    clip fraction = share of tokens where the clipped term was larger).
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_loss, clipped_loss), mask, loss_aggregation, normalizer,
                                max_length)
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


class Experience(NamedTuple):
    """The rollout's tensors the update reads, each (B, R) (`rollout.RolloutBatch` has them under these names): the
    sampled tokens, the old policy's log-probs and values, the advantages and returns, the policy's real tokens
    (True = a token the policy sampled), and the reference's log-probs (for a KL loss term; None without one)."""

    responses: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    policy_mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    """Step 11's settings: the PPOConfig fields the loss reads (`PPOConfig.loss_settings` builds it).

    temperature: the sampling temperature (log-probs of temperature-scaled logits, as sampled);
    cliprange / cliprange_low / cliprange_high / dual_clip / importance_sampling_level: the policy loss's clipping
    (`policy_loss`); cliprange_value and vf_coef: the value loss (`value_loss`) and its weight; entropy_coef: the
    entropy bonus (0: off); loss_aggregation and response_length: the reduction (`aggregate_loss`; the generation
    budget is Dr. GRPO's constant divisor); use_bias_correction_kl: the KL loss term times the importance ratio;
    memory_bytes: the budget of the vocabulary-wide fp32 work (`over_positions`); importance_sampling_cap: truncated
    importance sampling's cap (`truncated_importance_weights`, against the engine's `sampling_logprobs`; None: off);
    importance_sampling_mode / importance_sampling_min: the correction's level, truncation or rejection, and floor
    (`rollout_correction_weights`); kl_loss_estimator: the KL loss term's estimator (`kl_loss_per_token`);
    policy_loss: the policy loss (`POLICY_LOSSES`, `variant_policy_loss`) and the rest its variants' parameters.
    old_logprobs_from_forward: the rollout ran no old-log-prob pass (one optimizer step per rollout, no critic): the
    old log-probs are this forward's own, detached, so the ratio is exactly 1 (TRL GRPO's single-step shortcut).
    """

    temperature: float
    cliprange: float
    cliprange_value: float
    vf_coef: float
    entropy_coef: float = 0.0
    loss_aggregation: str = "token_mean"
    response_length: int | None = None
    cliprange_low: float | None = None
    cliprange_high: float | None = None
    dual_clip: float | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = False
    memory_bytes: int = LOGITS_MEMORY_BYTES
    importance_sampling_cap: float | None = None
    importance_sampling_mode: str = "token_truncate"
    importance_sampling_min: float | None = None
    kl_loss_estimator: str = "k3"
    policy_loss: str = "ppo"
    cispo_clip_max: float = 5.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    gmpo_cliprange: float = 0.4
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0

    old_logprobs_from_forward: bool = False


def variant_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, s: LossSettings, normalizer: float | torch.Tensor | None = None,
                        token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`s.policy_loss` other than "ppo" (`POLICY_LOSSES`) with its parameters from `s`, reduced like `policy_loss`
    (`s.loss_aggregation`, `normalizer`, `s.response_length`; `token_weights` multiply each token's loss). Inputs
    (batch, len). Returns (loss, share of tokens its clip or selection touched, approx KL), as `policy_loss`."""
    low = s.cliprange if s.cliprange_low is None else s.cliprange_low
    high = s.cliprange if s.cliprange_high is None else s.cliprange_high
    level = s.importance_sampling_level
    if s.policy_loss == "cispo":
        per_token, touched = cispo_per_token(logprobs, old_logprobs, advantages, mask, s.cispo_clip_max, level)
    elif s.policy_loss == "sapo":
        per_token, touched = sapo_per_token(logprobs, old_logprobs, advantages, mask, s.sapo_temperature_pos,
                                            s.sapo_temperature_neg, level)
    elif s.policy_loss == "gmpo":
        per_token, touched = gmpo_per_token(logprobs, old_logprobs, advantages, mask, s.gmpo_cliprange,
                                            s.gmpo_cliprange)
    elif s.policy_loss == "gpg":
        per_token, touched = gpg_per_token(logprobs, advantages)
    elif s.policy_loss == "clip_cov":
        per_token, touched = clip_cov_per_token(logprobs, old_logprobs, advantages, mask, low, high,
                                                s.clip_cov_ratio, s.clip_cov_lb, s.clip_cov_ub)
    elif s.policy_loss == "kl_cov":
        per_token, touched = kl_cov_per_token(logprobs, old_logprobs, advantages, mask, s.kl_cov_ratio, s.kl_cov_coef)
    else:
        raise ValueError(f"Unknown policy_loss {s.policy_loss!r}: choose one of {', '.join(POLICY_LOSSES)}.")
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = aggregate_loss(per_token, mask, s.loss_aggregation, normalizer, s.response_length)
    with torch.no_grad():
        touched_share = masked_mean(touched.float(), mask)
        approxkl = 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask)
    return loss, touched_share, approxkl


def ppo_loss(logits: torch.Tensor, values: torch.Tensor | None, old: Experience, normalizer: torch.Tensor,
             s: LossSettings, kl_loss_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO objective of one micro-batch: clipped policy loss + vf_coef * clipped value loss - entropy_coef * H
    + kl_loss_coef * KL.

    logits (B, R, vocab) and values (B, R) from the current model at the response positions; `old` the rollout's
    tensors (B, R) (an `Experience`, or a `RolloutBatch`). `values=None` (a critic-free estimator): no value loss and
    no value statistics. With `kl_loss_coef` > 0 the KL to the reference is a loss term (`kl_loss_per_token` against
    `old.ref_logprobs`, times the importance ratio with `s.use_bias_correction_kl`; aggregated like the policy loss).
    `normalizer` is the whole minibatch's (`loss_normalizer`), so accumulated micro-batches sum to the minibatch's
    loss. Returns the loss and its statistics (losses as this micro-batch's own aggregates).
    """
    responses, old_logprobs, mask = old.responses, old.logprobs, old.policy_mask
    temperature, memory_bytes, loss_aggregation = s.temperature, s.memory_bytes, s.loss_aggregation
    aggregation = {"loss_aggregation": loss_aggregation, "max_length": s.response_length}
    logprobs = logprobs_from_logits(logits, responses, temperature, memory_bytes)
    if s.old_logprobs_from_forward:  # the weights are still the rollout's: pi_old = pi, detached
        old_logprobs = logprobs.detach()
    weights = None
    if s.importance_sampling_cap is not None and old.sampling_logprobs is not None:
        weights = rollout_correction_weights(old_logprobs, old.sampling_logprobs, mask, s.importance_sampling_mode,
                                             s.importance_sampling_cap, s.importance_sampling_min)
    if s.policy_loss == "ppo":
        pg_loss, pg_clipfrac, approxkl = policy_loss(logprobs, old_logprobs, old.advantages, mask, s.cliprange,
                                                     normalizer, cliprange_low=s.cliprange_low,
                                                     cliprange_high=s.cliprange_high, dual_clip=s.dual_clip,
                                                     importance_sampling_level=s.importance_sampling_level,
                                                     token_weights=weights, **aggregation)
    else:
        pg_loss, pg_clipfrac, approxkl = variant_policy_loss(logprobs, old_logprobs, advantages=old.advantages,
                                                             mask=mask, s=s, normalizer=normalizer,
                                                             token_weights=weights)
    loss, stats = pg_loss, {}
    if values is not None:
        vf_loss, vf_clipfrac = value_loss(values, old.values, old.returns, mask, s.cliprange_value, normalizer,
                                          **aggregation)
        loss = loss + s.vf_coef * vf_loss
        stats = {"loss/value_avg": vf_loss, "val/clipfrac_avg": vf_clipfrac}
    if kl_loss_coef:
        per_token_kl = kl_loss_per_token(logprobs, old.ref_logprobs, old_logprobs if s.use_bias_correction_kl else None,
                                         s.kl_loss_estimator)
        kl_loss = aggregate_loss(per_token_kl, mask, normalizer=normalizer, **aggregation)
        loss = loss + kl_loss_coef * kl_loss
        stats["loss/kl_avg"] = kl_loss
    if s.entropy_coef:  # a vocabulary-wide softmax: only paid when the bonus is on
        entropy = entropy_from_logits(logits, temperature, memory_bytes)
        loss = loss - s.entropy_coef * aggregate_loss(entropy, mask, normalizer=normalizer, **aggregation)
    with torch.no_grad():
        scale = normalizer / loss_normalizer(mask, loss_aggregation)
        ratio = torch.exp(logprobs - old_logprobs)
        stats = {"loss/policy_avg": pg_loss * scale, **{k: v * scale if k.startswith("loss/") else v
                                                        for k, v in stats.items()},
                 "policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac,
                 "val/ratio": masked_mean(ratio, mask), "val/ratio_var": masked_var(ratio, mask)}
        if weights is not None:
            stats["policy/importance_weight_avg"] = masked_mean(weights, mask)
    return loss, {k: v.detach() for k, v in stats.items()}
