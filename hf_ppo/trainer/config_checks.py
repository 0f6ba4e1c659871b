"""The checks `PPOConfig.__post_init__` runs on value ranges and on the critic's Hub repo, each returning the list of
problems it found (so one error can name them all), apart from the dataclass that declares the fields."""

from __future__ import annotations

import math

# Fields only a config written for TRL 1.12 sets (hf_ppo has its own ways to say the same).
_TRL_ONLY_NAMES = ("total_episodes", "num_total_batches", "sft_model_path", "reward_model_path")

# (field, accepts None, test, what the value must be): every numeric PPO field, checked when PPOConfig is built.
_RANGES = [
    ("per_device_train_batch_size", False, lambda v: v >= 1, "an integer >= 1"),
    ("gradient_accumulation_steps", False, lambda v: v >= 1, "an integer >= 1"),
    ("num_ppo_epochs", False, lambda v: v >= 1, "an integer >= 1"),
    ("num_mini_batches", False, lambda v: v >= 1, "an integer >= 1"),
    ("response_length", False, lambda v: v >= 1, "an integer >= 1"),
    ("local_rollout_forward_batch_size", False, lambda v: v >= 1, "an integer >= 1"),
    ("max_prompt_length", True, lambda v: v >= 1, "None (no limit) or an integer >= 1"),
    ("temperature", False, lambda v: 0 < v < math.inf, "> 0 (log-probs divide the logits by it)"),
    ("top_k", True, lambda v: v >= 0, "None or 0 (off), or an integer >= 1"),
    ("top_p", False, lambda v: 0 < v <= 1, "in (0, 1]"),
    ("stop_token_id", True, lambda v: v >= 0, "None or a token id >= 0"),
    ("missing_eos_penalty", True, lambda v: 0 <= v < math.inf,
     "None or >= 0 (it is subtracted from the score of a response that never stops: a negative one pays the "
     "policy for never stopping)"),
    ("gamma", False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("lam", False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("lam_critic", True, lambda v: 0 <= v <= 1, "None (lam) or in [0, 1]"),
    ("lam_length_alpha", True, lambda v: 0 < v < math.inf, "None (off: lam) or > 0 (VAPO: 0.05)"),
    ("dataset_num_proc", True, lambda v: v >= 1, "None or an integer >= 1 (processes that tokenize the prompts)"),
    ("logits_memory_mb", False, lambda v: 0 < v < math.inf, "> 0 (MiB, e.g. 256)"),
    ("cliprange", False, lambda v: 0 < v < math.inf, "> 0 (e.g. 0.2)"),
    ("cliprange_value", False, lambda v: 0 < v < math.inf, "> 0 (e.g. 0.2)"),
    ("vf_coef", False, lambda v: 0 <= v < math.inf, ">= 0 (e.g. 0.1)"),
    ("value_head_learning_rate", True, lambda v: 0 < v < math.inf, "None (learning_rate) or > 0"),
    ("critic_learning_rate", True, lambda v: 0 < v < math.inf, "None (learning_rate) or > 0"),
    ("critic_warmup_steps", False, lambda v: v >= 0, "an integer >= 0 (optimizer steps; 0: off)"),
    ("critic_updates_per_step", False, lambda v: isinstance(v, int) and v >= 1,
     "an integer >= 1 (critic passes per policy pass; 1: off)"),
    ("num_generations", False, lambda v: v >= 1, "an integer >= 1 (responses per prompt)"),
    ("max_refill_rounds", False, lambda v: isinstance(v, int) and v >= 0,
     "an integer >= 0 (extra sampling rounds per iteration; 0: off)"),
    ("entropy_coef", False, math.isfinite, "a finite number (0: off)"),
    ("kl_coef", False, lambda v: 0 <= v < math.inf, ">= 0 (a negative beta rewards drifting from the reference)"),
    ("kl_target", False, lambda v: 0 < v < math.inf, "> 0"),
    ("kl_horizon", False, lambda v: v >= 1, "an integer >= 1 (episodes)"),
    ("reward_clip", True, lambda v: 0 < v < math.inf, "None (off) or > 0 (scores are clipped to [-clip, clip])"),
    ("overlong_penalty_factor", False, lambda v: 0 <= v < math.inf, ">= 0 (the penalty at full response_length)"),
    ("num_sample_generations", False, lambda v: v >= 0, "an integer >= 0 (0: never)"),
    ("num_eval_samples", False, lambda v: isinstance(v, int) and v >= 1,
     "an integer >= 1 (responses per eval prompt and side; 1: one each)"),
    ("max_consecutive_nonfinite", False, lambda v: v >= 1, "an integer >= 1"),
    ("collapse_kl_threshold", True, lambda v: 0 < v < math.inf, "None (3 x kl_target with adaptive_kl) or > 0 (nats)"),
]


# The PPO fields that are flags (TrainingArguments checks its own).
_BOOL_FIELDS = ("disable_dropout", "whiten_advantages", "whiten_rewards", "scale_rewards", "adaptive_kl",
                "use_kl_loss", "use_bias_correction_kl", "drop_uniform_groups",
                "normalize_rewards", "normalize_each_reward", "push_merged_model", "allow_config_change_on_resume",
                "print_metrics", "watch_collapse", "stop_on_collapse")


def _range_errors(config) -> list[str]:
    """One line per out-of-range field (a NaN fails every test), with the range it must be in."""
    errors = []
    for name, optional, ok, expected in _RANGES:
        value = getattr(config, name)
        if value is None and optional:
            continue
        try:
            valid = not isinstance(value, bool) and value is not None and bool(ok(value))
        except TypeError:
            valid = False
        if not valid:
            errors.append(f"{name}={value!r}: must be {expected}.")
    return errors


def critic_repo_problems(repo_id, policy_repo_id: str | None, fsdp: int | None) -> list[str]:
    """Why `critic_hub_model_id=repo_id` cannot be pushed to (empty: it can): not a full 'namespace/name' id, the
    policy's repo, or a critic sharded by FSDP (`push_critic_to_hub` reads it on one process)."""
    from huggingface_hub.utils import validate_repo_id

    if repo_id is None:
        return []
    try:
        if not isinstance(repo_id, str) or "/" not in repo_id:
            raise ValueError("no namespace")
        validate_repo_id(repo_id)
    except ValueError:
        return [f"critic_hub_model_id={repo_id!r}: must be a Hub repo id 'namespace/name' (the critic's own repo), "
                "e.g. 'your-user/my-run-critic'."]
    problems = []
    if repo_id == policy_repo_id:
        problems.append(f"critic_hub_model_id={repo_id!r} is hub_model_id, the policy's repo: the critic goes to a "
                        f"repo of its own, e.g. critic_hub_model_id='{repo_id}-critic'.")
    if fsdp is not None:
        problems.append("critic_hub_model_id is set with FSDP, which shards the critic across processes while the "
                        "critic push reads it on one: unset critic_hub_model_id (the critic is in the checkpoints).")
    return problems
