"""TRL's and verl's names for PPOConfig's settings, turned into hf_ppo's once when the config is built
(`PPOConfig.__post_init__` calls these): one name per setting from then on (the records, the resume comparison, the
card). Each returns the errors for names that cannot apply, so one error can name them all."""

from __future__ import annotations

import math

from ..algorithms.ppo_math import (
    KL_ALIASES,
    KL_ESTIMATORS,
    LOSS_AGGREGATION_ALIASES,
    LOSS_AGGREGATIONS,
    RENAMED_LOSS_AGGREGATIONS,
    kl_estimator_name,
    loss_aggregation_name,
)
from ..runtime.warn import warn_user
from .config_checks import _TRL_ONLY_NAMES


def map_verl_names(config) -> list[str]:
    """Store verl's names of the KL estimators and loss aggregations as hf_ppo's (one name per setting from here
    on: the records, the resume comparison, the card); return the errors for unknown or renamed ones."""
    errors = []
    if isinstance(config.scale_rewards, bool):  # TRL's bools, stored as its words
        config.scale_rewards = "group" if config.scale_rewards else "none"
    for name in ("kl_estimator", "kl_loss_estimator"):
        try:
            setattr(config, name, kl_estimator_name(getattr(config, name)))
        except (ValueError, TypeError):
            errors.append(f"{name}={getattr(config, name)!r}: choose one of {', '.join(KL_ESTIMATORS)} (or verl's "
                          f"names {', '.join(KL_ALIASES)}).")
    try:
        config.loss_aggregation = loss_aggregation_name(config.loss_aggregation)
    except (ValueError, TypeError) as err:
        errors.append(str(err) if config.loss_aggregation in RENAMED_LOSS_AGGREGATIONS else
                      f"loss_aggregation={config.loss_aggregation!r}: choose one of {', '.join(LOSS_AGGREGATIONS)} "
                      f"(or verl's {', '.join(LOSS_AGGREGATION_ALIASES)}).")
    return errors

def map_trl_names(config) -> list[str]:
    """Turn TRL 1.12's names into hf_ppo's fields; return the errors for names that cannot apply."""
    errors = []
    if config.max_completion_length is not None:  # TRL GRPO's name: one setting, two names
        unset = config.__dataclass_fields__["response_length"].default
        if config.response_length not in (config.max_completion_length, unset):
            errors.append(f"max_completion_length={config.max_completion_length} and response_length="
                          f"{config.response_length} both set the response budget: give one of them.")
        config.response_length = config.max_completion_length
    derived = {
        "local_batch_size": "rollout_batch_size (prompts per iteration per device)",
        "batch_size": "rollout_batch_size x world_size (prompts per iteration)",
        "local_mini_batch_size": "minibatch_size (sequences per optimizer step per device)",
        "mini_batch_size": "minibatch_size x world_size",
        "micro_batch_size": "per_device_train_batch_size x world_size",
    }
    for name, meaning in derived.items():
        if getattr(config, name) is not None:
            errors.append(f"{name}={getattr(config, name)} cannot be set (TRL computed it too, and overwrote your "
                          f"value): here it is {meaning}. Set per_device_train_batch_size, "
                          "gradient_accumulation_steps and num_mini_batches instead.")
    for name in ("sft_model_path", "reward_model_path"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            errors.append(f"{name}={value!r}: must be None or a Hub id / local path (a non-empty string).")
    if config.ds3_gather_for_generation is not None:
        warn_user("ds3_gather_for_generation is ignored: it is a DeepSpeed ZeRO-3 option and hf_ppo has no "
                  "ZeRO-3 weight gathering for generation. Use DDP or ZeRO-2 (recipes/accelerate/); to fit a "
                  "larger policy, load it in 4 bits with LoRA (policy_quantization='4bit').")
    # A TRL name marks a TRL config: there `num_mini_batches` split the rollout batch; here it multiplies it.
    trl_names = [name for name in _TRL_ONLY_NAMES if getattr(config, name) is not None]
    if trl_names and isinstance(config.num_mini_batches, int) and config.num_mini_batches > 1:
        warn_user(
        f"num_mini_batches={config.num_mini_batches} means something else than in TRL (this config uses TRL's "
        f"{trl_names[0]}): it multiplies the rollout batch here, so one iteration samples "
        "per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches prompts per device, "
        "where TRL sampled per_device_train_batch_size x gradient_accumulation_steps and split them. To keep "
        "TRL's batch sizes, divide gradient_accumulation_steps by num_mini_batches.")
    if config.total_episodes is None and config.num_total_batches is None:
        return errors
    if config.total_episodes is not None and config.num_total_batches is not None:
        return errors + ["Set total_episodes or num_total_batches, not both (both set the run length)."]
    for name in ("total_episodes", "num_total_batches"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            return errors + [f"{name}={getattr(config, name)}: set it to 1 or more."]
    if config.num_ppo_epochs < 1 or config.num_mini_batches < 1 or not (
            isinstance(config.critic_updates_per_step, int) and config.critic_updates_per_step >= 1):
        return errors  # reported by the range checks
    if config.num_total_batches is not None:
        iterations = config.num_total_batches
    else:
        iterations = math.ceil(config.total_episodes / (config.rollout_batch_size * config.world_size))
    steps = iterations * config.optimizer_steps_per_iteration
    if config.max_steps > 0 and config.max_steps != steps:
        name = "total_episodes" if config.total_episodes is not None else "num_total_batches"
        return errors + [f"{name} and max_steps={config.max_steps} both set the run length ({name} means "
                         f"max_steps={steps}): set only one."]
    config.max_steps = steps
    return errors
