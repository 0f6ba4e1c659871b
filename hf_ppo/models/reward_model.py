"""Loading the reward model(s), the fourth model beside the policy, the reference (`policy.py`) and the critic
(`critics.py`): a Hub id or path loaded as a one-label sequence classifier and frozen, a model object checked and
frozen, or a reward function `(prompts, completions) -> floats` passed through as it is; one reward or a list of them
(mixed rewards), each with the tokenizer it was given or, for an id/path, its own. How each reward is scored is
`rollout/scoring.py`'s."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from .pretrained import _init_kwargs, _is_quantized, freeze, from_pretrained
from .tokenizers import load_tokenizer

# A checkpoint without a trained score head (a causal LM, a base encoder) is not a reward model.
REWARD_HEAD_FIX = ("If a score head (`score` / `classifier`) is missing, this checkpoint is no reward model (a causal LM "
                   "or a base encoder, say): train one first (e.g. trl's RewardTrainer with num_labels=1 on preference "
                   "pairs) and pass that, or pass a reward function (prompts, completions) -> list[float].")


@dataclass(frozen=True)
class RewardLoading:
    """How the reward model(s) and the judges given by id/path load (`PPOConfig.reward_loading` builds it)."""

    reward_model_init_kwargs: dict | None = None  # from_pretrained keywords (revision, token, cache_dir, ...)
    reward_quantization: str = "none"  # '4bit', '8bit' or 'none'
    dtype: torch.dtype = torch.float32  # the compute dtype of the run's bf16 / fp16 (a quantized model computes in it)
    device: torch.device | str = "cpu"  # where the frozen models go (a quantized one is loaded there directly)


def load_reward_model(
    reward_model, init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device
):
    """The frozen reward model (a sequence classifier with one label), or a reward callable passed through."""
    if callable(reward_model) and not isinstance(reward_model, nn.Module):
        return reward_model
    if isinstance(reward_model, str):
        reward_model = from_pretrained(AutoModelForSequenceClassification, reward_model, "reward model",
                                       missing_fix=REWARD_HEAD_FIX, **_init_kwargs(init_kwargs, quantization, dtype,
                                                                                   device))
    if not isinstance(reward_model, PreTrainedModel):
        raise TypeError("reward_model must be a Hub id or path, an AutoModelForSequenceClassification, or a callable "
                        f"(prompts, completions) -> list[float]; got {type(reward_model).__name__}.")
    num_labels = getattr(reward_model.config, "num_labels", None)
    if num_labels != 1:
        raise ValueError(f"The reward model has num_labels={num_labels}; PPO needs one scalar score per response. "
                         "Use a reward model trained with num_labels=1 (e.g. trl's RewardTrainer).")
    if not _is_quantized(reward_model):
        reward_model = reward_model.to(device)
    return freeze(reward_model)


def load_rewards(reward_model, reward_processing_class, loading: RewardLoading):
    """(reward(s), reward tokenizer(s)): `load_reward_model` on one reward or on each of a list, with the tokenizer
    of each one given by id/path loaded beside it. For a list, `reward_processing_class` is None or a list with one
    entry (a tokenizer or None) per reward, and an error names the reward it concerns."""
    if not isinstance(reward_model, (list, tuple)):
        reward = load_reward_model(reward_model, loading.reward_model_init_kwargs, loading.reward_quantization,
                                   loading.dtype, loading.device)
        if isinstance(reward_model, str) and reward_processing_class is None:
            reward_processing_class = load_tokenizer(reward_model, "reward model", loading.reward_model_init_kwargs)
        return reward, reward_processing_class
    if not reward_model:
        raise ValueError("reward_model is an empty list: give at least one reward model, id or callable.")
    classes = reward_processing_class if reward_processing_class is not None else [None] * len(reward_model)
    if not isinstance(classes, (list, tuple)) or len(classes) != len(reward_model):
        raise ValueError(f"reward_model is a list of {len(reward_model)} rewards: reward_processing_class must be None "
                         "or a list with one entry per reward (its tokenizer, or None), in the same order.")
    rewards, tokenizers = [], []
    for i, (given, tokenizer) in enumerate(zip(reward_model, classes)):
        with naming_reward(reward_name(given), i):
            if isinstance(given, (list, tuple)):
                raise TypeError("a list inside the reward_model list: give one flat list of rewards.")
            reward, tokenizer = load_rewards(given, tokenizer, loading)
        rewards.append(reward)
        tokenizers.append(tokenizer)
    return rewards, tokenizers


def reward_name(reward) -> str:
    """How the logs name a reward, as TRL names it: an id/path's last part, a callable's `__name__` (a
    `functools.partial`'s function's), a model's `name_or_path`'s last part, else the class name."""
    while isinstance(reward, functools.partial):
        reward = reward.func
    source = reward if isinstance(reward, str) else getattr(reward, "name_or_path", None)
    if isinstance(source, str) and source.strip("/\\"):
        return source.replace("\\", "/").rstrip("/").split("/")[-1]
    name = getattr(reward, "__name__", None)
    return name.strip("<>") if isinstance(name, str) else type(reward).__name__  # "<lambda>" -> "lambda"


@contextlib.contextmanager
def naming_reward(name: str | None, index: int):
    """Errors raised inside name the reward of a list they come from (`name` None: a single reward, as it is)."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if name is None:
            raise
        raise type(err)(f"Reward {name!r} (reward_model[{index}]): {err}") from err
