"""The checks `PPOConfig.__post_init__` runs on value ranges, the mixed-reward fields, settings that together would make
a part of the objective a no-op, and the critic's Hub repo, each returning the list of problems it found (so one error
can name them all), apart from the dataclass that declares the fields."""

from __future__ import annotations

import math

from ..runtime.warn import warn_user

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


def no_op_errors(config) -> list[str]:
    """Settings each legal alone that together make a part of the objective a no-op: the run would train
    nothing, or not what was asked, without a word (docs/guides/errors.md)."""
    errors = []
    for name in _BOOL_FIELDS:  # "false" is a true value: a flag given as text would silently be on
        value = getattr(config, name)
        if not isinstance(value, bool):
            errors.append(f"{name}={value!r}: must be True or False.")
    if not (config.apply_chat_template_to_text is None or isinstance(config.apply_chat_template_to_text, bool)):
        errors.append(f"apply_chat_template_to_text={config.apply_chat_template_to_text!r}: must be True, False or "
                      "None.")
    if config.stop_token not in (None, "eos"):
        errors.append(f"stop_token={config.stop_token!r}: choose 'eos' or None (other stop tokens: stop_token_ids).")
    if config.kl_estimator not in ("k1", "k2", "k3"):
        errors.append(f"kl_estimator={config.kl_estimator!r}: choose 'k1', 'k2' or 'k3'.")
    if config.drop_uniform_groups is True and isinstance(config.num_generations, int) and config.num_generations < 2:
        errors.append("drop_uniform_groups=True compares the responses to one prompt: set num_generations >= 2.")
    refill = config.max_refill_rounds
    if type(refill) is int and refill > 0 and config.drop_uniform_groups is not True:
        errors.append(f"max_refill_rounds={refill} refills the places of the groups drop_uniform_groups drops, and "
                      "it is off: set drop_uniform_groups=True, or max_refill_rounds=0.")
    if config.importance_sampling_level not in ("token", "sequence"):
        errors.append(f"importance_sampling_level={config.importance_sampling_level!r}: choose 'token' or "
                      "'sequence' (GSPO).")
    if config.use_bias_correction_kl is True and not (config.use_kl_loss is True
                                                    or config.advantage_estimator == "grpo"):
        errors.append("use_bias_correction_kl=True corrects the KL loss term, and this run has none (its KL is in "
                      "the reward): set use_kl_loss=True, or unset use_bias_correction_kl.")
    if config.use_kl_loss is True and config.kl_coef == 0 and not config.adaptive_kl:
        errors.append("use_kl_loss=True with kl_coef=0: the KL loss term is multiplied by kl_coef, so it never "
                      "acts. Set kl_coef > 0, or use_kl_loss=False.")
    low = config.cliprange if config.cliprange_low is None else config.cliprange_low
    if isinstance(low, (int, float)) and low >= 1:
        name = "cliprange" if config.cliprange_low is None else "cliprange_low"
        errors.append(f"{name}={low}: the lower clip bound 1 - {low} <= 0 can never bind (a ratio is > 0), so "
                      "negative-advantage updates are never clipped. Use a value below 1 (e.g. 0.2).")
    warmup = config.critic_warmup_steps
    if isinstance(warmup, int) and warmup > 0 and config.max_steps > 0 and warmup >= config.max_steps:
        # A critic-only run can be meant (train the critic, then resume with a longer max_steps): said, not refused.
        warn_user(f"critic_warmup_steps={warmup} covers the whole run (max_steps={config.max_steps}): only the "
                  "critic trains and the policy ends where it started. Lower critic_warmup_steps or raise "
                  "max_steps if the policy should train.")
    alpha = config.lam_length_alpha
    if isinstance(alpha, (int, float)) and alpha > 0 and isinstance(config.response_length, int) \
            and alpha * config.response_length <= 1:
        warn_user(f"lam_length_alpha={alpha} x response_length={config.response_length} <= 1: every response gets "
                  "lambda 1 - 1 / (alpha x length) <= 0, clamped to 0 (one-step TD advantages). VAPO's 0.05 is "
                  "for responses of hundreds of tokens: raise lam_length_alpha, or unset it.")
    if isinstance(config.entropy_coef, (int, float)) and config.entropy_coef < 0:
        warn_user(f"entropy_coef={config.entropy_coef} is negative: the loss pays the policy for lower entropy, which "
                  "speeds up collapse to a few responses. Use entropy_coef >= 0 unless that is what you want.")
    if config.stop_on_collapse is True and config.watch_collapse is False:
        errors.append("stop_on_collapse=True with watch_collapse=False: nothing watches, so nothing would stop "
                      "training. Set watch_collapse=True, or stop_on_collapse=False.")
    if config.adaptive_kl and config.kl_coef == 0:
        errors.append("adaptive_kl=True with kl_coef=0: the adaptive controller scales the coefficient, so it "
                      "stays 0 and the KL penalty never acts. Start from kl_coef > 0, or set adaptive_kl=False.")
    weights = config.reward_weights
    if isinstance(weights, (list, tuple)) and weights and all(
            isinstance(w, (int, float)) and w == 0 for w in weights):
        errors.append(f"reward_weights={list(weights)}: every weight is 0, so every score is 0 and PPO learns "
                      "from the KL penalty alone. Give at least one reward a non-zero weight.")
    if config.vf_coef == 0 and config.advantage_estimator == "gae" and not config.critic_warmup_steps \
            and config.critic_updates_per_step == 1:
        warn_user("vf_coef=0 with advantage_estimator='gae': the critic is never trained, so GAE uses the "
                  "values of an untrained critic. Set vf_coef > 0 (e.g. 0.1), or use a critic-free estimator "
                  "(advantage_estimator='rloo' / 'grpo' / 'reinforce_pp').")
    return errors


def mixed_reward_errors(config) -> list[str]:
    """Check the mixed-reward fields (their count against the rewards is checked by the trainer)."""
    errors = []
    weights = config.reward_weights
    if weights is not None and (isinstance(weights, (str, bytes)) or not isinstance(weights, (list, tuple))
                                or not weights or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                          and math.isfinite(w) for w in weights)):
        errors.append(f"reward_weights={weights!r}: must be None or a non-empty list of finite numbers, one per "
                      "reward.")
    buffer = config.overlong_buffer_length
    if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, int)
                               or not 1 <= buffer <= config.response_length):
        errors.append(f"overlong_buffer_length={buffer!r}: must be None (off) or an integer in [1, "
                      f"response_length={config.response_length}].")
    return errors
