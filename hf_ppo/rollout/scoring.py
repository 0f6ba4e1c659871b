"""Scoring: everything about scores, one interface (`RewardSet.score`) that training and evaluation both score
through. (The rewards are loaded in `models/reward_model.py`; ready-made reward functions are `hf_ppo.rewards`.)

- a reward is a frozen reward model (`reward_model_scores`: decoder `score` heads read at the last real token,
  encoders that pool [CLS] on right-aligned inputs) or a callable `(prompts, completions) -> floats` on text
  (`check_reward_values` checks what it returns; `probe_reward_callable` calls it once at construction);
- its inputs (`score_responses`): the policy's token ids, or decoded text in a `reward_input_format` ('chat' through
  the reward tokenizer's template, a (question, answer) 'pair', or 'concat'), fitted to the reward model's context
  (`fit_context`);
- several rewards (`RewardSet`): each scored, optionally normalised by its own running statistics, and combined as a
  weighted sum; each keeps a name for its metric (`reward_name`, `unique_names`); the settings they are read and
  combined with travel as one record (`RewardSettings`);
- what the rollout does to a score: step 4's penalties (`penalize`) and step 7's running normalisation and clipping
  (`shape_scores`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass, replace
from typing import Callable, ContextManager

import torch
from torch import nn
from transformers import PreTrainedModel

from ..algorithms.ppo_math import RunningMoments, last_token_index, overlong_penalty
from ..models.pretrained import pools_itself
from ..models.reward_model import RewardLoading, load_rewards, naming_reward, reward_name
from ..models.tokenizers import (load_reward_tokenizer, render_chat_prompt, same_checkpoint, same_tokenizer,
                                 with_completion, with_scoring_pad)
from ..runtime.warn import warn_user
from .engines import chunks, input_device, sequence_inputs
from .reward_calls import (
    RewardHooks,
    call_reward,
    check_reward_function,
    data_columns,
    finish_reward_calls,
    reward_values,
    start_reward_call,
)


@dataclass(frozen=True)
class RewardSettings:
    """How the training rewards are read and combined (`PPOConfig.reward_settings` builds it): the fields of the same
    names, documented there."""

    reward_input_format: str = "auto"  # 'auto', 'chat', 'pair' or 'concat': how a reward model reads its input
    reward_weights: tuple[float, ...] | None = None  # one weight per reward (None: all 1.0)
    normalize_each_reward: bool = False  # each reward normalised by its own running statistics before the sum
    multi_objective_aggregation: str = "sum_then_normalize"  # or each reward normalised within its group (TRL's)
    num_generations: int = 1  # the group size normalize_then_sum normalises over


def group_normalized(scores: torch.Tensor, applies: torch.Tensor, k: int, eps: float = 1e-4) -> torch.Tensor:
    """One reward's scores normalised within each group of k consecutive rows (TRL's `normalize_then_sum`; GDPO):
    (r - group mean) / (group std + eps), the mean and the sample std (n - 1) over the group's rows the reward applies
    to (a group where it applies once: 0). scores, applies (B,) -> (B,). Example: k = 2, r = [1, 3, 5, 5] ->
    [-1, 1, 0, 0] / (sqrt(2) + eps) for the first group, 0 for the second."""
    grouped, used = scores.reshape(-1, k), applies.reshape(-1, k)
    n = used.sum(dim=1, keepdim=True)
    mean = torch.where(used, grouped, torch.zeros_like(grouped)).sum(dim=1, keepdim=True) / n.clamp(min=1)
    square = torch.where(used, (grouped - mean) ** 2, torch.zeros_like(grouped)).sum(dim=1, keepdim=True)
    std = torch.sqrt(square / (n - 1).clamp(min=1))
    return ((grouped - mean) / (std + eps)).reshape(scores.shape)


def reward_set(loaded, given, tokenizer, settings: RewardSettings, chat: set[bool], train_dataset,
               eval_datasets: dict | None = None) -> RewardSet:
    """The run's `RewardSet`: each reward's tokenizer and input format resolved and checked as for a single reward
    (`reward_tokenizer`), each callable probed on the training prompts and on each evaluation set (`eval_datasets`:
    {name: dataset}; `probe_reward_callable`), names for the logs, and `reward_weights` checked against the number
    of rewards. `loaded`: the `LoadedModels` of `trainer/assembly.py` (its rewards, their tokenizers, and the context
    they score as loaded in); `given`: the trainer's `reward_model` argument (a list or one reward)."""
    is_list = isinstance(given, (list, tuple))
    rewards = loaded.reward_model if is_list else [loaded.reward_model]
    classes = loaded.reward_processing_class if is_list else [loaded.reward_processing_class]
    names = unique_names([reward_name(r) for r in (given if is_list else [given])])
    return _reward_set(rewards, classes, names, is_list, tokenizer, chat, train_dataset, settings,
                       loaded.reward_scoring_context, eval_datasets)


def judge_set(given, tokenizer, settings: RewardSettings, loading: RewardLoading, chat: set[bool], train_dataset,
              scoring_context: Callable[[], ContextManager] = contextlib.nullcontext,
              eval_datasets: dict | None = None) -> RewardSet | None:
    """The evaluation-only rewards (the trainer's `eval_reward_model`: one or a list, in the forms of
    `reward_model`), loaded (`loading`) and checked as the training rewards are (on `eval_datasets` too), in their
    `reward_input_format`, scored each on its own (weights 1.0, never normalised) in `scoring_context` (see
    `RewardSet`); None when none is given."""
    if given is None:
        return None
    given = list(given) if isinstance(given, (list, tuple)) else [given]
    if not given:
        raise ValueError("eval_reward_model is an empty list: give a judge (id, path, model or callable) or None.")
    judges, classes = load_rewards(given, None, loading)
    names = unique_names([reward_name(r) for r in given])
    alone = replace(settings, reward_weights=None, normalize_each_reward=False,
                    multi_objective_aggregation="sum_then_normalize")
    return _reward_set(judges, classes, names, True, tokenizer, chat, train_dataset, alone, scoring_context,
                       eval_datasets)


def _reward_set(rewards, classes, names, is_list, tokenizer, chat, train_dataset, settings: RewardSettings,
                scoring_context, eval_datasets: dict | None = None) -> RewardSet:
    weights = settings.reward_weights if settings.reward_weights is not None else [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise ValueError(f"reward_weights has {len(weights)} weights but there {'are' if len(rewards) > 1 else 'is'} "
                         f"{len(rewards)} reward{'s' if len(rewards) > 1 else ''} ({', '.join(names)}): give one weight "
                         "per reward, in the order of reward_model, or reward_weights=None for all 1.0.")
    # A forced format is meant for the list's models: its callables always read text.
    any_model = any(isinstance(r, PreTrainedModel) for r in rewards)
    tokenizers = []
    for i, (reward, processing_class, name) in enumerate(zip(rewards, classes, names)):
        callable_in_list = is_list and any_model and not isinstance(reward, PreTrainedModel)
        input_format = "auto" if callable_in_list else settings.reward_input_format
        with naming_reward(name if is_list else None, i):
            tokenizers.append(reward_tokenizer(reward, tokenizer, processing_class, input_format, chat))
            probe_reward_callable(reward, train_dataset, tokenizer, name)
            for source, dataset in (eval_datasets or {}).items():  # a column only an evaluation set lacks: now
                probe_reward_callable(reward, dataset, tokenizer, name, source)
    return RewardSet(rewards, tokenizers, names, [float(w) for w in weights],
                     input_format=settings.reward_input_format, normalize_each=settings.normalize_each_reward,
                     is_list=is_list, scoring_context=scoring_context,
                     group_size=settings.num_generations
                     if settings.multi_objective_aggregation == "normalize_then_sum" else None)


def reward_tokenizer(reward_model, tokenizer, reward_processing_class, input_format: str, chat: set[bool]):
    """None when the reward model reads the policy's token ids as they are (the 'concat' fast path); else the
    tokenizer the reward model reads decoded text with (its own; a pad chosen for scoring when it has none).

    A reward model object without `reward_processing_class` gets its tokenizer from its own name or path (a local
    folder or the HF cache); when that fails, only a model that comes from the policy tokenizer's own checkpoint may
    read the policy's ids: anything else is an error asking for `reward_processing_class`. `chat`: whether the
    prompts are chat messages (one value per dataset); forced formats that cannot apply fail here.
    """
    if not isinstance(reward_model, PreTrainedModel):
        if input_format != "auto":
            raise ValueError(f"reward_input_format={input_format!r} applies to reward models; a reward callable always "
                             "receives (prompts, completions) as text. Leave reward_input_format='auto'.")
        return None
    if reward_processing_class is None:
        reward_processing_class, why = load_reward_tokenizer(reward_model)
        if reward_processing_class is None:
            vocab = reward_model.get_input_embeddings().num_embeddings
            if not same_checkpoint(reward_model, tokenizer) or len(tokenizer) > vocab:
                raise ValueError(
                    f"The reward model was given as an object without its tokenizer, and its tokenizer could not be "
                    f"loaded from its name or path ({why}); nothing shows that it reads the policy tokenizer's ids "
                    f"(embedding of {vocab} tokens, policy tokenizer of {len(tokenizer)}). Pass "
                    "reward_processing_class=<the reward model's tokenizer>, or pass reward_model as its Hub id or path.")
            reward_processing_class = tokenizer
    chosen = with_scoring_pad(reward_processing_class)
    vocab = reward_model.get_input_embeddings().num_embeddings
    if len(chosen) > vocab:  # ids past the embedding would fail mid-rollout with a bare IndexError
        raise ValueError(f"The reward tokenizer has {len(chosen)} tokens but the reward model's embedding has {vocab}: "
                         "pass the tokenizer the reward model was trained with as reward_processing_class.")
    formats = {reward_input_format(input_format, reward_model, chosen, c) for c in chat}
    if formats == {"concat"} and same_tokenizer(tokenizer, chosen):
        return None
    return chosen


def right_aligned(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move each row's real tokens (mask True) to the front, order kept: (B, T) -> (mask, *tensors) right-padded.

    Encoders pool at position 0 and number positions from 0, so their inputs must start at the first real token.
    """
    order = torch.sort((~mask).long(), dim=1, stable=True).indices
    return (mask.gather(1, order), *(t.gather(1, order) for t in tensors))


@torch.no_grad()
def reward_model_scores(reward_model: nn.Module, input_ids, attention_mask, batch_size: int,
                        token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar score of each sequence. input_ids/attention_mask/token_type_ids (B, T) -> (B,) fp32.

    A decoder reward model (`score` head): the head runs on the backbone's hidden states and the value at the last
    position with attention_mask == 1 is taken, so any padding side works and its pad_token_id never matters. A model
    that pools itself (encoders: [CLS] through `pooler` + `classifier`) runs its own forward on right-padded inputs
    (real tokens moved to the front, pad slots masked and filled with its pad id), exactly as it was trained.
    Inputs longer than the reward model's context (`max_position_embeddings`) never run past it (`fit_context`).
    The inputs may be on another device than the reward model (which may sit elsewhere than the policy, or be spread
    by a `device_map`): they are moved to the device of its input embedding, and the scores come back on the
    inputs' device.
    """
    scores = []
    own_pooling = pools_itself(reward_model)
    attention_mask = fit_context(attention_mask, reward_context(reward_model), own_pooling)
    device = input_device(reward_model)
    returned_on = input_ids.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if token_type_ids is not None:
        token_type_ids = token_type_ids.to(device)
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
        per_token = reward_model.score(hidden)[..., 0]  # on the score head's device (a device_map's last)
        last = last_token_index(mask).to(per_token.device)
        scores.append(per_token[torch.arange(ids.shape[0], device=per_token.device), last].float())
    return torch.cat([s.to(returned_on) for s in scores])


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
    """A reward callable's output as a (B,) float32 tensor, every entry a number (`reward_calls.reward_values`, which
    also takes None for "does not apply", is what scoring uses); anything else is an error that says what came back.
    NaN/inf pass through: the trainer drops such a rollout (see trainer/guard.py)."""
    scores, applies = reward_values(values, expected)
    if not applies.all():
        i = int((~applies).nonzero()[0])
        raise TypeError(f"The reward function returned a non-number at position {i}: NoneType None "
                        f"({int((~applies).sum())} such entries): return one number per (prompt, completion) pair.")
    return scores


def scores_given(prompts, completions):
    """The reward of a trainer built without a `reward_model` because its scores come from elsewhere (an
    environment's episodes, or `step()`'s arguments): asked for a score, it refuses, naming the fix."""
    raise ValueError("A sample needs a score from the reward model, but the trainer has none: return a score from "
                     "the environment (EnvSample.score), or pass reward_model= to PPOLMTrainer.")


# Inside `probing_once()`: the (reward, its probe's inputs) of each probe made and passed; None outside.
_probes_made: list[tuple[object, str]] | None = None


@contextlib.contextmanager
def probing_once():
    """Inside, a probe (`probe_reward_callable`) already made and passed is not made again: the same reward callable
    on the same inputs (prompts, their text, columns) is called once. `hf-ppo train` probes each reward function
    before any model loads and builds the trainer inside, whose own identical probe is then skipped: a function that
    costs (an API call, a sandboxed code run) is called once at start-up, not twice. Forgotten at the end."""
    global _probes_made
    outer, _probes_made = _probes_made, []
    try:
        yield
    finally:
        _probes_made = outer


def probe_reward_callable(reward, dataset, tokenizer, name: str | None = None, source: str = "train_dataset") -> None:
    """Check a reward callable at construction: its signature against the columns of `dataset` (the prompts named
    `source` in errors: train_dataset, or an evaluation set) (`check_reward_function`), then one call on its first two
    rows (their prompts and columns) with empty completions, outside training (`RewardHooks()`): a wrong return
    type, NaN/inf or an exception fails now, naming the function and the fix, not at the first rollout or
    evaluation. Models are skipped; without a dataset only the signature is checked. Inside `probing_once()`, the
    call is skipped when the same probe already passed."""
    if not callable(reward) or isinstance(reward, nn.Module) or reward is scores_given:
        return
    name = name or reward_name(reward)
    try:
        check_reward_function(reward, None if dataset is None else data_columns(dataset.column_names), name)
    except TypeError as err:
        raise TypeError(f"{err} (on {source})" if source != "train_dataset" else str(err)) from None
    if dataset is None or not len(dataset) or "prompt" not in dataset.column_names:
        return
    rows = [dataset[i] for i in range(min(2, len(dataset)))]
    prompts = [row["prompt"] for row in rows]
    texts = [p if isinstance(p, str) else render_chat_prompt(tokenizer, p, tokenize=False) for p in prompts]
    columns = {c: [row[c] for row in rows] for c in data_columns(rows[0])}
    inputs = repr((prompts, texts, columns)) if _probes_made is not None else None
    if inputs is not None and any(made is reward and seen == inputs for made, seen in _probes_made):
        return  # this very call was made and passed (`probing_once`)
    values = call_reward(reward, name, prompts=prompts, prompt_texts=texts, texts=[""] * len(rows),
                         completion_ids=[[] for _ in rows], columns=columns, hooks=RewardHooks())
    scores, applies = reward_values(values, len(rows), name)
    if not torch.isfinite(scores[applies]).all():
        raise ValueError(f"The reward function {name!r} returned NaN/inf for the probe (the first prompts of "
                         f"{source}, empty completions): return finite floats (or None where it does not apply).")
    if inputs is not None:
        _probes_made.append((reward, inputs))


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
    reward_tokenizer=None, input_format: str = "auto", columns: dict[str, list] | None = None,
) -> torch.Tensor:
    """One score per response: (B,) fp32 (`score_applicable`, for a reward that applies to every row: a None
    returned by a reward function is an error here; `RewardSet.score` is what takes it)."""
    scores, applies = score_applicable(reward, queries=queries, query_mask=query_mask, responses=responses,
                                       response_mask=response_mask, tokenizer=tokenizer, prompts=prompts,
                                       batch_size=batch_size, reward_tokenizer=reward_tokenizer,
                                       input_format=input_format, columns=columns)
    if not applies.all():
        raise ValueError(f"The reward function {reward_name(reward)!r} returned None (does not apply) for "
                         f"{int((~applies).sum())} row(s): score through a RewardSet, which leaves them out of the "
                         "weighted sum, or return a number for every row.")
    return scores


@torch.no_grad()
def score_applicable(
    reward, *, queries, query_mask, responses, response_mask, tokenizer, prompts: list, batch_size: int,
    reward_tokenizer=None, input_format: str = "auto", columns: dict[str, list] | None = None,
    name: str | None = None, hooks: RewardHooks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(one score per response (B,) fp32, whether the reward applies to each row (B,) bool).

    `reward` is a reward function called on text in its convention (`reward_calls.call_reward`: TRL's keywords with
    the dataset's `columns` and the trainer's `hooks`, or positional `(prompts, completions)`; a returned None: does
    not apply; an `async def` one awaited), or a frozen reward model (applies to every row). `name`: the function's
    name in errors.
    With `reward_tokenizer=None` the reward model shares the policy's tokenizer and reads prompt + response as token
    ids (no decode: the 'concat' format's fast path). Otherwise prompt and response are decoded and given in
    `input_format` (see `reward_input_format`, resolved per batch): the conversation rendered with the reward
    tokenizer's chat template ('chat'), a (question, answer) text pair ('pair'), or prompt + response ('concat').
    """
    if reward is scores_given:  # hf_ppo's own refusal, not a user's function failing
        scores_given(prompts, None)
    if callable(reward) and not isinstance(reward, nn.Module):
        name = name or reward_name(reward)
        prompt_texts = decode_masked(tokenizer, queries, query_mask)
        ids = [row[keep].tolist() for row, keep in zip(responses, response_mask.bool())]
        values = call_reward(reward, name, prompts=list(prompts), prompt_texts=prompt_texts, columns=columns,
                             texts=decode_masked(tokenizer, responses, response_mask), completion_ids=ids, hooks=hooks)
        scores, applies = reward_values(values, len(prompt_texts), name)
        return scores.to(queries.device), applies.to(queries.device)
    everywhere = torch.ones(len(queries), dtype=torch.bool, device=queries.device)
    if reward_tokenizer is None:
        inputs = sequence_inputs(queries, query_mask, responses, response_mask)
        return reward_model_scores(reward, inputs["input_ids"], inputs["attention_mask"], batch_size), everywhere
    conversational = all(isinstance(p, list) for p in prompts)
    kind = reward_input_format(input_format, reward, reward_tokenizer, conversational)
    prompt_texts = decode_masked(tokenizer, queries, query_mask)
    completions = decode_masked(tokenizer, responses, response_mask)
    if kind == "chat":
        # A prefill (a final assistant turn) and its continuation are one answer (`with_completion`).
        texts = [reward_tokenizer.apply_chat_template([*turns, answer], tokenize=False)
                 for turns, answer in (with_completion(p, c) for p, c in zip(prompts, completions))]
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
                               batch_size, None if token_types is None else token_types.to(device)), everywhere


def reward_identity(reward) -> dict[str, str]:
    """What a reward is, for a checkpoint to compare on resume: a model's `name_or_path` ({"model": ...}), a
    function's import path ({"function": "module.qualname"}; for a file loaded by `reward_funcs`, "path/to/file.py:
    qualname"; a `functools.partial` as the function it wraps, a callable object as its class)."""
    if isinstance(reward, nn.Module):
        config = getattr(reward, "config", None)
        return {"model": str(getattr(config, "_name_or_path", None) or getattr(reward, "name_or_path", None)
                             or type(reward).__name__)}
    if reward is scores_given:
        return {"function": "none (scores from an environment or step())"}
    while isinstance(reward, functools.partial):
        reward = reward.func
    target = reward if inspect.isfunction(reward) or inspect.ismethod(reward) or inspect.isbuiltin(reward) \
        else type(reward)
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    file = getattr(sys.modules.get(module), "__file__", None)
    if module.startswith(REWARD_FILE_MODULE) and file:  # a file `reward_funcs` loaded: its path is its import path
        return {"function": f"{file}:{qualname}"}
    return {"function": f"{module}.{qualname}"}


# The module-name prefix `cli/reward_funcs.py` gives a reward file it loads (its path's digest follows).
REWARD_FILE_MODULE = "_hf_ppo_reward_file_"


def unique_names(names: list[str]) -> list[str]:
    """`names` with repeats numbered (`a`, `a_2`, `a_3`), so each reward has a metric of its own. A number is never
    one another reward already goes by (`a`, `a`, `a_2` -> `a`, `a_3`, `a_2`): equal names would overwrite one
    reward's scores with another's."""
    taken = set(names)
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        if name not in seen:
            seen[name] = 1
            unique.append(name)
            continue
        number = seen[name] + 1
        while f"{name}_{number}" in taken:
            number += 1
        seen[name] = number
        taken.add(f"{name}_{number}")
        unique.append(f"{name}_{number}")
    return unique


class RewardSet:
    """The run's rewards, scored at step 3 and combined: one reward model / callable, or a list with weights.

    Each reward keeps its own tokenizer (None: it reads the policy's token ids; see `score_responses`) and reads
    (prompt, response) in `input_format`, resolved per model. The score is sum_i w_i * r_i, each r_i first normalised
    by its own running mean/std (`normalize_each`, statistics over all processes) when asked. A single reward given
    alone (`is_list=False`) with weight 1.0 and no normalisation scores exactly as `score_responses`.

    `scoring_context`: a no-argument callable giving the context manager every reward model scores in, so that it
    scores as it was loaded: a `reward_lora` critic's adapter on a reward model's frozen base is disabled there
    (`models.critics.load_critic` returns it), and the critic never changes the reward. Default: no context.
    """

    def __init__(self, rewards: list, tokenizers: list, names: list[str], weights: list[float], *,
                 input_format: str = "auto", normalize_each: bool = False, is_list: bool = True,
                 scoring_context: Callable[[], ContextManager] = contextlib.nullcontext,
                 group_size: int | None = None):
        self.rewards, self.tokenizers, self.names, self.weights = list(rewards), list(tokenizers), names, weights
        self.group_size = group_size  # normalize_then_sum's group (k consecutive rows); None: sum_then_normalize
        self.input_format, self.is_list, self.scoring_context = input_format, is_list, scoring_context
        self.moments = [RunningMoments() for _ in rewards] if normalize_each else None
        self.warned_nonfinite: set[str] = set()  # the rewards already warned about a NaN/inf score

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
              gather: Callable | None = None, columns: dict[str, list] | None = None,
              hooks: RewardHooks | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the combined score (B,), {name: the reward's raw score (B,), 0.0 where it returned None} for a list, else
        {}): `score_each`, then `combine`. `columns`: the dataset's other columns, one value per row; `hooks`: what
        the trainer passes reward functions (`reward_calls.RewardHooks`)."""
        each = self.score_each(queries=queries, query_mask=query_mask, responses=responses,
                               response_mask=response_mask, tokenizer=tokenizer, prompts=prompts,
                               batch_size=batch_size, columns=columns, hooks=hooks)
        combined = self.combine(each, prompts, gather)
        return combined, ({name: scores for name, (scores, _) in each.items()} if self.is_list else {})

    @torch.no_grad()
    def score_each(self, *, queries, query_mask, responses, response_mask, tokenizer, prompts: list,
                   batch_size: int, columns: dict[str, list] | None = None, hooks: RewardHooks | None = None
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{name: (raw scores (B,), applies (B,) bool)} for every reward, in order (`score_applicable`; a reward
        function's None: applies False, score 0.0). The reward functions are all called first, each on its own copy
        of the batch; the `async def` ones are then awaited together, concurrently
        (`reward_calls.finish_reward_calls`)."""
        each, calls = {}, {}
        texts = prompt_texts = ids = None
        for i, (reward, reward_tokenizer, name) in enumerate(zip(self.rewards, self.tokenizers, self.names)):
            if callable(reward) and not isinstance(reward, nn.Module) and reward is not scores_given:
                if texts is None:  # decoded once for every function
                    prompt_texts = decode_masked(tokenizer, queries, query_mask)
                    texts = decode_masked(tokenizer, responses, response_mask)
                    ids = [row[keep].tolist() for row, keep in zip(responses, response_mask.bool())]
                calls[name] = start_reward_call(reward, name, prompts=list(prompts), prompt_texts=prompt_texts,
                                                texts=texts, completion_ids=ids, columns=columns, hooks=hooks)
                continue
            as_loaded = self.scoring_context() if isinstance(reward, nn.Module) else contextlib.nullcontext()
            with naming_reward(name if self.is_list else None, i), as_loaded:
                each[name] = score_applicable(reward, queries=queries, query_mask=query_mask, responses=responses,
                                              response_mask=response_mask, tokenizer=tokenizer, prompts=prompts,
                                              batch_size=batch_size, reward_tokenizer=reward_tokenizer,
                                              input_format=self.input_format, columns=columns, name=name)
        for (name, call), values in zip(calls.items(), finish_reward_calls(list(calls.values()))):
            scores, applies = reward_values(values, len(texts), name)
            each[name] = (scores.to(queries.device), applies.to(queries.device))
        return {name: each[name] for name in self.names}

    def identities(self) -> list[dict[str, str]]:
        """What a checkpoint records of the rewards, so that a resume with others is noticed: per reward, the name
        its metrics use and what it is (`reward_identity`)."""
        return [{"name": name, **reward_identity(reward)} for name, reward in zip(self.names, self.rewards)]

    def combine(self, each: dict[str, tuple[torch.Tensor, torch.Tensor]], prompts: list,
                gather: Callable | None = None) -> torch.Tensor:
        """sum_i w_i * r_i over the rewards that apply to each row (TRL's None), each r_i first normalised by its own
        running statistics when `normalize_each` (updated from the finite scores of the rows it applies to, over all
        processes through `gather`; None (evaluation): unchanged). A row no reward applies to is an error naming it.
        With `group_size` (TRL's multi_objective_aggregation="normalize_then_sum") and in training (`gather` given),
        each r_i is first normalised within its group of `group_size` consecutive rows (`group_normalized`), so the
        combined score is TRL's normalised-then-summed reward (what TRL logs as `reward`); evaluation (`gather`
        None) sums the raw scores, which compare a policy's responses with the reference's.

        A reward's NaN/inf score of a row it applies to leaves that row's combined score NaN/inf: the rollout leaves
        the row out of the update (`steps.unscored_rows`), and a one-time warning per reward names it and the row."""
        combined = None
        for i, (name, (scores, applies)) in enumerate(each.items()):
            nonfinite = applies & ~torch.isfinite(scores)
            if nonfinite.any():
                self.warn_nonfinite(name, scores, nonfinite, prompts)
            if self.moments is not None:
                if gather is not None:
                    gathered_scores, gathered_usable = gather(scores), gather((applies & ~nonfinite).float()) > 0
                    if gathered_usable.any():
                        self.moments[i].update(gathered_scores[gathered_usable])
                scores = self.moments[i].normalize(scores)
            if self.group_size is not None and gather is not None:
                scores = group_normalized(scores, applies, self.group_size)
            term = torch.where(applies, self.weights[i] * scores, torch.zeros_like(scores))
            combined = term if combined is None else combined + term
        none = ~torch.stack([applies for _, applies in each.values()]).any(0)
        if none.any():
            row = int(none.nonzero()[0])
            prompt = prompts[row] if row < len(prompts) else None
            raise ValueError(f"Every reward returned None (does not apply) for {int(none.sum())} row(s), first row "
                             f"{row} of the batch (prompt {prompt!r:.200}); rewards: {', '.join(self.names)}. Such a "
                             "row would train on a score of nothing: return a number for it from at least one "
                             "reward (e.g. 0.0 for a wrong answer), add a reward that applies to every row, or drop "
                             "those rows from the dataset.")
        return combined

    def warn_nonfinite(self, name: str, scores: torch.Tensor, rows: torch.Tensor, prompts: list,
                       who: str | None = None) -> None:
        """Once per reward `name`: it scored NaN/inf (`rows` (B,) bool); the row is left out of the update, not the
        rollout. `who`: what gave the score, when it is no reward of the set (an environment's own scores)."""
        if name in self.warned_nonfinite:
            return
        self.warned_nonfinite.add(name)
        row = int(rows.nonzero()[0])
        prompt = prompts[row] if row < len(prompts) else None
        more = int(rows.sum()) - 1
        warn_user(f"{who or f'The reward {name!r}'} returned {float(scores[row])} for row {row} of the batch (prompt "
                  f"{prompt!r:.200}){f' and {more} more row(s)' if more else ''}. In training, a row without a "
                  "finite score is left out of the update (with the group estimators rloo, grpo and reinforce_pp "
                  "with num_generations > 1, its prompt's whole group, whose baseline it would spoil) and the rest of "
                  "the rollout trains; `nonfinite/unscored_rows` in the logs counts them. In an evaluation, the pair "
                  "is left out of that score's means and win rate. Fix the reward (or return None for rows it does "
                  "not apply to); this warning is shown once per reward.")

    def state_dict(self) -> dict | None:
        """The per-reward running statistics by name (None without `normalize_each`): JSON-able, for checkpoints."""
        if self.moments is None:
            return None
        return {name: m.state_dict() for name, m in zip(self.names, self.moments)}

    def load_state_dict(self, state: dict | None, matching_only: bool = False) -> None:
        """Restore `state_dict()`; the checkpoint's rewards must be this run's (same names), unless `matching_only`
        (other rewards allowed on resume): then each reward the checkpoint has a statistic for by name gets it, and
        the others start afresh."""
        if self.moments is None or state is None:
            return
        if matching_only:
            for name, m in zip(self.names, self.moments):
                if name in state:
                    m.load_state_dict(state[name])
            return
        if list(state) != self.names:
            raise ValueError(f"The checkpoint normalised the rewards {list(state)}, this run has {self.names}: resume "
                             "with the same rewards, in the same order.")
        for name, m in zip(self.names, self.moments):
            m.load_state_dict(state[name])


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


def shape_scores(scores: torch.Tensor, *, reward_moments, reward_clip: float | None, gather) -> torch.Tensor:
    """Step 7: running normalisation of the scores (`reward_moments`, statistics over all processes through
    `gather`, from the finite scores: a NaN/inf row leaves the update, `steps.unscored_rows`) and clipping to
    [-reward_clip, reward_clip], when configured."""
    if reward_moments is not None:
        gathered = gather(scores)
        reward_moments.update(gathered[torch.isfinite(gathered)])
        return reward_moments.normalize(scores, reward_clip)
    if reward_clip is not None:
        return scores.clamp(-reward_clip, reward_clip)
    return scores
