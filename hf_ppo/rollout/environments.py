"""Bring your own rollout: multi-turn conversations, tool calls and environments (steps 1-3 of an iteration).

An `Environment` replaces the single-turn "generate, truncate, score" with its own episode: given the iteration's
prompts and `sample` (the current policy, through the trainer's rollout engine), it returns one `EnvSample` per
prompt: the tokens after the prompt, the policy's and its own interleaved, which of them the policy sampled, and the
reward (a final score, or None for the trainer's reward model / callables; optionally rewards at positions).

What training makes of it (`rollout/steps.py`, `RolloutBatch.policy_mask`): the environment's tokens are context, never
actions. The model attends to them, but log-probs, KL, entropy, values, advantages and every loss term and mean use
the policy's tokens only; GAE runs over the policy's tokens in order and bootstraps across an environment segment
from the next policy token's value (`ppo_math.compute_gae`). Everything else (penalties, shaping, the estimators, the
non-finite guard, exact resume, mixed rewards, `num_generations`) is the ordinary path.
"""

from __future__ import annotations

import numbers
from typing import Callable, NamedTuple

import torch

from .scoring import scores_given


class Prompt(NamedTuple):
    """One prompt as an environment gets it: `ids` (P,) long, its token ids without padding, on the CPU whatever the
    policy's device, and `text`, the dataset's prompt (text, or a chat's messages)."""

    ids: torch.Tensor
    text: object


class EnvSample(NamedTuple):
    """One episode after its prompt. `tokens` (T,) long: the policy's and the environment's tokens interleaved, in
    order; `policy_mask` (T,) bool: True where the policy sampled the token; `score`: the final reward, or None to
    score the whole episode with the trainer's reward model / callables; `rewards` (T,) float or None: rewards at
    positions (a per-turn or per-step reward), each credited to the policy token at or before its position (a reward
    on an environment token goes to the policy token that led to it). T <= `response_length`. `collate` checks each
    field where it enters (integer ids the policy can embed, a number or None as the score) and names the sample.
    The tensors may be on any device (the trainer takes them to the CPU to check them, then to the policy's)."""

    tokens: torch.Tensor
    policy_mask: torch.Tensor
    score: float | None = None
    rewards: torch.Tensor | None = None


Sample = Callable[..., list[torch.Tensor]]


class Environment:
    """Subclass it and pass an instance as `PPOLMTrainer(..., environment=...)`: every training rollout then samples
    through `rollout`. Evaluation still samples single-turn responses. Pinned by tests/rollout/test_environments.py;
    recipes/tool_use.py is a complete example (a calculator tool)."""

    def rollout(self, prompts: list[Prompt], sample: Sample) -> list[EnvSample]:
        """One `EnvSample` per prompt, in order.

        `sample(sequences, max_new_tokens=None)`: continues each 1-D token sequence (a prompt and the conversation so
        far) with the current policy and returns its new tokens (1-D, up to and including a stop token, at most
        `max_new_tokens` and `response_length`); call it once per turn for the whole batch (a non-empty list of 1-D
        sequences without padding), as the rollout engine samples a batch at once.

        Devices: the environment works on the CPU whatever the policy's device. `Prompt.ids` and what `sample`
        returns are CPU tensors, so `torch.cat([prompt.ids, answer, torch.tensor(reply)])` works as it is on a GPU
        run; `sample` takes sequences on any device (the trainer moves them to the policy's device to sample), and
        the `EnvSample`s may hold tensors on any device (they are collated on the CPU and moved to the policy's).
        """
        raise NotImplementedError


def check_environment(environment, reward_model, train_dataset):
    """At construction: `environment` is an `Environment` (or has its `rollout` method). Returns (environment,
    reward_model): without a reward_model, scores must come from elsewhere (an environment, or `step()` when there
    is no train_dataset), and `rewards.scores_given` stands in, refusing if a score is ever asked of it."""
    if environment is not None and not callable(getattr(environment, "rollout", None)):
        raise TypeError(f"environment must be an hf_ppo.Environment (a `rollout(prompts, sample)` method), got "
                        f"{type(environment).__name__}: subclass hf_ppo.Environment.")
    if reward_model is None and (environment is not None or train_dataset is None):
        reward_model = scores_given
    return environment, reward_model


_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def embedding_rows(model) -> int | None:
    """The number of token ids `model` (a causal LM) can embed: its input embedding's rows (which may exceed the
    tokenizer's vocabulary: padded rows are legitimate ids), else `config.vocab_size`, else None."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return rows if rows is not None else getattr(getattr(model, "config", None), "vocab_size", None)


def token_ids(value, where: str, rows: int | None, fix: str) -> torch.Tensor:
    """`value` (a 1-D tensor or list of token ids) as a 1-D long CPU tensor, or an error naming `where` (who gave it,
    e.g. "step(): queries[3]"), the value and `fix`: not 1-D, not integers (a float id would be floored), empty,
    negative or >= `rows` (the policy's embedding rows; None: unchecked)."""
    try:
        tensor = torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{where} is {type(value).__name__} {_short(value)}, not token ids ({error}). {fix}") from None
    if tensor.dim() != 1:
        raise ValueError(f"{where} has shape {tuple(tensor.shape)}: token ids must be 1-D (one sequence, no "
                         f"padding). {fix}")
    if tensor.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{where} has dtype {tensor.dtype}: token ids must be integers (torch.long); a float id "
                        f"would be floored to another token. {fix}")
    if not len(tensor):
        raise ValueError(f"{where} is empty: it holds no token. {fix}")
    bad = ((tensor < 0) | (tensor >= rows)) if rows is not None else tensor < 0
    if bad.any():
        position = int(bad.nonzero()[0])
        limit = f"0 <= id < {rows}, the policy's embedding rows" if rows is not None else "ids >= 0"
        raise ValueError(f"{where} holds the token id {int(tensor[position])} at position {position}, outside "
                         f"{limit}: it names no token of the policy. {fix}")
    return tensor.long()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _as_tensor(value, dtype, name: str, where: str) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value, dtype=dtype).cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{where}: {name} is {type(value).__name__} {_short(value)}, not a 1-D tensor "
                        f"({error}).") from None
    if tensor.dim() != 1:
        raise ValueError(f"{where}: {name} must be 1-D, got shape {tuple(tensor.shape)}.")
    return tensor


def _score(value, where: str) -> float | None:
    """An `EnvSample.score`: None, a real number or a one-element tensor / array -> float, else an error."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__array__")
                                               or torch.is_tensor(value)):
        raise TypeError(f"{where}: score is {type(value).__name__} {_short(value)}: give a number (float(...)), or "
                        "None to score the episode with the trainer's reward model.")
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1 or not (tensor.dtype.is_floating_point or tensor.dtype in _INTEGER_DTYPES
                                   or tensor.dtype == torch.bool):
        raise ValueError(f"{where}: score has shape {tuple(tensor.shape)} and dtype {tensor.dtype}: give one number "
                         "per sample (a sum or a weighted sum of its parts; per-token rewards go in `rewards`).")
    return float(tensor)


def credit_to_policy_tokens(rewards: torch.Tensor, policy_mask: torch.Tensor) -> torch.Tensor:
    """Move each reward (T,) to the policy token at or before its position (policy_mask (T,) bool) -> (T,), 0 at
    environment tokens. Example: policy_mask [1, 1, 0, 0, 1], rewards [0, 0, 0, 2, 1] -> [0, 2, 0, 0, 1]."""
    owner = torch.cummax(torch.where(policy_mask, torch.arange(len(policy_mask)), -1), dim=0).values
    given = rewards != 0
    if (given & (owner < 0)).any():
        raise ValueError("An environment reward sits before the policy's first token: no action of the policy led "
                         "to it. Put it on a later position, or add it to the final score.")
    credited = torch.zeros_like(rewards)
    return credited.index_add_(0, owner[given], rewards[given])


class Collated(NamedTuple):
    """A batch of `EnvSample`s as tensors (B, R), padded after each episode; scores (B,) with NaN where the sample
    gave none (`given` (B,) bool False); step_rewards (B, R) or None when no sample gave any."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    policy_mask: torch.Tensor
    scores: torch.Tensor
    given: torch.Tensor
    step_rewards: torch.Tensor | None


def collate(samples: list[EnvSample], batch_size: int, response_length: int, pad_token_id: int, device, *,
            source: str = "Environment.rollout", rows: int | None = None) -> Collated:
    """Check the samples `source` (e.g. "MyEnv.rollout") returned (one `EnvSample` per prompt, integer token ids
    below `rows` (the policy's embedding rows; None: unchecked), matching lengths, at most `response_length` tokens,
    at least one policy token, a numeric score, finite rewards) and pad them into tensors of width `response_length`.
    Every error names `source`, the sample and the value."""
    if not isinstance(samples, (list, tuple)) or len(samples) != batch_size:
        count = len(samples) if isinstance(samples, (list, tuple)) else type(samples).__name__
        raise ValueError(f"{source} returned {count} samples for {batch_size} prompts: return a list with "
                         "one EnvSample per prompt, in order.")
    B, R = batch_size, response_length
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.bool)
    policy_mask = torch.zeros((B, R), dtype=torch.bool)
    scores, step_rewards = torch.full((B,), float("nan")), torch.zeros((B, R))
    for row, sample in enumerate(samples):
        where = f"{source} sample {row}"
        if not isinstance(sample, EnvSample):
            raise TypeError(f"{where} is a {type(sample).__name__} ({_short(sample)}): return hf_ppo.EnvSample("
                            "tokens, policy_mask, score, rewards) for each prompt" + (
                                " (EnvSample(**d) from a dict with those keys)" if isinstance(sample, dict) else "")
                            + ".")
        tokens = token_ids(sample.tokens, f"{where}: tokens", rows, "Return the token ids after the prompt, the "
                           "policy's and the environment's, as a 1-D LongTensor.")
        mask = _as_tensor(sample.policy_mask, None, "policy_mask", where)
        if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"{where}: policy_mask must be 0/1 (or bool) flags, got {_short(mask.tolist())}.")
        mask = mask.bool()
        T = len(tokens)
        if len(mask) != T:
            raise ValueError(f"{where}: {T} tokens but a policy_mask of {len(mask)}: one flag per token.")
        if T > R:
            raise ValueError(f"{where} has {T} tokens after its prompt, more than response_length={R}: raise "
                             "response_length or end the episode earlier (the context must hold them).")
        if not mask.any():
            raise ValueError(f"{where} holds no policy token: there is nothing to train on.")
        responses[row, :T], response_mask[row, :T], policy_mask[row, :T] = tokens, True, mask
        score = _score(sample.score, where)
        if score is not None:
            scores[row] = score
        if sample.rewards is not None:
            rewards = _as_tensor(sample.rewards, torch.float32, "rewards", where)
            if len(rewards) != T or not torch.isfinite(rewards).all():
                raise ValueError(f"{where}: rewards must be {T} finite floats, one per token.")
            step_rewards[row, :T] = credit_to_policy_tokens(rewards, mask)
    given = torch.tensor([s.score is not None for s in samples])
    any_rewards = any(s.rewards is not None for s in samples)
    return Collated(responses.to(device), response_mask.to(device), policy_mask.to(device), scores.to(device),
                    given.to(device), step_rewards.to(device) if any_rewards else None)


def check_sequences(sequences, source: str, rows: int | None) -> list[torch.Tensor]:
    """The `sequences` an environment passes to `sample` (`Environment.rollout`'s docstring) as 1-D long tensors,
    or an error naming `source` (who called `sample`), the sequence and the fix."""
    fix = ("Pass sample() a list of 1-D token tensors, one per conversation to continue, without padding (a "
           "prompt's `ids`, or torch.cat of the conversation so far).")
    if torch.is_tensor(sequences) or not isinstance(sequences, (list, tuple)):
        shape = f" of shape {tuple(sequences.shape)}" if torch.is_tensor(sequences) else ""
        raise TypeError(f"{source} called sample() with a {type(sequences).__name__}{shape}. {fix}")
    if not sequences:
        raise ValueError(f"{source} called sample([]): there is no sequence to continue. {fix} Skip the call when "
                         "no conversation needs another turn.")
    return [token_ids(seq, f"{source} called sample() with sequences[{i}], which", rows, fix)
            for i, seq in enumerate(sequences)]


class GivenSamples(Environment):
    """Samples made elsewhere (the step API, `trainer/step_api.py`): `rollout` returns them as they are and never samples."""

    source = "step()"  # who gave the samples, in `collate`'s errors (an Environment's are "<its class>.rollout")

    def __init__(self, samples: list[EnvSample]):
        self.samples = samples


    def rollout(self, prompts: list[Prompt], sample: Sample) -> list[EnvSample]:
        return self.samples
