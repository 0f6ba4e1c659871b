"""Rollout: one PPO iteration's experience, in the numbered steps used everywhere (README, trainer, here).

`rollout` runs them in order and returns a `RolloutBatch`, complete when constructed, and its statistics:
1. generate: the rollout engine (`generation.py`) samples `response_length` tokens for the left-padded prompts;
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
8. rewards and advantages: the `advantage_estimator` (`compute_advantages`, `estimators.py`): for PPO KL-penalised
   per-token rewards, GAE, whitening; or a critic-free estimator over each prompt's `num_generations` responses;
9. statistics: `rollout_stats`, one dict of batch means.
The trainer then moves the KL controller (step 10) and runs the clipped PPO update (step 11).
Micro-batching (`batch_size`) bounds the memory of every no-grad pass, and `memory_bytes` the fp32 work on the logits
(log-probs and entropy in chunks of positions, `ppo_math.over_positions`).
"""

from __future__ import annotations

import contextlib
import numbers
import time
from dataclasses import dataclass, field, fields
from typing import Callable, NamedTuple

import torch
from torch import nn

from .adapters import adapter_active
from .estimators import ESTIMATORS, EstimatorSettings
from .generation import RolloutEngine, chunks, stop_tensor
from .modeling import scores_as_loaded
from .ppo_math import (
    LOGITS_MEMORY_BYTES,
    RunningMoments,
    entropy_from_logits,
    explained_variance,
    kl_estimate,
    last_token_index,
    logprobs_from_logits,
    loss_normalizer,
    masked_mean,
    masked_sum,
    overlong_penalty,
)
from .reporting import warn_user
from .sharding import gathered

@dataclass
class RolloutBatch:
    """One PPO iteration's experience. B = prompts, Q = prompt length (left-padded), R = response_length.

    queries (B, Q) long; query_mask (B, Q) bool; responses (B, R) long, pad after the stop token;
    response_mask (B, R) bool, True = a real response token (the stop token included); logprobs, ref_logprobs,
    values (B, R) float32 from the rollout-time policy / reference / critic (zeros without a critic); scores (B,)
    reward after penalties;
    contains_stop (B,) bool; rewards, non_score_rewards, advantages, returns (B, R), 0 at masked positions.
    Every field is set at construction (`rollout` builds it once everything is computed).
    """

    queries: torch.Tensor
    query_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    contains_stop: torch.Tensor
    rewards: torch.Tensor
    non_score_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def __len__(self) -> int:
        return self.queries.shape[0]

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """The rows `index` of every tensor (a minibatch or micro-batch)."""
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def sequence_inputs(queries, query_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / position_ids of prompt + response; positions count real tokens only."""
    attention_mask = torch.cat([query_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": torch.cat([queries, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids}


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
        inputs = sequence_inputs(queries[rows], query_mask[rows], responses[rows], response_mask[rows])
        out = model(**inputs, logits_to_keep=R + 1, use_cache=False)
        logits = out.logits[:, :-1]
        logprobs.append(logprobs_from_logits(logits, responses[rows], temperature, memory_bytes))
        if with_values:
            values.append(out.value[:, :-1].float())
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


def pools_itself(reward_model: nn.Module) -> bool:
    """True for a sequence classifier that pools on its own (no `score` head over its backbone).

    Decoder reward models in transformers (Llama, Qwen, Mistral, GPT-2, ...) put a `score` head on every position;
    encoders (BERT, RoBERTa, DeBERTa) pool the first ([CLS]) position through `pooler` / `classifier` instead.
    """
    backbone = getattr(reward_model, getattr(reward_model, "base_model_prefix", ""), None)
    return backbone is None or not isinstance(getattr(reward_model, "score", None), nn.Module)


def right_aligned(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move each row's real tokens (mask True) to the front, order kept: (B, T) -> (mask, *tensors) right-padded.

    Encoders pool at position 0 and number positions from 0, so their inputs must start at the first real token.
    """
    order = torch.sort((~mask).long(), dim=1, stable=True).indices
    return (mask.gather(1, order), *(t.gather(1, order) for t in tensors))


@torch.no_grad()
@scores_as_loaded  # a `reward_lora` critic's adapter on the reward model's base is disabled while it scores
def reward_model_scores(reward_model: nn.Module, input_ids, attention_mask, batch_size: int,
                        token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar score of each sequence. input_ids/attention_mask/token_type_ids (B, T) -> (B,) fp32.

    A decoder reward model (`score` head): the head runs on the backbone's hidden states and the value at the last
    position with attention_mask == 1 is taken, so any padding side works and its pad_token_id never matters. A model
    that pools itself (encoders: [CLS] through `pooler` + `classifier`) runs its own forward on right-padded inputs
    (real tokens moved to the front, pad slots masked and filled with its pad id), exactly as it was trained.
    Inputs longer than the reward model's context (`max_position_embeddings`) never run past it (`fit_context`).
    """
    scores = []
    own_pooling = pools_itself(reward_model)
    attention_mask = fit_context(attention_mask, reward_context(reward_model), own_pooling)
    for rows in chunks(input_ids.shape[0], batch_size):
        ids, mask = input_ids[rows], attention_mask[rows].bool()
        if own_pooling:
            extra = {}
            if token_type_ids is not None:
                mask, ids, extra["token_type_ids"] = right_aligned(mask, ids, token_type_ids[rows])
            else:
                mask, ids = right_aligned(mask, ids)
            pad_id = getattr(reward_model.config, "pad_token_id", None)
            ids = ids.masked_fill(~mask, pad_id if pad_id is not None else 0)
            logits = reward_model(input_ids=ids, attention_mask=mask.long(), **extra).logits
            scores.append(logits[:, 0].float())
            continue
        backbone = getattr(reward_model, reward_model.base_model_prefix)
        position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
        hidden = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids).last_hidden_state
        per_token = reward_model.score(hidden)[..., 0]
        last = last_token_index(mask)
        scores.append(per_token[torch.arange(ids.shape[0], device=ids.device), last].float())
    return torch.cat(scores)


def reward_context(reward_model: nn.Module) -> int | None:
    """The reward model's context length (its text config's `max_position_embeddings`), or None when it has none."""
    config = reward_model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def fit_context(attention_mask: torch.Tensor, context: int | None, own_pooling: bool) -> torch.Tensor:
    """The mask (B, T) a reward model of `context` positions can score: unchanged when every row fits.

    A decoder reward model (score at the last real token) scores a longer row on its last `context` real tokens:
    the start of the prompt is cut, the response and the token the score is read at are kept, with one warning. An
    encoder (pooling its first token) cannot be cut without losing [CLS] or the response: an error names the fix.
    """
    lengths = attention_mask.sum(1)
    if context is None or int(lengths.max()) <= context:
        return attention_mask
    fix = ("lower max_prompt_length or response_length so that prompt + response fit, in the reward tokenizer's "
           "tokens")
    if own_pooling:
        raise ValueError(f"A reward input has {int(lengths.max())} tokens, more than the reward model's context of "
                         f"{context} (max_position_embeddings): {fix}; with reward_input_format='pair' the question "
                         "is truncated instead.")
    warn_user(f"{int((lengths > context).sum())} reward input(s) have up to {int(lengths.max())} tokens, more than "
              f"the reward model's context of {context}: each is scored on its last {context} tokens (the "
              f"prompt's start is cut). To score whole inputs, {fix}.")
    mask = attention_mask.bool()
    tokens_after = mask.flip(1).long().cumsum(1).flip(1)  # real tokens at or after each position
    return (mask & (tokens_after <= context)).to(attention_mask.dtype)


def check_reward_values(values, expected: int) -> torch.Tensor:
    """A reward callable's output as a (B,) float32 tensor: a sequence, 1-D tensor or 1-D array of `expected` numbers.

    Anything else (a dict, a 2-D tensor, strings, None entries, a single number) is an error that says what came
    back. NaN/inf pass through: the trainer drops such a rollout (see guard.py).
    """
    fix = f"return one number per (prompt, completion) pair: a list of {expected} floats or a 1-D tensor/array"
    if hasattr(values, "ndim") and hasattr(values, "shape"):  # torch tensor or numpy array
        if values.ndim != 1:
            raise TypeError(f"The reward function returned a {type(values).__name__} of shape {tuple(values.shape)}: "
                            f"{fix} (e.g. .squeeze(-1) on (B, 1) logits).")
        try:
            scores = torch.as_tensor(values).detach().to(device="cpu", dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"The reward function returned a {type(values).__name__} of dtype {values.dtype}: "
                            f"{fix}.") from err
    elif isinstance(values, (str, bytes, dict)) or not isinstance(values, (list, tuple)):
        shown = f"a dict with keys {list(values)[:5]}" if isinstance(values, dict) else f"{values!r:.100}"
        raise TypeError(f"The reward function returned {type(values).__name__} {shown}: {fix}.")
    else:
        bad = [(i, v) for i, v in enumerate(values) if not _is_number(v)]
        if bad:
            i, v = bad[0]
            raise TypeError(f"The reward function returned a non-number at position {i}: {type(v).__name__} "
                            f"{v!r:.60} ({len(bad)} such entries): {fix}.")
        scores = torch.tensor([float(v) for v in values], dtype=torch.float32)
    if scores.numel() != expected:
        raise ValueError(f"The reward function returned {scores.numel()} scores for {expected} completions: it must "
                         "return one float per (prompt, completion) pair, in order.")
    return scores


def probe_reward_callable(reward, train_dataset, tokenizer) -> None:
    """Call a reward callable once at construction on two prompts with empty completions: a wrong return type or
    NaN/inf fails now, naming the fix, not at the first rollout. Models and a missing dataset are skipped."""
    if not callable(reward) or isinstance(reward, nn.Module) or train_dataset is None:
        return
    probe = [train_dataset[i]["prompt"] for i in range(min(2, len(train_dataset)))]
    probe = [p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False) for p in probe]
    if not torch.isfinite(check_reward_values(reward(probe, [""] * len(probe)), len(probe))).all():
        raise ValueError("The reward function returned NaN/inf for the probe (prompts, empty completions): "
                         "return finite floats.")


def _is_number(value) -> bool:
    """A real number: int/float/bool, a numpy scalar, or a one-element tensor/array (not a string, not None)."""
    if isinstance(value, (str, bytes)) or value is None:
        return False
    if isinstance(value, numbers.Real):
        return True
    return getattr(value, "ndim", None) == 0 or getattr(value, "shape", None) in ((), (1,))


def decode_masked(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decode the real tokens (mask True) of prompts or responses, without special tokens (stop token, padding)."""
    return tokenizer.batch_decode(ids.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)


def encodes_pairs(tokenizer) -> bool:
    """True when the tokenizer marks a text pair with special tokens ([CLS] q [SEP] a [SEP] and the like)."""
    if getattr(tokenizer, "sep_token", None) is None:
        return False
    return tokenizer.num_special_tokens_to_add(pair=True) > tokenizer.num_special_tokens_to_add(pair=False)


def reward_input_format(requested: str, reward_model: nn.Module, reward_tokenizer, conversational: bool) -> str:
    """Resolve `reward_input_format` ('auto', 'chat', 'pair', 'concat') to 'chat', 'pair' or 'concat'.

    'auto': the reward tokenizer's chat template for chat prompts; else a (question, answer) pair for a model that
    pools itself (an encoder) whose tokenizer encodes pairs; else the concatenation. A forced 'chat' that cannot
    apply is an error naming the fix.
    """
    has_template = bool(getattr(reward_tokenizer, "chat_template", None))
    if requested == "chat":
        if not conversational:
            raise ValueError("reward_input_format='chat' needs chat prompts (a 'messages' column, or 'prompt' rows that "
                             "are lists of {'role', 'content'} turns); with text prompts use 'concat', 'pair' or 'auto'.")
        if not has_template:
            raise ValueError("reward_input_format='chat' needs a reward tokenizer with a chat template: pass "
                             "reward_processing_class=<the reward model's tokenizer> with `chat_template` set, or use "
                             "reward_input_format='concat' or 'auto'.")
        return "chat"
    if requested in ("pair", "concat"):
        return requested
    if conversational and has_template:
        return "chat"
    if pools_itself(reward_model) and encodes_pairs(reward_tokenizer):
        return "pair"
    return "concat"


def _question_text(prompt, decoded: str) -> str:
    """The question of a (question, answer) pair: the prompt the policy saw, or a chat's turns as plain text."""
    if isinstance(prompt, list):
        return "\n\n".join(str(turn.get("content") or "") for turn in prompt)
    return decoded


@torch.no_grad()
def score_responses(
    reward, *, queries, query_mask, responses, response_mask, tokenizer, prompts: list, batch_size: int,
    reward_tokenizer=None, input_format: str = "auto",
) -> torch.Tensor:
    """One score per response: (B,) fp32.

    `reward` is a callable `(prompts, completions) -> list[float]` (called on text), or a frozen reward model.
    With `reward_tokenizer=None` the reward model shares the policy's tokenizer and reads prompt + response as token
    ids (no decode: the 'concat' format's fast path). Otherwise prompt and response are decoded and given in
    `input_format` (see `reward_input_format`, resolved per batch): the conversation rendered with the reward
    tokenizer's chat template ('chat'), a (question, answer) text pair ('pair'), or prompt + response ('concat').
    """
    if callable(reward) and not isinstance(reward, nn.Module):
        prompt_texts = decode_masked(tokenizer, queries, query_mask)
        values = reward(prompt_texts, decode_masked(tokenizer, responses, response_mask))
        return check_reward_values(values, len(prompt_texts)).to(queries.device)
    if reward_tokenizer is None:
        inputs = sequence_inputs(queries, query_mask, responses, response_mask)
        return reward_model_scores(reward, inputs["input_ids"], inputs["attention_mask"], batch_size)
    conversational = all(isinstance(p, list) for p in prompts)
    kind = reward_input_format(input_format, reward, reward_tokenizer, conversational)
    prompt_texts = decode_masked(tokenizer, queries, query_mask)
    completions = decode_masked(tokenizer, responses, response_mask)
    if kind == "chat":
        texts = [reward_tokenizer.apply_chat_template(p + [{"role": "assistant", "content": c}], tokenize=False)
                 for p, c in zip(prompts, completions)]
        encoded = reward_tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    elif kind == "pair":
        questions = [_question_text(p, t) for p, t in zip(prompts, prompt_texts)]
        context = reward_context(reward)  # too long: the question is cut, the answer kept
        encoded = reward_tokenizer(questions, completions, padding=True, return_tensors="pt",
                                   **({"truncation": "only_first", "max_length": context} if context else {}))
    else:
        encoded = reward_tokenizer([p + c for p, c in zip(prompt_texts, completions)], padding=True,
                                   return_tensors="pt")
    device = queries.device
    token_types = encoded.get("token_type_ids") if kind == "pair" else None
    return reward_model_scores(reward, encoded["input_ids"].to(device), encoded["attention_mask"].to(device),
                               batch_size, None if token_types is None else token_types.to(device))


@torch.no_grad()
def compute_advantages(
    logprobs, ref_logprobs, values, response_mask, shaped_scores: torch.Tensor, *, kl_coef: float, kl_estimator: str,
    gamma: float, lam: float, whiten_rewards: bool, whiten_advantages: bool, advantage_estimator: str = "gae",
    num_generations: int = 1, scale_rewards: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Step 8: the per-token KL (B, R) and {rewards, non_score_rewards, advantages, returns} (B, R) of a rollout,
    from `advantage_estimator` (see `estimators.py`: where its KL penalty enters, what it normalises).

    values (B, R) from the critic, or None for a critic-free estimator; the B rows hold `num_generations`
    consecutive responses per prompt.
    """
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
    settings = EstimatorSettings(kl_coef, num_generations, gamma, lam, whiten_rewards, whiten_advantages, scale_rewards)
    return kl, ESTIMATORS[advantage_estimator].compute(shaped_scores, kl, response_mask, values, settings)


ROLLOUT_STATS = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                 "objective/scores", "rollout/response_length", "rollout/eos_rate", "val/num_eos_tokens",
                 "val/explained_variance", "policy/entropy_avg", "rollout/advantages_mean", "rollout/returns_mean"]
CRITIC_STATS = {"val/explained_variance"}  # absent from the logs of a run without a critic


@torch.no_grad()
def rollout_stats(batch: RolloutBatch, kl: torch.Tensor, entropy: torch.Tensor, stop_token_ids,
                  has_critic: bool = True) -> dict:
    """Step 9: the metrics named in `ROLLOUT_STATS` (a dict, in that order; stack it for one all-reduce), without
    the critic's (`CRITIC_STATS`) when `has_critic` is False.

    Sequence-level sums as the removed TRL trainer logged them (KL, -logp "entropy", non-score reward per response),
    then means over the batch; `policy/entropy_avg` is the per-token entropy of the temperature-scaled policy
    at rollout time (measured once per iteration, not per micro-batch). `rollout/eos_rate` is the fraction of
    responses that stopped and `val/num_eos_tokens` the number of stop tokens among the real response tokens, for
    every id in `stop_token_ids`.
    """
    mask = batch.response_mask
    num_stop_tokens = (torch.isin(batch.responses, stop_tensor(stop_token_ids, mask.device)) & mask).sum().float()
    non_score = masked_sum(batch.non_score_rewards, mask, dim=1)
    stats = dict(zip(ROLLOUT_STATS, [
        masked_sum(kl, mask, dim=1).mean(), masked_sum(-batch.logprobs, mask, dim=1).mean(), non_score.mean(),
        (batch.scores + non_score).mean(), batch.scores.mean(), mask.sum(1).float().mean(),
        batch.contains_stop.float().mean(), num_stop_tokens,
        explained_variance(batch.values, batch.returns, mask), masked_mean(entropy, mask),
        masked_mean(batch.advantages, mask), masked_mean(batch.returns, mask),
    ]))
    return stats if has_critic else {k: v for k, v in stats.items() if k not in CRITIC_STATS}


def reward_name(reward) -> str:
    """How the logs name a reward: an id/path's last part, a callable's `__name__`, a model's `name_or_path`'s last
    part, else the class name."""
    source = reward if isinstance(reward, str) else getattr(reward, "name_or_path", None)
    if isinstance(source, str) and source.strip("/\\"):
        return source.replace("\\", "/").rstrip("/").split("/")[-1]
    name = getattr(reward, "__name__", None)
    return name.strip("<>") if isinstance(name, str) else type(reward).__name__  # "<lambda>" -> "lambda"


def unique_names(names: list[str]) -> list[str]:
    """`names` with repeats numbered (`a`, `a_2`, `a_3`), so each reward has a metric of its own."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique


@contextlib.contextmanager
def naming_reward(name: str | None, index: int):
    """Errors raised inside name the reward of a list they come from (`name` None: a single reward, as it is)."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if name is None:
            raise
        raise type(err)(f"Reward {name!r} (reward_model[{index}]): {err}") from err


class RewardSet:
    """The run's rewards, scored at step 3 and combined: one reward model / callable, or a list with weights.

    Each reward keeps its own tokenizer (None: it reads the policy's token ids; see `score_responses`) and reads
    (prompt, response) in `input_format`, resolved per model. The score is sum_i w_i * r_i, each r_i first normalised
    by its own running mean/std (`normalize_each`, statistics over all processes) when asked. A single reward given
    alone (`is_list=False`) with weight 1.0 and no normalisation scores exactly as `score_responses`.
    """

    def __init__(self, rewards: list, tokenizers: list, names: list[str], weights: list[float], *,
                 input_format: str = "auto", normalize_each: bool = False, is_list: bool = True):
        self.rewards, self.tokenizers, self.names, self.weights = list(rewards), list(tokenizers), names, weights
        self.input_format, self.is_list = input_format, is_list
        self.moments = [RunningMoments() for _ in rewards] if normalize_each else None

    @classmethod
    def single(cls, reward, reward_tokenizer=None, input_format: str = "auto") -> "RewardSet":
        """One reward model / callable, scored as it is."""
        return cls([reward], [reward_tokenizer], [reward_name(reward)], [1.0], input_format=input_format,
                   is_list=False)

    @property
    def tokenizer(self):
        """The reward tokenizer of a single reward (None: the policy's ids), or the list of them."""
        return self.tokenizers if self.is_list else self.tokenizers[0]

    @torch.no_grad()
    def score(self, *, queries, query_mask, responses, response_mask, tokenizer, prompts: list, batch_size: int,
              gather: Callable | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the combined score (B,), {name: the reward's raw score (B,)} for a list, else {}).

        `gather` (training): the per-reward statistics take in this batch, gathered over processes, before
        normalising; None (evaluation): they normalise with what they hold, unchanged.
        """
        combined, raw = None, {}
        for i, (reward, reward_tokenizer, name) in enumerate(zip(self.rewards, self.tokenizers, self.names)):
            with naming_reward(name if self.is_list else None, i):
                scores = score_responses(reward, queries=queries, query_mask=query_mask, responses=responses,
                                         response_mask=response_mask, tokenizer=tokenizer, prompts=prompts,
                                         batch_size=batch_size, reward_tokenizer=reward_tokenizer,
                                         input_format=self.input_format)
            raw[name] = scores
            if self.moments is not None:
                if gather is not None:
                    self.moments[i].update(gather(scores))
                scores = self.moments[i].normalize(scores)
            term = self.weights[i] * scores
            combined = term if combined is None else combined + term
        return combined, (raw if self.is_list else {})

    def state_dict(self) -> dict | None:
        """The per-reward running statistics by name (None without `normalize_each`): JSON-able, for checkpoints."""
        if self.moments is None:
            return None
        return {name: m.state_dict() for name, m in zip(self.names, self.moments)}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore `state_dict()`; the checkpoint's rewards must be this run's (same names)."""
        if self.moments is None or state is None:
            return
        if list(state) != self.names:
            raise ValueError(f"The checkpoint normalised the rewards {list(state)}, this run has {self.names}: resume "
                             "with the same rewards, in the same order.")
        for name, m in zip(self.names, self.moments):
            m.load_state_dict(state[name])


class Samples(NamedTuple):
    """Steps 1-3 for a batch of prompts: responses (B, R), response_mask (B, R), contains_stop (B,), scores (B,)
    before any penalty, the seconds spent sampling (steps 1-2), and with a list of rewards each one's raw score
    {name: (B,)} ({} for a single reward)."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    contains_stop: torch.Tensor
    scores: torch.Tensor
    generate_seconds: float
    reward_scores: dict | None = None


@torch.no_grad()
def sample_and_score(engine: RolloutEngine, policy: nn.Module, reward, queries, query_mask, prompts: list, *,
                     tokenizer, reward_tokenizer=None, input_format: str = "auto", stop_token_ids, batch_size: int,
                     gather: Callable | None = None) -> Samples:
    """Steps 1-3, the path training and evaluation share: generate with `engine` from the policy model
    (`policy.policy_model`, never a DDP wrapper), truncate after the stop token, score with `reward`.

    `reward`: a `RewardSet` (it holds its tokenizers and format; `gather` updates its per-reward statistics), or one
    reward model / callable read with `reward_tokenizer` and `input_format`.
    """
    if isinstance(reward, RewardSet):
        if reward_tokenizer is not None:
            raise ValueError("A RewardSet holds its own reward tokenizers: pass reward_tokenizer=None.")
    else:
        reward = RewardSet.single(reward, reward_tokenizer, input_format)
    with gathered(policy):  # under FSDP: every shard gathered once, for all of steps 1-3
        start = time.perf_counter()
        responses = engine.generate(policy.policy_model, queries, query_mask)  # 1.
        responses, response_mask, contains_stop = truncate_after_stop(responses, stop_token_ids,
                                                                      tokenizer.pad_token_id)  # 2.
        generated = time.perf_counter()
        scores, each = reward.score(queries=queries, query_mask=query_mask, responses=responses,  # 3.
                                    response_mask=response_mask, tokenizer=tokenizer, prompts=prompts,
                                    batch_size=batch_size, gather=gather)
    return Samples(responses, response_mask, contains_stop, scores, generated - start, each)


def penalize(scores: torch.Tensor, contains_stop: torch.Tensor, response_mask: torch.Tensor, *,
             missing_eos_penalty: float | None, overlong_buffer_length: int | None = None,
             overlong_penalty_factor: float = 1.0) -> torch.Tensor:
    """Step 4: `missing_eos_penalty` off the score of responses without a stop token, then DAPO's soft overlong
    penalty (`ppo_math.overlong_penalty`) over the last `overlong_buffer_length` of the response_length (R) tokens."""
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~contains_stop).float()
    if overlong_buffer_length is not None:
        scores = scores + overlong_penalty(response_mask.sum(1), response_mask.shape[1], overlong_buffer_length,
                                           overlong_penalty_factor)
    return scores


@dataclass
class Rollout:
    """What `rollout` returns: the batch, its statistics (`rollout_stats`, then with a list of rewards each one's
    mean raw score as `objective/scores/<name>`), the seconds spent sampling (steps 1-2) and scoring (steps 3-6), and
    each reward's raw scores {name: (B,)} ({} for a single reward)."""

    batch: RolloutBatch
    stats: dict[str, torch.Tensor]
    generate_seconds: float
    score_seconds: float
    reward_scores: dict[str, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def rollout(
    policy: nn.Module, queries, query_mask, prompts: list, *, engine: RolloutEngine, ref_model, ref_adapter, reward,
    tokenizer, reward_tokenizer=None, input_format: str = "auto", stop_token_ids, temperature: float, batch_size: int,
    missing_eos_penalty: float | None, shape_scores: Callable[[torch.Tensor], torch.Tensor], kl_coef: float,
    kl_estimator: str, gamma: float, lam: float, whiten_rewards: bool, whiten_advantages: bool,
    gather: Callable | None = None, overlong_buffer_length: int | None = None, overlong_penalty_factor: float = 1.0,
    advantage_estimator: str = "gae", num_generations: int = 1, scale_rewards: bool = True,
    memory_bytes: int = LOGITS_MEMORY_BYTES,
) -> Rollout:
    """Steps 1-9 of one PPO iteration (see the module docstring) for left-padded prompts (B, Q).

    `policy` is the actor-critic (`AutoModelForCausalLMWithValueHead`, or `PolicyAndCritic` with or without a
    critic), unwrapped; `reward` a `RewardSet` or one reward (see `sample_and_score`; `gather` updates a RewardSet's
    per-reward statistics); `shape_scores` maps the penalised scores (B,) to the ones the rewards use (step 7). The B
    prompts come as `num_generations` consecutive copies of each (`data.RolloutRepeatSampler`); the group
    estimators compare the responses of each group. Without a critic, `values` are zeros and unused.
    """
    if len(queries) % num_generations:
        raise ValueError(f"{len(queries)} prompts are not whole groups of num_generations={num_generations}.")
    with gathered(policy):  # under FSDP: every shard gathered once, for all of steps 1-6 (sharding.py)
        start = time.perf_counter()
        # 1-3. Generate, truncate after the stop token, score (and combine a list of rewards).
        samples = sample_and_score(engine, policy, reward, queries, query_mask, prompts, tokenizer=tokenizer,
                                   reward_tokenizer=reward_tokenizer, input_format=input_format,
                                   stop_token_ids=stop_token_ids, batch_size=batch_size, gather=gather)
        responses, response_mask, contains_stop = samples[:3]
        # 4. The EOS penalty, on responses that never stopped; the overlong penalty.
        scores = penalize(samples.scores, contains_stop, response_mask, missing_eos_penalty=missing_eos_penalty,
                          overlong_buffer_length=overlong_buffer_length, overlong_penalty_factor=overlong_penalty_factor)
        # 5. Old log-probs and values, in one pass.
        has_critic = policy.has_critic
        logprobs, values, entropy = policy_forward(policy, queries, query_mask, responses, response_mask,
                                                   temperature=temperature, batch_size=batch_size, with_entropy=True,
                                                   with_values=has_critic, memory_bytes=memory_bytes)
        # 6. Reference log-probs.
        ref_logprobs = reference_logprobs(policy, ref_model, queries, query_mask, responses, response_mask,
                                          temperature=temperature, batch_size=batch_size, ref_adapter=ref_adapter,
                                          memory_bytes=memory_bytes)
    scored = time.perf_counter()
    # 7-8. Shaped scores -> rewards and advantages (the advantage estimator).
    kl, rewards = compute_advantages(logprobs, ref_logprobs, values, response_mask, shape_scores(scores),
                                     kl_coef=kl_coef, kl_estimator=kl_estimator, gamma=gamma, lam=lam,
                                     whiten_rewards=whiten_rewards, whiten_advantages=whiten_advantages,
                                     advantage_estimator=advantage_estimator, num_generations=num_generations,
                                     scale_rewards=scale_rewards)
    values = values if has_critic else torch.zeros_like(logprobs)
    batch = RolloutBatch(queries, query_mask, responses, response_mask, logprobs, ref_logprobs, values, scores,
                         contains_stop, **rewards)
    # 9. Statistics.
    stats = rollout_stats(batch, kl, entropy, stop_token_ids, has_critic)
    each = samples.reward_scores or {}
    stats.update({f"objective/scores/{name}": raw.mean() for name, raw in each.items()})
    return Rollout(batch, stats, samples.generate_seconds, scored - start - samples.generate_seconds, each)


class MinibatchSchedule:
    """The PPO update over one rollout: `num_ppo_epochs` shuffled passes, each split into `num_mini_batches`
    minibatches of gradient-accumulation micro-batches, handed out one micro-batch at a time.

    The rollout, the shuffles (`orders`, (num_ppo_epochs, B) long) and the `position` (micro-batches handed out) are
    the whole state, so a checkpoint taken part-way through an iteration resumes with exactly the rest of it.
    """

    def __init__(self, batch: RolloutBatch, orders: torch.Tensor, *, num_mini_batches: int,
                 gradient_accumulation_steps: int, position: int = 0, loss_aggregation: str = "token_mean"):
        self.batch, self.orders, self.position = batch, orders, position
        self.loss_aggregation = loss_aggregation
        self.num_mini_batches, self.gradient_accumulation_steps = num_mini_batches, gradient_accumulation_steps
        self.minibatch_size = len(batch) // num_mini_batches
        self.micro_batch_size = self.minibatch_size // gradient_accumulation_steps

    @classmethod
    def shuffled(cls, batch: RolloutBatch, *, num_ppo_epochs: int, num_mini_batches: int,
                 gradient_accumulation_steps: int, loss_aggregation: str = "token_mean") -> "MinibatchSchedule":
        """A new schedule over `batch`: one permutation per PPO epoch from the global torch RNG."""
        orders = torch.stack([torch.randperm(len(batch), device=batch.queries.device) for _ in range(num_ppo_epochs)])
        return cls(batch, orders, num_mini_batches=num_mini_batches,
                   gradient_accumulation_steps=gradient_accumulation_steps, loss_aggregation=loss_aggregation)

    def __len__(self) -> int:
        return self.orders.shape[0] * self.num_mini_batches * self.gradient_accumulation_steps

    @property
    def done(self) -> bool:
        return self.position >= len(self)

    def next(self) -> dict:
        """The next micro-batch: {"batch": RolloutBatch, "normalizer": what its whole minibatch's loss divides by
        (real tokens, or sequences for the seq-mean aggregations: `loss_normalizer`)}."""
        epoch, rest = divmod(self.position, self.num_mini_batches * self.gradient_accumulation_steps)
        m, k = divmod(rest, self.gradient_accumulation_steps)
        minibatch = self.orders[epoch, m * self.minibatch_size:(m + 1) * self.minibatch_size]
        self.position += 1
        return {"batch": self.batch.select(minibatch[k * self.micro_batch_size:(k + 1) * self.micro_batch_size]),
                "normalizer": loss_normalizer(self.batch.response_mask[minibatch], self.loss_aggregation)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the rollout, the orders and the position (as a 0-d tensor): what a checkpoint stores."""
        tensors = {f.name: getattr(self.batch, f.name) for f in fields(self.batch)}
        return {**tensors, "orders": self.orders, "position": torch.tensor(self.position)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], *, num_mini_batches: int,
                        gradient_accumulation_steps: int, loss_aggregation: str = "token_mean") -> "MinibatchSchedule":
        state = dict(state)
        orders, position = state.pop("orders"), int(state.pop("position"))
        return cls(RolloutBatch(**state), orders, num_mini_batches=num_mini_batches,
                   gradient_accumulation_steps=gradient_accumulation_steps, position=position,
                   loss_aggregation=loss_aggregation)


def shape_scores(scores: torch.Tensor, *, reward_moments, reward_clip: float | None, gather) -> torch.Tensor:
    """Step 7: running normalisation of the scores (`reward_moments`, statistics over all processes through
    `gather`) and clipping to [-reward_clip, reward_clip], when configured."""
    if reward_moments is not None:
        reward_moments.update(gather(scores))
        return reward_moments.normalize(scores, reward_clip)
    if reward_clip is not None:
        return scores.clamp(-reward_clip, reward_clip)
    return scores
