"""`PPOConfig`: the PPO fields on top of `transformers.TrainingArguments`.

How Trainer's words map to PPO (the natural reading of each wins):

- `per_device_train_batch_size`: sequences per forward/backward (a micro-batch), as in any Trainer.
- `gradient_accumulation_steps`: micro-batches per optimizer step. A PPO *minibatch* is
  `per_device_train_batch_size * gradient_accumulation_steps` sequences (per device).
- `num_mini_batches`: minibatches per rollout, so one rollout (one PPO *iteration*) samples
  `rollout_batch_size = minibatch_size * num_mini_batches` responses per device: rollout_batch_size /
  num_generations prompts, each sampled `num_generations` times.
- One iteration makes `num_ppo_epochs * num_mini_batches` optimizer steps (times `critic_updates_per_step`).
  `max_steps`, `logging_steps`, `save_steps` and `eval_steps` count optimizer steps, exactly as in Trainer;
  `num_train_epochs` counts passes over the prompt dataset. Set `max_steps` to a multiple of
  `optimizer_steps_per_iteration` to end on a whole iteration.

Defaults follow the N+ implementation details paper (Huang et al. 2024) unless a field says otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import TrainingArguments

from ..runtime.sharding import environment_restored_on_error, sharding_problems
from . import after_build
from .config_checks import (
    _range_errors,
    critic_and_estimator_errors,
    loss_family_errors,
    mixed_reward_errors,
    no_op_errors,
    vllm_errors,
)
from .config_names import map_trl_names, map_verl_names
from .config_records import SettingsRecords

Quantization = Literal["4bit", "8bit", "none"]
_HUB_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # 'namespace/name' or 'name'


@dataclass
class PPOConfig(SettingsRecords, TrainingArguments):
    r"""Configuration for [`PPOLMTrainer`]. Every field below is PPO-specific; the rest are TrainingArguments'."""

    # ---- Models: how the policy, the reference and the reward model are loaded; which adapter is trained -----------
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for the policy's `from_pretrained` when `model` is an id or a path "
                  "(e.g. `revision`, `dtype`, `attn_implementation`, `token`, `trust_remote_code`)."},
    )
    ref_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Like `model_init_kwargs`, for the reference model when given as id/path."}
    )
    reward_model_init_kwargs: dict | str | None = field(
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
    model_adapter_name: str | None = field(
        default=None,
        metadata={"help": "For a PeftModel policy holding several adapters: the one to train (TRL's name). None: its "
                  "active adapter."},
    )
    ref_adapter_name: str | None = field(
        default=None,
        metadata={"help": "For a PeftModel policy holding several adapters: the frozen one whose log-probs are the "
                  "reference (TRL's name; instead of ref_model). None: ref_model, or with ref_model=None a frozen copy "
                  "of the trained adapter as it starts."},
    )

    # ---- Prompts: how the dataset's prompts are tokenized ----------------------------------------------------------
    max_prompt_length: int | None = field(
        default=512,
        metadata={"help": "Prompts longer than this (in tokens) are truncated from the left, with one warning. "
                  "It is also capped so that prompt + response fits the policy's context."},
    )
    apply_chat_template_to_text: bool | None = field(
        default=None,
        metadata={"help": "Plain-text prompts (a 'prompt' column of strings) with a tokenizer that has a chat "
                  "template: True wraps each as one user turn and applies the template (as a 'messages' column "
                  "would); False feeds the text as it is (a base model, or prompts already formatted), silently; "
                  "None (default) feeds it as it is and warns once, since a chat model given raw text often answers "
                  "with empty turns."},
    )
    prompt_column: str | None = field(
        default=None,
        metadata={"help": "The dataset column holding the prompts (text, chat messages or token ids), used as the "
                  "'prompt' column; the dataset's other prompt-named columns are then left out. None: 'prompt', "
                  "else 'messages', else 'input_ids'."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "A system message put first in every prompt (train and eval): a text prompt becomes the "
                  "chat [system, user] rendered with the chat template, a chat prompt gets it in front. Recorded "
                  "beside the saved policy, so `hf-ppo evaluate` prompts as training did. None: prompts as they are."},
    )

    # ---- Steps 1-2, sampling: the engine, the response budget, the stop tokens -------------------------------------
    response_length: int = field(
        default=53,
        metadata={"help": "New tokens sampled per response (at most; a stop token ends it earlier). 53 is the N+ "
                  "paper's TL;DR summary budget: set it to what your task's answers need."},
    )
    temperature: float = field(
        default=0.7,
        metadata={"help": "Sampling temperature. Log-probs of policy and reference use logits / temperature too."},
    )
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (None: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (1.0: off)."})
    min_p: float = field(default=0.0, metadata={"help": "Min-p sampling (TRL's GRPOConfig.min_p): keep the tokens "
                         "whose probability is >= min_p x the top token's, after temperature (0.0: off)."})
    rollout_engine: Literal["kv_cache", "static", "vllm"] = field(
        default="kv_cache",
        metadata={"help": "How responses are sampled. 'kv_cache': hf_ppo's eager decode loop with a growing KV cache "
                  "(the default). 'static': a preallocated KV cache and a torch.compile'd fixed-shape decode step "
                  "(CUDA graphs on a GPU); the same tokens, for GPUs, where the eager loop is bound by kernel "
                  "launches. Its first rollout pays the compilation. 'vllm': an in-process vLLM engine holding a copy "
                  "of the policy (a LoRA policy sends it only the adapter), synced once per rollout after an "
                  "update; needs `pip install \"hf_ppo[vllm]\"` (docs/guides/vllm.md)."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "rollout_engine='vllm': the share of the GPU's memory vLLM takes for its "
                               "weights and KV cache (training uses the rest)."})
    vllm_max_model_len: int | None = field(
        default=None, metadata={"help": "rollout_engine='vllm': the longest prompt + response vLLM holds. None: "
                                "max_prompt_length + response_length (without max_prompt_length, the policy's "
                                "context)."})
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(
        default="auto", metadata={"help": "rollout_engine='vllm': the dtype of vLLM's weights. 'auto': the "
                                  "policy's (a 4-bit base's compute dtype)."})
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "rollout_engine='vllm': vLLM frees its GPU memory (weights to the CPU, KV "
                                 "cache dropped) between rollouts, for the update's memory. GPU only."})
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "rollout_engine='vllm': truncated importance sampling: each token's policy "
                                "loss times min(pi_old / pi_vLLM, cap), pi_vLLM the probability vLLM drew it with "
                                "(TRL: 2.0). None: off."})
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        field(default="token_truncate", metadata={"help": "With vllm_importance_sampling_cap: how the ratio pi_old / "
              "pi_vLLM corrects the loss (TRL's name and modes). 'token_truncate': each token's ratio capped (the "
              "default; hf_ppo's only mode before). 'sequence_truncate': one ratio per response, the product of its "
              "tokens' (verl's rollout_is sequence level), capped. 'token_mask' / 'sequence_mask': a token / a "
              "response whose ratio leaves [vllm_importance_sampling_min, cap] is rejected (weight 0; verl's "
              "rollout_rs); the others keep their ratio. TRL's default is 'sequence_mask' with cap 3.0."})
    vllm_importance_sampling_min: float | None = field(
        default=None, metadata={"help": "The lower bound of vllm_importance_sampling_mode's band (TRL's "
                                "vllm_importance_sampling_clip_min): truncate modes raise a smaller ratio to it, mask "
                                "modes reject below it. None: no lower bound."})
    stop_token: Literal["eos"] | None = field(
        default="eos",
        metadata={"help": "'eos': responses end at the tokenizer's EOS or any id of the policy's "
                  "`generation_config.eos_token_id` (e.g. `<|eot_id|>`, `<end_of_turn>`, `<|im_end|>`); None: use "
                  "`stop_token_ids` / `stop_token_id`, or never stop."},
    )
    stop_token_id: int | None = field(
        default=None, metadata={"help": "One token id that ends a response (same as stop_token_ids=[id])."}
    )
    stop_token_ids: list[int] | None = field(
        default=None,
        metadata={"help": "Token ids that end a response (any of them), replacing the `stop_token` default. Used by "
                  "the sampler, the truncation after the stop token, the EOS trick and `rollout/eos_rate`."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64,
        metadata={"help": "Micro-batch size of the no-grad rollout forwards (policy, reference, reward) and generation."},
    )
    logits_memory_mb: float = field(
        default=256,
        metadata={"help": "Memory budget (MiB) of the vocabulary-wide fp32 work on logits (log-probs, entropy), in "
                  "the rollout and the loss: positions are processed in chunks that fit it, so that work makes no "
                  "(batch, length, vocab) fp32 tensor. The numbers do not depend on it. The model's own logits (in "
                  "its dtype: fp32 for an fp32 model) are still made whole, once per forward: "
                  "local_rollout_forward_batch_size and per_device_train_batch_size bound those."},
    )

    # ---- Steps 3-4, scoring: what the reward model reads, mixed rewards, the penalties (docs/concepts/rewards.md) --
    reward_input_format: Literal["auto", "chat", "pair", "concat"] = field(
        default="auto",
        metadata={"help": "How a reward model reads (prompt, response). 'chat': the reward tokenizer's chat template "
                  "over the conversation (chat prompts only); 'pair': a (question, answer) text pair, as encoder "
                  "reward models (DeBERTa, BERT, RoBERTa) were trained; 'concat': prompt + response as one sequence "
                  "(token ids as they are when the tokenizers match). 'auto': chat for chat prompts when the reward "
                  "tokenizer has a template, else pair for an encoder whose tokenizer encodes pairs, else concat."},
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward when the trainer's `reward_model` is a list (TRL GRPOConfig's name), "
                  "in the same order: the score is sum_i w_i * r_i. None: every weight 1.0."},
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = field(
        default="sum_then_normalize",
        metadata={"help": "How a reward list becomes one score (TRL GRPOConfig's name). 'sum_then_normalize': the "
                  "weighted sum, normalised afterwards by the estimator. 'normalize_then_sum' (GDPO): in training "
                  "each reward is first normalised within its prompt's group, (r - group mean) / (group std + 1e-4), "
                  "then weighted and summed; the logged objective/scores is that sum, as TRL's `reward`. Needs "
                  "advantage_estimator='grpo' with scale_rewards='batch' (TRL normalises the sum over the batch). "
                  "Evaluation sums the raw rewards."},
    )
    normalize_each_reward: bool = field(
        default=False,
        metadata={"help": "Normalise each reward by its own running mean/std (over all processes) before weighting, "
                  "so rewards on different scales weigh as `reward_weights` say. Saved in checkpoints."},
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of a response that never produced the stop token (the 'EOS "
                  "trick'; N+ uses 1.0). None: no penalty."},
    )
    overlong_buffer_length: int | None = field(
        default=None,
        metadata={"help": "DAPO's soft overlong punishment: over the last `overlong_buffer_length` tokens of "
                  "`response_length` a penalty growing linearly to `overlong_penalty_factor` is subtracted from the "
                  "score (step 4, like `missing_eos_penalty`). None: off."},
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"help": "The overlong penalty of a response of the full `response_length`."}
    )

    # ---- Step 7, reward shaping ------------------------------------------------------------------------------------
    normalize_rewards: bool = field(
        default=False, metadata={"help": "Normalise scores with running mean/std (PPO-max; Zheng et al. 2023)."}
    )
    reward_clip: float | None = field(
        default=None, metadata={"help": "Clip (normalised) scores to [-reward_clip, reward_clip]. None: off."}
    )

    # ---- Step 8, advantages: the estimator, samples per prompt, GAE, dynamic sampling ------------------------------
    advantage_estimator: Literal["gae", "rloo", "grpo", "reinforce_pp", "auto"] = field(
        default="gae",
        metadata={"help": "'gae': PPO with a critic (GAE, `gamma`, `lam`). Critic-free, with no value head or value "
                  "loss: 'rloo' (leave-one-out baseline over the `num_generations` responses to a prompt), 'grpo' "
                  "(group mean, divided by the group std when `scale_rewards`), 'reinforce_pp' (REINFORCE++: "
                  "KL-penalised returns, a group-mean baseline when num_generations > 1, whitened over the batch). "
                  "kl_coef enters the reward per token (gae, reinforce_pp), per response (rloo), or as a k3 KL loss "
                  "term (grpo); see hf_ppo/estimators.py. 'auto' (EVPO): per batch, gae where the critic explains "
                  "the returns (auto_ev_threshold), else grpo's group baseline; num_generations >= 2."},
    )
    auto_ev_threshold: float = field(default=0.0, metadata={"help": "'auto': GAE when the critic's explained variance "
                                     "of the batch's returns is above this (0: EVPO's), else the group baseline."})
    num_generations: int = field(
        default=1,
        metadata={"help": "Responses sampled per prompt (k). Batch sizes count responses: a rollout batch holds "
                  "rollout_batch_size / k prompts, each sampled k times. rloo and grpo need k >= 2."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "grpo (TRL's values): 'group' (True) divides by the group's reward std; 'batch' by the std "
                  "of the whole batch's rewards (PPO Lite); 'none' (False) does not divide (Dr. GRPO, mean-centred "
                  "only). True / False are stored as 'group' / 'none'."},
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE, and of REINFORCE++'s returns."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of GAE (the actor's advantages)."})
    lam_critic: float | None = field(
        default=None,
        metadata={"help": "Lambda of the GAE returns the critic learns (decoupled GAE, VAPO: Yue et al. 2025; e.g. "
                  "1.0, unbiased returns for the critic, with lam=0.95 for the actor). None: `lam`. gae only."},
    )
    lam_length_alpha: float | None = field(
        default=None,
        metadata={"help": "VAPO's length-adaptive lambda for the actor's advantages (Yue et al. 2025): each response "
                  "gets lambda = 1 - 1 / (lam_length_alpha x l), l its number of real (policy) tokens, clamped at 0, "
                  "in place of `lam`; the critic's returns keep `lam_critic` (or `lam`; VAPO pairs it with "
                  "lam_critic=1.0). VAPO uses 0.05. None: off (`lam` for every response). gae only; leave `lam` at "
                  "its default with it."},
    )
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards before GAE (gae only)."})
    whiten_advantages: bool = field(
        default=True,
        metadata={"help": "Whiten advantages over the rollout batch (gae and rloo; grpo and reinforce_pp normalise "
                  "by their own definition)."},
    )
    drop_uniform_groups: bool = field(
        default=False,
        metadata={"help": "DAPO's dynamic sampling: the responses of a prompt whose `num_generations` scores are "
                  "all equal (no signal for a group baseline) leave the update: they are excluded from every loss "
                  "term and its mean. `max_refill_rounds` > 0 refills their places with groups from extra prompts. "
                  "`rollout/groups_dropped` logs how many groups stay dropped. Needs num_generations >= 2."},
    )
    max_refill_rounds: int = field(
        default=0,
        metadata={"help": "DAPO's refill (verl's max_num_gen_batches - 1): with drop_uniform_groups, up to this many "
                  "extra rounds per iteration, each sampling and scoring one more rollout batch of prompts drawn "
                  "from train_dataset, whose groups with signal take the places of dropped ones. Each round costs "
                  "one rollout's generation and scoring. 0: drop without refilling."},
    )

    # ---- Steps 8 and 10, the KL penalty and its controller ---------------------------------------------------------
    kl_coef: float = field(default=0.05, metadata={"help": "beta: per-token reward is score - beta * KL."})
    kl_estimator: Literal["k1", "k2", "k3", "k3+", "abs", "kl", "mse", "low_var_kl", "low_var_kl+"] = field(
        default="k1",
        metadata={"help": "Per-token KL estimator of the penalty in the reward and of the logged KL: k1 = logp - "
                  "logp_ref; k2 = (logp - logp_ref)^2 / 2; abs = |logp - logp_ref|; k3 = (r - 1) - log r with r = "
                  "p_ref / p (unbiased, non-negative; log r clamped to +-20 and k3 to +-10, as verl does); k3+ = k3's "
                  "value with k2's gradient (in the reward, where no gradient flows, the same as k3). verl's names "
                  "are accepted and stored as hf_ppo's: kl = k1, mse = k2, low_var_kl = k3, low_var_kl+ = k3+."},
    )
    use_kl_loss: bool = field(
        default=False,
        metadata={"help": "The KL to the reference as a loss term in the update, kl_coef x k3 per token aggregated "
                  "like the policy loss, instead of -kl_coef x KL in the reward (verl's and OpenRLHF's name; grpo "
                  "always does this). `kl_estimator` still picks the logged KL and the KL controller's input."},
    )
    kl_loss_estimator: Literal["k1", "k2", "k3", "k3+", "abs", "kl", "mse", "low_var_kl", "low_var_kl+"] = field(
        default="k3",
        metadata={"help": "The estimator of the KL loss term (use_kl_loss, or grpo) (verl's kl_loss_type): 'k3' "
                  "(GRPO's; its gradient is the forward KL's), 'k3+' (k3's value, k2's gradient: the unbiased "
                  "gradient of KL(pi || pi_ref), verl's straight-through), 'k1', 'k2', 'abs'; verl's names accepted "
                  "as for kl_estimator."},
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Multiply the KL loss term's k3 by the per-token importance ratio pi / pi_old (TRL GRPO's "
                  "name; DeepSeek-V3.2 sec. 3.1): its gradient becomes the unbiased gradient of KL(pi || pi_ref). "
                  "Needs a KL loss term (use_kl_loss=True or advantage_estimator='grpo')."},
    )
    adaptive_kl: bool = field(
        default=False, metadata={"help": "Adapt kl_coef towards `kl_target` (Ziegler et al. 2019)."}
    )
    kl_target: float = field(default=6.0, metadata={"help": "Target KL of the adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon (in episodes) of the adaptive controller."})
    stats_pass_every: int = field(
        default=4,
        metadata={"help": "Where a rollout skips a forward pass it does not need (the reference at kl_coef=0 with a "
                  "fixed controller; the old-log-prob pass of a critic-free estimator with one optimizer step per "
                  "rollout), every N-th rollout (the first included) runs it all the same, for the metrics that "
                  "read it (objective/kl, objective/entropy, policy/entropy_avg) and the collapse watch; the other "
                  "rollouts log none of them. 1: every rollout (the cost of no skip); 0: never (those metrics are "
                  "absent and the watch's KL and entropy signatures off)."},
    )

    # ---- Step 11, the update: epochs, minibatches, the clipped losses ----------------------------------------------
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    num_mini_batches: int = field(default=1, metadata={"help": "Minibatches (optimizer steps) per PPO epoch."})
    # Read afresh by every step (`loss_settings`): the only fields a built trainer's args may change (after_build.py).
    _LIVE = ("cliprange", "cliprange_value", "vf_coef", "entropy_coef", "use_bias_correction_kl")
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio (epsilon)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value update around V_old."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of an entropy bonus (0: off)."})

    # ---- Step 11, loss variants (defaults: the clipped PPO loss as above, a token mean) ----------------------------
    # The old name is a choice so that the command line reaches the refusal that names its fix.
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo", "token-mean",
                              "seq-mean-token-mean", "seq-mean-token-sum", "seq_mean_token_sum_norm"] = field(
        default="token_mean",
        metadata={"help": "How per-token losses (policy, value, entropy, KL) become one number: 'token_mean' (sum "
                  "over the minibatch's real tokens / their count; TRL's dapo); 'seq_mean_token_mean' (mean over "
                  "responses of each response's token mean; GRPO, TRL's grpo); 'seq_mean_token_sum' (mean over "
                  "responses of each response's token sum); 'dr_grpo' (each response's token sum / response_length, "
                  "averaged over responses; no length bias, Dr. GRPO, TRL's dr_grpo). verl's spellings "
                  "('seq-mean-token-mean', ...) are accepted and stored as hf_ppo's. 'seq_mean_token_sum_norm' is "
                  "refused: hf_ppo's mode of that name is now 'dr_grpo', and verl's sums over responses."},
    )
    cliprange_low: float | None = field(
        default=None, metadata={"help": "Lower clip range of the ratio: clip to 1 - cliprange_low (None: cliprange)."}
    )
    cliprange_high: float | None = field(
        default=None,
        metadata={"help": "Upper clip range of the ratio: clip to 1 + cliprange_high (None: cliprange). Larger than "
                  "cliprange_low is DAPO's 'clip-higher' (e.g. 0.2 / 0.28), against entropy collapse."},
    )
    importance_sampling_level: Literal["token", "sequence"] = field(
        default="token",
        metadata={"help": "The policy ratio of the clipped loss (TRL GRPO's name). 'token': PPO's per-token ratio. "
                  "'sequence': GSPO (Zheng et al. 2025): one ratio per response, exp(mean over its tokens of "
                  "logp - logp_old), on every token; GSPO clips it far tighter (e.g. cliprange_low=3e-4, "
                  "cliprange_high=4e-4)."},
    )
    dual_clip: float | None = field(
        default=None,
        metadata={"help": "Dual clip c > 1 (Ye et al. 2020; e.g. 3): for negative advantages the policy loss of a "
                  "token is at most -c * A. None: off (TRL's default; verl's is on, clip_ratio_c=3.0)."},
    )
    policy_loss: Literal["ppo", "cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov"] = field(
        default="ppo",
        metadata={"help": "The policy loss (docs/reference/algorithms.md). 'ppo': the clipped surrogate above "
                  "(verl's vanilla). 'cispo': clipped, stop-gradient importance weights times the REINFORCE term "
                  "(MiniMax-M1; TRL's cispo; cispo_clip_max). 'sapo': a smooth sigmoid gate instead of the clip "
                  "(TRL's sapo; sapo_temperature_pos/neg). 'gmpo': the geometric mean of a response's token ratios "
                  "(verl's geo_mean; gmpo_cliprange). 'gpg': the plain policy gradient -A logp (GPG). 'clip_cov' / "
                  "'kl_cov': PPO's loss with a few high-covariance tokens detached / pulled back by a KL term, "
                  "against entropy collapse (Cui et al. 2025; clip_cov_* / kl_cov_*)."},
    )
    cispo_clip_max: float = field(
        default=5.0, metadata={"help": "policy_loss='cispo': the cap on the importance weight (TRL's epsilon_high "
                               "for cispo; ScaleRL's epsilon_max, 5.0)."})
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "policy_loss='sapo': the gate's temperature for tokens with A > 0 (TRL's and "
                               "the paper's 1.0)."})
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "policy_loss='sapo': the gate's temperature for tokens with A <= 0 (TRL's and "
                                "the paper's 1.05)."})
    gmpo_cliprange: float = field(
        default=0.4, metadata={"help": "policy_loss='gmpo': each token's log-ratio is clipped to [-c, c] (the "
                               "paper's ratio range (e^-0.4, e^0.4))."})
    clip_cov_ratio: float = field(
        default=2e-4, metadata={"help": "policy_loss='clip_cov': the share of tokens detached (the paper's and "
                                "verl's 2e-4; at least one)."})
    clip_cov_lb: float = field(
        default=1.0, metadata={"help": "policy_loss='clip_cov': tokens are drawn among those with covariance above "
                               "this (verl's name; 1.0)."})
    clip_cov_ub: float = field(
        default=5.0, metadata={"help": "policy_loss='clip_cov': ... and below this (verl's name; 5.0)."})
    kl_cov_ratio: float = field(
        default=2e-3, metadata={"help": "policy_loss='kl_cov': the share of tokens, those of largest covariance, "
                                "that get the KL term (the paper's 2e-3 for a 7B model, 2e-4 at 32B; at least one)."})
    kl_cov_coef: float = field(
        default=1.0, metadata={"help": "policy_loss='kl_cov': the weight of |log r| on the selected tokens (the "
                               "paper's beta = 1)."})

    # ---- The critic: what predicts the values GAE needs, and how it trains (docs/concepts/critics.md) --------------
    critic: Literal["shared", "separate", "reward_lora"] = field(
        default="shared",
        metadata={"help": "'shared': a value head on the policy's body (one model, no extra memory). 'separate': a "
                  "critic with its own body + value head, initialised from the reward model (N+ paper, OpenRLHF) or "
                  "from the trainer's `critic_model`; LoRA when the policy uses LoRA, else full fine-tuning; loaded "
                  "with `critic_quantization`. 'reward_lora': a LoRA adapter + value head on the reward model's "
                  "frozen (4-bit) base, the head starting from the reward model's score head: no extra base model in "
                  "memory; the reward is scored with the adapter disabled. Only with advantage_estimator='gae'."},
    )
    critic_quantization: Quantization = field(
        default="none",
        metadata={"help": "Quantization of a 'separate' critic's base loaded by id/path ('4bit' needs LoRA)."},
    )
    critic_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Like `model_init_kwargs`, for a 'separate' critic loaded by id/path."}
    )
    critic_warmup_steps: int = field(
        default=0,
        metadata={"help": "Optimizer steps at the start of training that update only the critic (the policy does not "
                  "move; with the shared critic only the value head trains). 0: off."},
    )
    critic_updates_per_step: int = field(
        default=1,
        metadata={"help": "Critic passes over each rollout per policy pass: each of the `num_ppo_epochs` policy "
                  "(and critic) passes is followed by critic_updates_per_step - 1 critic-only passes, during which the "
                  "policy does not move (SAO's two critic updates per policy update: 2). They are optimizer steps "
                  "too: an iteration makes num_ppo_epochs x critic_updates_per_step x num_mini_batches of them. 1: "
                  "off. gae only; needs vf_coef > 0."},
    )
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the critic's own parameters (the shared value head, or a critic's "
                  "adapter/body and head). None: learning_rate. A zero-initialised head moves about lr per Adam "
                  "step, so at LoRA-sized learning rates a larger one lets the critic reach the scale of the returns."},
    )

    # ---- Reporting and publishing ----------------------------------------------------------------------------------
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "Log a table of sample completions this many times over training (0: never)."},
    )
    num_eval_samples: int = field(
        default=1,
        metadata={"help": "Evaluation: responses sampled per eval prompt from the policy and from the reference "
                  "(sample j of one paired with sample j of the other for the win rate). k > 1 adds pass@1 .. pass@k "
                  "(Chen et al. 2021's unbiased estimator) for every reward whose scores are all 0 or 1, and costs k "
                  "times the sampling."},
    )
    push_merged_model: bool = field(
        default=False,
        metadata={"help": "push_to_hub uploads the adapter merged into a de-quantized base instead of the adapter."},
    )
    hub_base_model_id: str | None = field(
        default=None,
        metadata={"help": "The Hub id a pushed adapter names as its base (adapter_config.json's "
                  "base_model_name_or_path) when the policy was loaded from a local folder or a GGUF file, e.g. "
                  "'HuggingFaceTB/SmolLM2-135M-Instruct'; the local copy keeps the base it was trained on. None: "
                  "the base as loaded (a local path loads only on this machine: a warning says so)."},
    )
    critic_hub_model_id: str | None = field(
        default=None,
        metadata={"help": "push_to_hub also pushes the critic (`trainer.push_critic_to_hub`) to this Hub repo, "
                  "'namespace/name': a repo of its own, never hub_model_id's. A later run starts from it with "
                  "critic_model=<this id>. None: the critic stays local."},
    )

    # ---- TRL 1.12 PPOConfig names (migration): mapped onto the fields above in __post_init__ ---------------------
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "TRL's run length in episodes (responses sampled over all processes: prompts x "
                  "num_generations). Sets max_steps = "
                  "ceil(total_episodes / (rollout_batch_size x world_size)) iterations x optimizer steps per "
                  "iteration; rounded up, as TRL did, so at least total_episodes are sampled."},
    )
    num_total_batches: int | None = field(
        default=None,
        metadata={"help": "TRL's number of rollout batches, i.e. PPO iterations: sets max_steps = num_total_batches "
                  "x optimizer steps per iteration."},
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes used to tokenize the prompt datasets (datasets.map num_proc)."}
    )
    sft_model_path: str | None = field(
        default=None,
        metadata={"help": "TRL's name for the policy to train (its SFT checkpoint: Hub id or local path), which is "
                  "also where the reference starts. Used when PPOLMTrainer gets no `model`; given both, they must name "
                  "the same checkpoint. No default (TRL's was EleutherAI/pythia-160m)."},
    )
    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "TRL's name for the reward model (Hub id or local path of a sequence classifier with 1 "
                  "label). Used when PPOLMTrainer gets no `reward_model`; given both, they must name the same "
                  "checkpoint. No default (TRL's was EleutherAI/pythia-160m, a base LM with a random score head)."},
    )
    ds3_gather_for_generation: bool | None = field(
        default=None,
        metadata={"help": "TRL's DeepSpeed ZeRO-3 option; hf_ppo has no ZeRO-3 gathering, so it is ignored with a "
                  "warning. Use DDP or ZeRO-2 (recipes/accelerate/), a 4-bit policy with LoRA to save memory, or FSDP2 "
                  "(recipes/accelerate/fsdp.yaml) to shard the policy."},
    )
    exp_name: str | None = field(default=None, metadata={"help": "TRL's experiment name: used as run_name."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "TRL GRPOConfig's name for response_length: sets it (give one of the two)."}
    )
    # Sizes TRL derived itself (and overwrote); here they derive from per_device_train_batch_size,
    # gradient_accumulation_steps and num_mini_batches, so setting one is an error that says which to set.
    local_batch_size: int | None = field(default=None, metadata={"help": "Derived in hf_ppo: do not set."})
    micro_batch_size: int | None = field(default=None, metadata={"help": "Derived in hf_ppo: do not set."})
    batch_size: int | None = field(default=None, metadata={"help": "Derived in hf_ppo: do not set."})
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Derived in hf_ppo: do not set."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Derived in hf_ppo: do not set."})

    # ---- Reliability: non-finite numbers and resume ---------------------------------------------------------------
    max_consecutive_nonfinite: int = field(
        default=10,
        metadata={"help": "A rollout with NaN/inf is dropped and sampled again, an optimizer step with a NaN/inf loss "
                  "or gradient norm is skipped; this many of them without a good step in between stop training with "
                  "an error naming the cause and the last complete checkpoint."},
    )
    watch_collapse: bool = field(
        default=True,
        metadata={"help": "Watch the logged metrics for collapse and reward-hacking signatures (trainer/watch.py: length up "
                  "while entropy falls, entropy collapse, KL far beyond its threshold, clip fraction or value loss out "
                  "of range, the training reward beating the reference while a judge's loses); each warns once with "
                  "its fixes."},
    )
    stop_on_collapse: bool = field(
        default=False,
        metadata={"help": "Stop training at the first collapse signature the watch sees, naming the last complete "
                  "checkpoint and saving none after it, so resume_from_checkpoint=True resumes from it (needs "
                  "watch_collapse)."},
    )
    collapse_kl_threshold: float | None = field(
        default=None,
        metadata={"help": "Per-response KL (`objective/kl`, nats) above which the watch warns. None: 3 x kl_target "
                  "with adaptive_kl, 30 nats with a fixed kl_coef."},
    )
    allow_config_change_on_resume: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint written with other PPO settings or batch geometry: the new values "
                  "apply (with a warning). False: such a resume is an error listing the differences."},
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
        default=None, metadata={"help": "bf16 mixed precision. None: on when the run is on a CUDA GPU that supports "
                                      "it (not with use_cpu=True), else off."}
    )

    # Dict fields also take a JSON object as a string, as on the command line (`--reward_model_init_kwargs
    # '{"num_labels": 1}'`): transformers' convention for TrainingArguments' own dict fields.
    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs", "ref_model_init_kwargs",
                          "reward_model_init_kwargs", "critic_model_init_kwargs"]

    __setattr__ = after_build.assign  # once a trainer holds it: each field live or refused (trainer/after_build.py)

    # A refused config leaves the process as it found it (TrainingArguments sets FSDP_* variables first).
    @environment_restored_on_error
    def __post_init__(self):
        for name in self._VALID_DICT_FIELDS:
            value = getattr(self, name, None)
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{name}={value!r} is not valid JSON ({err.msg}): give a JSON object, e.g. "
                                     f"--{name} '{{\"num_labels\": 1}}'.") from None
                if name.endswith("model_init_kwargs") and not isinstance(parsed, dict):
                    raise ValueError(f"{name}={value!r}: give a JSON object ({{...}}), the keyword arguments of "
                                     "from_pretrained.")
        if self.bf16 is None:
            # use_cpu=True runs on the CPU where a GPU is visible too: its default is the CPU's (fp32), not the GPU's.
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not (
                self.fp16 or self.use_cpu)
        if self.exp_name is not None and self.run_name is None:
            self.run_name = self.exp_name
        if self.hub_token == "<HUB_TOKEN>":  # TrainingArguments.to_dict()'s mask of any hub_token: never a token
            self.hub_token = None  # (sent to the Hub, it fails the push after training; None: the saved login)
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = torch.accelerator.is_available() and not self.use_cpu
        sharded = sharding_problems(self.fsdp, self.fsdp_config, self.deepspeed)  # before TrainingArguments reads a DeepSpeed config (it imports deepspeed)
        if sharded:
            raise ValueError("Invalid PPOConfig:\n- " + "\n- ".join(sharded))
        super().__post_init__()
        trl_errors = map_trl_names(self)
        errors = _range_errors(self) + trl_errors
        if self.stop_token_ids is not None and self.stop_token_id is not None:
            errors.append("stop_token_id and stop_token_ids are both set: put every id in stop_token_ids.")
        if self.stop_token_ids is not None and not all(isinstance(i, int) and i >= 0 for i in self.stop_token_ids):
            errors.append(f"stop_token_ids={self.stop_token_ids!r}: must be a list of token ids (ints >= 0).")
        never_stops = (self.stop_token is None and self.stop_token_id is None) if self.stop_token_ids is None \
            else not self.stop_token_ids
        if never_stops and self.missing_eos_penalty is not None:
            errors.append("missing_eos_penalty needs a stop token: set stop_token='eos', stop_token_ids or "
                          "stop_token_id.")
        if self.rollout_engine not in ("kv_cache", "static", "vllm"):
            errors.append(f"rollout_engine={self.rollout_engine!r}: choose 'kv_cache' (the default), 'static' or "
                          "'vllm'.")
        errors += vllm_errors(self)
        errors += map_verl_names(self)
        errors += loss_family_errors(self)
        for name in ("cliprange_low", "cliprange_high"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                errors.append(f"{name}={getattr(self, name)}: must be > 0 (or None to use cliprange).")
        if self.dual_clip is not None and not self.dual_clip > 1:
            errors.append(f"dual_clip={self.dual_clip}: must be > 1 (the bound -c * A must lie beyond the clipped "
                          "loss), or None to turn it off.")
        if self.hub_base_model_id is not None and not _HUB_ID.match(self.hub_base_model_id):
            errors.append(f"hub_base_model_id={self.hub_base_model_id!r}: give a Hub model id ('namespace/name'), "
                          "not a local path.")
        for name in ("policy_quantization", "ref_quantization", "reward_quantization"):
            if getattr(self, name) not in ("4bit", "8bit", "none"):
                errors.append(f"{name}={getattr(self, name)!r}: choose '4bit', '8bit' or 'none'.")
        if self.reward_input_format not in ("auto", "chat", "pair", "concat"):
            errors.append(f"reward_input_format={self.reward_input_format!r}: choose 'auto', 'chat', 'pair' or 'concat'.")
        if self.ref_adapter_name is not None and self.ref_adapter_name == self.model_adapter_name:
            errors.append(f"model_adapter_name and ref_adapter_name are both {self.ref_adapter_name!r}: the reference "
                          "adapter must be another adapter than the trained one.")
        errors += critic_and_estimator_errors(self)
        errors += mixed_reward_errors(self)
        errors += no_op_errors(self)
        if errors:
            raise ValueError("Invalid PPOConfig:\n- " + "\n- ".join(errors))

    def to_dict(self) -> dict:
        """TrainingArguments' dict, with `stop_token` as it is: Trainer hides every field named `*_token` as a
        secret, and a config rebuilt from that dict would read '<STOP_TOKEN>' as its stop token."""
        return {**super().to_dict(), "stop_token": self.stop_token}
