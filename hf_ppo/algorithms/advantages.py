"""The critic-free advantage estimators' group math (RLOO, GRPO, ReMax): the scores of the k responses to each
prompt in, one advantage per response out, and that advantage on each of its tokens. Tensors and floats only; the
estimators of step 8 (`estimators`) call these. REINFORCE++'s per-token returns sit beside GAE in `ppo_math`.
"""

from __future__ import annotations

import torch

from .masked import as_bool_mask


# Group layout, shared by every group estimator: the k responses to one prompt are k consecutive rows, so row
# i * k + j is response j of prompt i. Scores come flat, (num_prompts * k,), or already grouped, (num_prompts, k);
# the result has the input's shape.
def _grouped(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`scores` as (num_prompts, k), with the errors a wrong layout deserves."""
    if k < 2:
        raise ValueError(f"k={k}: a group estimator needs k >= 2 responses per prompt (one response has no baseline "
                         "from its group).")
    if scores.dim() == 2 and scores.shape[1] != k:
        raise ValueError(f"scores of shape {tuple(scores.shape)} are not grouped by k={k}: pass (num_prompts, k) or "
                         "a flat (num_prompts * k,) tensor.")
    if scores.dim() not in (1, 2) or scores.numel() % k:
        raise ValueError(f"scores of shape {tuple(scores.shape)} cannot be split into groups of k={k}: pass "
                         "(num_prompts * k,) or (num_prompts, k), the k responses of a prompt in consecutive rows.")
    return scores.reshape(-1, k)


def group_centred(scores: torch.Tensor, k: int) -> torch.Tensor:
    """R_i - mean_group(R) over groups of k consecutive rows: (num_prompts * k,) or (num_prompts, k) -> same shape.
    Example: k = 2, R = [1, 3, 5, 5] -> [-1, 1, 0, 0]."""
    grouped = _grouped(scores, k)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(scores.shape)


def uniform_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """True on every row of a group whose k scores are all equal (no signal for a group baseline: DAPO's dynamic
    sampling, Yu et al. 2025, drops them): (num_prompts * k,) -> (num_prompts * k,) bool.
    Example: k = 2, R = [1, 1, 0, 2] -> [True, True, False, False]."""
    grouped = _grouped(scores, k)
    uniform = grouped.amax(dim=1) == grouped.amin(dim=1)
    return uniform.repeat_interleave(k).reshape(scores.shape)


def rloo_advantages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, "Back to Basics").

    A_i = R_i - 1/(k-1) * sum_{j != i} R_j over the k responses to the same prompt, which equals
    k/(k-1) * (R_i - mean_group(R)). scores: (num_prompts * k,) or (num_prompts, k), k consecutive rows per prompt
    -> same shape. Any KL penalty is the caller's: pass R_i - beta * sum_t KL_t to follow the paper.
    Example: k = 3, R = [1, 2, 6] -> [1 - 4, 2 - 3.5, 6 - 1.5] = [-3, -1.5, 4.5].
    """
    grouped = _grouped(scores, k)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (k - 1)  # baseline: mean of the other k - 1
    return (grouped - others_mean).reshape(scores.shape)


SCALE_REWARDS = ("group", "batch", "none")


def scale_rewards_name(scale_rewards: bool | str) -> str:
    """TRL's `scale_rewards` as one of `SCALE_REWARDS`: True is "group", False "none" (TRL maps them so too)."""
    name = {True: "group", False: "none"}.get(scale_rewards, scale_rewards) if isinstance(scale_rewards, bool) \
        else scale_rewards
    if name not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose 'group' (True), 'batch' or 'none' (False).")
    return name


def grpo_advantages(scores: torch.Tensor, k: int, scale_rewards: bool | str = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages (Shao et al. 2024, GRPO; Liu et al. 2025, Dr. GRPO; TRL's `scale_rewards`).

    A_i = (R_i - mean_group(R)) / (std + eps), std = std_group(R) with `scale_rewards` True / "group", the std of
    every score of the batch with "batch" (TRL's; PPO Lite, Liu et al. 2025), no division with False / "none"
    (Dr. GRPO: the std division favours groups whose rewards barely differ). std is the sample std (Bessel's
    correction, n - 1), as TRL's GRPO; a group of equal scores gets A = 0 either way. scores: (num_prompts * k,) or
    (num_prompts, k), k consecutive rows per prompt -> same shape.
    Example: k = 3, R = [1, 2, 6]: mean 3, std sqrt(7) -> [-2, -1, 3] / (sqrt(7) + eps).
    """
    grouped = _grouped(scores, k)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    scale = scale_rewards_name(scale_rewards)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (grouped.std() + eps)
    return centred.reshape(scores.shape)


def _index_groups(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: its group's size, mean and sample std (0 for a group of one), the groups named by `index` (batch,)
    (any integer ids, rows of a group anywhere, groups of any size)."""
    _, group = torch.unique(index, return_inverse=True)
    n = int(group.max()) + 1 if group.numel() else 0
    ones = torch.ones_like(scores)
    size = torch.zeros(n, dtype=scores.dtype, device=scores.device).index_add(0, group, ones)
    mean = torch.zeros_like(size).index_add(0, group, scores) / size
    square = torch.zeros_like(size).index_add(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(square / (size - 1).clamp(min=1))
    return size[group], mean[group], std[group]


def grpo_advantages_by_index(scores: torch.Tensor, index: torch.Tensor, scale_rewards: bool | str = True,
                             eps: float = 1e-4) -> torch.Tensor:
    """`grpo_advantages` with the groups named by `index` (batch,) instead of k consecutive rows: groups of unequal
    size (dynamic sampling's filtered batches, environments that ended early), and a group of one passes its score
    through (its baseline 0, its std 1, as verl's `index`-grouped GRPO). scores (batch,) -> (batch,).
    Example: index [0, 0, 1], R = [1, 3, 5], scale "none" -> [-1, 1, 5]."""
    size, mean, std = _index_groups(scores, index)
    alone = size == 1
    centred = scores - torch.where(alone, torch.zeros_like(mean), mean)
    scale = scale_rewards_name(scale_rewards)
    if scale == "group":
        centred = centred / (torch.where(alone, torch.ones_like(std), std) + eps)
    elif scale == "batch":
        centred = centred / (scores.std() + eps)
    return centred


def rloo_advantages_by_index(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rloo_advantages` with the groups named by `index` (batch,): A_i = n/(n-1) * (R_i - mean_group(R)) in a group
    of n >= 2, R_i itself in a group of one (no other response to compare with: verl's RLOO passes it through).
    scores (batch,) -> (batch,). Example: index [0, 0, 0, 1], R = [1, 2, 6, 4] -> [-3, -1.5, 4.5, 4]."""
    size, mean, _ = _index_groups(scores, index)
    return torch.where(size > 1, size / (size - 1).clamp(min=1) * (scores - mean), scores)


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2024): each sampled response's score minus the score of the greedy (temperature 0) response
    to the same prompt, A_i = R_i - R_greedy(prompt of i). scores (num_prompts * k,), k consecutive rows per prompt;
    greedy_scores (num_prompts,) -> (num_prompts * k,). Example: k = 2, R = [1, 3, 0, 2], greedy [2, 1] ->
    [-1, 1, -1, 1]. The estimator only: the rollout does not yet sample the greedy response (docs: what is left)."""
    k, rest = divmod(scores.numel(), greedy_scores.numel())
    if rest or k < 1:
        raise ValueError(f"{scores.numel()} scores cannot be split over {greedy_scores.numel()} prompts: pass one "
                         "greedy score per prompt, its responses in consecutive rows.")
    return scores - greedy_scores.repeat_interleave(k)


def sequence_to_token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every real response token its sequence's advantage: (batch,) and (batch, len) -> (batch, len), 0 where
    `mask` is False (True = a real response token)."""
    mask = as_bool_mask(mask)
    token_advantages = advantages.unsqueeze(1).expand(mask.shape)
    return torch.where(mask, token_advantages, torch.zeros_like(token_advantages))
