"""The checks `PPOConfig.__post_init__` runs on value ranges, the mixed-reward fields, settings that together would make
a part of the objective a no-op, and the critic's Hub repo, each returning the list of problems it found (so one error
can name them all), apart from the dataclass that declares the fields."""

from __future__ import annotations

import math

import torch

from ..algorithms.ppo_math import POLICY_LOSSES, ROLLOUT_CORRECTIONS, SCALE_REWARDS
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
    ("max_completion_length", True, lambda v: v >= 1, "None or an integer >= 1 (TRL GRPO's name for response_length)"),
    ("local_rollout_forward_batch_size", False, lambda v: v >= 1, "an integer >= 1"),
    ("max_prompt_length", True, lambda v: v >= 1, "None (no limit) or an integer >= 1"),
    ("temperature", False, lambda v: 0 < v < math.inf, "> 0 (log-probs divide the logits by it)"),
    ("top_k", True, lambda v: v >= 0, "None or 0 (off), or an integer >= 1"),
    ("top_p", False, lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", False, lambda v: 0 <= v <= 1, "in [0, 1] (0.0: off)"),
    ("stop_token_id", True, lambda v: v >= 0, "None or a token id >= 0"),
    ("missing_eos_penalty", True, lambda v: 0 <= v < math.inf,
     "None or >= 0 (it is subtracted from the score of a response that never stops: a negative one pays the "
     "policy for never stopping)"),
    ("gamma", False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("lam", False, lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("lam_critic", True, lambda v: 0 <= v <= 1, "None (lam) or in [0, 1]"),
    ("lam_length_alpha", True, lambda v: 0 < v < math.inf, "None (off: lam) or > 0 (VAPO: 0.05)"),
    ("auto_ev_threshold", False, lambda v: -1 <= v < 1,
     "in [-1, 1) (explained variance; 0: EVPO's, where the critic starts to lower the advantages' variance)"),
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
    ("stats_pass_every", False, lambda v: isinstance(v, int) and v >= 0,
     "an integer >= 0 (rollouts between the passes a skip leaves out; 1: every rollout, 0: never)"),
    ("reward_clip", True, lambda v: 0 < v < math.inf, "None (off) or > 0 (scores are clipped to [-clip, clip])"),
    ("overlong_penalty_factor", False, lambda v: 0 <= v < math.inf, ">= 0 (the penalty at full response_length)"),
    ("num_sample_generations", False, lambda v: v >= 0, "an integer >= 0 (0: never)"),
    ("num_eval_samples", False, lambda v: isinstance(v, int) and v >= 1,
     "an integer >= 1 (responses per eval prompt and side; 1: one each)"),
    ("max_consecutive_nonfinite", False, lambda v: v >= 1, "an integer >= 1"),
    ("collapse_kl_threshold", True, lambda v: 0 < v < math.inf, "None (3 x kl_target with adaptive_kl) or > 0 (nats)"),
    ("vllm_gpu_memory_utilization", False, lambda v: 0 < v <= 1, "in (0, 1] (a share of the GPU's memory, e.g. 0.3)"),
    ("vllm_max_model_len", True, lambda v: isinstance(v, int) and v >= 2,
     "None (max_prompt_length + response_length) or an integer >= 2 (tokens)"),
    ("vllm_importance_sampling_cap", True, lambda v: 1 <= v < math.inf, "None (off) or >= 1 (TRL uses 2.0)"),
    ("vllm_importance_sampling_min", True, lambda v: 0 < v <= 1, "None (no lower bound) or in (0, 1] (e.g. 0.5)"),
    ("cispo_clip_max", False, lambda v: 0 < v < math.inf, "> 0 (the cap on CISPO's weight; TRL: 5.0)"),
    ("sapo_temperature_pos", False, lambda v: 0 < v < math.inf, "> 0 (SAPO: 1.0)"),
    ("sapo_temperature_neg", False, lambda v: 0 < v < math.inf, "> 0 (SAPO: 1.05)"),
    ("gmpo_cliprange", False, lambda v: 0 < v < math.inf, "> 0 (a log-ratio bound; GMPO: 0.4)"),
    ("clip_cov_ratio", False, lambda v: 0 < v <= 1, "in (0, 1] (a share of tokens; 2e-4)"),
    ("clip_cov_lb", False, math.isfinite, "a finite number (a covariance; 1.0)"),
    ("clip_cov_ub", False, math.isfinite, "a finite number (a covariance; 5.0)"),
    ("kl_cov_ratio", False, lambda v: 0 < v <= 1, "in (0, 1] (a share of tokens; 2e-3)"),
    ("kl_cov_coef", False, lambda v: 0 <= v < math.inf, ">= 0 (KL-Cov's beta: 1.0)"),
]

# Each policy loss's own parameters (`loss_family_errors`): one set away from its default with another loss chosen
# would do nothing.
_POLICY_LOSS_PARAMETERS = {"cispo": ("cispo_clip_max",), "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
                           "gmpo": ("gmpo_cliprange",), "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
                           "kl_cov": ("kl_cov_ratio", "kl_cov_coef")}


# The PPO fields that are flags (TrainingArguments checks its own).
_BOOL_FIELDS = ("disable_dropout", "whiten_advantages", "whiten_rewards", "adaptive_kl",
                "use_kl_loss", "use_bias_correction_kl", "drop_uniform_groups",
                "normalize_rewards", "normalize_each_reward", "push_merged_model", "allow_config_change_on_resume",
                "print_metrics", "watch_collapse", "stop_on_collapse", "vllm_enable_sleep_mode")


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
    for name in ("prompt_column", "system_prompt"):  # a name, a message: None or text
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            errors.append(f"{name}={value!r}: must be None or a non-empty string"
                          + (" (the column of the prompts)." if name == "prompt_column" else " (the system message)."))
    if config.stop_token not in (None, "eos"):
        errors.append(f"stop_token={config.stop_token!r}: choose 'eos' or None (other stop tokens: stop_token_ids).")
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
    if config.vf_coef == 0 and config.advantage_estimator in ("gae", "auto") and not config.critic_warmup_steps \
            and config.critic_updates_per_step == 1:
        warn_user(f"vf_coef=0 with advantage_estimator={config.advantage_estimator!r}: the critic is never trained, "
                  "so GAE uses the "
                  "values of an untrained critic. Set vf_coef > 0 (e.g. 0.1), or use a critic-free estimator "
                  "(advantage_estimator='rloo' / 'grpo' / 'reinforce_pp').")
    return errors


def loss_family_errors(config) -> list[str]:
    """Check the policy loss, its parameters and the rollout correction (docs/reference/algorithms.md)."""
    errors = []
    loss = config.policy_loss
    if loss not in POLICY_LOSSES:
        return [f"policy_loss={loss!r}: choose one of {', '.join(map(repr, POLICY_LOSSES))}."]
    defaults = type(config).__dataclass_fields__
    for owner, names in _POLICY_LOSS_PARAMETERS.items():
        for name in names:
            if owner != loss and getattr(config, name) != defaults[name].default:
                errors.append(f"{name}={getattr(config, name)!r} is a parameter of policy_loss={owner!r}, and this "
                              f"run's is {loss!r}: set policy_loss={owner!r}, or unset {name}.")
    if loss == "clip_cov" and isinstance(config.clip_cov_lb, (int, float)) and isinstance(config.clip_cov_ub, (
            int, float)) and not config.clip_cov_lb < config.clip_cov_ub:
        errors.append(f"clip_cov_lb={config.clip_cov_lb} >= clip_cov_ub={config.clip_cov_ub}: no token's covariance "
                      "lies between them, so Clip-Cov would detach none. Set clip_cov_lb < clip_cov_ub (1.0, 5.0).")
    if loss not in ("ppo", "clip_cov"):
        for name in ("cliprange_low", "cliprange_high", "dual_clip"):
            if getattr(config, name) is not None:
                errors.append(f"{name} clips PPO's ratio, and policy_loss={loss!r} has no such clip: unset {name}, or "
                              f"use policy_loss='ppo'" + (" (its own bounds: " + ", ".join(
                                  _POLICY_LOSS_PARAMETERS[loss]) + ")." if loss in _POLICY_LOSS_PARAMETERS else "."))
    elif loss == "clip_cov" and config.dual_clip is not None:
        errors.append("dual_clip with policy_loss='clip_cov': Clip-Cov uses PPO's single clip. Unset dual_clip.")
    if config.importance_sampling_level == "sequence" and loss not in ("ppo", "cispo", "sapo"):
        errors.append(f"importance_sampling_level='sequence' with policy_loss={loss!r}: only 'ppo' (GSPO), 'cispo' and "
                      "'sapo' take a sequence-level ratio. Set importance_sampling_level='token'.")
    if config.advantage_estimator in ("rloo", "grpo") and config.gamma != 1:
        errors.append(f"gamma={config.gamma} with advantage_estimator={config.advantage_estimator!r}: its advantage "
                      "is one per response, with nothing to discount. Set gamma=1.0 (gae and reinforce_pp discount).")
    aggregation = config.multi_objective_aggregation
    if aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        errors.append(f"multi_objective_aggregation={aggregation!r}: choose 'sum_then_normalize' or "
                      "'normalize_then_sum'.")
    elif aggregation == "normalize_then_sum" and (config.advantage_estimator != "grpo"
                                                  or config.scale_rewards != "batch"):
        errors.append("multi_objective_aggregation='normalize_then_sum' is TRL's GRPO recipe: each reward normalised "
                      "within its group, the sum over the batch. Set advantage_estimator='grpo' and "
                      "scale_rewards='batch' (TRL's numbers), or use 'sum_then_normalize'.")
    elif aggregation == "normalize_then_sum" and config.normalize_each_reward is True:
        errors.append("multi_objective_aggregation='normalize_then_sum' with normalize_each_reward=True normalises "
                      "each reward twice (running statistics, then its group): choose one.")
    mode = config.vllm_importance_sampling_mode
    if mode not in ROLLOUT_CORRECTIONS:
        errors.append(f"vllm_importance_sampling_mode={mode!r}: choose one of "
                      f"{', '.join(map(repr, ROLLOUT_CORRECTIONS))}.")
    elif config.vllm_importance_sampling_cap is None and (mode != "token_truncate"
                                                         or config.vllm_importance_sampling_min is not None):
        errors.append("vllm_importance_sampling_mode / vllm_importance_sampling_min shape the rollout correction, and "
                      "it is off: set vllm_importance_sampling_cap (e.g. 3.0, TRL's), or unset them.")
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


def critic_and_estimator_errors(config) -> list[str]:
    """Check the critic and estimator choices."""
    errors = []
    if config.critic not in ("shared", "separate", "reward_lora"):
        errors.append(f"critic={config.critic!r}: choose 'shared', 'separate' or 'reward_lora'.")
    if config.critic_quantization not in ("4bit", "8bit", "none"):
        errors.append(f"critic_quantization={config.critic_quantization!r}: choose '4bit', '8bit' or 'none'.")
    if config.advantage_estimator not in ("gae", "rloo", "grpo", "reinforce_pp", "auto"):
        errors.append(f"advantage_estimator={config.advantage_estimator!r}: choose 'gae', 'rloo', 'grpo', "
                      "'reinforce_pp' or 'auto'.")
    elif config.advantage_estimator not in ("gae", "auto") and config.critic != "shared":
        errors.append(f"critic={config.critic!r} with advantage_estimator={config.advantage_estimator!r}: the "
                      "critic-free estimators use no critic. Set advantage_estimator='gae' or leave critic unset.")
    elif config.advantage_estimator not in ("gae", "auto"):
        # Options that only act through a critic or GAE: set, they would be silently ignored.
        for name, is_set in (("critic_learning_rate", config.critic_learning_rate is not None),
                             ("critic_warmup_steps", bool(config.critic_warmup_steps)),
                             ("critic_updates_per_step", config.critic_updates_per_step != 1),
                             ("critic_hub_model_id", config.critic_hub_model_id is not None),
                             ("lam_critic", config.lam_critic is not None),
                             ("lam_length_alpha", config.lam_length_alpha is not None),
                             ("whiten_rewards", config.whiten_rewards is True)):
            if is_set:
                errors.append(f"{name} is set, but advantage_estimator={config.advantage_estimator!r} has no critic "
                              f"and no GAE: unset {name}, or use advantage_estimator='gae'.")
    if config.lam_length_alpha is not None and config.lam != type(config).__dataclass_fields__["lam"].default:
        errors.append(f"lam={config.lam} and lam_length_alpha={config.lam_length_alpha} both set the actor's GAE "
                      "lambda (lam_length_alpha replaces lam there): leave lam at its default, or unset "
                      "lam_length_alpha. The critic's lambda is lam_critic (VAPO: 1.0).")
    # Settings another choice would read: set with this one, they would be silently ignored.
    if config.critic != "separate":
        for name, is_set in (("critic_quantization", config.critic_quantization != "none"),
                             ("critic_model_init_kwargs", config.critic_model_init_kwargs is not None)):
            if is_set:
                errors.append(f"{name} is set, but it applies to critic='separate' only (critic={config.critic!r} "
                              f"loads no critic model): unset {name}, or set critic='separate'.")
    errors += critic_repo_problems(config.critic_hub_model_id, config.hub_model_id, config.fsdp_version)
    if config.scale_rewards not in SCALE_REWARDS:
        errors.append(f"scale_rewards={config.scale_rewards!r}: choose 'group' (True), 'batch' or 'none' (False).")
    elif config.scale_rewards != "group" and config.advantage_estimator not in ("grpo", "auto"):
        errors.append(f"scale_rewards={config.scale_rewards!r} applies to advantage_estimator='grpo' (False / "
                      f"'none': Dr. GRPO) and 'auto' (its group baseline) only, not "
                      f"{config.advantage_estimator!r}: unset it, or set advantage_estimator='grpo'.")
    if config.advantage_estimator == "auto" and isinstance(config.num_generations, int) \
            and config.num_generations < 2:
        errors.append(f"advantage_estimator='auto' falls back to the group baseline where the critic does not explain "
                      f"the returns, and a group needs several responses to one prompt: set num_generations >= 2 "
                      f"(e.g. 4; it is {config.num_generations}), or use advantage_estimator='gae'.")
    if config.advantage_estimator != "auto" and config.auto_ev_threshold != 0:
        errors.append(f"auto_ev_threshold={config.auto_ev_threshold} applies to advantage_estimator='auto' only (it "
                      f"is {config.advantage_estimator!r}): unset it, or set advantage_estimator='auto'.")
    if isinstance(config.critic_warmup_steps, int) and config.critic_warmup_steps > 0 and (
            config.vf_coef == 0):
        errors.append(f"critic_warmup_steps={config.critic_warmup_steps} trains only the critic, so it needs a value "
                      "loss: vf_coef > 0 and advantage_estimator='gae'. Set critic_warmup_steps=0 otherwise.")
    if isinstance(config.critic_updates_per_step, int) and config.critic_updates_per_step > 1 and config.vf_coef == 0:
        errors.append(f"critic_updates_per_step={config.critic_updates_per_step} adds critic-only passes, so it "
                      "needs a value loss: vf_coef > 0. Set critic_updates_per_step=1 otherwise.")
    if config.advantage_estimator in ("rloo", "grpo") and isinstance(config.num_generations, int) \
            and config.num_generations < 2:
        errors.append(f"advantage_estimator={config.advantage_estimator!r} compares the responses to one prompt: "
                      f"set num_generations >= 2 (it is {config.num_generations}).")
    if isinstance(config.num_generations, int) and config.num_generations >= 1 \
            and config.per_device_train_batch_size * config.gradient_accumulation_steps * config.num_mini_batches \
            % config.num_generations:
        errors.append(f"The rollout batch (per_device_train_batch_size x gradient_accumulation_steps x "
                      f"num_mini_batches = {config.rollout_batch_size} responses per device) must be a multiple of "
                      f"num_generations={config.num_generations}: each prompt's responses stay on one device.")
    return errors


_VLLM_FIELDS = ("vllm_gpu_memory_utilization", "vllm_max_model_len", "vllm_dtype", "vllm_enable_sleep_mode",
                "vllm_importance_sampling_cap")


def vllm_errors(config) -> list[str]:
    """rollout_engine='vllm' with what it cannot work with (FSDP shards, an 8-bit base, sleep mode without a GPU), or
    a vllm_* setting given to another engine, where it would be silently ignored (docs/guides/vllm.md)."""
    if config.rollout_engine != "vllm":
        return [f"{name}={getattr(config, name)!r} applies to rollout_engine='vllm' only (it is "
                f"{config.rollout_engine!r}): unset it, or set rollout_engine='vllm'." for name in _VLLM_FIELDS
                if getattr(config, name) != config.__dataclass_fields__[name].default]
    errors = []
    if config.fsdp_version is not None:
        errors.append("rollout_engine='vllm' holds a whole copy of the policy in each process, and FSDP shards it: "
                      "use DDP (recipes/accelerate/ddp.yaml; a 4-bit QLoRA policy fits where a sharded one would), "
                      "or leave rollout_engine at 'kv_cache' with FSDP.")
    if config.policy_quantization == "8bit":
        errors.append("rollout_engine='vllm' with policy_quantization='8bit': vLLM cannot load the base in 8-bit as "
                      "the policy holds it. Use policy_quantization='4bit' (QLoRA: vLLM loads the base in 4-bit too) "
                      "or 'none'.")
    if config.vllm_dtype not in ("auto", "bfloat16", "float16", "float32"):
        errors.append(f"vllm_dtype={config.vllm_dtype!r}: choose 'auto', 'bfloat16', 'float16' or 'float32'.")
    if config.vllm_enable_sleep_mode is True and (config.use_cpu or not torch.cuda.is_available()):
        errors.append("vllm_enable_sleep_mode=True frees vLLM's GPU memory between rollouts, and this run has no GPU "
                      "(vLLM's CPU build cannot sleep): set vllm_enable_sleep_mode=False.")
    return errors
