"""`load_models`: the policy, the reference, the reward model(s) and the critic, assembled and checked against each
other as `PPOLMTrainer` is given them, plus TRL 1.12's names for them (`sft_model_path`, `reward_model_path`,
`value_model`).

Each piece is loaded by the module that owns it (`models.policy`, `models.reward_model`, `models.critics`); this module
only decides the order and the checks across models: every model that reads the policy's token ids is checked against
the tokenizer here (not by an IndexError mid-rollout), the stop tokens are resolved before a pad token that is none of
them is chosen, and dropout is turned off everywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, ContextManager

from torch import nn
from transformers import PreTrainedTokenizerBase

from ..algorithms.estimators import ESTIMATORS
from ..models import gguf
from ..models.actor_critic import PolicyAndCritic
from ..models.adapters import prepare_adapters
from ..models.critics import critic_reward, load_critic, saved_critic
from ..models.policy import load_policy, load_reference, without_critic
from ..models.pretrained import compute_dtype, disable_dropout, keep_4bit_differentiable
from ..models.reward_model import load_rewards
from ..models.tokenizers import (
    check_stop_token_ids,
    check_vocab,
    choose_pad_token,
    load_policy_tokenizer,
    max_positions,
    resolve_stop_token_ids,
)
from ..models.value_head import AutoModelForCausalLMWithValueHead
from ..runtime.warn import warn_user, without_checkpointing_deprecation


def trl_inputs(model, reward_model, value_model, critic_model, args) -> tuple:
    """(model, reward_model, critic_model) from the trainer's arguments and TRL 1.12's names for them:
    `args.sft_model_path` / `args.reward_model_path` stand in for a model or reward model not given (an argument
    given too must name the same checkpoint), and `value_model=` is a 'separate' critic (`trl_value_model`)."""
    model = _config_path(model, args.sft_model_path, "model", "sft_model_path")
    reward_model = _config_path(reward_model, args.reward_model_path, "reward_model", "reward_model_path")
    if model is None:
        raise ValueError("PPOLMTrainer needs a policy: pass model=<Hub id / path / model object>, or set "
                         "PPOConfig(sft_model_path=<Hub id / path>) (TRL's name).")
    return model, reward_model, trl_value_model(value_model, critic_model, args)


def _config_path(given, path: str | None, argument: str, field_name: str):
    """`given`, or `path` when nothing is given; an error when both are given and name different checkpoints (an
    object is compared by the id/path it was loaded from, its config's `name_or_path`)."""
    if path is None or given is None:
        return path if given is None else given
    name = given if isinstance(given, str) else getattr(getattr(given, "config", None), "name_or_path", None)
    if isinstance(name, str) and _same_checkpoint_name(name, path):
        return given
    what = repr(given) if isinstance(given, str) else (f"a {type(given).__name__} loaded from {name!r}" if name
                                                       else f"a {type(given).__name__}")
    raise ValueError(f"{argument}= is {what}, but PPOConfig.{field_name}={path!r} names another checkpoint: give the "
                     f"model in one place (drop {field_name}, or drop the {argument} argument).")


def _same_checkpoint_name(a: str, b: str) -> bool:
    """True when two ids/paths name one checkpoint: equal ids, or local paths to the same folder."""
    def norm(p):
        expanded = os.path.expanduser(p)
        return os.path.realpath(expanded) if os.path.exists(expanded) else p.rstrip("/")
    return norm(a) == norm(b)


def trl_value_model(value_model, critic_model, args):
    """TRL 1.12's `PPOTrainer(value_model=...)`, a critic model of its own: hf_ppo's `critic="separate"` started from
    `critic_model`. Returns the critic model to use; with `critic="shared"` (the default) `args.critic` becomes
    "separate", which is what TRL's argument meant."""
    if value_model is None:
        return critic_model
    if critic_model is not None:
        raise ValueError("Both value_model (TRL's name) and critic_model give the critic model: pass one of them.")
    if not ESTIMATORS[args.advantage_estimator].needs_critic:
        raise ValueError(f"value_model is given, but advantage_estimator={args.advantage_estimator!r} uses no critic: "
                         "drop value_model, or use advantage_estimator='gae'.")
    if args.critic == "reward_lora":
        raise ValueError("value_model (TRL's separate critic) is given with critic='reward_lora', which puts the "
                         "critic's adapter on the reward model: drop value_model, or set critic='separate'.")
    args.critic = "separate"
    return value_model


POLICY_VOCAB_FIX = ("If you added tokens to the tokenizer (a [PAD], chat tokens), the policy needs rows for them: "
                     "`model.resize_token_embeddings(len(tokenizer))` and pass the model object; a pad token needs "
                     "none (the trainer picks an existing unused special token when the tokenizer has no pad). "
                     "Otherwise pass the tokenizer that belongs to the policy.")
REFERENCE_VOCAB_FIX = ("The reference scores the policy's token ids, so it must have the policy's vocabulary: pass "
                        "the policy's starting checkpoint as ref_model (or ref_model=None), resized like the policy "
                        "if you added tokens.")


@dataclass
class LoadedModels:
    """Everything `load_models` builds: the policy + value head (or the policy alone for a critic-free
    estimator), the frozen models and the tokenizers."""

    policy: AutoModelForCausalLMWithValueHead | PolicyAndCritic  # the latter for critic='separate' / 'reward_lora'
    tokenizer: PreTrainedTokenizerBase  # the policy's, with a pad token that is no stop token
    ref_model: nn.Module | None  # None: the policy's reference adapter, or its adapter disabled
    reward_model: nn.Module  # or a reward callable; a list of them for mixed rewards
    reward_processing_class: PreTrainedTokenizerBase | None  # a list (one per reward) for mixed rewards
    stop_token_ids: list[int]
    trained_adapter: str | None
    ref_adapter: str | None
    reward_scoring_context: Callable[[], ContextManager]  # the reward models score in it, as loaded (`load_critic`)


@without_checkpointing_deprecation
def load_models(model, processing_class, reward_model, ref_model, reward_processing_class, peft_config,
                args, device, critic_model=None) -> LoadedModels:
    """Load and check the policy, the reference, the reward model and the critic (`load_critic`) as `PPOLMTrainer`
    is given them.

    Each model that reads the policy's token ids is checked against the tokenizer here, not by an IndexError
    mid-rollout; the stop tokens are resolved, then a pad token that is none of them is chosen; dropout is turned off.
    """
    if reward_model is None:
        raise ValueError("PPOLMTrainer needs a reward_model: a Hub id or path, an AutoModelForSequenceClassification "
                         "(num_labels=1), a callable (prompts, completions) -> list[float], or a list of them.")
    dtype = compute_dtype(args.bf16, args.fp16)
    init_kwargs, ref_init_kwargs = args.model_init_kwargs, args.ref_model_init_kwargs
    if isinstance(model, str):  # a GGUF checkpoint loads from its converted folder (models/gguf.py)
        model, init_kwargs = gguf.converted(model, init_kwargs, "policy")
    if isinstance(ref_model, str):
        ref_model, ref_init_kwargs = gguf.converted(ref_model, ref_init_kwargs, "reference model")
    elif ref_init_kwargs and ref_init_kwargs.get("gguf_file"):  # the reference is a copy of the starting policy
        ref_init_kwargs = {k: v for k, v in ref_init_kwargs.items() if k != "gguf_file"}
    if processing_class is None:
        if not isinstance(model, str):
            raise ValueError("Pass processing_class=tokenizer when model is not a Hub id or path.")
        processing_class = load_policy_tokenizer(model, init_kwargs)
    policy = load_policy(model, init_kwargs, args.policy_quantization, peft_config, dtype, device,
                         args.gradient_checkpointing)
    if not ESTIMATORS[args.advantage_estimator].needs_critic:
        policy = without_critic(policy, args.advantage_estimator, given_with_head=isinstance(
            model, AutoModelForCausalLMWithValueHead))
    body = policy.policy_model
    policy_warned = check_vocab(body, processing_class, "policy", POLICY_VOCAB_FIX, warn_unused=True)
    stop_token_ids = resolve_stop_token_ids(args.stop_token_ids, args.stop_token_id, args.stop_token,
                                            processing_class, body)
    check_stop_token_ids(stop_token_ids, body, needs_stop=args.missing_eos_penalty is not None)
    tokenizer = choose_pad_token(processing_class, body, stop_token_ids, "id" if isinstance(model, str) else "object")
    for config in (body.config, getattr(body, "generation_config", None)):  # said once, by hf_ppo: Trainer need not
        if config is not None:                                               # align (and announce) it again
            config.pad_token_id = tokenizer.pad_token_id
    # The trained adapter and, with ref_model=None, the reference adapter beside it (continuing from an adapter).
    trained_adapter, ref_adapter = prepare_adapters(
        body, fresh=peft_config is not None, ref_model_given=ref_model is not None,
        model_adapter_name=args.model_adapter_name, ref_adapter_name=args.ref_adapter_name)
    ref = load_reference(ref_model, model, ref_init_kwargs, args.ref_quantization, dtype, device,
                         uses_peft=policy.is_peft_model, policy=body)
    if ref is not None:
        # A reference of another model than the policy's (its vocabulary far larger) is said unless the policy's
        # check already named this tokenizer.
        check_vocab(ref, tokenizer, "reference model", REFERENCE_VOCAB_FIX, warn_unused=not policy_warned)
    reward, reward_processing_class = load_rewards(reward_model, reward_processing_class, args.reward_loading)
    saved = saved_critic(critic_model, args.critic, args.critic_model_init_kwargs)  # rebuilt, then its state loaded
    critic_model = saved.build_from if saved is not None else critic_model
    critic, reward_scoring_context = load_critic(critic_model, *critic_reward(args.critic, reward_model, reward,
                                                                              reward_processing_class, critic_model),
                                                 tokenizer, body, peft_config, args.critic_loading)
    if critic is not None:  # the critic has a body of its own: the shared value head is not used
        if isinstance(model, AutoModelForCausalLMWithValueHead):
            warn_user(f"critic={args.critic!r}: the value head of the model passed is not used (the critic has "
                      "its own). Pass the causal LM alone, or use critic='shared' to train that head.")
        policy = PolicyAndCritic(body, critic)
        if (getattr(critic, "quantization_method", None) and not getattr(body, "quantization_method", None)
                and not (args.fsdp or args.deepspeed)):
            # Trainer moves no model that reports a quantization method, and this pair reports the critic's 4-bit
            # one: the full-precision policy goes where the critic already is, as Trainer would have put it.
            body.to(args.device)
    if saved is not None:
        policy.load_critic_state_dict(saved.state)
    models = [m for m in (policy, ref, *(reward if isinstance(reward, list) else [reward])) if isinstance(m, nn.Module)]
    for m in models:
        keep_4bit_differentiable(m)
        if args.disable_dropout:
            disable_dropout(m)
    return LoadedModels(policy, tokenizer, ref, reward, reward_processing_class, stop_token_ids, trained_adapter,
                        ref_adapter, reward_scoring_context)
