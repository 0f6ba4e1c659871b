"""Rollout: one PPO iteration's experience, in the numbered steps used everywhere (docs, trainer, here).

`rollout` runs them in order and returns a `RolloutBatch`, complete when constructed, and its statistics:
1. generate: the rollout engine (`rollout/engines.py`) samples `response_length` tokens for the left-padded prompts;
2. truncate: everything after the first stop token becomes padding (`truncate_after_stop`, the "EOS trick");
3. score: the reward model's score (`score_responses`) or a reward callable on text; several rewards (a
   `RewardSet`) are each scored and combined as a weighted sum, optionally each normalised first;
   (steps 1-3 are `sample_and_score`, shared with evaluation)
4. penalties (`penalize`): `missing_eos_penalty` off the score of responses without a stop token; the optional
   overlong penalty;
5. policy forward: old log-probs and values in one no-grad pass of policy + value head (`policy_forward`);
6. reference: the reference's log-probs (`reference_logprobs`: a frozen model, or the policy with its reference
   adapter active or its adapter disabled);
7. shaping: running normalisation / clipping of the scores (the trainer's callable: its statistics span processes);
8. rewards and advantages: the `advantage_estimator` (`compute_advantages`, `algorithms/estimators.py`): for PPO KL-penalised
   per-token rewards, GAE, whitening; or a critic-free estimator over each prompt's `num_generations` responses;
9. statistics: `rollout_stats`, one dict of batch means.
The trainer then moves the KL controller (step 10) and runs the clipped PPO update (step 11).
Micro-batching (`batch_size`) bounds the memory of every no-grad pass, and `memory_bytes` the fp32 work on the logits
(log-probs and entropy in chunks of positions, `ppo_math.over_positions`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..algorithms.estimators import ESTIMATORS, EstimatorSettings, estimate
from ..algorithms.ppo_math import (
    LOGITS_MEMORY_BYTES,
    entropy_from_logits,
    explained_variance,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    uniform_groups,
)
from ..models.adapters import adapter_active
from ..runtime.sharding import gathered
from .batch import RolloutBatch
from .engines import (RolloutEngine, SamplingSettings, chunks, engine_stats, input_device, predicting_inputs,
                      stop_tensor)
from .environments import Prompt, check_sequences, collate, embedding_rows
from .reward_calls import RewardHooks
from .scoring import RewardSet, penalize


def truncate_after_stop(
    responses: torch.Tensor, stop_token_ids, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each response up to and including its first stop token (any of `stop_token_ids`); pad the rest.

    responses (B, R) -> (responses, response_mask (B, R) bool, contains_stop (B,) bool). `stop_token_ids`: a list of
    ids, one id, or None / [] (never stop: every token is real).
    """
    stops = stop_tensor(stop_token_ids, responses.device)
    if not stops.numel():
        mask = torch.ones_like(responses, dtype=torch.bool)
        return responses, mask, torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
    is_stop = torch.isin(responses, stops)
    # A position is real if no stop token appeared strictly before it.
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    mask = stops_before == 0
    return responses.masked_fill(~mask, pad_token_id), mask, is_stop.any(dim=1)


@torch.no_grad()
def policy_forward(
    model: nn.Module, queries, query_mask, responses, response_mask, *, temperature: float, batch_size: int,
    with_values: bool = True, with_entropy: bool = False, memory_bytes: int = LOGITS_MEMORY_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs of the response tokens (temperature-scaled logits), and values / entropy when asked.

    `model` is the policy+value head (`with_values=True`) or any causal LM (the reference). Returns logprobs
    (B, R) fp32, values (B, R) fp32 or None, entropy (B, R) or None. `memory_bytes` bounds the fp32 work on the
    logits (`ppo_math.over_positions`).
    """
    R = responses.shape[1]
    logprobs, values, entropies = [], [], []
    for rows in chunks(queries.shape[0], batch_size):
        inputs = predicting_inputs(queries[rows], query_mask[rows], responses[rows], response_mask[rows])
        out = model(**inputs, logits_to_keep=R, use_cache=False)
        logits = out.logits
        logprobs.append(logprobs_from_logits(logits, responses[rows], temperature, memory_bytes))
        if with_values:
            values.append(out.value.float())
        if with_entropy:
            entropies.append(entropy_from_logits(logits, temperature, memory_bytes))
    return (torch.cat(logprobs), torch.cat(values) if with_values else None,
            torch.cat(entropies) if with_entropy else None)


def reference_context(model: nn.Module, ref_adapter: str | None = None):
    """Context in which a PEFT policy runs as the reference (when `ref_model` is None): its reference adapter active
    (`ref_adapter`: the frozen SFT copy or TRL's `ref_adapter_name`), or without one its adapter disabled."""
    peft_model = getattr(model, "pretrained_model", model)
    if ref_adapter is not None:
        return adapter_active(peft_model, ref_adapter)
    return peft_model.disable_adapter() if hasattr(peft_model, "disable_adapter") else contextlib.nullcontext()


@torch.no_grad()
def reference_logprobs(policy: nn.Module, ref_model: nn.Module | None, queries, query_mask, responses, response_mask,
                       *, temperature: float, batch_size: int, ref_adapter: str | None = None,
                       memory_bytes: int = LOGITS_MEMORY_BYTES) -> torch.Tensor:
    """Reference log-probs (B, R): the frozen `ref_model`, or with `ref_model=None` the policy with its reference
    adapter `ref_adapter` active, or (None) with its adapter disabled."""
    if ref_model is not None:
        return policy_forward(ref_model, queries, query_mask, responses, response_mask, temperature=temperature,
                              batch_size=batch_size, with_values=False, memory_bytes=memory_bytes)[0]
    with reference_context(policy, ref_adapter):
        return policy_forward(getattr(policy, "pretrained_model", policy), queries, query_mask, responses,
                              response_mask, temperature=temperature, batch_size=batch_size, with_values=False,
                              memory_bytes=memory_bytes)[0]


@torch.no_grad()
def compute_advantages(logprobs, ref_logprobs, values, response_mask, shaped_scores: torch.Tensor, s: EstimatorSettings,
                       step_rewards: torch.Tensor | None = None,
                       index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Step 8: the per-token KL (B, R) and {rewards, non_score_rewards, advantages, returns} (B, R) of a rollout,
    from `s.advantage_estimator` (see `algorithms/estimators.py`: where its KL penalty enters, what it normalises).

    values (B, R) from the critic, or None for a critic-free estimator; the B rows hold `s.num_generations`
    consecutive responses per prompt. `response_mask` is the policy's tokens (`RolloutBatch.policy_mask`).
    `step_rewards` (B, R): an environment's per-position rewards, on policy tokens; with gae they join the per-token
    rewards where they were given, a critic-free estimator (sequence-level) gets their sum added to the score.
    `index` (B,): each row's group id (`group_index`), for the estimators that group by it (`Estimator.by_index`:
    rloo, grpo; groups of any size); None: k consecutive rows.
    """
    kl = kl_estimate(logprobs, ref_logprobs, s.kl_estimator)
    extra = {"index": index} if index is not None and ESTIMATORS[s.advantage_estimator].by_index else {}
    if step_rewards is not None and ESTIMATORS[s.advantage_estimator].needs_critic:
        extra = {**extra, "step_rewards": step_rewards}
    elif step_rewards is not None:
        shaped_scores = shaped_scores + masked_sum(step_rewards, response_mask, dim=1)
    return kl, estimate(shaped_scores, kl, response_mask, values, s, **extra)


ROLLOUT_STATS = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                 "objective/scores", "rollout/response_length", "rollout/eos_rate", "val/num_eos_tokens",
                 "val/explained_variance", "policy/entropy_avg", "rollout/advantages_mean", "rollout/returns_mean"]
CRITIC_STATS = {"val/explained_variance"}  # absent from the logs of a run without a critic


# What each skipped pass leaves unmeasured: the KL needs both, the entropies the policy's pass.
NEEDS_REFERENCE = ("objective/kl",)
NEEDS_OLD_LOGPROBS = ("objective/kl", "objective/entropy", "policy/entropy_avg")


def skipped_stats(skip_old_logprobs: bool, skip_reference: bool) -> set[str]:
    """The `ROLLOUT_STATS` a rollout without the old-log-prob pass (step 5) or the reference pass (step 6) leaves
    out of its statistics: they would read placeholders. `objective/non_score_reward` and `objective/rlhf_reward`
    stay: the old-log-prob pass is skipped only at kl_coef=0 (`PPOConfig.old_logprobs_from_update`), and with the
    reference skipped kl_coef is 0 too, so the non-score reward is exactly 0."""
    return (set(NEEDS_OLD_LOGPROBS) if skip_old_logprobs else set()) | (set(NEEDS_REFERENCE) if skip_reference
                                                                         else set())


def _rows_mean(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The mean of `values` (B,) over `rows` (B,) bool (None: all of them)."""
    return values.mean() if rows is None else values[rows].mean()


@torch.no_grad()
def rollout_stats(batch: RolloutBatch, kl: torch.Tensor, entropy: torch.Tensor, stop_token_ids,
                  has_critic: bool = True, scored: torch.Tensor | None = None) -> dict:
    """Step 9: the metrics named in `ROLLOUT_STATS` (a dict, in that order; stack it for one all-reduce), without
    the critic's (`CRITIC_STATS`) when `has_critic` is False. `scored` (B,) bool: the rows whose score entered the
    update (`unscored_rows`; None: all): the score means are over them.

    Sequence-level sums as the removed TRL trainer logged them (KL, -logp "entropy", non-score reward per response),
    then means over the batch; `policy/entropy_avg` is the per-token entropy of the temperature-scaled policy
    at rollout time (measured once per iteration, not per micro-batch). `rollout/eos_rate` is the fraction of
    responses that stopped and `val/num_eos_tokens` the number of stop tokens among the real response tokens, for
    every id in `stop_token_ids`.
    """
    mask = batch.policy_mask
    num_stop_tokens = (torch.isin(batch.responses, stop_tensor(stop_token_ids, mask.device)) & mask).sum().float()
    non_score = masked_sum(batch.non_score_rewards, mask, dim=1)
    stats = dict(zip(ROLLOUT_STATS, [
        masked_sum(kl, mask, dim=1).mean(), masked_sum(-batch.logprobs, mask, dim=1).mean(), non_score.mean(),
        _rows_mean(batch.scores + non_score, scored), _rows_mean(batch.scores, scored),
        batch.response_mask.sum(1).float().mean(),
        batch.contains_stop.float().mean(), num_stop_tokens,
        explained_variance(batch.values, batch.returns, mask), masked_mean(entropy, mask),
        masked_mean(batch.advantages, mask), masked_mean(batch.returns, mask),
    ]))
    return stats if has_critic else {k: v for k, v in stats.items() if k not in CRITIC_STATS}


def combined_reward_stats(scores: torch.Tensor, gather: Callable | None = None) -> dict[str, torch.Tensor]:
    """`reward` and `reward_std` (TRL's names): the mean and std of the combined score (step 3's weighted sum, before
    step 4's penalties) over the finite rows of all processes (`gather`); NaN when no row is finite."""
    if gather is not None:
        scores = gather(scores)
    kept = scores[torch.isfinite(scores)].float()
    nan = torch.full((), float("nan"), device=scores.device)
    return {"reward": kept.mean() if kept.numel() else nan,
            "reward_std": kept.std() if kept.numel() > 1 else (nan if not kept.numel() else torch.zeros_like(nan))}


def unscored_rows(scores: torch.Tensor, s: EstimatorSettings) -> torch.Tensor:
    """The rows (B,) bool whose score is NaN/inf (a reward or an environment scored them so), and for an estimator
    that compares the responses of one prompt in k consecutive rows (reinforce_pp with `num_generations` k > 1)
    every row of their group: a group baseline with a NaN/inf in it is no baseline. rloo and grpo group by index
    (`group_index`): the row leaves its group alone, and the others keep training as a smaller group. The rollout
    leaves them out of the update (their masks cleared), so the rest of it trains."""
    bad = ~torch.isfinite(scores)
    k = s.num_generations
    estimator = ESTIMATORS[s.advantage_estimator]
    if k > 1 and (not estimator.needs_critic or estimator.compares_groups) and not estimator.by_index and bad.any():
        bad = bad.reshape(-1, k).any(1, keepdim=True).expand(-1, k).reshape(bad.shape)
    return bad


def group_index(batch_size: int, k: int, alone: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's group id (B,) long, verl's uid: row i answers prompt i // k (`data.RolloutRepeatSampler`'s
    layout), and each row of `alone` (B,) bool (rows that left the update) is a group of its own, so it enters no
    other row's baseline. Example: B = 4, k = 2, alone [F, T, F, F] -> [0, 4, 1, 1]."""
    index = torch.arange(batch_size) // k
    if alone is None:
        return index
    return torch.where(alone.cpu(), torch.arange(batch_size) + batch_size, index).to(alone.device)


def uniform_scored_groups(scores: torch.Tensor, unscored: torch.Tensor, k: int) -> torch.Tensor:
    """DAPO's test for a group without signal, over the rows still in the update: True on every row of a group of
    `k` whose scored rows (`unscored` (B,) False) all have one score, or that has none (a group of one has no
    spread). Example: k = 3, scores [1, 0, 1, 2, 0, 2], unscored [F, T, F, F, F, F] -> [T, T, T, F, F, F]."""
    low = torch.where(unscored, torch.full_like(scores, float("inf")), scores).reshape(-1, k).amin(1)
    high = torch.where(unscored, torch.full_like(scores, float("-inf")), scores).reshape(-1, k).amax(1)
    return (high <= low).repeat_interleave(k)


def reward_stats(each_reward: dict, gather: Callable | None = None) -> dict[str, torch.Tensor]:
    """`rewards/<name>/mean` and `rewards/<name>/std` (TRL's names) of each reward's raw scores over the rows it
    applies to with a finite score (a reward function's None rows left out, and NaN/inf ones), over all processes
    (`gather`); a reward that applied to no row anywhere has none."""
    stats = {}
    for name, (scores, applies) in each_reward.items():
        if gather is not None:
            scores, applies = gather(scores), gather(applies.float()) > 0
        kept = scores[applies & torch.isfinite(scores)].float()  # a NaN/inf row left the update (`unscored_rows`)
        if kept.numel():
            stats[f"rewards/{name}/mean"] = kept.mean()
            stats[f"rewards/{name}/std"] = kept.std() if kept.numel() > 1 else torch.zeros((), device=kept.device)
    return stats


def frac_reward_zero_std(scores: torch.Tensor, k: int, gather: Callable | None = None) -> torch.Tensor:
    """TRL's `frac_reward_zero_std`: the fraction of prompt groups (k consecutive rows, `num_generations`) whose
    combined scores (B,) are all equal, over all processes (`gather`): groups with no signal for a group baseline.
    With k = 1 a group of one has no spread by definition, so the whole rollout batch counts as one group: 1.0 when
    every sample of the iteration got the same score, else 0.0. A NaN/inf score equals nothing (its group counts
    as having spread: it leaves the update anyway). TRL tests the group std against 0 with `isclose`; here the scores
    must be exactly equal; a single sample in all has no spread (1.0). Example: k = 2, scores [1, 1, 0, 2] -> 0.5."""
    if gather is not None:
        scores = gather(scores)
    scores = scores.float()
    size = k if k > 1 else scores.numel()
    if size < 2:  # one sample in all: nothing to compare it with, so no spread
        return torch.ones((), device=scores.device)
    return uniform_groups(scores, size).float().mean()


def uniform_rewards(scores: torch.Tensor, each_reward: dict, gather: Callable | None = None) -> dict:
    """{reward name: the value every sample got} for each reward that gave every row it applies to (finite scores
    only) one and the same value over all processes (`gather`), and {None: value} when the combined score (B,) did:
    no signal from it in this iteration (the trainer warns, `trainer/watch.py`). Fewer than two scored rows prove
    nothing and are left out."""
    found = {}
    for name, (values, applies) in [(None, (scores, None)), *each_reward.items()]:
        if gather is not None:
            values, applies = gather(values), None if applies is None else gather(applies.float()) > 0
        kept = values.float() if applies is None else values[applies].float()
        kept = kept[torch.isfinite(kept)]
        if kept.numel() > 1 and bool(kept.max() == kept.min()):
            found[name] = kept[0].item()
    return found


@dataclass(frozen=True)
class RolloutSettings:
    """Steps 1-9's settings (`PPOConfig.rollout_settings` builds it): how responses are sampled (`sampling`, also
    the temperature and the rows per pass of every no-grad forward), step 4's penalties (`missing_eos_penalty`, the
    overlong penalty), step 8's estimator (`estimator`, with the KL controller's current `kl_coef`), DAPO's dynamic
    sampling (`drop_uniform_groups`, `max_refill_rounds`) and the fp32 budget of the work on the logits
    (`memory_bytes`). The passes no update reads (`PPOConfig.skips_reference`, `old_logprobs_from_update`):
    `skip_reference` (step 6 off: kl_coef=0 with a fixed controller), `skip_old_logprobs` (step 5 off: a critic-free
    estimator whose rollout feeds one optimizer step, which takes its own forward's log-probs as the old ones);
    `importance_sampling`: truncated importance sampling is on, so without the engine's own log-probs (vLLM's) step 5
    still runs (its log-probs are then the sampling ones)."""

    sampling: SamplingSettings
    estimator: EstimatorSettings
    missing_eos_penalty: float | None = None
    overlong_buffer_length: int | None = None
    overlong_penalty_factor: float = 1.0
    drop_uniform_groups: bool = False
    max_refill_rounds: int = 0
    memory_bytes: int = LOGITS_MEMORY_BYTES
    skip_reference: bool = False
    skip_old_logprobs: bool = False
    importance_sampling: bool = False

    def with_all_passes(self) -> RolloutSettings:
        """These settings with every pass on: the `stats_pass_every`-th rollout, whose metrics read them all."""
        return replace(self, skip_reference=False, skip_old_logprobs=False)

    def with_kl_coef(self, kl_coef: float) -> RolloutSettings:
        """These settings with the KL controller's current coefficient."""
        return replace(self, estimator=self.estimator._replace(kl_coef=kl_coef))

    def with_response_length(self, response_length: int) -> RolloutSettings:
        """These settings with responses `response_length` wide (`step()`: its longest given response)."""
        return replace(self, sampling=replace(self.sampling, response_length=response_length))


def _unchanged(scores: torch.Tensor) -> torch.Tensor:
    return scores


@dataclass(frozen=True)
class RolloutParts:
    """What steps 1-7 sample, score and compare with beside the policy: the engine, the reward(s) (a `RewardSet`; one
    reward model or callable is wrapped as `RewardSet.single(reward, None, "auto")`), the policy's tokenizer and
    stop ids, the reference (a frozen `ref_model`, or with None the policy with its `ref_adapter` active or its
    adapter disabled), an `environment` whose episodes replace steps 1-3 (None: the engine samples), accelerate's
    `gather` across processes (None: one process), step 7's `shape_scores` (the penalised scores (B,) -> the
    scores the rewards use) and the `hooks` reward functions are given (`reward_calls.RewardHooks`: the trainer's
    state and its `log_metric` / `log_extra`; None: outside training). The trainer hands them over at each rollout, so an engine assigned after construction
    is the one used."""

    engine: RolloutEngine
    reward: RewardSet
    tokenizer: object
    stop_token_ids: object
    ref_model: nn.Module | None = None
    ref_adapter: str | None = None
    environment: object = None
    gather: Callable | None = None
    shape_scores: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    hooks: RewardHooks | None = None  # what reward functions get from the trainer (TRL's trainer_state, log_metric...)

    def __post_init__(self):
        if self.reward is not None and not isinstance(self.reward, RewardSet):
            object.__setattr__(self, "reward", RewardSet.single(self.reward, None, "auto"))


class Samples(NamedTuple):
    """Steps 1-3 for a batch of prompts: responses (B, R), response_mask (B, R), contains_stop (B,), scores (B,)
    before any penalty, the seconds spent sampling (steps 1-2), and with a list of rewards each one's raw score
    {name: (B,)} ({} for a single reward); from an environment also policy_mask (B, R) and step_rewards (B, R) or
    None (`environment_samples`); `each_reward`: every reward's raw scores and the rows it applies to (its metrics,
    `reward_stats`)."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    contains_stop: torch.Tensor
    scores: torch.Tensor
    generate_seconds: float
    reward_scores: dict | None = None
    policy_mask: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None
    each_reward: dict | None = None  # {name: (raw scores (B,), applies (B,) bool)} for every reward scored


@torch.no_grad()
def sample_and_score(parts: RolloutParts, policy: nn.Module, queries, query_mask, prompts: list, batch_size: int,
                     columns: dict[str, list] | None = None) -> Samples:
    """Steps 1-3, the path training and evaluation share: generate with `parts.engine` from the policy model
    (`policy.policy_model`, never a DDP wrapper), truncate after a stop token, score with `parts.reward` (a
    `RewardSet`: `parts.gather` updates its per-reward statistics). `columns`: the prompt dataset's other columns,
    one value per row, for the reward functions (`reward_calls.call_reward`); `batch_size` rows per scoring pass.
    """
    reward, tokenizer = parts.reward, parts.tokenizer
    with gathered(policy):  # under FSDP: every shard gathered once, for all of steps 1-3
        start = time.perf_counter()
        responses = parts.engine.generate(policy.policy_model, queries, query_mask)  # 1.
        responses, response_mask, contains_stop = truncate_after_stop(responses, parts.stop_token_ids,
                                                                      tokenizer.pad_token_id)  # 2.
        generated = time.perf_counter()
        every = reward.score_each(queries=queries, query_mask=query_mask, responses=responses,  # 3.
                                  response_mask=response_mask, tokenizer=tokenizer, prompts=prompts,
                                  batch_size=batch_size, columns=columns, hooks=parts.hooks)
        scores = reward.combine(every, prompts, parts.gather)
    each = {name: raw for name, (raw, _) in every.items()} if reward.is_list else {}
    return Samples(responses, response_mask, contains_stop, scores, generated - start, each, each_reward=every)


@torch.no_grad()
def environment_samples(parts: RolloutParts, policy: nn.Module, queries, query_mask, prompts: list, batch_size: int,
                        response_length: int, columns: dict[str, list] | None = None) -> Samples:
    """Steps 1-3 through `parts.environment` (`rollout/environments.py`): its episodes, sampled with `parts.engine`
    from the policy, padded to `response_length`; samples without a score of their own are scored with
    `parts.reward` on the whole episode. `contains_stop`: the policy sampled a stop token somewhere in the episode.

    The environment works on the CPU whatever the policy's device: the prompts' `ids` it gets and the tokens `sample`
    returns are CPU tensors (an environment written and tested on a CPU runs unchanged on a GPU); the sequences it
    passes to `sample` and the samples it returns may be on any device (`check_sequences` and `collate` take them to
    the CPU; the engine then samples on the policy's device, and the episodes come back on the queries')."""
    environment, engine, tokenizer, stop_token_ids = parts.environment, parts.engine, parts.tokenizer, \
        parts.stop_token_ids
    start, pad = time.perf_counter(), tokenizer.pad_token_id
    # Who gave the samples, for the errors of the boundary checks (`check_sequences`, `collate`).
    source = getattr(environment, "source", None) or f"{type(environment).__name__}.rollout"
    rows, device = embedding_rows(policy.policy_model), input_device(policy.policy_model)

    def sample(sequences: list[torch.Tensor], max_new_tokens: int | None = None) -> list[torch.Tensor]:
        sequences = check_sequences(sequences, source, rows)  # 1-D long CPU tensors
        width = max(len(seq) for seq in sequences)
        ids = torch.full((len(sequences), width), pad, dtype=queries.dtype)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq):], mask[row, width - len(seq):] = seq, True
        ids, mask = ids.to(device), mask.to(device)
        new, new_mask, _ = truncate_after_stop(engine.generate(policy.policy_model, ids, mask), stop_token_ids, pad)
        new, new_mask = new.cpu(), new_mask.cpu()  # one copy for the batch, not one per row
        return [row[keep][:max_new_tokens] for row, keep in zip(new, new_mask)]

    cpu_queries, cpu_mask = queries.cpu(), query_mask.cpu().bool()
    episodes = environment.rollout([Prompt(q[m], p) for q, m, p in zip(cpu_queries, cpu_mask, prompts)], sample)
    out = collate(episodes, len(queries), response_length, pad, queries.device, source=source, rows=rows)
    contains_stop = (torch.isin(out.responses, stop_tensor(stop_token_ids, queries.device)) & out.policy_mask).any(1)
    generated = time.perf_counter()
    scores, each, every = out.scores, {}, None
    given_nonfinite = out.given & ~torch.isfinite(out.scores)
    if given_nonfinite.any():  # the row leaves the update (`unscored_rows`): said once, naming who gave the score
        parts.reward.warn_nonfinite(f"<{source}>", out.scores, given_nonfinite, prompts, who=f"{source} (its score)")
    if not out.given.all():  # 3. the trainer's rewards score the episodes that came back without a score
        every = parts.reward.score_each(queries=queries, query_mask=query_mask, responses=out.responses,
                                        response_mask=out.response_mask, tokenizer=tokenizer, prompts=prompts,
                                        batch_size=batch_size, columns=columns, hooks=parts.hooks)
        scored = parts.reward.combine(every, prompts, parts.gather)
        each = {name: raw for name, (raw, _) in every.items()} if parts.reward.is_list else {}
        scores = torch.where(out.given, scores, scored.to(scores.dtype))
    return Samples(out.responses, out.response_mask, contains_stop, scores, generated - start, each,
                   out.policy_mask, out.step_rewards, every)


def without_uniform_groups(batch: RolloutBatch, scores: torch.Tensor, k: int,
                           uniform: torch.Tensor | None = None) -> tuple[RolloutBatch, torch.Tensor]:
    """DAPO's dynamic sampling, the dropping half (the refill: `rollout_with_refill`): the rows of every group of `k`
    whose `scores` (B,) are all equal get an all-False response_mask and policy_mask, so they leave every loss term
    and its normaliser (the minibatch's real tokens or responses); the batch keeps its size. `uniform` (B,) bool:
    those rows, when the caller has them (`uniform_scored_groups`: over the rows still in the update). Returns the
    batch and the number of groups dropped (a float tensor)."""
    kept = ~(uniform_groups(scores, k) if uniform is None else uniform).unsqueeze(1)
    return (replace(batch, response_mask=batch.response_mask & kept, policy_mask=batch.policy_mask & kept),
            (~kept).sum().float() / k)


@dataclass
class Rollout:
    """What `rollout` returns: the batch, its statistics (`rollout_stats`, then with a list of rewards each one's
    mean raw score as `objective/scores/<name>`), the seconds spent sampling (steps 1-2) and scoring (steps 3-4:
    the rewards alone), each reward's raw scores {name: (B,)} ({} for a single reward), the rows
    `drop_uniform_groups` masked, the number of tokens the policy sampled (dropped rows included), and the seconds of
    the policy's no-grad pass (step 5: old log-probs and values) and of the reference's (step 6). The trainer logs
    the four times apart (`time/generate`, `time/score`, `time/policy_forward`, `time/reference`): a reward that
    looks slow is then the reward, not the forwards after it. `unscored`: the rows left out of the update because a
    reward scored them NaN/inf (`unscored_rows`)."""

    batch: RolloutBatch
    stats: dict[str, torch.Tensor]
    generate_seconds: float
    score_seconds: float
    reward_scores: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: torch.Tensor | None = None  # (B,) bool: the rows `drop_uniform_groups` masked (None: it is off)
    generated_tokens: int = 0
    policy_forward_seconds: float = 0.0
    reference_seconds: float = 0.0
    unscored: torch.Tensor | None = None  # (B,) bool: the rows left out of the update for a NaN/inf score
    uniform: dict = field(default_factory=dict)  # `uniform_rewards`: the rewards every sample got one value of


def _clock(device: torch.device) -> float:
    """`time.perf_counter()` once the work queued on `device` is done (CUDA runs asynchronously: without the wait,
    a phase's time would land in the next phase's)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def rollout(policy: nn.Module, queries, query_mask, prompts: list, parts: RolloutParts, settings: RolloutSettings,
            columns: dict[str, list] | None = None) -> Rollout:
    """Steps 1-9 of one PPO iteration (see the module docstring) for left-padded prompts (B, Q).

    `policy` is the actor-critic (`AutoModelForCausalLMWithValueHead`, or `PolicyAndCritic` with or without a
    critic), unwrapped; `parts` what it samples, scores and compares with (`RolloutParts`); `settings` how
    (`RolloutSettings`). The B prompts come as `num_generations` consecutive copies of each
    (`data.RolloutRepeatSampler`); the group estimators compare the responses of each group. Without a critic,
    `values` are zeros and unused. With `drop_uniform_groups`, the groups whose shaped scores are all equal leave the
    update (`without_uniform_groups`) after the statistics, which describe everything sampled (`rollout_with_refill`
    refills their places). With `parts.environment` (`rollout/environments.py`) steps 1-3 are its episodes
    (`environment_samples`, `response_length` wide). `columns`: the prompt dataset's other columns, one value per
    prompt row, for the reward functions.
    """
    estimator, sampling = settings.estimator, settings.sampling
    k, batch_size, temperature = estimator.num_generations, sampling.forward_batch_size, sampling.temperature
    if len(queries) % k:
        raise ValueError(f"{len(queries)} prompts are not whole groups of num_generations={k}.")
    with gathered(policy):  # under FSDP: every shard gathered once, for all of steps 1-6 (runtime/sharding.py)
        start = time.perf_counter()
        # 1-3. Generate, truncate after the stop token, score (and combine a list of rewards); or an environment's
        # episodes.
        if parts.environment is None:
            samples = sample_and_score(parts, policy, queries, query_mask, prompts, batch_size, columns)
        else:
            samples = environment_samples(parts, policy, queries, query_mask, prompts, batch_size,
                                          sampling.response_length, columns)
        responses, response_mask, contains_stop = samples[:3]
        policy_mask = samples.policy_mask if samples.policy_mask is not None else response_mask.clone()
        # 4. The EOS penalty, on responses that never stopped; the overlong penalty.
        scores = penalize(samples.scores, contains_stop, response_mask, missing_eos_penalty=settings.missing_eos_penalty,
                          overlong_buffer_length=settings.overlong_buffer_length,
                          overlong_penalty_factor=settings.overlong_penalty_factor)
        scored = _clock(queries.device)
        # 5. Old log-probs and values, in one pass (the value head's values come from the policy's own forward).
        # Skipped where the update reads its own forward's log-probs (`skip_old_logprobs`), unless truncated
        # importance sampling has no engine log-probs to weigh against (then these are the sampling ones).
        has_critic = policy.has_critic
        sampled = parts.engine.last_logprobs() if parts.environment is None else None  # vLLM's, for its correction
        sampled = sampled if sampled is not None and sampled.shape == response_mask.shape else None
        skip_old = settings.skip_old_logprobs and not has_critic and (sampled is not None
                                                                       or not settings.importance_sampling)
        if skip_old:  # placeholders no update reads: its loss takes the log-probs of its own forward
            logprobs, values, entropy = torch.zeros(response_mask.shape, device=queries.device), None, None
        else:
            logprobs, values, entropy = policy_forward(policy, queries, query_mask, responses, response_mask,
                                                       temperature=temperature, batch_size=batch_size,
                                                       with_entropy=True, with_values=has_critic,
                                                       memory_bytes=settings.memory_bytes)
        forwarded = _clock(queries.device)
        # 6. Reference log-probs; skipped (`skip_reference`) where no reward and no loss term reads the KL.
        if settings.skip_reference:  # the policy's own: a KL of exactly 0 for every estimator, read by no update
            ref_logprobs = logprobs.clone()
        else:
            ref_logprobs = reference_logprobs(policy, parts.ref_model, queries, query_mask, responses, response_mask,
                                              temperature=temperature, batch_size=batch_size,
                                              ref_adapter=parts.ref_adapter, memory_bytes=settings.memory_bytes)
        referenced = _clock(queries.device)
    # 7-8. Shaped scores -> rewards and advantages (the advantage estimator). A row a reward scored NaN/inf (with a
    # group estimator, its whole group) leaves the update: its masks are cleared and its NaN/inf a placeholder 0
    # (`unscored_rows`), so the rest of the rollout trains. With no row left, the scores stay as they are and the
    # trainer's guard drops the whole rollout (trainer/guard.py).
    shaped = parts.shape_scores(scores)  # the running statistics read the finite scores alone
    finite = torch.isfinite(scores)
    unscored = unscored_rows(scores, estimator)
    left_out = bool(unscored.any()) and not bool(unscored.all())
    update_mask = policy_mask
    if left_out:
        scores = torch.where(finite, scores, torch.zeros_like(scores))
        shaped = torch.where(torch.isfinite(shaped), shaped, torch.zeros_like(shaped))
        update_mask = policy_mask & ~unscored.unsqueeze(1)
    kl, rewards = compute_advantages(logprobs, ref_logprobs, values, update_mask, shaped, estimator,
                                     step_rewards=samples.step_rewards,
                                     index=group_index(len(scores), k, unscored if left_out else None))
    estimator_stats = rewards.pop("stats", {})  # an estimator's own metrics (auto: which advantages it used)
    values = values if has_critic else torch.zeros_like(logprobs)
    batch = RolloutBatch(queries, query_mask, responses, response_mask, logprobs, ref_logprobs, values, scores,
                         contains_stop, **rewards, policy_mask=policy_mask, sampling_logprobs=sampled)
    # 9. Statistics (of everything sampled; the score means over the finite scores). None that reads a skipped pass:
    # absent, never a placeholder's 0 (`skipped_stats`).
    stats = rollout_stats(batch, kl, entropy if entropy is not None else torch.zeros_like(logprobs),
                          parts.stop_token_ids, has_critic, finite if left_out else None)
    for name in skipped_stats(skip_old, settings.skip_reference):
        del stats[name]
    stats.update(combined_reward_stats(samples.scores, parts.gather))
    stats.update(estimator_stats)
    if left_out:
        kept = ~unscored.unsqueeze(1)
        batch = replace(batch, response_mask=batch.response_mask & kept, policy_mask=batch.policy_mask & kept)
    each = samples.reward_scores or {}
    per_reward = reward_stats(samples.each_reward or {}, parts.gather)
    # A reward's None rows are no score of 0: its mean is over the rows it applies to.
    stats.update({f"objective/scores/{name}": per_reward.get(f"rewards/{name}/mean", raw.mean())
                  for name, raw in each.items()})
    stats.update(per_reward)
    stats.update(engine_stats(parts.engine, logprobs if parts.environment is None and not skip_old else None,
                              policy_mask))
    stats["frac_reward_zero_std"] = frac_reward_zero_std(samples.scores, k, parts.gather)
    uniform = uniform_rewards(samples.scores, samples.each_reward or {}, parts.gather)
    dropped = None
    if settings.drop_uniform_groups:
        dropped = uniform_scored_groups(shaped, unscored, k) if left_out else uniform_groups(shaped, k)
        batch, stats["rollout/groups_dropped"] = without_uniform_groups(batch, shaped, k, dropped)
        dropped = dropped | (unscored if left_out else torch.zeros_like(dropped))  # the refill fills them too
    return Rollout(batch, stats, samples.generate_seconds, scored - start - samples.generate_seconds, each, dropped,
                   int(policy_mask.sum().item()), policy_forward_seconds=forwarded - scored,
                   reference_seconds=referenced - forwarded,
                   unscored=unscored if left_out else torch.zeros_like(unscored), uniform=uniform)
