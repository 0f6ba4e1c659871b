"""`PPOConfig`: the PPO fields on top of `transformers.TrainingArguments`.

How Trainer's words map to PPO (the natural reading of each wins):

- `per_device_train_batch_size`: sequences per forward/backward (a micro-batch), as in any Trainer.
- `gradient_accumulation_steps`: micro-batches per optimizer step. A PPO *minibatch* is
  `per_device_train_batch_size * gradient_accumulation_steps` sequences (per device).
- `num_mini_batches`: minibatches per rollout, so one rollout (one PPO *iteration*) samples
  `rollout_batch_size = minibatch_size * num_mini_batches` prompts per device.
- One iteration makes `num_ppo_epochs * num_mini_batches` optimizer steps. `max_steps`, `logging_steps`,
  `save_steps` and `eval_steps` count optimizer steps, exactly as in Trainer; `num_train_epochs` counts passes over
  the prompt dataset. Set `max_steps` to a multiple of `optimizer_steps_per_iteration` to end on a whole iteration.

Defaults follow the N+ implementation details paper (Huang et al. 2024) unless a field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import TrainingArguments

Quantization = Literal["4bit", "8bit", "none"]


@dataclass
class PPOConfig(TrainingArguments):
    r"""Configuration for [`PPOLMTrainer`]. Every field below is PPO-specific; the rest are TrainingArguments'."""

    # ---- Models: how the policy, the reference and the reward model are loaded -----------------------------------
    model_init_kwargs: dict | None = field(
        default=None,
        metadata={"help": "Keyword arguments for the policy's `from_pretrained` when `model` is an id or a path "
                  "(e.g. `revision`, `dtype`, `attn_implementation`, `token`, `trust_remote_code`)."},
    )
    ref_model_init_kwargs: dict | None = field(
        default=None, metadata={"help": "Like `model_init_kwargs`, for the reference model when given as id/path."}
    )
    reward_model_init_kwargs: dict | None = field(
        default=None, metadata={"help": "Like `model_init_kwargs`, for the reward model when given as id/path."}
    )
    policy_quantization: Quantization = field(
        default="none",
        metadata={"help": "Load the policy's base in '4bit' (NF4, QLoRA: needs `peft_config`), '8bit' or 'none'."},
    )
    ref_quantization: Quantization = field(
        default="4bit",
        metadata={"help": "Quantization of a reference model given by id/path. (ref_model=None uses the policy with "
                  "its adapter disabled, or without LoRA an unquantized copy of the starting policy.)"},
    )
    reward_quantization: Quantization = field(
        default="4bit", metadata={"help": "Quantization of the frozen reward model."}
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Set every dropout probability to 0 in all models (RL needs it: N+ paper)."}
    )

    # ---- Rollout: sampling -------------------------------------------------------------------------------------
    response_length: int = field(
        default=53,
        metadata={"help": "New tokens sampled per response (at most; a stop token ends it earlier). 53 is the N+ "
                  "paper's TL;DR summary budget: set it to what your task's answers need."},
    )
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Prompts longer than this (in tokens) are truncated from the left, with one warning. "
                  "It is also capped so that prompt + response fits the policy's context."},
    )
    temperature: float = field(
        default=0.7,
        metadata={"help": "Sampling temperature. Log-probs of policy and reference use logits / temperature too."},
    )
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (None: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (1.0: off)."})
    stop_token: Literal["eos"] | None = field(
        default="eos",
        metadata={"help": "'eos': responses end at the tokenizer's EOS; None: use `stop_token_id`, or never stop."},
    )
    stop_token_id: int | None = field(default=None, metadata={"help": "Token id that ends a response."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of a response that never produced the stop token (the 'EOS "
                  "trick'; N+ uses 1.0). None: no penalty."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64,
        metadata={"help": "Micro-batch size of the no-grad rollout forwards (policy, reference, reward) and generation."},
    )

    # ---- PPO ---------------------------------------------------------------------------------------------------
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    num_mini_batches: int = field(default=1, metadata={"help": "Minibatches (optimizer steps) per PPO epoch."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of GAE."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio (epsilon)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value update around V_old."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    value_head_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the value head (None: learning_rate). The head starts at zero and Adam "
                  "moves each weight by about lr per step, so at LoRA-sized learning rates a larger one lets the "
                  "critic reach the scale of the returns."},
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of an entropy bonus (0: off)."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Whiten advantages over the rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards before GAE."})

    # ---- KL penalty ----------------------------------------------------------------------------------------------
    kl_coef: float = field(default=0.05, metadata={"help": "beta: per-token reward is score - beta * KL."})
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1",
        metadata={"help": "Per-token KL estimator: k1 = logp - logp_ref; k2 = (logp - logp_ref)^2 / 2; "
                  "k3 = (r - 1) - log r with r = p_ref / p (unbiased, non-negative)."},
    )
    adaptive_kl: bool = field(
        default=False, metadata={"help": "Adapt kl_coef towards `kl_target` (Ziegler et al. 2019)."}
    )
    kl_target: float = field(default=6.0, metadata={"help": "Target KL of the adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon (in episodes) of the adaptive controller."})

    # ---- Reward shaping ----------------------------------------------------------------------------------------
    normalize_rewards: bool = field(
        default=False, metadata={"help": "Normalise scores with running mean/std (PPO-max; Zheng et al. 2023)."}
    )
    reward_clip: float | None = field(
        default=None, metadata={"help": "Clip (normalised) scores to [-reward_clip, reward_clip]. None: off."}
    )

    # ---- Reporting and publishing -----------------------------------------------------------------------------------
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "Log a table of sample completions this many times over training (0: never)."},
    )
    push_merged_model: bool = field(
        default=False,
        metadata={"help": "push_to_hub uploads the adapter merged into a de-quantized base instead of the adapter."},
    )

    # ---- Console output (what a person watching the run reads) --------------------------------------------------
    print_metrics: bool = field(
        default=False,
        metadata={"help": "Print every logged metric dict under the progress bar, as Trainer does. Off: the bar shows "
                  "the iteration, reward and KL; the metrics go to `report_to` trackers and trainer_state.json."},
    )
    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={"help": "Pin the prompt batches in page-locked memory. None: only when an accelerator (GPU) is "
                  "present (pinning on a CPU-only machine does nothing but warn)."},
    )

    # TrainingArguments defaults that differ for PPO.
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial AdamW learning rate (N+ paper)."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the trainer tokenizes the prompt column itself."}
    )
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on when a CUDA GPU supports it, else off."}
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not self.fp16
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = torch.accelerator.is_available() and not self.use_cpu
        super().__post_init__()
        errors = []
        if self.num_ppo_epochs < 1:
            errors.append(f"num_ppo_epochs={self.num_ppo_epochs}: set it to 1 or more.")
        if self.num_mini_batches < 1:
            errors.append(f"num_mini_batches={self.num_mini_batches}: set it to 1 or more.")
        if self.response_length < 1:
            errors.append(f"response_length={self.response_length}: set it to 1 or more.")
        if self.temperature <= 0:
            errors.append(f"temperature={self.temperature}: must be > 0 (log-probs divide logits by it).")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p={self.top_p}: must be in (0, 1].")
        if self.stop_token is None and self.stop_token_id is None and self.missing_eos_penalty is not None:
            errors.append("missing_eos_penalty needs a stop token: set stop_token='eos' or stop_token_id.")
        for name in ("policy_quantization", "ref_quantization", "reward_quantization"):
            if getattr(self, name) not in ("4bit", "8bit", "none"):
                errors.append(f"{name}={getattr(self, name)!r}: choose '4bit', '8bit' or 'none'.")
        if errors:
            raise ValueError("Invalid PPOConfig:\n- " + "\n- ".join(errors))

    @property
    def minibatch_size(self) -> int:
        """Sequences per optimizer step on one device: per_device_train_batch_size * gradient_accumulation_steps."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def rollout_batch_size(self) -> int:
        """Prompts sampled per PPO iteration on one device: minibatch_size * num_mini_batches."""
        return self.minibatch_size * self.num_mini_batches

    @property
    def optimizer_steps_per_iteration(self) -> int:
        """Optimizer steps per PPO iteration: num_ppo_epochs * num_mini_batches."""
        return self.num_ppo_epochs * self.num_mini_batches
