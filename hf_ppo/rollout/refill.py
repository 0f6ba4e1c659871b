"""Dynamic sampling's refill (DAPO, Yu et al. 2025): after `steps.rollout` drops the prompt groups whose responses
all scored the same (`without_uniform_groups`), extra rounds of prompts are rolled out and their groups with signal
take the dropped groups' places (`rollout_with_refill`, `merge_groups`, `padded`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

import torch
from torch import nn

from .batch import RolloutBatch
from .steps import Rollout, RolloutParts, RolloutSettings, rollout


@torch.no_grad()
def rollout_with_refill(policy: nn.Module, queries, query_mask, prompts: list, parts: RolloutParts,
                        settings: RolloutSettings, columns: dict[str, list] | None = None,
                        extra_prompts: Callable[[int], dict] | None = None) -> Rollout:
    """`rollout`, then DAPO's refill (Yu et al. 2025, dynamic sampling; verl's `filter_groups.max_num_gen_batches`).

    While groups of the batch are dropped (`settings.drop_uniform_groups`) and fewer than `settings.max_refill_rounds` extra rounds
    were sampled, round r rolls out `extra_prompts(r)` (one more rollout batch of prompt groups, as the data collator
    makes them: {"queries", "query_mask", "prompts", "columns"}, each round's reward functions given its own
    prompts' `columns`) with the same `parts` and `settings`, and its groups with signal take the
    places of dropped ones (`merge_groups`); groups still uniform after the last round stay masked. Under several
    processes every round gathers across them, so they all sample until none has a dropped group left.

    The statistics describe the main batch (the unfiltered sample of the prompts: a refill picks groups for their
    signal, so its scores would bias them), plus `rollout/groups_dropped` (groups still masked),
    `rollout/groups_refilled` and `rollout/refill_rounds`; the seconds and `generated_tokens` count every round, the
    cost of the refill. Advantages normalised over a batch (gae's whitening, reinforce_pp's) are normalised over the
    rollout that sampled each group; the group estimators (rloo, grpo) read each group alone. Running reward
    statistics (`normalize_rewards`, `normalize_each_reward`) see every round.
    """
    result = rollout(policy, queries, query_mask, prompts, parts, settings, columns)
    max_refill_rounds = settings.max_refill_rounds
    if not max_refill_rounds:
        return result
    if extra_prompts is None or result.dropped is None:
        raise ValueError("max_refill_rounds > 0 refills the groups drop_uniform_groups drops: pass "
                         "drop_uniform_groups=True and extra_prompts (a source of prompt groups).")
    k, gather, pad_token_id = settings.estimator.num_generations, parts.gather, parts.tokenizer.pad_token_id
    batch, dropped, refilled, rounds = result.batch, result.dropped, 0, 0
    while rounds < max_refill_rounds and _anywhere(whole_groups(dropped, k).any(), gather):
        extra = extra_prompts(rounds)
        more = rollout(policy, extra["queries"].to(queries.device), extra["query_mask"].to(query_mask.device),
                       extra["prompts"], parts, settings, extra.get("columns"))
        batch, dropped, count = merge_groups(batch, dropped, more.batch, more.dropped, k, pad_token_id)
        refilled, rounds = refilled + count, rounds + 1
        result.generate_seconds += more.generate_seconds
        result.score_seconds += more.score_seconds
        result.policy_forward_seconds += more.policy_forward_seconds
        result.reference_seconds += more.reference_seconds
        result.generated_tokens += more.generated_tokens
    device = result.stats["rollout/groups_dropped"].device
    result.stats.update({"rollout/groups_dropped": whole_groups(dropped, k).sum().float(),
                         "rollout/groups_refilled": torch.tensor(float(refilled), device=device),
                         "rollout/refill_rounds": torch.tensor(float(rounds), device=device)})
    result.batch, result.dropped = batch, dropped
    return result


def _anywhere(flag: torch.Tensor, gather: Callable | None) -> bool:
    """`flag` (a 0-d bool) is True on any process (`gather`: accelerate's, None for one process)."""
    flag = flag.reshape(1).float()
    return bool((gather(flag) if gather is not None else flag).sum() > 0)


def whole_groups(dropped: torch.Tensor, k: int) -> torch.Tensor:
    """The groups (B // k,) bool of `k` consecutive rows whose rows are all `dropped` (B,): the holes a refill fills.
    A group with some rows left (the others scored NaN/inf: rloo and grpo group by index, `steps.group_index`)
    trains on them and is no hole. Example: k = 2, dropped [T, T, F, T] -> [T, F]."""
    return dropped.reshape(-1, k).all(1)


def merge_groups(batch: RolloutBatch, dropped: torch.Tensor, extra: RolloutBatch, extra_dropped: torch.Tensor,
                 k: int, pad_token_id: int) -> tuple[RolloutBatch, torch.Tensor, int]:
    """One refill: the wholly dropped groups of `batch` (`dropped` (B,) bool, `whole_groups` of `k` rows) take, in
    order, the groups of `extra` (B', ...) with signal (not wholly `extra_dropped`), as many as both have; a donor's
    rows dropped alone (scored NaN/inf) stay dropped in their new place.

    The result has the wider prompts (left-padded) and responses (right-padded) of the two (`padded`). Returns it,
    the rows still dropped (B,) bool, and the number of groups refilled. Example, k = 1: dropped [T, F, T], extra
    dropped [T, F, F] -> rows 0 and 2 become extra's rows 1 and 2; nothing stays dropped; 2 refilled.
    """
    holes = whole_groups(dropped, k).nonzero().flatten()
    donors = (~whole_groups(extra_dropped, k)).nonzero().flatten()
    count = min(len(holes), len(donors))
    if count == 0:
        return batch, dropped, 0
    widths = [max(getattr(b, name).shape[1] for b in (batch, extra)) for name in ("queries", "responses")]
    batch, extra = padded(batch, *widths, pad_token_id), padded(extra, *widths, pad_token_id)
    offsets = torch.arange(k, device=dropped.device)
    into, take = [(groups[:count, None] * k + offsets).flatten() for groups in (holes, donors.to(dropped.device))]
    merged = {}
    for f in fields(batch):
        merged[f.name] = getattr(batch, f.name).clone()
        merged[f.name][into] = getattr(extra, f.name)[take.to(merged[f.name].device)]
    left = dropped.clone()
    left[into] = extra_dropped[take.to(extra_dropped.device)].to(left.device)  # a donor's own unscored rows
    return RolloutBatch(**merged), left, count


def padded(batch: RolloutBatch, query_width: int, response_width: int, pad_token_id: int) -> RolloutBatch:
    """`batch` with prompts left-padded to `query_width` and every (B, R) field right-padded to `response_width`:
    `pad_token_id` in the token ids, False in the masks, 0 in the float fields (padding is never a real token, so
    the log-probs, losses and means are unchanged: positions count real tokens, `sequence_inputs`)."""
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        left = f.name in ("queries", "query_mask")
        width = query_width if left else response_width
        if value.dim() == 1 or value.shape[1] == width:
            out[f.name] = value
            continue
        fill = pad_token_id if f.name in ("queries", "responses") else 0
        wide = value.new_full((value.shape[0], width), fill)
        if left:
            wide[:, width - value.shape[1]:] = value
        else:
            wide[:, :value.shape[1]] = value
        out[f.name] = wide
    return RolloutBatch(**out)
