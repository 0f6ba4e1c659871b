"""TRL's `GRPOConfig` names that `hf-ppo train` does not take, each with hf_ppo's name for it or why there is none.

A TRL GRPO user types these first (`--beta 0.04`, `--use_vllm`); the unknown-key message gives the entry below
instead of the nearest spelling (which for `--use_vllm` was `--use_kl_loss`). `tests/cli/test_grpo_names.py` walks
trl's `GRPOConfig` so that every field is either a key `hf-ppo train` takes or listed here (written against trl
1.16). A value starting "hf_ppo calls it" names the key(s) to use; any other value says why hf_ppo has none.
"""

from __future__ import annotations

GRPO_NAMES: dict[str, str] = {
    # -- the algorithm ---------------------------------------------------------------------------------------------
    "beta": "hf_ppo calls it kl_coef (with advantage_estimator: grpo the KL is GRPO's k3 loss term, as TRL's beta; "
            "kl_coef: 0 keeps a reference model all the same)",
    "epsilon": "hf_ppo calls it cliprange (or cliprange_low for the lower bound alone)",
    "epsilon_high": "hf_ppo calls it cliprange_high (DAPO's clip-higher)",
    "delta": "hf_ppo calls it dual_clip (a bound on the clipped loss of negative advantages)",
    "num_iterations": "hf_ppo calls it num_ppo_epochs (passes over each rollout batch; mu in the GRPO paper)",
    "loss_type": "hf_ppo splits it in two: the aggregation is loss_aggregation (grpo: seq_mean_token_mean, "
                 "dr_grpo: dr_grpo, dapo / bnpo: token_mean) and the loss itself policy_loss (cispo, sapo); "
                 "luspo and vespo are not implemented",
    "mask_truncated_completions": "hf_ppo has no mask for it: penalise responses that never stop with "
                                  "missing_eos_penalty, or the long ones with overlong_buffer_length",
    "top_entropy_quantile": "not implemented in hf_ppo (every real token enters the loss)",
    "off_policy_mask_threshold": "not implemented in hf_ppo; vllm_importance_sampling_cap corrects vLLM's "
                                 "sampling mismatch instead",
    "vespo_k_pos": "the vespo loss is not implemented in hf_ppo (see policy_loss)",
    "vespo_lambda_pos": "the vespo loss is not implemented in hf_ppo (see policy_loss)",
    "vespo_k_neg": "the vespo loss is not implemented in hf_ppo (see policy_loss)",
    "vespo_lambda_neg": "the vespo loss is not implemented in hf_ppo (see policy_loss)",
    "use_adaptive_entropy": "not implemented in hf_ppo: entropy_coef is a fixed coefficient",
    "entropy_coef_min": "not implemented in hf_ppo (adaptive entropy control): entropy_coef is fixed",
    "entropy_coef_max": "not implemented in hf_ppo (adaptive entropy control): entropy_coef is fixed",
    "entropy_coef_delta": "not implemented in hf_ppo (adaptive entropy control): entropy_coef is fixed",
    "entropy_target": "not implemented in hf_ppo (adaptive entropy control): entropy_coef is fixed",
    "sync_ref_model": "not implemented in hf_ppo: the reference stays the starting policy (TR-DPO's sync is not "
                      "offered)",
    "ref_model_mixup_alpha": "not implemented in hf_ppo: the reference stays the starting policy",
    "ref_model_sync_steps": "not implemented in hf_ppo: the reference stays the starting policy",
    "router_aux_loss_coef": "not implemented in hf_ppo (no MoE auxiliary loss is added)",
    "cast_lm_head_to_fp32": "hf_ppo computes the log-probs in fp32 already (in chunks of logits_memory_mb)",
    # -- sampling ---------------------------------------------------------------------------------------------------
    "use_vllm": "hf_ppo calls it rollout_engine: vllm (--rollout_engine vllm; vLLM in the trainer's own process, "
                "TRL's colocate mode)",
    "vllm_mode": "hf_ppo runs vLLM in the trainer's process only (rollout_engine: vllm, TRL's colocate): no server "
                 "mode",
    "vllm_model_impl": "hf_ppo loads vLLM's own model implementation; there is no switch",
    "vllm_structured_outputs_regex": "not implemented in hf_ppo",
    "vllm_server_base_url": "hf_ppo has no vLLM server mode (rollout_engine: vllm runs it in the trainer's process)",
    "vllm_server_host": "hf_ppo has no vLLM server mode (rollout_engine: vllm runs it in the trainer's process)",
    "vllm_server_port": "hf_ppo has no vLLM server mode (rollout_engine: vllm runs it in the trainer's process)",
    "vllm_server_timeout": "hf_ppo has no vLLM server mode (rollout_engine: vllm runs it in the trainer's process)",
    "vllm_group_port": "hf_ppo has no vLLM server mode (rollout_engine: vllm runs it in the trainer's process)",
    "vllm_max_model_length": "hf_ppo calls it vllm_max_model_len",
    "vllm_tensor_parallel_size": "hf_ppo runs one vLLM engine per process (no tensor parallelism); use "
                                 "accelerate launch for data parallelism",
    "vllm_importance_sampling_correction": "hf_ppo calls it vllm_importance_sampling_cap (set: the correction on, "
                                           "capped there; unset: off)",
    "vllm_importance_sampling_clip_max": "hf_ppo calls it vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_min": "hf_ppo calls it vllm_importance_sampling_min",
    "repetition_penalty": "not implemented in hf_ppo: it would make the sampling distribution differ from the "
                          "policy's log-probs that PPO's ratio uses",
    "generation_kwargs": "hf_ppo takes the sampling settings as keys of their own (temperature, top_k, top_p, "
                         "response_length, stop_token_ids)",
    "cache_implementation": "hf_ppo's rollout_engine: kv_cache decodes with its own KV cache",
    "use_transformers_continuous_batching": "not implemented in hf_ppo (rollout_engine: kv_cache or vllm)",
    "transformers_continuous_batching_config": "not implemented in hf_ppo (rollout_engine: kv_cache or vllm)",
    "use_transformers_paged": "not implemented in hf_ppo (rollout_engine: kv_cache or vllm)",
    "chat_template_kwargs": "not implemented in hf_ppo: prompts use the tokenizer's chat template as it is "
                            "(apply_chat_template_to_text, system_prompt)",
    "max_tool_calling_iterations": "hf_ppo has no tool calling; multi-turn episodes come from an environment "
                                   "(docs/guides/environments.md)",
    # -- batches ----------------------------------------------------------------------------------------------------
    "generation_batch_size": "hf_ppo derives it: one rollout samples per_device_train_batch_size x "
                             "gradient_accumulation_steps x num_mini_batches responses per device",
    "steps_per_generation": "hf_ppo calls it num_mini_batches (optimizer steps per rollout and PPO epoch)",
    "num_generations_eval": "hf_ppo calls it num_eval_samples (responses per evaluation prompt and side)",
    "shuffle_dataset": "hf_ppo always shuffles the prompts (seed: the order)",
    "pad_to_multiple_of": "not needed in hf_ppo: prompts are left-padded to the batch's longest",
    # -- logging ----------------------------------------------------------------------------------------------------
    "log_completions": "hf_ppo calls it num_sample_generations (sample tables logged that many times in a run)",
    "num_completions_to_print": "hf_ppo prints the sample table of num_sample_generations; its rows are fixed",
    "log_unique_prompts": "hf_ppo's sample tables show one row per response",
    "log_multimodal": "hf_ppo trains on text only",
    "log_completions_hub_repo": "not implemented in hf_ppo: the sample tables go to report_to and the console",
}


def grpo_hint(key: str) -> str | None:
    """The message part for a TRL GRPOConfig `key` that `hf-ppo train` does not take (None: not one)."""
    return GRPO_NAMES.get(key)
