"""Mutation check: plant realistic wiring bugs one at a time and report which the test suite catches.

    python tests/mutation_check.py              # every mutation, 2 workers
    python tests/mutation_check.py -k shuffle   # only mutations whose name contains "shuffle"
    python tests/mutation_check.py --list       # the mutations, without running anything

Each mutation replaces an exact snippet of today's code (a file under hf_ppo/: rollout/, models/, algorithms/, trainer/)
with a bug of a kind a refactor introduces. It is applied to a temporary COPY of the repository (the working tree is never
touched), and a fast subset of the suite (`SUBSET`) runs against the copy with `-x`. The score is caught / total;
it must stay at 100%. A snippet that no longer appears exactly once in the code is reported STALE: when code moves,
move the mutation with it (same bug, new snippet). The script exits non-zero if a mutation is MISSED or STALE, or if
the unmutated subset does not pass. Not collected by pytest (the name does not start with `test_`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def deselect(path: str, *tests: str) -> list[str]:
    """pytest arguments that leave `tests` of the file at `path` out of a run that names the whole file."""
    return [f"--deselect={path}::{test}" for test in tests]


def select(path: str, *tests: str) -> list[str]:
    return [f"{path}::{test}" for test in tests]


# Fast tests that pin the wiring; the files that catch the most mutations run first (-x stops at the first failure).
# A file that also holds tests no mutation needs (slower ones, or a wheel build the copy cannot do) names the tests
# the subset runs, or the ones it leaves out, whichever list is shorter.
SUBSET = [
    "tests/integration/test_reference_iteration.py",
    "tests/integration/test_wiring.py",
    "tests/trainer/test_ppo_trainer.py::test_gradient_accumulation_gives_the_whole_minibatch_gradient",
    "tests/algorithms/test_estimators.py",  # VAPO's length-adaptive lambda included
    "tests/trainer/test_config.py",  # every field of every settings record follows its PPOConfig field
    "tests/models/test_critics.py",  # each critic's values included; its files and resumes left out:
    *deselect("tests/models/test_critics.py",
              "test_a_save_killed_mid_write_leaves_the_earlier_critic",
              "test_a_shared_critic_saved_over_a_separate_one_leaves_one_critic",
              "test_a_critic_folder_with_the_users_files_is_never_replaced",
              "test_a_damaged_saved_critic_names_the_file_and_the_fix",
              "test_a_gae_checkpoint_resumed_as_grpo_resumes_the_policy_and_leaves_the_critic",
              "test_a_grpo_checkpoint_resumed_as_gae_says_the_critic_starts_fresh",
              "test_a_critic_folder_with_nothing_in_it_says_so"),
    "tests/rollout/test_scoring.py",  # the reward lists; the reward models' inputs and the adapters left out:
    *deselect("tests/rollout/test_scoring.py",
              "test_pair_format_scores_a_deberta_reward_model_like_by_hand",
              "test_chat_and_concat_formats_with_a_decoder_reward_model",
              "test_forced_formats_that_cannot_apply_fail_at_construction",
              "test_reward_object_loads_its_tokenizer_from_its_path",
              "test_reward_tokenizer_without_pad_gets_one_for_scoring",
              "test_continue_from_an_sft_adapter",
              "test_adapter_policy_with_peft_config_is_an_error",
              "test_frozen_adapter_with_an_explicit_reference_is_made_trainable",
              "test_named_adapters_train_one_and_use_the_other_as_reference",
              "test_a_decoder_reward_scores_a_too_long_input_on_its_last_tokens",
              "test_an_encoder_reward_cuts_the_question_or_names_the_fix",
              "test_a_checkpoint_without_a_trained_score_head_is_refused_as_the_reward_model",
              "test_a_reference_checkpoint_without_an_lm_head_is_refused"),
    # the settings compared on resume
    *select("tests/trainer/test_checkpoint.py",
            "test_the_reviewed_list_names_only_real_fields",
            "test_every_field_that_changes_the_run_is_compared_on_resume",
            "test_fields_that_may_change_are_not_compared",
            "test_a_checkpoint_from_before_a_field_existed_resumes_at_its_default"),
    "tests/integration/test_objective_wiring.py",
    "tests/trainer/test_guard.py",
    "tests/trainer/test_data.py",
    # environments: the four tests that catch the mutations of their section
    *select("tests/rollout/test_environments.py",
            "test_environment_tokens_get_zero_kl_zero_advantage_and_zero_gradient",
            "test_first_ratio_is_exactly_one_and_the_loss_reads_the_policy_mask",
            "test_per_position_rewards_join_gae_rewards_and_critic_free_scores"),
    "tests/algorithms/test_ppo_math.py::test_gae_bootstraps_across_an_environment_segment_hand_example",
    "tests/algorithms/test_ppo_math.py::test_chunked_backward_makes_one_logits_sized_gradient",
    "tests/models/test_policy.py",  # a reference of the policy's checkpoint at another precision is said
    # the newest paths' pinning tests
    # subset:evaluation
    *select("tests/evaluation/test_evaluator.py",
            "test_win_rate_interval_is_the_documented_95_percent_bootstrap_of_a_known_binomial",
            "test_the_evaluation_metrics_interval_is_95_percent_and_the_report_says_so",
            "test_after_training_the_reference_side_samples_the_frozen_reference_and_the_policy_side_wins",
            "test_eval_kl_is_the_per_response_sum_of_policy_against_the_frozen_reference"),
    # subset:watch-step
    *select("tests/trainer/test_watch.py",
            "test_the_kl_threshold_the_config_derives_decides_the_warning_in_a_real_run",
            "test_watch_collapse_false_leaves_no_watch_and_a_collapsing_run_silent",
            "test_step_returns_trl_0_11_statistics_when_kl_is_not_zero",
            "test_step_with_gradient_accumulation_gives_the_whole_minibatch_update",
            "test_tokens_response_masks_marks_0_change_neither_the_update_nor_the_loss",
            "test_generate_keeps_a_sampled_eos_at_the_end_and_cuts_what_follows"),
    # subset:env-engine
    *select("tests/rollout/test_environments.py",
            "test_a_row_that_stops_early_gets_padding_and_the_others_sample_to_the_end",
            "test_sample_continues_each_sequence_as_the_policy_continues_it_alone",
            "test_missing_eos_penalty_and_tokens_per_second_read_the_policys_tokens"),
    # subset:settings-files
    "tests/integration/test_run_settings.py",
    "tests/integration/test_run_files.py",
    # subset:critic-values (in tests/models/test_critics.py, above)
    "tests/runtime/test_sharding.py::test_fsdp_support_agrees_with_the_installed_accelerate",
    "tests/runtime/test_sharding.py::test_the_fsdp_version_of_a_launcher_that_sets_none_is_accelerates_default",
    # subset:saved-outputs
    "tests/hub/test_cards.py",
    # subset:console
    "tests/trainer/test_progress.py",  # the progress bar's caption and the sample tables left out:
    *deselect("tests/trainer/test_progress.py",
              "test_the_bar_names_the_kl_estimate_it_shows",
              "test_sample_tables_are_written_above_the_progress_bar"),
    # subset:new-user
    "tests/cli/test_command.py",  # the command's first tests left out (one builds a wheel):
    *deselect("tests/cli/test_command.py",
              "test_help_leads_with_how_to_run_it",
              "test_evaluate_prints_the_table_and_writes_the_report",
              "test_a_full_model_policy_needs_a_reference",
              "test_the_built_wheel_installs_a_working_command"),
    # subset:lambda (in tests/algorithms/test_estimators.py, above)
    # subset:i51 (documented values, saved-output edges, step() boundaries, each save guard after a collapse stop;
    # tests/rollout/test_scoring.py and tests/hub/test_cards.py run whole, above)
    *select("tests/evaluation/test_evaluator.py",
            "test_a_none_on_the_reference_side_alone_leaves_the_pair_out_of_both_sides",
            "test_a_correct_sample_whose_pair_was_not_scored_is_left_out_of_pass_at_k"),
    "tests/rollout/test_environments.py::test_a_negative_reward_is_credited_as_it_is_and_summed_with_the_others_by_hand",
    "tests/hub/test_publish.py::test_a_hub_id_base_stays_an_id_and_a_relative_folder_becomes_absolute",
    *select("tests/trainer/test_step_api.py",
            "test_a_call_whose_optimizer_steps_jump_past_a_multiple_of_save_steps_ends_with_a_checkpoint",
            "test_a_prompt_and_response_exactly_filling_the_context_train_and_one_token_more_is_refused"),
    *select("tests/trainer/test_watch.py",
            "test_the_log_that_stops_training_turns_off_its_own_steps_save",
            "test_a_log_after_the_stop_turns_off_its_save",
            "test_the_epoch_end_and_an_evaluation_after_the_stop_save_nothing",
            "test_save_strategy_best_after_the_stop_is_refused_by_save_checkpoint",
            "test_a_step_call_that_stops_on_a_save_step_writes_no_checkpoint"),
    "tests/cli/test_train.py::test_a_run_the_collapse_watch_stopped_saves_and_pushes_no_policy",
    # subset:i52 (the rollout and evaluation under bf16 autocast, use_cpu's precision, the TRL 0.11 shim's)
    *select("tests/trainer/test_ppo_trainer.py",
            "test_use_cpu_keeps_the_cpus_precision_where_a_bf16_gpu_is_visible",
            "test_under_bf16_mixed_precision_the_reference_computes_as_the_policy[separate_reference]"),
    "tests/evaluation/test_evaluator.py::test_at_step_zero_the_policy_is_its_reference[bf16]",
    "tests/compat/test_trl011.py::test_accelerator_kwargs_mixed_precision_reaches_the_run",
    # subset:i51b (the refusals, each row's tokens with its text and columns; completion_ids: test_scoring.py, above)
    *select("tests/rollout/test_reward_calls.py",
            "test_a_class_given_where_its_instance_was_meant_is_refused_naming_the_fix",
            "test_a_column_not_aligned_with_the_completions_is_refused_before_the_call",
            "test_a_column_named_like_a_call_keyword_is_refused_naming_the_rename"),
    "tests/evaluation/test_evaluator.py::test_evaluate_keeps_each_samples_tokens_with_its_prompts_text_and_columns",
    # subset:i49-50 (system_prompt: test_data.py, a user's metrics.json: test_command.py, both above)
    "tests/trainer/test_run_lock.py::test_the_lock_is_held_while_training_and_released_at_the_end_and_on_error",
    *select("tests/rewards/test_answers.py",
            "test_float_answers_compare_as_the_decimals_they_were_written_as",
            "test_a_comma_that_is_no_thousands_separator_is_no_answer"),
    *select("tests/rollout/test_steps.py",
            "test_frac_reward_zero_std_counts_the_groups_without_spread",
            "test_uniform_rewards_names_each_reward_and_the_score_that_gave_every_sample_one_value"),
    "tests/trainer/test_watch.py::test_no_signal_warns_once_per_reward_and_suggests_groups_to_a_run_without_them",
    # subset:i48 (the vLLM engine's checks that run without vLLM; its sampling runs in the vLLM leg only)
    *select("tests/rollout/test_vllm_engine.py",
            "test_engine_stats_are_the_gap_over_real_tokens",
            "test_vllm_settings_given_to_another_engine_are_refused",
            "test_what_vllm_cannot_work_with_is_refused_by_the_config",
            "test_bases_vllm_cannot_hold_as_the_policy_does_are_named"),
    # subset:i53 (the run lock over step() loops; the loss's kept positions)
    *select("tests/trainer/test_run_lock.py",
            "test_a_step_loop_in_another_process_holds_the_folder_until_its_process_ends",
            "test_in_one_process_a_later_trainer_takes_the_folder_over_and_the_earlier_step_loop_is_refused"),
    "tests/trainer/test_ppo_trainer.py::test_the_loss_keeps_only_the_positions_that_predict_the_response",
    "tests/hub/test_publish.py::test_train_push_load_generate",  # (push_to_hub's card arguments and callback)
    "tests/rollout/test_reward_calls.py::test_a_reference_completion_column_never_reaches_the_functions_as_in_trl",
    "tests/cli/test_train.py::test_a_dataset_config_given_with_a_local_file_is_said_to_be_ignored",
    # subset:i53 (a reward function probed once at start-up, the card written once; PEFT's blank card: test_cards.py)
    *select("tests/cli/test_train.py",
            "test_hf_ppo_train_calls_a_reward_function_once_per_prompt_set_at_start_up[train]",
            "test_hf_ppo_train_writes_the_card_once_and_a_users_create_model_card_still_rewrites_it[save]"),
    # subset:i53 (accelerate's state after refused constructions; the final save on a full disk)
    "tests/trainer/test_ppo_trainer.py::test_a_trainer_trains_and_evaluates_after_refused_constructions_in_its_process",
    *select("tests/trainer/test_checkpoint.py",
            "test_a_full_disk_during_the_final_save_keeps_the_earlier_save_and_names_the_checkpoint[lora]"),
    # subset:i53r (exact_answer reads the answers models write: bold markers, signs, boxed wrappers, expressions)
    *select("tests/rewards/test_answers.py",
            "test_markdown_emphasis_around_the_marker_is_part_of_it",
            "test_a_negative_frac_reference_and_completion_compare_as_numbers",
            "test_what_wraps_a_boxed_number_is_read_through",
            "test_the_first_number_of_an_expression_is_never_paid_as_the_answer"),
    # subset:i53s (space-grouped thousands, math delimiters, explicit signs; one-element numpy arrays refused)
    *select("tests/rewards/test_answers.py",
            "test_space_grouping_pays_the_grouped_number_only",
            "test_numbers_side_by_side_that_are_no_grouping_are_no_answer",
            "test_math_delimiters_around_the_answer_are_read_through",
            "test_an_explicit_plus_sign_and_a_negative_denominator_are_read",
            "test_signed_answers_score_against_their_references"),
    "tests/rollout/test_reward_calls.py::test_one_element_numpy_arrays_in_the_list_are_refused_naming_the_function",
    # subset:i53c (a split of a local file, the run's own reference, a test split nothing evaluates on, --config=)
    *select("tests/cli/test_train.py",
            "test_a_split_name_on_a_local_dataset_file_is_refused_not_read_as_the_whole_file",
            "test_a_test_split_that_nothing_evaluates_on_is_said",
            "test_config_with_an_equals_sign_is_read_and_a_second_config_is_refused"),
    *select("tests/cli/test_command.py",
            "test_hf_ppo_evaluate_compares_against_the_reference_the_run_gave",
            "test_hf_ppo_evaluate_refuses_a_split_of_a_local_file"),
    # subset:i53e (evaluate stops, truncates, scores and splits as the run trained; the record holds them)
    *select("tests/cli/test_command.py",
            "test_hf_ppo_evaluate_stops_truncates_scores_and_splits_as_the_run_trained",
            "test_hf_ppo_evaluate_warns_on_the_training_file_and_names_the_held_out_one"),
    "tests/hub/test_publish.py::test_the_run_record_holds_the_stop_truncation_scoring_and_dataset",
    # subset:i63 (the vLLM engine's checks that need no vLLM; values, second calls, both sides sharing a bug)
    *select("tests/rollout/test_vllm_engine.py",
            "test_a_head_dim_vllms_cpu_attention_lacks_is_refused_naming_kv_cache",
            "test_vllms_max_model_len_holds_the_prompt_and_the_response"),
    "tests/evaluation/test_evaluator.py::test_evaluation_tells_the_engine_which_weights_each_side_samples",
    "tests/trainer/test_ppo_trainer.py::test_truncated_importance_sampling_changes_the_loss_when_the_engines_log_probs_differ",
    "tests/trainer/test_checkpoint.py::test_the_saved_folder_holds_exactly_its_files_and_the_staged_save_equals_the_checkpoints",
    "tests/rollout/test_steps.py::test_the_estimators_output_is_the_same_with_an_unscored_row_as_without_it",
    "tests/hub/test_cards.py::test_the_cards_rollout_batch_is_the_responses_one_device_samples_per_iteration",
    *select("tests/rollout/test_reward_calls.py",
            "test_log_metric_twice_is_the_mean_and_log_extra_over_two_calls_is_extended",
            "test_trls_own_signature_is_called_by_keyword_with_every_column",
            "test_a_messages_column_never_reaches_the_reward_functions_as_data"),
    "tests/trainer/test_watch.py::test_a_nan_row_beside_a_uniform_reward_still_says_no_signal",
    *select("tests/rewards/test_answers.py",
            "test_of_an_equation_of_two_numbers_the_last_side_is_the_answer",
            "test_a_conversational_completion_with_several_messages_is_read_from_the_last"),
    # subset:loss-family (issue 62): the loss family's oracles and its settings' way down
    "tests/algorithms/test_policy_losses.py",
    # subset:i61 (auto: tests/algorithms/test_estimators.py above; the no-signal watch and the closing line,
    # evaluation's log_metric per side, the card of a flat reward, TRL GRPO names, one-line refusals)
    *select("tests/trainer/test_watch.py",
            "test_no_signal_names_what_the_run_shows",
            "test_no_signal_says_again_with_the_count"),
    "tests/trainer/test_progress.py::test_the_closing_line_says_when_no_update_moved_the_policy",
    "tests/evaluation/test_evaluator.py::"
    "test_a_reward_functions_log_metric_is_reported_for_the_policy_and_the_reference_apart",
    "tests/hub/test_cards.py::test_a_run_whose_reward_never_moved_names_no_best_step",
    "tests/cli/test_grpo_names.py",
    # subset:i60, i63 kinds 1-2 (a finished run's resume, the lock until the final save, its file, float32, async)
    *select("tests/trainer/test_checkpoint.py",
            "test_a_finished_runs_resume_trains_nothing_and_saves_the_last_checkpoint",
            "test_a_kill_between_creating_a_checkpoint_folder_and_its_marker_never_blocks_a_resume",
            "test_a_leftover_under_the_name_a_checkpoint_is_made_under_is_never_deleted_unless_hf_ppos",
            "test_leftovers_of_a_killed_final_save",
            "test_the_final_save_moves_the_run_record_in_after_the_weights"),
    *select("tests/trainer/test_run_lock.py",
            "test_the_recorded_command_masks_every_secret",
            "test_a_lock_path_that_is_a_fifo_or_a_symlink_is_refused_without_waiting_or_writing_through",
            "test_a_recorded_pid_now_owned_by_another_process_is_no_run",
            "test_a_lock_recorded_on_another_host",
            "test_a_filesystem_without_flock_lets_the_recorded_process_decide",
            "test_a_refusal_broadcast_from_another_rank",
            "test_an_empty_lock_file_is_taken_over_in_silence",
            "test_a_lock_file_replaced_by_another_runs_is_left_at_release",
            "test_the_final_save_holds_the_folder_and_is_refused_while_another_run_holds_it",
            "test_hf_ppo_train_holds_the_folder_until_its_final_save_is_written"),
    "tests/rewards/test_answers.py::test_a_float32_answer_column_scores_the_right_answers_right",
    "tests/trainer/test_checkpoint.py::test_a_save_of_the_other_kind_leaves_no_stale_weights_of_an_earlier_hf_ppo_save",
    "tests/hub/test_publish.py::test_a_damaged_run_record_is_said_not_ignored_in_silence",
    *select("tests/rollout/test_reward_calls.py",
            "test_an_async_function_raising_systemexit_or_keyboardinterrupt_stops_naming_itself",
            "test_a_blocking_call_inside_an_async_function_is_named_and_later_calls_get_a_fresh_loop",
            "test_log_metric_under_a_trainer_metrics_name_warns_once"),
    # subset:i59 (every forward counts: the passes no update reads are skipped)
    *select("tests/trainer/test_ppo_trainer.py",
            "test_grpo_with_one_step_per_rollout_and_no_kl_runs_no_old_logprob_or_reference_pass",
            "test_the_skipped_passes_run_where_an_update_reads_them"),
    *select("tests/rollout/test_engines.py",
            "test_the_decode_loop_syncs_the_host_once_per_8_tokens_not_per_token",
            "test_the_4d_decode_mask_samples_the_2d_masks_tokens",
            "test_the_static_engine_compiles_once_per_bucket_and_never_again_across_iterations"),
    # subset:i58 (min_p against transformers' warper, its check)
    *select("tests/rollout/test_steps.py", "test_min_p_keeps_the_tokens_transformers_min_p_warper_keeps"),
    "tests/trainer/test_checkpoint.py::test_each_bad_config_value_is_refused[min_p-1.5]",
    "tests/algorithms/test_policy_losses.py",
    # subset:groups-by-index (issue 62): rloo and grpo grouped by the prompt's index in the rollout
    "tests/algorithms/test_advantages.py",
]
COPIED = ["hf_ppo", "tests", "pyproject.toml", "recipes"]  # recipes/ppo.py: tests/cli/test_train.py loads it


@dataclass
class Mutation:
    name: str
    bug: str  # the kind of bug, in the issue's words
    edits: list[tuple[str, str, str]]  # (file under hf_ppo/, exact original snippet, replacement)
    tests: list[str] | None = None  # the tests that catch it when not SUBSET's: VLLM_SUBSET (the vLLM leg's)


# The vLLM leg's tests (marked `vllm`: vLLM's CPU build, .venv-vllm) that catch the mutations with tests=VLLM_SUBSET.
# Those run only where vLLM imports: `.venv-vllm/bin/python tests/mutation_check.py -k i63v`; elsewhere they are
# listed as VLLM-LEG and left out of the score.
VLLM_SUBSET = [
    *select("tests/rollout/test_vllm_engine.py",
            "test_a_lora_policy_whose_base_was_changed_in_memory_is_refused_at_the_first_sync",
            "test_another_model_samples_with_hf_ppos_loop_said_once_naming_truncated_is",
            "test_a_policy_that_puts_its_mass_on_eos_is_not_stopped_by_vllm_when_hf_ppo_says_not_to",
            "test_a_full_fine_tunes_reload_samples_the_new_weights_for_prompts_longer_than_a_kv_block",
            "test_two_syncs_in_a_row_give_two_lora_ids_and_vllm_follows_the_second"),
]


R = "rollout/steps.py"
RF = "rollout/refill.py"
SC = "trainer/schedule.py"
W = "rollout/scoring.py"
G = "rollout/engines.py"
EC = "rollout/engine_choice.py"
LP = "models/policy.py"
PT = "models/pretrained.py"
AS = "trainer/assembly.py"
T = "trainer/ppo_trainer.py"
SV = "trainer/saving.py"
CR = "models/critics.py"
M = "models/value_head.py"
P = "algorithms/ppo_math.py"
MA = "algorithms/masked.py"
AD = "algorithms/advantages.py"
PL = "algorithms/policy_losses.py"
E = "algorithms/estimators.py"
C = "trainer/config.py"
CC = "trainer/config_checks.py"
CN = "trainer/config_names.py"
RC = "trainer/config_records.py"
D = "trainer/data.py"
GU = "trainer/guard.py"
CK = "trainer/checkpoint.py"
ARANGE = "torch.arange({0}.shape[1], device={0}.device).expand_as({0})"
MUTATIONS = [
    # -- the reference ------------------------------------------------------------------------------------------------
    Mutation("ref_adapter_enabled", "reference log-probs computed with the LoRA adapter enabled",
             [(R, "    with reference_context(policy, ref_adapter):\n", "    with contextlib.nullcontext():\n")]),
    Mutation("adapter_disabled_noop", "reference log-probs computed with the LoRA adapter enabled",
             [(R, 'return peft_model.disable_adapter() if hasattr(peft_model, "disable_adapter") else contextlib.nullcontext()',
               "return contextlib.nullcontext()")]),
    Mutation("ref_is_policy", "frozen reference ignored: the policy scores itself (KL always 0)",
             [(R, "reference_logprobs(policy, parts.ref_model,", "reference_logprobs(policy, None,")]),
    Mutation("ref_untempered", "reference log-probs without the sampling temperature",
             [(R, "policy_forward(ref_model, queries, query_mask, responses, response_mask, temperature=temperature,",
               "policy_forward(ref_model, queries, query_mask, responses, response_mask, temperature=1.0,")]),
    Mutation("ref_untempered_lora", "reference log-probs without the sampling temperature (adapter-disabled)",
             [(R, "response_mask, temperature=temperature, batch_size=batch_size, with_values=False,\n",
               "response_mask, temperature=1.0, batch_size=batch_size, with_values=False,\n")]),
    # -- the score ----------------------------------------------------------------------------------------------------
    Mutation("score_at_pad_slot", "reward model's score read at a pad slot instead of the last real token",
             [(W, "last = last_token_index(mask)",
               "last = torch.full_like(last_token_index(mask), mask.shape[1] - 1)")]),
    Mutation("score_attends_padding", "reward model attends the padding after the stop token",
             [(G, "attention_mask = torch.cat([query_mask, response_mask], dim=1).long()",
               "attention_mask = torch.cat([query_mask, torch.ones_like(response_mask)], dim=1).long()")]),
    Mutation("reward_tokenizer_ignored", "reward model with another tokenizer fed the policy's token ids",
             [(W, 'if formats == {"concat"} and same_tokenizer(tokenizer, chosen):', "if True:")]),
    Mutation("reward_text_without_prompt", "reward model with another tokenizer scores the completion alone",
             [(W, "encoded = reward_tokenizer([p + c for p, c in zip(prompt_texts, completions)], padding=True,",
               "encoded = reward_tokenizer(list(completions), padding=True,")]),
    Mutation("eos_penalty_to_stopped", "missing-EOS penalty given to responses that did stop",
             [(W, "missing_eos_penalty * (~contains_stop).float()", "missing_eos_penalty * contains_stop.float()")]),
    Mutation("eos_penalty_to_all", "missing-EOS penalty given to responses that did stop",
             [(W, "scores = scores - missing_eos_penalty * (~contains_stop).float()",
               "scores = scores - missing_eos_penalty")]),
    Mutation("stop_token_not_real", "the stop token left out of the response mask",
             [(R, "stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()",
               "stops_before = torch.cumsum(is_stop.long(), dim=1)")]),
    Mutation("tokens_after_stop_kept", "tokens after the stop token not replaced by padding (sampler and truncation)",
             [(G, "token = sample_token(out.logits[:, -1], s).masked_fill(done, pad_token_id)",
               "token = sample_token(out.logits[:, -1], s)"),
              (R, "return responses.masked_fill(~mask, pad_token_id), mask, is_stop.any(dim=1)",
               "return responses, mask, is_stop.any(dim=1)")]),
    # -- positions and shifts -----------------------------------------------------------------------------------------
    Mutation("logprobs_shifted", "the model sees the whole sequence, consistently in rollout and loss: every "
             "log-prob and value is read one position late",
             [(G, "    return {name: value[:, :-1] for name, value in inputs.items()}",
               "    return {name: value for name, value in inputs.items()}")]),
    Mutation("values_shifted", "values shifted by one position, consistently in rollout and loss",
             [(R, "values.append(out.value.float())", "values.append(torch.roll(out.value, -1, 1).float())"),
              (T, "ppo_loss(out.logits, out.value, batch,",
               "ppo_loss(out.logits, out.value if out.value is None else torch.roll(out.value, -1, 1), batch,")]),
    Mutation("value_from_wrong_layer", "value head reads a hidden state other than the LM head's",
             [(M, "lambda module, args: head_input.append(args[0]))",
               "lambda module, args: head_input.append(torch.nn.functional.layer_norm(args[0], args[0].shape[-1:])))")]),
    Mutation("value_positions_misaligned", "value head reads the first positions instead of the kept ones",
             [(M, "lambda module, args: head_input.append(args[0]))",
               "lambda module, args: head_input.append(args[0].roll(1, dims=1)))")]),
    Mutation("positions_scoring", "position ids not derived from the attention mask (policy/reference passes)",
             [(G, "position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)",
               "position_ids = " + ARANGE.format("attention_mask"))]),
    Mutation("positions_generation", "position ids not derived from the attention mask (sampling)",
             [(G, "positions = (attention.cumsum(1) - 1).clamp(min=0)", "positions = " + ARANGE.format("attention"))]),
    Mutation("positions_reward", "position ids not derived from the attention mask (reward model)",
             [(W, "position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)", "position_ids = " + ARANGE.format("mask"))]),
    # -- temperature --------------------------------------------------------------------------------------------------
    Mutation("sampler_ignores_temperature", "the sampler ignoring temperature",
             [(G, "logits = logits.float() / s.temperature if s.temperature != 1.0 else logits.float()",
               "logits = logits.float()")]),
    Mutation("rollout_samples_at_t1", "the sampler ignoring temperature (not passed by the trainer)",
             [(EC, "return engine(s, pad_token_id=pad_token_id,",
               "return engine(__import__('dataclasses').replace(s, temperature=1.0), pad_token_id=pad_token_id,")]),
    Mutation("old_logprobs_untempered", "rollout log-probs without the sampling temperature",
             [(R, "logprobs.append(logprobs_from_logits(logits, responses[rows], temperature, memory_bytes))",
               "logprobs.append(logprobs_from_logits(logits, responses[rows], 1.0, memory_bytes))")]),
    Mutation("loss_logprobs_untempered", "loss log-probs without the sampling temperature",
             [(P, "logprobs = logprobs_from_logits(logits, responses, temperature, memory_bytes)",
               "logprobs = logprobs_from_logits(logits, responses, 1.0, memory_bytes)")]),
    # -- rewards, advantages, returns ---------------------------------------------------------------------------------
    Mutation("kl_estimator_ignored", "the configured KL estimator ignored",
             [(R, "kl = kl_estimate(logprobs, ref_logprobs, s.kl_estimator)",
               'kl = kl_estimate(logprobs, ref_logprobs, "k1")')]),
    Mutation("advantages_not_whitened", "advantages never whitened although whiten_advantages=True",
             [(E, "whitened = masked_whiten(advantages, mask) if s.whiten_advantages else advantages",
               "whitened = advantages")]),
    Mutation("returns_from_whitened", "returns built from whitened advantages",
             [(E, '"advantages": whitened, "returns": returns}',
               '"advantages": whitened, "returns": torch.where(mask, masked_whiten(advantages, mask) + values, '
               'torch.zeros_like(advantages))}')]),
    Mutation("gamma_lam_swapped", "GAE hyperparameters swapped",
             [(RC, "gamma=self.gamma,\n                                 lam=self.lam,",
               "gamma=self.lam,\n                                 lam=self.gamma,")]),
    # -- KL controller ------------------------------------------------------------------------------------------------
    Mutation("kl_ctl_fed_entropy", "the KL controller fed the wrong KL (the entropy)",
             [(T, "self.kl_ctl.update(stats[kl].item(),", "self.kl_ctl.update(stats[kl + 1].item(),")]),
    Mutation("kl_ctl_fed_per_token_kl", "the KL controller fed the wrong KL (per token, not per response)",
             [(T, "self.kl_ctl.update(stats[kl].item(),", "self.kl_ctl.update((stats[kl] / stats[kl + 5]).item(),")]),
    Mutation("kl_coef_not_adapted", "rewards use the initial kl_coef, not the controller's",
             [(T, "settings = args.rollout_settings.with_kl_coef(self.kl_ctl.value)",
               "settings = args.rollout_settings")]),
    # -- minibatches and the loss -------------------------------------------------------------------------------------
    Mutation("never_shuffled", "the minibatch order never shuffled",
             [(SC, "torch.stack([torch.randperm(len(batch), device=batch.queries.device)\n",
               "torch.stack([torch.arange(len(batch), device=batch.queries.device)\n")]),
    Mutation("same_order_every_epoch", "the minibatch order the same in every PPO epoch",
             [(SC, "torch.stack([torch.randperm(len(batch), device=batch.queries.device)\n"
                  "                              for _ in range(num_ppo_epochs * critic_passes)])",
               "torch.randperm(len(batch), device=batch.queries.device).expand(num_ppo_epochs * critic_passes, "
               "-1).clone()")]),
    Mutation("vf_coef_ignored", "vf_coef ignored",
             [(P, "loss = loss + s.vf_coef * vf_loss", "loss = loss + vf_loss")]),
    Mutation("entropy_sign", "the entropy bonus sign flipped",
             [(P, "loss = loss - s.entropy_coef *", "loss = loss + s.entropy_coef *")]),
    Mutation("old_logprobs_recomputed", "old log-probs recomputed every step (the ratio is always 1)",
             [(P, "policy_loss(logprobs, old_logprobs, old.advantages,",
               "policy_loss(logprobs, logprobs.detach(), old.advantages,")]),
    Mutation("old_values_recomputed", "old values recomputed every step (value clipping never acts)",
             [(P, "value_loss(values, old.values, old.returns,", "value_loss(values, values.detach(), old.returns,")]),
    Mutation("rollout_every_step", "old log-probs recomputed every step (a fresh rollout per micro-batch)",
             [(T, "if position == 0 or self._schedule is None or self._schedule.done:", "if True:")]),
    Mutation("micro_batch_normalizer", "loss normalised by the micro-batch's tokens, not the minibatch's",
             [(SC, '"normalizer": loss_normalizer(self.batch.policy_mask[minibatch], self.loss_aggregation),',
               '"normalizer": loss_normalizer(self.batch.policy_mask[minibatch[k * self.micro_batch_size:'
               '(k + 1) * self.micro_batch_size]], self.loss_aggregation),')]),
    # -- frozen models, aliasing, dropout -----------------------------------------------------------------------------
    Mutation("dropout_kept", "dropout left on",
             [(PT, "            module.p = 0.0\n", "            pass\n")]),
    Mutation("attention_dropout_kept", "dropout left on (Llama-family float attention dropout)",
             [(PT, "            setattr(obj, name, 0.0)\n", "            pass\n")]),
    Mutation("disable_dropout_skipped", "dropout left on (never called)",
             [(AS, "    if args.disable_dropout:\n", "    if False:\n")]),
    Mutation("frozen_trainable", "the reference (and reward) model left trainable",
             [(PT, "    model.requires_grad_(False)\n", "")]),
    Mutation("frozen_train_mode", "a frozen model left in training mode",
             [(PT, "    model.eval()\n    model.requires_grad_(False)\n", "    model.requires_grad_(False)\n")]),
    Mutation("ref_alias_not_copied", "a reference passed as an object aliasing the policy",
             [(LP, "        ref_model = copy.deepcopy(ref_model)\n", "        pass\n")]),
    Mutation("ref_alias_identity_only", "a reference aliasing the policy (a wrapper's body) not detected",
             [(LP, "elif _shares_parameters(ref_model, policy_source):", "elif ref_model is policy_source:")]),
    # -- advantage estimators, num_generations ---------------------------------------------------------------------------
    Mutation("groups_interleaved", "a prompt's k responses spread over the batch (and across devices)",
             [(D, "chunk = [i for i in order[start:start + self.prompts_per_batch] for _ in range(self.num_generations)]",
               "chunk = [i for _ in range(self.num_generations) for i in order[start:start + self.prompts_per_batch]]")]),
    Mutation("grpo_kl_loss_dropped", "grpo's KL loss term never applied",
             [(T, "kl_loss_coef(args.estimator_settings._replace(kl_coef=self.kl_ctl.value)))", "0.0)")]),
    Mutation("critic_kept", "a critic-free estimator keeps the value head (memory, optimizer, checkpoint)",
             [(AS, "    if not ESTIMATORS[args.advantage_estimator].needs_critic:\n        policy = without_critic(",
               "    if False:\n        policy = without_critic(")]),
    Mutation("groups_ignored", "the group estimators see k=1 (each response its own group)",
             [(RC, "num_generations=self.num_generations, gamma=", "num_generations=1, gamma=")]),
    # -- critics, mixed rewards ---------------------------------------------------------------------------------------
    Mutation("critic_adapter_scores", "the reward scored with the reward_lora critic's adapter enabled",
             [(W, "as_loaded = self.scoring_context() if isinstance(reward, nn.Module) else contextlib.nullcontext()",
               "as_loaded = contextlib.nullcontext()")]),
    Mutation("warmup_moves_policy", "the critic warm-up lets the policy move",
             [(T, 'critic_only=inputs.get("critic_only") or self.state.global_step < args.critic_warmup_steps)',
               'critic_only=inputs.get("critic_only"))')]),
    Mutation("critic_passes_move_policy", "the critic-only passes (critic_updates_per_step) let the policy move",
             [(T, 'critic_only=inputs.get("critic_only") or self.state.global_step < args.critic_warmup_steps)',
               "critic_only=self.state.global_step < args.critic_warmup_steps)")]),
    Mutation("saved_critic_state_not_loaded", "critic_model=<a saved critic> rebuilds the critic but drops its state",
             [(AS, "        policy.load_critic_state_dict(saved.state)\n", "        pass\n")]),
    Mutation("uniform_groups_kept", "drop_uniform_groups never drops",
             [(R, "response_mask=batch.response_mask & kept, policy_mask=batch.policy_mask & kept),",
               "response_mask=batch.response_mask, policy_mask=batch.policy_mask),")]),
    Mutation("refill_takes_uniform_groups", "the refill puts groups without signal in the dropped places",
             [(RF, "donors = (~whole_groups(extra_dropped, k)).nonzero()",
               "donors = (whole_groups(extra_dropped, k)).nonzero()")]),
    Mutation("refill_prompts_repeat_each_round", "every refill round samples the same extra prompts",
             [(D, "key = [self.seed, self.step, round_, self.process]", "key = [self.seed, self.step, 0, self.process]")]),
    Mutation("lam_critic_ignored", "the critic's returns use lam, not lam_critic",
             [(E, "returns = compute_gae(rewards, values, mask, s.gamma, s.lam_critic)[1]",
               "returns = compute_gae(rewards, values, mask, s.gamma, s.lam)[1]")]),
    Mutation("reward_weights_ignored", "mixed rewards summed without their weights",
             [(W, "term = torch.where(applies, self.weights[i] * scores,", "term = torch.where(applies, scores,")]),
    Mutation("reward_stats_not_restored", "a dropped NaN rollout moves the per-reward statistics",
             [(T, "            self.rewards.load_state_dict(each_moments)\n", "")]),
    # -- the objective's options on their way from PPOConfig to the loss -------------------------------------------------
    Mutation("clip_higher_swapped", "clip-higher wired backwards (low and high bounds swapped on the way to the loss)",
             [(RC, "cliprange_low=self.cliprange_low, cliprange_high=self.cliprange_high,",
               "cliprange_low=self.cliprange_high, cliprange_high=self.cliprange_low,")]),
    Mutation("dual_clip_dropped", "the dual-clip setting never reaches the loss",
             [(RC, "dual_clip=self.dual_clip,", "dual_clip=None,")]),
    Mutation("loss_aggregation_ignored", "loss_aggregation not passed to the loss (token_mean always)",
             [(RC, "loss_aggregation=self.loss_aggregation, response_length",
               'loss_aggregation="token_mean", response_length')]),
    Mutation("normalizer_token_count", "the minibatch normalizer always counts tokens, whatever the aggregation",
             [(RC, "loss_aggregation=self.loss_aggregation, critic_passes",
               'loss_aggregation="token_mean", critic_passes')]),
    Mutation("cliprange_value_is_cliprange", "the value loss clipped with the policy's clip range",
             [(RC, "cliprange_value=self.cliprange_value,", "cliprange_value=self.cliprange,")]),
    Mutation("entropy_coef_dropped", "entropy_coef never reaches the loss",
             [(RC, "entropy_coef=self.entropy_coef,", "entropy_coef=0.0,")]),
    Mutation("kl_loss_initial_coef", "grpo's KL loss term at the initial kl_coef, not the controller's",
             [(T, "kl_loss_coef(args.estimator_settings._replace(kl_coef=self.kl_ctl.value))",
               "kl_loss_coef(args.estimator_settings)")]),
    Mutation("use_kl_loss_ignored", "use_kl_loss never reaches the update (the KL leaves the reward for nothing)",
             [(E, "return s.kl_coef if s.use_kl_loss or ESTIMATORS[s.advantage_estimator].kl_in_loss else 0.0",
               "return s.kl_coef if ESTIMATORS[s.advantage_estimator].kl_in_loss else 0.0")]),
    Mutation("bias_correction_kl_ignored", "use_bias_correction_kl never reaches the loss",
             [(RC, "use_bias_correction_kl=self.use_bias_correction_kl,", "use_bias_correction_kl=False,")]),
    Mutation("sequence_ratio_ignored", "importance_sampling_level never reaches the loss",
             [(RC, "importance_sampling_level=self.importance_sampling_level,",
                   'importance_sampling_level="token",')]),
    Mutation("whiten_rewards_ignored", "whiten_rewards never reaches the estimator",
             [(RC, "whiten_rewards=self.whiten_rewards", "whiten_rewards=False")]),
    Mutation("reward_clip_ignored", "reward_clip not applied to normalised scores",
             [(T, "reward_clip=self.args.reward_clip,", "reward_clip=None,")]),
    Mutation("normalize_rewards_ignored", "normalize_rewards builds no running moments",
             [(T, "RunningMoments() if args.normalize_rewards else None", "None")]),
    # -- the non-finite guard -------------------------------------------------------------------------------------------
    Mutation("guard_grad_norm_nan_only", "the guard checks the gradient norm for NaN but not for infinities",
             [(GU, "return value is None or math.isfinite(float(value))",
               "return value is None or not math.isnan(float(value))")]),
    Mutation("guard_rollout_nan_only", "the guard checks the rollout for NaN but not for infinities",
             [(GU, "counts = [(~torch.isfinite(batch.scores)).sum()]", "counts = [torch.isnan(batch.scores).sum()]"),
              (GU, "(~torch.isfinite(getattr(batch, name)) & mask)", "(torch.isnan(getattr(batch, name)) & mask)")]),
    Mutation("skipped_step_zero_grads", "a skipped step zeroes the gradients: Adam's moments, step and weight decay "
             "still move the weights", [(T, "model.zero_grad(set_to_none=True)", "model.zero_grad(set_to_none=False)")]),
    Mutation("skipped_step_steps", "a non-finite step is counted but the optimizer still steps",
             [(T, "            model.zero_grad(set_to_none=True)\n", "            pass\n")]),
    Mutation("reward_moments_not_restored", "a dropped rollout's scores stay in the reward normalisation's moments",
             [(T, "                self.reward_moments.load_state_dict(moments)\n", "                pass\n")]),
    # -- the resume comparison ------------------------------------------------------------------------------------------
    Mutation("resume_skips_a_field", "the resume comparison skips a field that changes the run",
             [(CK, '_NOT_COMPARED = {"model_init_kwargs",', '_NOT_COMPARED = {"cliprange_high", "model_init_kwargs",')]),
    Mutation("resume_skips_seed", "the resume comparison skips the seed (the prompt order)",
             [(CK, '_GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")',
               '_GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps")')]),
    # -- environments: their tokens are context (tests/rollout/test_environments.py, tests/algorithms/test_ppo_math.py) 
    Mutation("env_tokens_in_loss", "an environment's tokens trained on as actions (the loss reads the response mask)",
             [(P, "old_logprobs, mask = old.responses, old.logprobs, old.policy_mask",
               "old_logprobs, mask = old.responses, old.logprobs, old.response_mask")]),
    Mutation("env_tokens_in_advantages", "KL penalty, rewards and advantages on an environment's tokens",
             [(R, "    update_mask = policy_mask\n", "    update_mask = response_mask\n")]),
    Mutation("gae_no_bootstrap_across_env", "GAE ends the episode at an environment segment (no bootstrap across it)",
             [(P, "next_value = torch.where(real, values[:, t], next_value)",
               "next_value = torch.where(real, values[:, t], torch.zeros_like(next_value))")]),
    Mutation("step_rewards_dropped", "an environment's per-position rewards never reach GAE",
             [(E, "rewards = rewards + torch.where(mask, step_rewards, torch.zeros_like(step_rewards))",
               "rewards = rewards")]),
    # -- evaluation (issue 41) ----------------------------------------------------------------------------------------
    # mutations:evaluation
    Mutation("eval_sides_swapped", "the reference's scores reported as the policy's (win rate the wrong way round)",
             [("evaluation/evaluator.py", "_tensors(self._reference[key], side, kl, k)",
               "_tensors(side, self._reference[key], kl, k)")]),
    Mutation("eval_interval_90", "a 90% interval passed off as the documented 95%",
             [("evaluation/report.py", "CONFIDENCE = 0.95", "CONFIDENCE = 0.90")]),
    Mutation("eval_interval_tails", "the interval's quantiles at 1 - confidence and confidence (a 90% interval)",
             [("evaluation/evaluator.py", "[(1 - confidence) / 2, (1 + confidence) / 2]",
               "[1 - confidence, confidence]")]),
    Mutation("eval_kl_reversed", "eval KL(reference || policy) instead of KL(policy || reference)",
             [("evaluation/evaluator.py", "kl_estimate(logprobs, ref_logprobs, settings.kl_estimator)",
               "kl_estimate(ref_logprobs, logprobs, settings.kl_estimator)")]),
    Mutation("eval_kl_token_mean", "eval KL a token mean, not the per-response sum objective/kl uses",
             [("evaluation/evaluator.py", "import LOGITS_MEMORY_BYTES, kl_estimate, masked_sum\n",
               "import LOGITS_MEMORY_BYTES, kl_estimate, masked_mean, masked_sum\n"),
              ("evaluation/evaluator.py", "kl = masked_sum(kl_estimate(", "kl = masked_mean(kl_estimate(")]),
    Mutation("eval_kl_against_policy", "eval KL's reference log-probs from the policy (ref_model not passed)",
             [("evaluation/evaluator.py", "reference_logprobs(policy, trainer.ref_model,",
               "reference_logprobs(policy, None,")]),
    Mutation("eval_reference_samples_policy", "the reference side samples the trained policy (full fine-tune)",
             [("evaluation/evaluator.py", "model, weights = _Generator(trainer.ref_model),",
               "model, weights = _Generator(policy.policy_model),")]),
    Mutation("eval_lora_reference_adapter_on", "the LoRA reference samples with the adapter still enabled",
             [("evaluation/evaluator.py", "context = reference_context(policy, trainer.ref_adapter)",
               "context = contextlib.nullcontext()")]),
    Mutation("eval_report_columns_swapped", "the report's reference and policy columns swapped",
             [("evaluation/evaluator.py",
               "(label(i, p), reference.responses[i], scores(reference, i), policy.responses[i], scores(policy, i))",
               "(label(i, p), policy.responses[i], scores(policy, i), reference.responses[i], scores(reference, i))")]),
    # -- the collapse watch, step() and TRL 0.11's generate() (issue 41) ----------------------------------------------
    # mutations:watch-step
    Mutation("ws_watch_kl_from_kl_coef", "the adaptive-KL collapse threshold taken from kl_coef, not kl_target",
             [("trainer/watch.py", "threshold, reason = KL_TARGET_MULTIPLE * args.kl_target,",
               "threshold, reason = KL_TARGET_MULTIPLE * args.kl_coef,")]),
    Mutation("ws_watch_collapse_flag_ignored", "watch_collapse=False still adds the collapse watch",
             [("trainer/watch.py", "    if not args.watch_collapse:\n        return callbacks\n", "")]),
    Mutation("ws_watch_not_added", "the trainer forgets to add the collapse watch to its callbacks",
             [(T, "callbacks=watch.add_watch(callbacks, args, self._last_complete_checkpoint)", "callbacks=callbacks")]),
    Mutation("ws_step_scores_penalised", "step()'s ppo/mean_scores holds the KL-penalised reward, not the score",
             [("trainer/step_api.py", '"ppo/mean_scores": "objective/scores",',
               '"ppo/mean_scores": "objective/rlhf_reward",')]),
    Mutation("ws_step_non_score_per_response", "step()'s ppo/mean_non_score_reward a per-response sum, not TRL's "
             "per-token mean",
             [("trainer/step_api.py",
               '"ppo/mean_non_score_reward": masked_mean(batch.non_score_rewards, batch.policy_mask).item(),',
               '"ppo/mean_non_score_reward": stats["objective/non_score_reward"],')]),
    Mutation("ws_trl_temperature_default", "TRL 0.11's config keeps hf_ppo's temperature 0.7 for step()'s log-probs",
             [("compat/trl011.py", 'seed=trl["seed"], temperature=1.0,', 'seed=trl["seed"],')]),
    Mutation("ws_step_optimizer_per_micro_batch", "step() takes an optimizer step after every accumulated micro-batch",
             [("trainer/step_api.py",
               "                losses.append(self.training_step(model, schedule.next()))\n"
               "            self._step_optimizer(model)\n",
               "                losses.append(self.training_step(model, schedule.next()))\n"
               "                self._step_optimizer(model)\n")]),
    Mutation("ws_step_loss_total_per_micro_batch", "step()'s ppo/loss/total averaged over micro-batches (1/GA of it)",
             [("trainer/step_api.py", "(len(losses) // args.gradient_accumulation_steps)", "len(losses)")]),
    Mutation("ws_step_masks_inverted", "step()'s response_masks read with 1 = the environment's token",
             [("trainer/step_api.py", "    return mask.bool()", "    return ~mask.bool()")]),
    Mutation("ws_step_masks_dropped", "step() checks response_masks but trains on every token",
             [("trainer/step_api.py", "samples.append(EnvSample(response, mask, _given_score(score, i)))",
               "samples.append(EnvSample(response, torch.ones_like(mask), _given_score(score, i)))")]),
    Mutation("ws_generate_drops_eos", "generate() cuts the response before its EOS instead of after",
             [("trainer/step_api.py", "new = new[:int(stops[0]) + 1]", "new = new[:int(stops[0])]")]),
    Mutation("ws_generate_last_eos", "generate() cuts the response at its last EOS instead of the first",
             [("trainer/step_api.py", "new = new[:int(stops[0]) + 1]", "new = new[:int(stops[-1]) + 1]")]),
    # -- environments and the static engine (issue 41) ----------------------------------------------------------------
    # mutations:env-engine
    Mutation("static_row_restarts_after_stop", "the static engine samples on in a row after its stop token",
             [(G, "token = sample_token(logits, s).masked_fill(done, pad_token_id)", "token = sample_token(logits, s)")]),
    Mutation("static_done_forgotten", "the static engine forgets a row stopped (done reset every token)",
             [(G, "done |= torch.isin(token, stops)\n            if t == R - 1",
               "done = torch.isin(token, stops)\n            if t == R - 1")]),
    Mutation("static_stops_when_any_row_stops", "the static engine ends every row once one row stopped",
             [(G, "(t + 1) % self.check_every == 0 and bool(done.all())",
               "(t + 1) % self.check_every == 0 and bool(done.any())")]),
    Mutation("kv_row_restarts_after_stop", "the default engine samples on in a row after its stop token",
             [(G, "token = sample_token(out.logits[:, -1], s).masked_fill(done, pad_token_id)",
               "token = sample_token(out.logits[:, -1], s)")]),
    Mutation("kv_done_forgotten", "the default engine forgets a row stopped (done reset every token)",
             [(G, "done |= torch.isin(token, stops)\n            # The host reads",
               "done = torch.isin(token, stops)\n            # The host reads")]),
    Mutation("env_sample_right_pads", "an environment's sequences padded on the right before sampling",
             [(R, "ids[row, width - len(seq):], mask[row, width - len(seq):] =",
               "ids[row, :len(seq)], mask[row, :len(seq)] =")]),
    Mutation("env_sample_attends_padding", "the padding of an environment's batch attended (mask all True)",
             [(R, "mask = torch.zeros_like(ids, dtype=torch.bool)\n        for row, seq in enumerate(sequences):",
               "mask = torch.ones_like(ids, dtype=torch.bool)\n        for row, seq in enumerate(sequences):")]),
    Mutation("env_stop_token_counts", "an environment's own stop token spares the missing_eos_penalty",
             [(R, "stop_tensor(stop_token_ids, queries.device)) & out.policy_mask).any(1)",
               "stop_tensor(stop_token_ids, queries.device)) & out.response_mask).any(1)")]),
    Mutation("tokens_per_second_env_tokens", "tokens/second counts an environment's tokens as generated",
             [(R, "int(policy_mask.sum().item())", "int(response_mask.sum().item())")]),
    Mutation("tokens_per_second_padding", "tokens/second counts the padding after the stop token",
             [(R, "int(policy_mask.sum().item())", "responses.numel()")]),
    # -- settings reached through wiring, files and the Hub (issue 41) ------------------------------------------------
    # mutations:settings-files
    Mutation("use_kl_loss_not_in_rollout", "use_kl_loss reaches the loss but not the rollout: the KL counted twice",
             [(E, "    if not s.use_kl_loss or estimator.kl_in_loss:\n", "    if True:\n")]),
    Mutation("reward_clip_needs_normalization", "reward_clip applied only with normalize_rewards",
             [(W, "    if reward_clip is not None:\n        return scores.clamp(-reward_clip, reward_clip)\n", "")]),
    Mutation("grpo_bias_correction_refused", "grpo with use_bias_correction_kl refused (only use_kl_loss counted)",
             [(CC, 'or config.advantage_estimator == "grpo"):', "or False):")]),
    Mutation("bias_correction_only_with_use_kl_loss", "the bias-corrected KL applied with use_kl_loss only, not grpo",
             [(RC, "use_bias_correction_kl=self.use_bias_correction_kl,",
               "use_bias_correction_kl=self.use_bias_correction_kl and self.use_kl_loss,")]),
    Mutation("repeated_reward_names_collide", "rewards with the same name not numbered: one overwrites the other",
             [(W, '        unique.append(f"{name}_{number}")', "        unique.append(name)")]),
    Mutation("numbered_name_collides", "a numbered reward name equal to another reward's own name",
             [(W, '        while f"{name}_{number}" in taken:\n            number += 1\n', "")]),
    Mutation("run_critic_push_public", "push_to_hub creates the critic's repo public in a hub_private_repo run",
             [(SV, "args.critic_hub_model_id, repo_id, private=args.hub_private_repo, token=token)",
               "args.critic_hub_model_id, repo_id, private=None, token=token)")]),
    Mutation("critic_push_public", "push_critic_to_hub ignores the run's hub_private_repo",
             [(SV, "        private = private if private is not None else self.args.hub_private_repo\n", "")]),
    Mutation("gitattributes_is_foreign", "a critic push refuses a repo holding only the Hub's .gitattributes",
             [("hub/publish.py", 'foreign = [f for f in existing if f != ".gitattributes"]', "foreign = list(existing)")]),
    Mutation("push_needs_a_new_repo", "a push into a repo created beforehand fails (create_repo without exist_ok)",
             [("hub/publish.py", "api.create_repo(repo_id, private=private, exist_ok=True)",
               "api.create_repo(repo_id, private=private)")]),
    Mutation("resume_defaults_forgotten", "a checkpoint without a newer setting refused although it ran as its default",
             [(CK, 'changed = compare_settings(state["settings"], settings(args), default_settings(args))',
               'changed = compare_settings(state["settings"], settings(args))')]),
    Mutation("rollout_buffer_not_required", "a mid-iteration checkpoint without its rollout buffer counted complete",
             [(CK, 'names = [VALUE_HEAD_FILE] + ([ROLLOUT_BUFFER_FILE] if ppo.get("rollout_buffer") else [])',
               "names = [VALUE_HEAD_FILE]")]),
    Mutation("rollout_buffer_silent_fallback", "a missing rollout buffer silently replaced by a fresh rollout",
             [(CK, 'names = [VALUE_HEAD_FILE] + ([ROLLOUT_BUFFER_FILE] if ppo.get("rollout_buffer") else [])',
               "names = [VALUE_HEAD_FILE]"),
              (CK, 'if state["rollout_buffer"] else None)',
               'if state["rollout_buffer"] and os.path.isfile(os.path.join(folder, ROLLOUT_BUFFER_FILE)) else None)')]),
    Mutation("saved_full_critic_from_base", "a saved full critic rebuilt from its recorded base, not its own folder",
             [(CR, "return SavedCritic(critic, state, folder if full else base)",
               'return SavedCritic(critic, state, info.get("base"))')]),
    # -- critics of their own (issue 41) ------------------------------------------------------------------------------
    # mutations:critic-values
    Mutation("critic_value_shifted", "a critic's values read one position late, consistently in rollout and loss",
             [(CR, "hidden = hidden[:, -logits_to_keep:]", "hidden = hidden[:, -logits_to_keep - 1:-1]")]),
    # (attention_mask=None alone is no bug to plant: with positions from the mask and no KV cache, transformers reads
    # the left padding as packed sequences and masks it anyway.)
    Mutation("critic_attends_padding", "a critic of its own runs on the ids alone: the left padding attended",
             [(CR, "input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,\n"
                   "                               use_cache=False)", "input_ids=input_ids, use_cache=False)")]),
    Mutation("critic_positions_not_passed", "the actor-critic does not pass the position ids on to its critic",
             [("models/actor_critic.py",
               "values = self.critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,",
               "values = self.critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=None,")]),
    Mutation("critic_positions_ignore_padding", "a critic's position ids count the left padding (not passed on)",
             [(CR, "hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,",
               "hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=None,")]),
    # -- sharding: the guard and the launcher's default (issue 41) ---------------------------------------------------
    Mutation("fsdp_support_off", "FSDP refused (and its tests skipped) on the tested accelerate",
             [("runtime/sharding.py", "return Version(version(\"accelerate\")) >= Version(FSDP_ACCELERATE)",
               "return Version(version(\"accelerate\")) > Version(FSDP_ACCELERATE)")]),
    Mutation("fsdp_launcher_default_2", "a launcher that names no FSDP version read as FSDP2 (accelerate builds FSDP1)",
             [("runtime/sharding.py", 'return int(os.environ.get("FSDP_VERSION", "1"))',
               'return int(os.environ.get("FSDP_VERSION", "2"))')]),
    # -- what a run saves: card, plot, tokenizer, reports (issue 38 point 9) ------------------------------------------
    # mutations:saved-outputs
    Mutation("card_plot_two_panels", "the card's plot draws reward and KL only",
             [("hub/cards.py", "panels=DEFAULT_PANELS,", "panels={key: label for key, label in CARD_METRICS[:2]},")]),
    Mutation("card_plot_against_steps", "the card's plot is drawn against optimizer steps, not PPO iterations",
             [("hub/cards.py", "x_key=x_axis(log_history),", 'x_key="step",')]),
    Mutation("card_chat_flag_forgotten", "the trainer does not tell the card that the prompts were chat",
             [(SV, "saved_locally=saved_locally,\n                                           chat_prompts=self._chat_prompts)",
               "saved_locally=saved_locally)")]),
    Mutation("card_unused_run_length", "the card lists the unused run length (epochs of a max_steps run)",
             [(RC, 'unused = "num_train_epochs" if self.max_steps > 0 else "max_steps"',
               'unused = "max_steps" if self.max_steps > 0 else "num_train_epochs"')]),
    Mutation("tokenizer_padding_not_saved", "the copy pads left in memory but saves without padding_side",
             [("models/tokenizers.py", 'tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"',
               'tokenizer.padding_side = "left"')]),
    Mutation("tokenizer_length_test_flipped", "model_max_length replaced when real, kept when the 1e30 sentinel",
             [("models/tokenizers.py", "if tokenizer.model_max_length > LARGE_INTEGER and isinstance(context, int)",
               "if tokenizer.model_max_length < LARGE_INTEGER and isinstance(context, int)")]),
    Mutation("report_foreign_file_overwritten", "a report file hf_ppo did not write is replaced",
             [("evaluation/report.py", "        if path not in foreign:\n", "        if True:\n")]),
    Mutation("report_old_mark_refused", "a report of an earlier hf_ppo (the old first line) is taken for a user's",
             [("evaluation/report.py", "return f.readline().startswith(_MARK_START)",
               "return f.readline().rstrip() == REPORT_MARK")]),
    Mutation("report_latest_only", "each evaluation writes eval_report.md only (the step's report is not kept)",
             [("evaluation/report.py", "paths = [os.path.join(output_dir, STEP_REPORT_FILE.format(step=step)), ",
               "paths = [os.path.join(output_dir, REPORT_FILE), ")]),
    Mutation("gguf_cache_folder_missed", "the conversion folder is compared with the cache root itself",
             [("hub/cards.py", "folder.parent.resolve() == gguf.cache_root().resolve()",
               "folder.resolve() == gguf.cache_root().resolve()")]),
    Mutation("gguf_example_without_file", "the example loads a GGUF repo's base without gguf_file",
             [("hub/cards.py", "if gguf_file and base_id and base_id == gguf_repo",
               "if gguf_file and base_id and base_id != gguf_repo")]),
    Mutation("card_ignores_hub_base_model_id", "the card names the local base although hub_base_model_id is set",
             [("hub/cards.py", 'base_model=settings.hub_base_model_id or sources["model"],',
               'base_model=sources["model"],')]),
    # -- what a run prints: prompts, tables, bar, summary, time/ metrics, import noise (issue 38) ---------------------
    # mutations:console
    Mutation("chat_template_flag_dropped", "apply_chat_template_to_text never reaches the tokenization",
             [(D, "num_proc=args.dataset_num_proc, apply_chat_template_to_text=args.apply_chat_template_to_text,",
               "num_proc=args.dataset_num_proc,")]),
    Mutation("text_prompt_warning_not_silenced", "apply_chat_template_to_text=False still warns about text prompts",
             [(D, "if apply_chat_template_to_text is not None or not getattr(tokenizer, \"chat_template\", None):",
               "if apply_chat_template_to_text or not getattr(tokenizer, \"chat_template\", None):")]),
    Mutation("sample_tables_skip_the_last", "the sample tables spread by total // n: the last iteration never shown",
             [("trainer/progress.py", "return {1 + j * (total - 1) // (n - 1) for j in range(n)}",
               "return {1 + j * total // n for j in range(n)}")]),
    Mutation("prompt_cell_unchecked", "a table row shows the dataset's prompt even where the refill replaced the row",
             [("evaluation/report.py", "return raw if isinstance(raw, str) and raw.strip() and raw.strip() in decoded "
               "else decoded", "return raw if isinstance(raw, str) and raw.strip() else decoded")]),
    Mutation("score_time_holds_policy_forward", "time/score measured up to the end of the policy's forward",
             [(R, "scored - start - samples.generate_seconds, each, dropped,",
               "forwarded - start - samples.generate_seconds, each, dropped,")]),
    Mutation("bar_unit_unset", "the PPO bar's rate stays tqdm's 'it' while it counts optimizer steps",
             [("trainer/progress.py", 'self.training_bar.unit = "step"', "pass")]),
    Mutation("kl_note_inverted", "the KL note armed only with adaptive_kl (where the controller holds KL anyway)",
             [("trainer/watch.py", "note = None if args.adaptive_kl or args.kl_target",
               "note = None if not args.adaptive_kl or args.kl_target")]),
    Mutation("summary_first_reward", "the summary's first reward read from the last log",
             [("trainer/progress.py", '{"first": scores[0], "last": scores[-1]}',
               '{"first": scores[-1], "last": scores[-1]}')]),
    Mutation("checkpointing_filter_wrong_module", "the is_gradient_checkpointing filter names the wrong module",
             [("runtime/warn.py", 'module="transformers.modeling_utils")', 'module="transformers.trainer")')]),
    Mutation("bitsandbytes_filter_inverted", "the bitsandbytes log filter keeps the note and drops the rest",
             [("runtime/warn.py", "return not str(record.msg).startswith(self.prefix)",
               "return str(record.msg).startswith(self.prefix)")]),
    # -- a new user's GGUF, hf-ppo evaluate and Hub path (issue 38) -----------------------------------------------------
    # mutations:new-user
    Mutation("gguf_key_by_path_not_file", "the GGUF cache keyed by the path given, not the real file (links differ)",
             [("models/gguf.py", "parts = [os.path.realpath(real), str(stat.st_size), str(stat.st_mtime_ns)]",
               "parts = [os.path.abspath(real), str(stat.st_size), str(stat.st_mtime_ns)]")]),
    Mutation("recipe_tokenizer_without_gguf_file", "hf-ppo train reads the tokenizer without the GGUF file",
             [("cli/train.py", 'folder, _ = gguf.converted(path, policy_init_kwargs, "policy")',
               "folder = path")]),
    Mutation("gguf_path_not_split", "a .gguf file given as the model is read as a folder",
             [("models/gguf.py", '    name_or_path, init_kwargs = split_gguf_path(name_or_path, init_kwargs)\n', "")]),
    Mutation("evaluate_defaults_to_4bit", "hf-ppo evaluate loads a model in 4 bits when nothing is recorded",
             [("cli/command.py", 'or recorded[name] or "none"', 'or recorded[name] or "4bit"')]),
    Mutation("evaluate_ignores_record", "hf-ppo evaluate ignores the run's recorded quantization",
             [("cli/command.py", 'loaded = record.get("quantization") or {}', "loaded = {}")]),
    Mutation("record_reference_not_policy_base", "the record says the reference was loaded in full precision when "
             "it was the 4-bit policy base", [("hub/publish.py", "_quantization_of(ref_model) if ref_model is not None\n"
                                              "                         else policy_q", '"none"')]),
    Mutation("reference_sampling_unseeded", "the reference sampled from the policy's generator stream",
             [("evaluation/evaluator.py", "with _seeded(seed):", "with contextlib.nullcontext():")]),
    Mutation("reference_is_policy_unsaid", "evaluating an adapter against itself is silent",
             [("evaluation/evaluator.py", "            _warn_if_reference_is_policy(trainer, policy)\n", "")]),
    Mutation("pushed_base_left_local", "the pushed adapter keeps the local conversion folder as its base",
             [("hub/publish.py", 'return {**config, "base_model_name_or_path": base_model_id}', "return None")]),
    # -- VAPO's length-adaptive lambda (issue 39, item 1) -------------------------------------------------------------
    # mutations:lambda
    Mutation("length_counts_padding", "the response length counted with padding (the batch's width)",
             [(P, "lengths = as_bool_mask(mask).sum(dim=1).to(torch.float32)",
               "lengths = torch.full((mask.shape[0],), float(mask.shape[1]))")]),
    Mutation("length_lambda_on_critic", "the length-adaptive lambda applied to the critic's returns, not the actor's",
             [(E, "advantages = compute_gae(rewards, values, mask, s.gamma, "
                  "length_adaptive_lam(mask, s.lam_length_alpha))[0]",
               "returns = compute_gae(rewards, values, mask, s.gamma, length_adaptive_lam(mask, s.lam_length_alpha))[1]")]),
    Mutation("length_alpha_inverted", "alpha inverted in the lambda (1 - alpha / l)",
             [(P, "(1.0 - 1.0 / (alpha * lengths))", "(1.0 - alpha / lengths)")]),
    Mutation("length_alpha_not_passed", "lam_length_alpha dropped on its way from PPOConfig to the rollout",
             [(RC, " lam_length_alpha=self.lam_length_alpha,", "")]),
    Mutation("use_kl_loss_not_in_records", "use_kl_loss dropped where PPOConfig builds the estimator's record",
             [(RC, "                                 use_kl_loss=self.use_kl_loss, auto_ev_threshold",
               "                                 use_kl_loss=False, auto_ev_threshold")]),
    Mutation("eval_seed_constant", "evaluation seeded with a constant instead of the run's seed",
             [(RC, "num_eval_samples=self.num_eval_samples, seed=self.seed,",
                   "num_eval_samples=self.num_eval_samples, seed=42,")]),
    # -- files hf_ppo did not write, a LoRA critic's base, the evaluated precision ------------------------------------
    # mutations:own-files
    Mutation("users_readme_overwritten", "a README.md the user keeps in output_dir is replaced by the card",
             [("hub/cards.py", "    if path.exists() and not is_replaceable_card(path):", "    if False:")]),
    Mutation("users_plot_overwritten", "a training_curves.png of the user's is redrawn",
             [("hub/cards.py", "if plot_path.exists() and not is_hf_ppo_plot(plot_path) and not is_hf_ppo_card(path):",
               "if False:")]),
    Mutation("peft_card_edit_kept", "PEFT's in-place edit of the user's README.md is left in it",
             [("hub/publish.py", "        Path(card).write_bytes(kept)", "        pass")]),
    Mutation("plot_unstamped", "hf_ppo's plot is drawn without its stamp, so a later save keeps the stale one",
             [("hub/plots.py", ', metadata={"Software": PLOT_STAMP}', "")]),
    Mutation("lora_critic_base_unchecked", "a LoRA critic whose base folder is gone fails in huggingface_hub",
             [("models/critics.py", "_is_local_path(base) and not os.path.isdir", "False and not os.path.isdir")]),
    Mutation("precision_not_recorded", "the run's compute dtype is not recorded beside the policy",
             [("hub/publish.py", '"precision": settings.precision,', '"precision": "fp32",')]),
    Mutation("evaluate_ignores_precision", "hf-ppo evaluate runs in fp32 whatever the run used",
             [("cli/command.py", "bf16=precision == \"bf16\", fp16=precision == \"fp16\",", "")]),
    # -- exact documented values, saved-output edges, step() boundaries, each save guard after a stop (issue 51) ----
    # mutations:i51
    Mutation("i51_reward_names_from_1", "repeated reward names numbered from 1 (a, a_1), not the documented a_2",
             [(W, "            seen[name] = 1\n            unique.append(name)",
               "            seen[name] = 0\n            unique.append(name)")]),
    Mutation("i51_lambda_name_brackets", "a lambda reward logged as '<lambda>', not the documented 'lambda'",
             [("models/reward_model.py", 'return name.strip("<>") if isinstance(name, str) else',
               "return name if isinstance(name, str) else")]),
    Mutation("i51_none_term_normalised", "with normalize_each_reward a None row's normalised 0.0 joins the sum",
             [(W, "term = torch.where(applies, self.weights[i] * scores, torch.zeros_like(scores))",
               "term = self.weights[i] * scores")]),
    Mutation("i51_eval_applies_policy_only", "a pair is scored when the policy's reward applied, whatever the "
             "reference's", [("evaluation/evaluator.py",
                              '        for side in ("policy", "reference"):\n'
                              '            if f"applies:{side}|{name}" in tensors:',
                              '        for side in ("policy",):\n'
                              '            if f"applies:{side}|{name}" in tensors:')]),
    Mutation("i51_pass_at_k_own_side", "pass@k counts a side's own finite samples, also where the pair was not scored",
             [("evaluation/evaluator.py", "pass_at_k_mean(scores.nan_to_num(0.0), scored, j)",
               "pass_at_k_mean(scores.nan_to_num(0.0), torch.isfinite(scores) & applies, j)")]),
    Mutation("i51_env_negative_dropped", "an environment's negative rewards are never credited",
             [("rollout/environments.py", "    given = rewards != 0\n", "    given = rewards > 0\n")]),
    Mutation("i51_env_rewards_overwrite", "two rewards credited to one policy token: one overwrites the other",
             [("rollout/environments.py", "    return credited.index_add_(0, owner[given], rewards[given])",
               "    credited[owner[given]] = rewards[given]\n    return credited")]),
    Mutation("i51_env_rewards_not_moved", "collate leaves a reward on the environment's token it came with",
             [("rollout/environments.py", "step_rewards[row, :T] = credit_to_policy_tokens(rewards, mask)",
               "step_rewards[row, :T] = rewards")]),
    Mutation("i51_one_placeholder_mark", "a README holding one of PEFT's placeholder marks is taken for the placeholder",
             [("hub/cards.py", "    return is_hf_ppo_card(path) or is_peft_blank_card(path)\n",
               "    return is_hf_ppo_card(path) or any(mark in Path(path).read_text(encoding='utf-8') for mark in "
               "('# Model Card for Model ID', '<!-- Provide a quick summary of what the model is/does. -->'))\n")]),
    Mutation("i51_ppo_tag_is_hf_ppos", "a README tagged ppo or rlhf (not hf_ppo) is taken for hf_ppo's card",
             [("hub/cards.py", "return isinstance(tags, list) and CARD_TAGS[0] in tags",
               "return isinstance(tags, list) and any(tag in tags for tag in CARD_TAGS)")]),
    Mutation("i51_own_unstamped_plot_kept", "hf_ppo's unstamped plot beside its own card is kept as the user's",
             [("hub/cards.py", "if plot_path.exists() and not is_hf_ppo_plot(plot_path) and not is_hf_ppo_card(path):",
               "if plot_path.exists() and not is_hf_ppo_plot(plot_path):")]),
    Mutation("i51_hub_id_base_absolute", "a Hub-id base in adapter_config.json is made an absolute path",
             [("hub/publish.py", "    if base and not os.path.isabs(base) and os.path.isdir(base):",
               "    if base and not os.path.isabs(base):")]),
    Mutation("i51_step_context_off_by_one", "step() refuses a prompt + response that exactly fill the context",
             [("trainer/step_api.py", "if context is not None and len(query) + len(response) > context:",
               "if context is not None and len(query) + len(response) >= context:")]),
    Mutation("i51_step_save_exact_multiple", "step() saves only when a call ends on a multiple of save_steps",
             [("trainer/step_api.py", "if (every > 0 and last // every > first_step // every) or",
               "if (every > 0 and last % every == 0) or")]),
    Mutation("i51_stop_step_saves", "the log that stops training leaves its own step's save on",
             [("trainer/watch.py", "control.should_training_stop, control.should_save, self.stopped = True, False, True",
               "control.should_training_stop, self.stopped = True, True")]),
    Mutation("i51_later_log_saves", "a log after the stop leaves its save on",
             [("trainer/watch.py", "        if self.stopped:\n            control.should_save = False\n        if not logs:",
               "        if not logs:")]),
    Mutation("i51_epoch_end_saves", "the epoch end (and an evaluation) after the stop saves",
             [("trainer/watch.py", 'save nothing either."""\n        if self.stopped:',
               'save nothing either."""\n        if False:')]),
    Mutation("i51_evaluate_saves", "an evaluation after the stop leaves its save on (on_evaluate not guarded)",
             [("trainer/watch.py", "    on_evaluate = on_epoch_end\n", "    on_evaluate = TrainerCallback.on_evaluate\n")]),
    Mutation("i51_checkpoint_unguarded", "_save_checkpoint saves after a stop (save_strategy='best', step())",
             [(SV, "        if watch.stopped_by_collapse(self.callback_handler.callbacks):  # save_strategy=",
               "        if False:  # save_strategy=")]),
    Mutation("i51_step_after_stop", "step() after a stop trains on",
             [("trainer/step_api.py", "        if stopped_by_collapse(self.callback_handler.callbacks):\n"
                                      '            raise ValueError(f"step(): stop_on_collapse',
               "        if False:\n"
               '            raise ValueError(f"step(): stop_on_collapse')]),
    Mutation("i51_recipe_saves_collapsed", "hf-ppo train saves (and pushes) the collapsed policy after a stop",
             [("cli/train.py", "    if stop is not None:  # stop_on_collapse", "    if False:  # stop_on_collapse")]),
    # -- issue 52: the rollout and evaluation under the run's autocast, use_cpu's precision, the TRL 0.11 shim's ------
    # mutations:i52
    Mutation("i52_rollout_no_autocast", "the rollout's passes (reference, reward, sampling) run outside the run's "
             "bf16 autocast, so step 0's KL is the precision gap",
             [(T, 'with showing_sampling(self.callback_handler.callbacks, self.state, "rollout"), '
                  "self.accelerator.autocast():",
               'with showing_sampling(self.callback_handler.callbacks, self.state, "rollout"):')]),
    Mutation("i52_eval_no_autocast", "evaluation runs outside the run's bf16 autocast (the policy is not its reference "
             "at step 0)",
             [(T, 'with showing_sampling(self.callback_handler.callbacks, self.state, "evaluation"), '
                  "self.accelerator.autocast():",
               'with showing_sampling(self.callback_handler.callbacks, self.state, "evaluation"):')]),
    Mutation("i52_use_cpu_takes_gpu_bf16", "bf16=None turns bf16 on with use_cpu=True where a bf16 GPU is visible",
             [(C, "and not (\n                self.fp16 or self.use_cpu)", "and not (\n                self.fp16)")]),
    Mutation("i52_trl011_precision_dropped", "the TRL 0.11 shim drops accelerator_kwargs' mixed_precision (hf_ppo's "
             "default precision applies)",
             [("compat/trl011.py", '        bf16=mixed == "bf16", fp16=mixed == "fp16",\n', "")]),
    # -- issue 51 (b): the refusals no test triggered, and each row's tokens, text and columns together under k > 1 --
    # mutations:i51b
    Mutation("i51b_class_reward_accepted", "a class given as a reward function is called (building an instance)",
             [("rollout/reward_calls.py", "    if inspect.isclass(func):  # callable,", "    if False:  # callable,")]),
    Mutation("i51b_call_name_column_hidden", "a dataset column named prompts/completions/completion_ids is silently "
             "hidden by the call's own value",
             [("rollout/reward_calls.py", "clash = sorted(set(columns or ()) & (set(CALL_NAMES) | set(HOOK_NAMES)))",
               "clash = sorted(set(columns or ()) & set(HOOK_NAMES))")]),
    Mutation("i51b_long_column_accepted", "a column longer than the batch reaches the reward function",
             [("rollout/reward_calls.py", "        if len(values) != len(texts):  # a misaligned column",
               "        if len(values) < len(texts):  # a misaligned column")]),
    Mutation("i51b_eval_tokens_tiled", "evaluate's k samples: the prompt tokens repeated (tiled) where the texts and "
             "columns are repeat_interleaved",
             [("evaluation/evaluator.py", 'out["queries"] = inputs["queries"].repeat_interleave(k, dim=0)',
               'out["queries"] = inputs["queries"].repeat(k, 1)'),
              ("evaluation/evaluator.py", 'out["query_mask"] = inputs["query_mask"].repeat_interleave(k, dim=0)',
               'out["query_mask"] = inputs["query_mask"].repeat(k, 1)')]),
    Mutation("i51b_eval_columns_tiled", "evaluate's k samples: the dataset columns tiled, not each row's k times",
             [("evaluation/evaluator.py", "{name: [v for v in values for _ in range(k)]",
               "{name: [v for _ in range(k) for v in values]")]),
    Mutation("i51b_completion_ids_padded", "a reward's completion_ids keep the padding after the stop token",
             [(W, "                    ids = [row[keep].tolist() for row, keep in zip(responses, "
                  "response_mask.bool())]",
               "                    ids = [row.tolist() for row in responses]")]),
    # -- issues 49 and 50: one run per output_dir, exact_answer's numbers, the no-signal warning, prompting, files ----
    # mutations:i49, i50
    Mutation("i49_lock_kept_on_error", "a train() that raises leaves output_dir locked",
             [("trainer/run_lock.py", "    try:\n        yield lock\n    finally:\n        if lock is not None:\n"
                                      "            lock.release()",
               "    yield lock\n    if lock is not None:\n        lock.release()")]),
    Mutation("i49_float_answer_binary", "a float answer compared as its binary fraction (0.1 != '0.1')",
             [("rewards/answers.py", "        return Fraction(Decimal(_written(answer)))", "        return Fraction(answer)")]),
    Mutation("i49_decimal_comma_read", "'#### 1,5' read as 15 (any comma dropped, not only thousands separators)",
             [("rewards/answers.py", '    if "," in numerator and not _GROUPED.fullmatch(numerator):\n'
                                     "        return None\n", "")]),
    Mutation("i50_zero_std_per_row_k1", "frac_reward_zero_std with num_generations=1 counts each row as a group "
             "(always 1.0)",
             [(R, "size = k if k > 1 else scores.numel()", "size = k")]),
    Mutation("i50_uniform_counts_unapplied", "the no-signal check counts the rows a reward does not apply to",
             [(R, "kept = values.float() if applies is None else values[applies].float()",
               "kept = values.float()")]),
    Mutation("i50_no_signal_each_iteration", "the no-signal warning repeats every iteration, not once per reward",
             [("trainer/watch.py", "        self.warned |= set(new)\n", "")]),
    Mutation("i50_system_prompt_last", "system_prompt appended after the prompt's turns, not first",
             [(D, 'return {key: [{"role": "system", "content": system_prompt}, *turns]}',
               'return {key: [*turns, {"role": "system", "content": system_prompt}]}')]),
    Mutation("i50_users_metrics_replaced", "hf-ppo evaluate overwrites a metrics.json the user wrote",
             [("evaluation/report.py", "    if not _our_metrics(path):\n        warn_user(",
               "    if False:\n        warn_user(")]),
    # Issue 48: the vLLM engine's statistics and refusals (the ones a machine without vLLM can run).
    Mutation("i48_gap_over_padding", "the vLLM log-prob gap averaged over padding too, not the real tokens alone",
             [("rollout/engines.py", "gap = (logprobs.float() - sampled.to(logprobs.device)).abs().masked_fill("
               "~mask.bool(), 0.0)", "gap = (logprobs.float() - sampled.to(logprobs.device)).abs()")]),
    Mutation("i48_vllm_field_silently_ignored", "a vllm_* setting given to another engine is silently ignored",
             [("trainer/config_checks.py", "                if getattr(config, name) != "
               "config.__dataclass_fields__[name].default]", "                if False]")]),
    Mutation("i48_8bit_base_accepted", "rollout_engine='vllm' accepts an 8-bit base it cannot load as the policy does",
             [("trainer/config_checks.py", '    if config.policy_quantization == "8bit":\n        errors.append('
               '"rollout_engine=\'vllm\' with', '    if False:\n        errors.append("rollout_engine=\'vllm\' with')]),
    Mutation("i48_8bit_model_accepted", "an 8-bit policy model object is handed to vLLM",
             [("rollout/vllm_engine.py", '    if getattr(base, "is_loaded_in_8bit", False):',
               "    if False:")]),
    # -- issue 50 item 6: the chunked log-probs' backward makes one logits-sized gradient ------------------------------
    Mutation("i50_chunks_by_slicing", "the chunked log-probs cut their chunks by slicing, whose backward makes a "
             "zero-filled tensor the size of the whole logits per chunk (195 MiB each at SmolLM2's 8 x 129)",
             [(P, "        pieces = zip(logits.split(per_chunk), *(t.split(per_chunk) for t in per_position))",
               "        pieces = zip([logits[i:i + per_chunk] for i in range(0, len(logits), per_chunk)],\n"
               "                     *(t.split(per_chunk) for t in per_position))")]),
    Mutation("i50_reference_precision_unsaid", "a reference of the policy's own checkpoint at another precision "
             "loads in silence (the KL penalty starts at the quantization gap)",
             [("models/policy.py", "    if ours == quantization:\n        return",
               "    if ours == quantization or True:\n        return")]),
    # -- issue 48 item 8: the rollout's prompts read once per iteration -------------------------------------------
    Mutation("i48_prompts_memory_ignores_indices", "the DataLoader's one-batch memory hands back the last rows for any "
             "batch, so every iteration trains on the first iteration's prompts",
             [(D, "        if self._last[0] == indices:", "        if self._last[0] is not None:")]),
    Mutation("i48_collator_memory_by_equality", "the collator hands back its last batch for rows of equal length, "
             "not only for the very same rows",
             [(D, "        if features is self._last[0] and ids == self._last[1]:",
               "        if self._last[0] is not None and len(features) == len(self._last[0]):")]),
    # -- the run lock over TRL 0.11's step() loops ----------------------------------------------------------------
    Mutation("i53_step_loop_unlocked", "a step() loop with save_strategy='steps' holds nothing: two loops into one "
             "output_dir overwrite each other's checkpoints in silence",
             [("trainer/step_api.py", "        self._check_step_settings()\n        self._hold_output_dir()\n",
               "        self._check_step_settings()\n")]),
    Mutation("i53_step_takeover_unsaid", "an earlier trainer's step() loop goes on writing into a folder a later "
             "trainer of the same process took over",
             [("trainer/run_lock.py", "    if lock is None or lock.taken_over is None:\n        return None",
               "    if True:\n        return None")]),
    # -- issue 53: PEFT's blank card only when untouched, a reward function probed once, the card written once -----
    Mutation("i53_card_marks_only", "a README holding both of PEFT's placeholder marks (the user's filled-in template) "
             "is taken for PEFT's blank card and replaced",
             [("hub/cards.py", "    return is_hf_ppo_card(path) or is_peft_blank_card(path)\n",
               "    return is_hf_ppo_card(path) or all(mark in Path(path).read_text(encoding='utf-8') for mark in "
               "('# Model Card for Model ID', '<!-- Provide a quick summary of what the model is/does. -->'))\n")]),
    Mutation("i53_reward_probed_twice", "hf-ppo train calls each reward function twice at start-up (its early probe, "
             "then the trainer's identical one)",
             [(W, "        return  # this very call was made and passed (`probing_once`)\n",
               "        pass  # this very call was made and passed (`probing_once`)\n")]),
    Mutation("i53_card_written_twice", "hf-ppo train writes the card in save_model() and again in create_model_card()",
             [("cli/train.py", "        trainer.save_model(ppo_config.output_dir, _internal_call=True)\n",
               "        trainer.save_model(ppo_config.output_dir)\n")]),
    # -- the loss keeps only the positions that predict the response ----------------------------------------------
    Mutation("i53_loss_keeps_one_more", "the loss keeps R + 1 positions of the whole sequence and cuts the last off "
             "(right numbers, one more logits-sized tensor in every backward)",
             [(T, "        out = model(**predicting_inputs(batch.queries, batch.query_mask, batch.responses, "
                  "batch.response_mask),\n                    logits_to_keep=batch.responses.shape[1],",
               "        out = model(**__import__('hf_ppo.rollout.engines', fromlist=['_']).sequence_inputs("
               "batch.queries, batch.query_mask, batch.responses, batch.response_mask),\n"
               "                    logits_to_keep=batch.responses.shape[1] + 1,"),
              (T, "        loss, stats = ppo_loss(out.logits, out.value, batch,",
               "        loss, stats = ppo_loss(out.logits[:, :-1], out.value if out.value is None else out.value[:, :-1], "
               "batch,")]),
    # -- issue 53: accelerate's state after a refused construction; the final save on a full disk ---------------------
    Mutation("i53_state_after_refusal", "a PPOConfig or trainer refused after TrainingArguments emptied accelerate's "
             "state leaves a trainer built before unable to train (AcceleratorState has no distributed_type)",
             [(T, "        sharding.reinstate_accelerate_state(self._accelerate_state)\n        "
                  "super()._hp_search_setup(trial)\n", "        super()._hp_search_setup(trial)\n")]),
    Mutation("i53_final_save_full_disk", "the final save_model() writes straight into the folder: a full disk leaves "
             "a truncated policy over the earlier save and raises safetensors' raw error",
             [(SV, "folder = output_dir if in_checkpoint else stack.enter_context(",
               "folder = output_dir if True else stack.enter_context(")]),
    # -- push_to_hub: Trainer's card arguments refused, its push callback called -------------------------------------
    Mutation("i53_push_drops_card_arguments", "push_to_hub(tags=..., model_name=...) pushes without them, in silence",
             [(SV, "        if kwargs:\n            raise TypeError(f\"push_to_hub(", "        if False:\n            raise "
                  "TypeError(f\"push_to_hub(")]),
    Mutation("i53_push_begin_unsaid", "push_to_hub never calls the callbacks' on_push_begin (Trainer's does)",
             [(SV, "        self.callback_handler.on_push_begin(self.args, self.state, self.control)  # as Trainer's "
                  "push_to_hub\n", "")]),
    # -- i53r: exact_answer reads the answers models write (each was a silent 0, or another number) ---------------
    Mutation("i53r_bold_marker", "'**Answer:** 42' has no answer (the '**' after the marker read as the number): a "
             "right answer scores 0",
             [("rewards/answers.py", r'answer\**\s*(?:is|:)\s*:?(?:\s*\*+)?", re.IGNORECASE)',
               r'answer\s*(?:is|:)\s*:?", re.IGNORECASE)')]),
    Mutation("i53r_signed_latex", "'-\\frac{3}{4}' and '-$5' are no number: a right negative answer scores 0",
             [("rewards/answers.py", '    negative = token.startswith("-") and not _NUMBER.fullmatch(token)\n',
               "    negative = False\n")]),
    Mutation("i53r_boxed_wrapper", "'\\boxed{\\text{42}}' drops the \\text{} as a unit and has no number",
             [("rewards/answers.py", '_LATEX_NOISE.sub("", _unbraced(inner).replace(',
               '_LATEX_NOISE.sub("", inner.replace(')]),
    Mutation("i53r_expression_first", "'the answer is 48 - 12 = 36' is read as 48, its first token",
             [("rewards/answers.py", "    numbers = [side[0] for side in sides if len(side) == 1]\n",
               "    numbers = [first]\n")]),
    # -- i53c: hf-ppo train / evaluate doing other than the user meant, in silence ------------------------------------
    Mutation("i53c_local_split_whole_file", "dataset_test_split: test (or --dataset_split test) on a local file reads "
             "the whole file: the training prompts evaluated as the test split",
             [("cli/train.py", '        if split != "train":\n            fix = (',
               '        if False:\n            fix = (')]),
    Mutation("i53c_run_reference_ignored", "hf-ppo evaluate compares a LoRA policy against its base, not the "
             "ref_model the run trained against (recorded beside it)",
             [("cli/command.py", "    reference = args.reference or recorded_reference(args.policy)\n",
               "    reference = args.reference\n")]),
    Mutation("i53c_reference_path_compared_as_text", "--reference given as a relative path to the run's own "
             "reference is taken for another model and loaded in full precision, not as the run loaded it",
             [("cli/command.py", 'and not same_model(record["reference"], args.reference):',
               'and record["reference"] != args.reference:')]),
    Mutation("i53c_test_split_unevaluated_unsaid", "dataset_test_split without eval_strategy: loaded and never "
             "evaluated on, in silence",
             [("cli/train.py", '    if test is not None and not held_out_file and ppo_config.eval_strategy == "no"',
               '    if False and ppo_config.eval_strategy == "no"')]),
    Mutation("i53c_config_equals_unread", "--config=run.yaml leaves the YAML unread",
             [("cli/train.py", '(["--config", arg[len("--config="):]] if arg.startswith("--config=")',
               '([arg] if arg.startswith("--config=")')]),
    Mutation("i53_reference_column_passed", "a prompt-completion dataset's reference 'completion' column reaches "
             "the reward functions (TRL leaves it out): a `completion` parameter scores the references in silence",
             [("rollout/reward_calls.py",
               "    return [c for c in column_names if c not in PROMPT_COLUMNS and c not in REFERENCE_COLUMNS]",
               "    return [c for c in column_names if c not in PROMPT_COLUMNS]")]),
    # -- i53s: exact_answer's space grouping, math delimiters, explicit signs; one-element numpy arrays refused -------
    Mutation("i53s_space_groups", "'#### 1 000' reads 1 and '#### 12 345' reads 12 (space-grouped thousands split)",
             [("rewards/answers.py", "    text = _space_groups_joined(text)\n", "    text = text\n")]),
    Mutation("i53s_side_by_side_first", "'#### 3 5' (a list) and '#### 5 3/4' (a mixed number) read as 3 and 5",
             [("rewards/answers.py",
               "    if i < len(tokens) and tokens[i][:1].isdigit() and not tokens[i - 1].endswith(_ENDS):\n",
               "    if False:\n")]),
    Mutation("i53s_math_opening", "'The answer is \\( 42 \\)' has no answer (the '\\(' read as the number)",
             [("rewards/answers.py", '            rest = _MATH_OPENING.sub("", text[match.end():].lstrip())\n',
               "            rest = text[match.end():].lstrip()\n")]),
    Mutation("i53s_close_paren_order", "'\\(42\\)' has no answer (')' stripped before '\\)', leaving '42\\')",
             [("rewards/answers.py", '"?", "\\\\)", "\\\\]", ")", "`")', '"?", ")", "\\\\)", "\\\\]", "`")')]),
    Mutation("i53s_plus_sign", "'#### +5' has no answer: a right answer with an explicit sign scores 0",
             [("rewards/answers.py", '    if token.startswith("+") and token[1:2] not in ("+", "-"):',
               "    if False:")]),
    Mutation("i53s_frac_negative_denominator", "'\\boxed{\\frac{7}{-2}}' has no answer: a right -7/2 scores 0",
             [("rewards/answers.py", '        if denominator.startswith("-"):  #', "        if False:  #")]),
    Mutation("i53s_one_element_array", "a list of numpy arrays of shape (1,) passes the number check, then float() "
             "raises numpy's bare error naming no function",
             [("rollout/reward_calls.py",
               '    one_element = isinstance(dtype, torch.dtype) and getattr(value, "shape", None) == (1,)',
               '    one_element = getattr(value, "shape", None) == (1,)')]),
    # -- i53e: evaluate stops, truncates, scores and splits as the run trained -----------------------------------------
    Mutation("i53e_stop_unrecorded", "the run record holds no stop tokens, max_prompt_length or reward_input_format: "
             "hf-ppo evaluate samples to 'eos' past the run's stop, keeps 512 prompt tokens, reads the rewards 'auto'",
             [("hub/publish.py", '                    "format": None if chat_prompts is None else "chat" if '
               'chat_prompts else "text",\n                    "max_prompt_length": settings.max_prompt_length},',
               '                    "format": None if chat_prompts is None else "chat" if chat_prompts else "text"},'),
              ("hub/publish.py", '"sampling": {**asdict(settings.sampling), "stop_token": settings.stop_token,\n'
               '                     "stop_token_ids": None if settings.stop_token_ids is None else '
               'list(settings.stop_token_ids)},\n        "scoring": {"reward_input_format": '
               'settings.reward_input_format},', '"sampling": {**asdict(settings.sampling)},')]),
    Mutation("i53e_recorded_settings_ignored", "hf-ppo evaluate reads only the four sampling settings of the record: "
             "the run's stop tokens, max_prompt_length and reward_input_format are not its defaults",
             [("cli/command.py", "    for name, section in RECORD_SECTIONS.items():",
               '    for name, section in {n: "sampling" for n in ("response_length", "temperature", "top_k", '
               '"top_p")}.items():')]),
    Mutation("i53e_split_train_default", "--dataset_split defaults to 'train' on the dataset the run trained on: "
             "the training prompts scored in silence",
             [("cli/command.py", "    if split is None and test is not None and not held_out_file:",
               "    if False:")]),
    Mutation("i53e_training_prompts_unsaid", "evaluating the split the run trained on says nothing",
             [("cli/command.py", "    if training:\n        fix = (", "    if False:\n        fix = (")]),
    Mutation("i53e_dataset_unrecorded", "hf-ppo train records no dataset beside the policy",
             [("cli/train.py", "    if ppo_config.should_save:  # the dataset", "    if False:  # the dataset")]),
    Mutation("i53_local_config_unsaid", "dataset_config given with a local file is dropped in silence",
             [("cli/train.py", "        if config is not None:  # nothing to choose in a file: said, since the user "
                               "meant something by it\n            warn_user(",
               "        if False:\n            warn_user(")]),
    # -- i63: the vLLM engine's reliability (58.6, 60.4, 60.9); tests of values, second calls, shared bugs ------------
    Mutation("i63_head_dim_accepted", "vLLM on the CPU with head_dim 16 is accepted, then dies at the first rollout",
             [("rollout/vllm_engine.py", "    if on_cpu and head_dim not in cpu_head_sizes():", "    if False:")]),
    Mutation("i63_max_model_len_prompt_alone", "vLLM's max_model_len, unset, holds the prompt alone, not its response",
             [(RC, "(self.max_prompt_length and self.max_prompt_length + self.response_length)",
               "(self.max_prompt_length)")]),
    Mutation("i63_reference_weights_untold", "evaluation's reference side is not told which weights it samples: the "
             "engine guesses (vLLM samples its copy of the policy as the reference)",
             [("evaluation/evaluator.py", "        with context, sampling_weights(weights), _naming(",
               "        with context, _naming(")]),
    Mutation("i63_is_against_the_policy", "the engine's log-probs never reach the batch: truncated importance "
             "sampling weighs the policy against itself (every weight 1) whatever vLLM sampled",
             [(R, "contains_stop, **rewards, policy_mask=policy_mask, sampling_logprobs=sampled)",
               "contains_stop, **rewards, policy_mask=policy_mask, sampling_logprobs=None)")]),
    Mutation("i63_staging_marker_kept", "the final save's staging marker is moved into the saved folder (and pushed)",
             [(CK, "            for name in sorted((n for n in written if n != _STAGING_MARKER), key=lambda n: n in last):",
               "            for name in sorted(written, key=lambda n: n in last):")]),
    Mutation("i63_unscored_rows_in_estimator", "rows a reward scored NaN/inf enter the advantage estimator's "
             "whitening (their placeholder 0 scores move every other row's advantage)",
             [(R, "        update_mask = policy_mask & ~unscored.unsqueeze(1)", "        update_mask = policy_mask")]),
    Mutation("i63_card_rollout_batch", "the card's rollout batch is the per-device batch, not the responses sampled "
             "per iteration", [(RC, 'values["rollout_batch_size (per device)"] = self.rollout_batch_size',
                                'values["rollout_batch_size (per device)"] = self.per_device_train_batch_size')]),
    Mutation("i63_log_metric_last", "log_metric called twice in an iteration logs the last value, not the mean",
             [("rollout/reward_calls.py", "        return {name: sum(values) / len(values) for name, values in "
               "metrics.items() if values}", "        return {name: values[-1] for name, values in "
               "metrics.items() if values}")]),
    Mutation("i63_log_extra_replaced", "log_extra over two calls keeps the second call's values only",
             [("rollout/reward_calls.py", "        self.extra.setdefault(str(column), []).extend(list(values))",
               "        self.extra[str(column)] = list(values)")]),
    Mutation("i63_nan_is_spread", "a NaN row beside a uniform reward reads as spread: the no-signal warning is lost",
             [(R, "        kept = kept[torch.isfinite(kept)]\n", "")]),
    Mutation("i63_messages_column_passed", "a 'messages' column reaches the reward functions as a data column",
             [("rollout/reward_calls.py", 'PROMPT_COLUMNS = ("prompt", "messages", "input_ids", "attention_mask")',
               'PROMPT_COLUMNS = ("prompt", "input_ids", "attention_mask")')]),
    Mutation("i63_first_message_read", "of a conversational completion with several messages the first is read",
             [("rewards/answers.py", '        return completion[-1]["content"]', '        return completion[0]["content"]')]),
    Mutation("i63_first_side_read", "'the answer is 40 = 42' reads 40, the first side",
             [("rewards/answers.py", "    numbers = [side[0] for side in sides if len(side) == 1]\n    if numbers:\n"
               "        return numbers[-1]", "    numbers = [side[0] for side in sides if len(side) == 1]\n"
               "    if numbers:\n        return numbers[0]")]),
    Mutation("i63_trl_signature_positional", "TRL's f(prompts, completions, **kwargs) is called positionally, "
             "without its columns", [("rollout/reward_calls.py", "    if any(p.kind is p.VAR_KEYWORD for p in params):"
                                      "\n        return True", "    if False:\n        return True")]),
    # the vLLM leg's (tests=VLLM_SUBSET: run with .venv-vllm/bin/python)
    Mutation("i63v_probe_skipped", "a LoRA policy whose base was merged in memory samples another model on vLLM",
             [("rollout/vllm_engine.py", "        if gap > tolerance:", "        if False:")], VLLM_SUBSET),
    Mutation("i63v_fallback_unsaid", "a fallback to hf_ppo's loop turns truncated importance sampling off unsaid",
             [("rollout/vllm_engine.py", "            self._said_fallback = self._said_fallback or "
               "_warn_fallback(weights, self.adapter is not None)", "            self._said_fallback = True")],
             VLLM_SUBSET),
    Mutation("i63v_eos_stops", "vLLM stops at EOS when hf_ppo says never to stop",
             [("rollout/vllm_engine.py", "stop_token_ids=self.stop_token_ids, ignore_eos=True,",
               "stop_token_ids=self.stop_token_ids, ignore_eos=False,")], VLLM_SUBSET),
    Mutation("i63v_prefix_cache_kept", "a full fine-tune's reload keeps the prefix cache: long prompts sample the "
             "old weights' keys and values",
             [("rollout/vllm_engine.py", "            self.llm.reset_prefix_cache()", "            pass")],
             VLLM_SUBSET),
    Mutation("i63v_lora_id_reused", "every sync loads its adapter under one LoRA id: vLLM keeps the first adapter",
             [("rollout/vllm_engine.py", "            self._lora_id += 1\n", "            self._lora_id = 1\n")],
             VLLM_SUBSET),
    # -- issue 62: the loss family users compare against (verl's and TRL's names) ------------------------------------
    Mutation("i62_k3_unclamped", "k3 without verl's clamp on the estimate: one ruled-out token gives 5e8",
             [(P, "k3 = (torch.expm1(log_r) - log_r).clamp(-K3_CLAMP, K3_CLAMP)", "k3 = torch.expm1(log_r) - log_r")]),
    Mutation("i62_k3plus_is_k3", "k3+ with k3's own gradient (the forward KL's), not k2's",
             [(P, "return k3.detach() + (k2 - k2.detach())", "return k3")]),
    Mutation("i62_kl_loss_estimator_ignored", "the KL loss term always k3, whatever kl_loss_estimator says",
             [(P, "old_logprobs if s.use_bias_correction_kl else None,\n                                         "
                  "s.kl_loss_estimator)",
               "old_logprobs if s.use_bias_correction_kl else None,\n                                         \"k3\")")]),
    Mutation("i62_gae_float_mask", "compute_gae reads a 0/1 float mask as it is (a bare torch error)",
             [(P, "    mask = as_bool_mask(mask)\n    zeros = torch.zeros_like(values[:, 0])",
               "    zeros = torch.zeros_like(values[:, 0])")]),
    Mutation("i62_cispo_weight_differentiated", "CISPO's weight not stop-gradient: the clipped ratio's gradient too",
             [(PL, "weight = ratio.clamp(max=clip_max).detach()", "weight = ratio.clamp(max=clip_max)")]),
    Mutation("i62_sapo_temperatures_swapped", "SAPO's positive and negative temperatures swapped",
             [(PL, "torch.full_like(ratio, temperature_pos), torch.full_like(ratio, temperature_neg)",
               "torch.full_like(ratio, temperature_neg), torch.full_like(ratio, temperature_pos)")]),
    Mutation("i62_gmpo_unclipped", "GMPO's token log-ratios never clipped",
             [(PL, "bounded = sign * torch.minimum(sign * log_ratio, sign * clipped)", "bounded = log_ratio")]),
    Mutation("i62_seq_mean_token_sum_is_a_mean", "seq_mean_token_sum divides each response's sum by its length",
             [(P, "        per_sequence = masked_sum(per_token, mask, dim=1)\n    else:",
               "        per_sequence = masked_sum(per_token, mask, dim=1) / mask.sum(dim=1).clamp(min=1)\n    else:")]),
    Mutation("i62_mask_mode_keeps_all", "the mask modes reject nothing: every ratio kept",
             [(PL, "return torch.where(keep, weights, torch.zeros_like(weights)).detach()",
                   "return weights.detach()")]),
    Mutation("i62_sequence_ratio_per_token", "the sequence modes use each token's ratio",
             [(PL, "        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(logprobs)\n",
               "        pass\n")]),
    Mutation("i62_policy_loss_dropped", "policy_loss never reaches the loss: PPO's runs under every name",
             [(RC, "kl_loss_estimator=self.kl_loss_estimator, policy_loss=self.policy_loss,",
               "kl_loss_estimator=self.kl_loss_estimator, policy_loss=\"ppo\",")]),
    Mutation("i62_batch_scale_is_group", "scale_rewards='batch' divides by each group's std",
             [(AD, "centred = centred / (grouped.std() + eps)",
                   "centred = centred / (grouped.std(dim=1, keepdim=True) + eps)")]),
    Mutation("i62_reinforce_gamma_ignored", "REINFORCE++ ignores gamma (always the plain sum)",
             [(E, "reinforce_pp_advantages(scores, kl, mask, s.kl_coef, k=k, gamma=s.gamma)",
               "reinforce_pp_advantages(scores, kl, mask, s.kl_coef, k=k)")]),
    Mutation("i62_group_of_one_centred", "a group of one is centred on itself (advantage 0) instead of passing through",
             [(AD, "centred = scores - torch.where(alone, torch.zeros_like(mean), mean)", "centred = scores - mean")]),
    Mutation("i62_old_aggregation_name_unexplained", "the renamed seq_mean_token_sum_norm refused without its fix",
             [(P, "    if name in RENAMED_LOSS_AGGREGATIONS:\n        raise", "    if False:\n        raise")]),
    Mutation("i62_variant_old_logprobs_recomputed", "a policy loss other than PPO's reads the current log-probs as "
             "the old ones (its ratio always 1)",
             [(P, "variant_policy_loss(logprobs, old_logprobs, advantages=old.advantages,",
               "variant_policy_loss(logprobs, logprobs.detach(), advantages=old.advantages,")]),
    Mutation("i62_normalize_then_sum_ignored", "normalize_then_sum sums the raw rewards (sum_then_normalize)",
             [(W, "            if self.group_size is not None and gather is not None:\n",
               "            if False:\n")]),
    Mutation("i62_normalize_then_sum_in_evaluation", "evaluation's combined score normalised within groups too",
             [(W, "            if self.group_size is not None and gather is not None:\n",
               "            if self.group_size is not None:\n")]),
    Mutation("i62_loss_parameter_unchecked", "a policy loss's parameter set under another loss passes in silence",
             [(CC, "if owner != loss and getattr(config, name) != defaults[name].default:", "if False:")]),
    # -- i61: learning from a cold start (auto, the no-signal watch, evaluation's numbers, a TRL GRPO user) -----------
    Mutation("i61_auto_always_gae", "advantage_estimator='auto' uses GAE whatever the critic explains",
             [(E, "    advantages = torch.where(uses_gae, out[\"advantages\"], "
                  "sequence_to_token_advantages(group, mask))",
               "    advantages = out[\"advantages\"]")]),
    Mutation("i61_auto_threshold_inclusive", "auto trusts a critic whose explained variance is exactly the threshold "
             "(EVPO: EV <= 0 inflates the variance)",
             [(E, "    return ev > threshold, ev", "    return ev >= threshold, ev")]),
    Mutation("i61_auto_nan_row_alone", "with auto, a NaN score leaves its row out but the rest of its group in: the "
             "group baseline is over k - 1 responses",
             [(R, "(not estimator.needs_critic or estimator.compares_groups) and not estimator.by_index",
               "not estimator.needs_critic and not estimator.by_index")]),
    Mutation("i61_auto_k1_accepted", "advantage_estimator='auto' with num_generations=1 is accepted: its group "
             "baseline compares one response with itself",
             [(CC, '    if config.advantage_estimator == "auto" and isinstance(config.num_generations, int) \\\n',
               '    if False and isinstance(config.num_generations, int) \\\n')]),
    Mutation("i61_no_signal_cut_off_unsaid", "the no-signal warning does not say that the answers are cut off at "
             "response_length",
             [("trainer/watch.py", "        if self.can_stop and eos_rate is not None and eos_rate < CUT_OFF:",
               "        if False:")]),
    Mutation("i61_no_signal_said_once", "the no-signal warning is said once, and 7 more empty iterations pass in "
             "silence",
             [("trainer/watch.py", "                 and (iteration - self.since[name] + 1) % REPEAT_AFTER == 0}",
               "                 and False}")]),
    Mutation("i61_unmoved_unsaid", "the closing line of a run whose KL stayed 0 reads like any other",
             [("trainer/progress.py", '    if summary.get("policy_unmoved"):', "    if False:")]),
    Mutation("i61_eval_log_metric_averaged", "a reward function's log_metric at evaluation averages the policy's "
             "and the reference's values",
             [("evaluation/evaluator.py",
               "            parts = replace(trainer.rollout_parts(), gather=None, hooks=logs.hooks(trainer.state))",
               "            parts = replace(trainer.rollout_parts(), gather=None)")]),
    Mutation("i61_card_best_of_flat", "the card says 'at best reward (step 2)' for a reward that never moved",
             [("hub/cards.py",
               "    if reward_key in series and min(series[reward_key][1]) != max(series[reward_key][1]):",
               "    if reward_key in series:")]),
    Mutation("i61_grpo_name_misread", "--use_vllm is pointed at --use_kl_loss, --beta at nothing",
             [("cli/train.py", "        if grpo_hint(key) is not None:", "        if False:")]),
    Mutation("i61_config_refusal_traceback", "PPOConfig's refusal on the command line comes under a traceback",
             [("cli/train.py", "        raise ConfigError(one_line_config_error(err)) from err", "        raise")]),
    # -- i60: a finished run's resume, the lock until the final save, its file, float32 answers, async hangs -----------
    Mutation("i60_finished_resume_trains", "a finished run's resume trains a step past max_steps and saves that",
             [(T, "return finished if finished is not None else super().train(*args, **kwargs)",
               "return super().train(*args, **kwargs)")]),
    Mutation("i60_finished_off_by_one", "a checkpoint at max_steps is not taken for a finished run",
             [(CK, "return (folder, step) if isinstance(step, int) and step >= max_steps else None",
               "return (folder, step) if isinstance(step, int) and step > max_steps else None")]),
    Mutation("i60_final_save_unlocked", "save_model() into output_dir writes while another run holds the folder",
             [(SV, "                stack.enter_context(self._holding_output_dir(every_process=False))\n",
               "                pass\n")]),
    Mutation("i60_cli_lock_ends_with_train", "hf-ppo train releases output_dir before its final save is complete",
             [("cli/train.py", "    with trainer._holding_output_dir():\n",
               "    with open(os.devnull):\n")]),
    Mutation("i60_command_unmasked", "the lock file records --hub_token's value in clear",
             [("trainer/run_lock.py", '"command": masked_command(sys.argv)[:300]', '"command": " ".join(sys.argv)[:300]')]),
    Mutation("i60_secret_equals_form_kept", "--api_key=VALUE is recorded in clear (only the spaced form masked)",
             [("trainer/run_lock.py", "        elif eq and _SECRET_OPTION.match(name):", "        elif False:")]),
    Mutation("i60_fifo_read", "a lock file that is a FIFO is read (hf-ppo train hangs on it)",
             [("trainer/run_lock.py", "    if _kind(path) is not None:\n        return None\n    try:", "    try:")]),
    Mutation("i60_other_host_called_dead", "a lock of another host taken over as 'no longer running', unchecked",
             [("trainer/run_lock.py", "    if previous and _alive(previous) is None:  # the OS lock", "    if False:  # the OS lock")]),
    Mutation("i60_checkpoint_made_in_place", "checkpoint-N is created before its marker: a kill between them blocks "
             "every resume ('hf_ppo did not write it')",
             [(CK, "    _created_with_marker(folder)\n",
               "    os.makedirs(folder)\n    _atomic_write(os.path.join(folder, MARKER_FILE), b'{\"writer\": \"hf_ppo\"}')\n")]),
    Mutation("i60_empty_checkpoint_blocks", "an empty checkpoint-N (a kill before its marker) is taken for another "
             "program's, and every resume stops on it",
             [(CK, "        if not written_by_hf_ppo(folder) and os.listdir(folder):",
               "        if not written_by_hf_ppo(folder):")]),
    Mutation("i60_record_moved_first", "the final save moves the run record in before the weights it describes",
             [(CK, "key=lambda n: n in last)", "key=lambda n: n not in last)")]),
    Mutation("i60_float32_at_float64", "a float32 answer cell read at float64's precision (0.1 scores '0.1' wrong)",
             [("rewards/answers.py", "    return str(single) if float(single) == float(value) else repr(float(value))",
               "    return repr(float(value))")]),
    Mutation("i60_async_exit_kills_loop", "an async reward raising SystemExit ends the loop's thread: training hangs",
             [("rollout/reward_calls.py", "    except (KeyboardInterrupt, SystemExit) as err:\n        return Raised(err)",
               "    except ZeroDivisionError as err:\n        return Raised(err)")]),
    Mutation("i60_blocked_loop_kept", "a loop a blocking call holds serves every later call, which hangs with it",
             [("rollout/reward_calls.py", "    with _loop_lock:\n        if _loop is loop:\n            _loop = None\n", "")]),
    Mutation("i60_hub_token_placeholder", "PPOConfig(**args.to_dict()) pushes with the token '<HUB_TOKEN>'",
             [(C, '        if self.hub_token == "<HUB_TOKEN>":', "        if False:")]),
    Mutation("i60_stale_weights_kept", "a LoRA save over an earlier full-model save leaves model.safetensors beside "
             "the adapter (pushed, and loaded as the model)",
             [(SV, "superseded = () if in_checkpoint else publish.superseded_files(output_dir, self.trained_adapter is "
               "not None)", "superseded = ()")]),
    Mutation("i60_damaged_record_silent", "a corrupt hf_ppo_run.json is ignored without a word",
             [("hub/publish.py", '    warn_user(f"{path} {problem}: it is ignored,', '    (f"{path} {problem}: it is ignored,')]),
    Mutation("i60_log_metric_mixes_in_silence", "log_metric('reward', ...) mixes into the trainer's own reward "
             "without a word", [("rollout/reward_calls.py", "        if trainer_metric(name) and name not in self.said:",
                                 "        if False:")]),
    # -- i63 kinds 1 and 2: the paths this machine never takes, and leftovers on disk ---------------------------------
    Mutation("i63_reused_pid_holds", "a recorded pid now owned by another process is taken for the run",
             [("trainer/run_lock.py", "    return start is None or now is None or now == start", "    return True")]),
    Mutation("i63_no_flock_ignores_record", "without flock a live recorded run is taken over",
             [("trainer/run_lock.py", "if locked is False or (locked is None and previous and _alive(previous) is not "
               "False):", "if locked is False:")]),
    Mutation("i63_refusal_not_broadcast", "the other ranks never learn the main process's refusal",
             [("trainer/run_lock.py", "    refusal = broadcast(refusal)\n", "    broadcast(refusal)\n")]),
    Mutation("i63_release_removes_anothers", "a release removes the lock file another run put in its place",
             [("trainer/run_lock.py", "            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:",
               "            if True:")]),
    Mutation("i63_foreign_staging_deleted", "a .hf_ppo-saving folder hf_ppo did not write is deleted by the save",
             [(CK, "    if os.path.isdir(staging) and not os.path.isfile(os.path.join(staging, _STAGING_MARKER)):",
               "    if False:")]),
    Mutation("i63_foreign_new_folder_deleted", "a checkpoint-N.hf_ppo-new holding a user's files is deleted",
             [(CK, "set(os.listdir(new)) - {MARKER_FILE, MARKER_FILE + \".tmp\"}:", "False:")]),
    # -- i59: every forward counts (the passes no update reads are skipped) ------------------------------------------
    Mutation("i59_skip_with_two_epochs", "the old-log-prob pass is skipped where a rollout feeds several optimizer "
             "steps: every later step's ratio is 1 in silence",
             [(RC, "not estimator.needs_critic and self.optimizer_steps_per_iteration == 1",
               "not estimator.needs_critic")]),
    Mutation("i59_loss_reads_placeholder", "without the old-log-prob pass the loss reads the rollout's placeholder "
             "log-probs as the old ones",
             [(P, "    if s.old_logprobs_from_forward:  # the weights", "    if False:  # the weights")]),
    Mutation("i59_stats_read_placeholders", "a rollout that skipped a pass logs objective/kl and the entropies from "
             "its placeholders",
             [(R, "    for name in skipped_stats(skip_old, settings.skip_reference):\n        del stats[name]\n", "")]),
    Mutation("i59_reference_skipped_with_kl", "the reference pass is skipped at kl_coef > 0: the KL penalty reads 0",
             [(RC, "        return self.kl_coef == 0 and not self.adaptive_kl",
                   "        return not self.adaptive_kl")]),
    Mutation("i59_no_stats_pass", "stats_pass_every is never honoured: the skipped passes' metrics never logged",
             [(T, "        if args.stats_pass_every and self.iteration % args.stats_pass_every == 0:",
               "        if False:")]),
    Mutation("i59_stop_check_every_token", "the kv_cache loop reads the stop flags on the host at every token",
             [(G, "if t == response_length - 1 or ((t + 1) % STOP_CHECK_EVERY == 0 and bool(done.all())):",
               "if t == response_length - 1 or bool(done.all()):")]),
    Mutation("i59_decode_mask_2d", "the decode loops hand transformers a 2-D mask: a padding check on the host per "
             "token", [(G, '    if kind not in ("sdpa", "eager") or _sliding_or_chunked(config):',
                        "    if True:")]),
    Mutation("i59_mask_drops_the_window", "a sliding-window model gets the full 4-D mask: its window ignored",
             [(G, '    if kind not in ("sdpa", "eager") or _sliding_or_chunked(config):',
               '    if kind not in ("sdpa", "eager"):')]),
    Mutation("i59_static_sees_unwritten_slots", "the static engine's 4-D mask shows the cache slots not yet written",
             [(G, "mask = decode_mask(model, attention.bool() & (slots <= length + t))",
               "mask = decode_mask(model, attention.bool())")]),
    Mutation("i59_compile_time_kept", "time/compile never reset: every rollout logs the first compilation again",
             [(G, "seconds, self._compile_seconds = self._compile_seconds, 0.0", "seconds = self._compile_seconds")]),
    Mutation("i59_bucket_forgotten", "every rollout's first decode step counted as a compilation",
             [(G, "            self._buckets.add((rows, length))\n", "")]),
    # -- issue 58: records reach the last rooms (SamplingSettings whole, min_p) ----------------------------------------
    Mutation("i58_min_p_ignored", "min_p declared, checked and recorded, but the sampler draws from every token",
             [(G, "    if s.min_p > 0.0:\n", "    if False:\n")]),
    Mutation("i58_min_p_unchecked", "a min_p outside [0, 1] is accepted (1.5 keeps no token but the top one)",
             [("trainer/config_checks.py", '("min_p", False, lambda v: 0 <= v <= 1,',
               '("min_p", False, lambda v: True,')]),
    Mutation("i58_sampling_field_dropped", "a sampling setting left out of the fields the record, the card, hf-ppo "
             "evaluate and PPOConfig.sampling_settings carry: the engine samples at its default",
             [(G, 'f.name not in ("forward_batch_size",', 'f.name not in ("min_p", "forward_batch_size",')]),
    Mutation("i60_late_setting_taken", "trainer.args.temperature = 0.3 on a built trainer is taken: the engine samples "
             "at the old value while the loss and the record use the new one",
             [("trainer/after_build.py", "    if name in settled_fields(type(config)) and not same_value(old, value):",
               "    if False:")]),
    Mutation("i60_replaced_args_taken", "trainer.args = dataclasses.replace(trainer.args, temperature=0.3) is taken",
             [("trainer/after_build.py", "            if changed:\n                first = changed[0]",
               "            if False:\n                first = changed[0]")]),
    Mutation("i60_never_held", "the trainer never holds its config: every late assignment is taken",
             [("trainer/ppo_trainer.py", "        after_build.hold(args)  # built", "        pass  # built")]),
    Mutation("i60_live_unchecked", "a live setting assigned out of its range is taken",
             [("trainer/after_build.py", "        if errors:\n            object.__setattr__(config, name, old)",
               "        if False:\n            object.__setattr__(config, name, old)")]),
    # -- issue 62: groups by index in the rollout (unequal groups, groups of one) -----------------------------------
    Mutation("i62b_rollout_groups_consecutive", "the rollout passes no index: a NaN/inf row's neighbours are "
             "baselined with its placeholder 0",
             [(R, "index=group_index(len(scores), k, unscored if left_out else None))", "index=None)")]),
    Mutation("i62b_index_not_forwarded", "the advantage step drops the index: k consecutive rows whatever it says",
             [(R, "extra = {\"index\": index} if index is not None and ESTIMATORS[s.advantage_estimator].by_index "
                  "else {}", "extra = {}")]),
    Mutation("i62b_unscored_takes_whole_group", "under grpo a NaN/inf row still takes its whole group out",
             [(R, "estimator.compares_groups) and not estimator.by_index and bad.any():",
               "estimator.compares_groups) and bad.any():")]),
    Mutation("i62b_refill_replaces_partial_groups", "the refill replaces a group that still has rows to train on",
             [(RF, "    return dropped.reshape(-1, k).all(1)", "    return dropped.reshape(-1, k).any(1)")]),
]

THREADS_PLUGIN = '''"""Loaded by tests/mutation_check.py with -p: one torch thread per run (two runs share the cores)."""
import torch


def pytest_sessionstart(session):
    torch.set_num_threads(1)
'''


def make_copy(dest: Path) -> None:
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif source.exists():
            shutil.copy2(source, dest / name)
    (dest / "_mutation_threads.py").write_text(THREADS_PLUGIN)


def check_snippets(mutation: Mutation) -> str | None:
    """None when every edit's snippet occurs exactly once in today's code, else why it is stale."""
    for file, old, _ in mutation.edits:
        count = (ROOT / "hf_ppo" / file).read_text().count(old)
        if count != 1:
            return f"snippet found {count} times in hf_ppo/{file}: {old.strip()[:60]!r}"
    return None


def run_subset(copy: Path, timeout: int, tests: list[str] = SUBSET) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "_mutation_threads",
               "-W", "ignore", *tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, output = -1, "TIMEOUT"
    return code, output, time.perf_counter() - start


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0].replace("tests/", "")
    return "TIMEOUT" if output == "TIMEOUT" else "(no test named: see the run's output)"


def run_mutation(mutation: Mutation, copy: Path, timeout: int, tests: list[str] = SUBSET) -> tuple[str, str, float]:
    originals = {}
    try:
        for file, old, new in mutation.edits:
            path = copy / "hf_ppo" / file
            text = originals.setdefault(path, path.read_text())
            current = path.read_text()
            path.write_text(current.replace(old, new, 1))
        code, output, seconds = run_subset(copy, timeout, tests)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    return ("caught" if code != 0 else "MISSED"), (first_failure(output) if code != 0 else ""), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this (comma-separated: any)")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run in parallel (each in its own copy)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run of the subset")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--tests", nargs="+", default=SUBSET,
                        help="run these tests instead of SUBSET (quicker; caught by them is caught by SUBSET)")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if any(k in m.name for k in args.k.split(","))]
    if args.list:
        for m in mutations:
            print(f"{m.name:28s} {', '.join(sorted({f for f, _, _ in m.edits})):24s} {m.bug}")
        return 0

    stale = {m.name: why for m in mutations if (why := check_snippets(m))}
    import importlib.util

    other_leg = set() if importlib.util.find_spec("vllm") is not None else {
        m.name for m in mutations if m.tests is VLLM_SUBSET}  # run with .venv-vllm/bin/python
    runnable = [m for m in mutations if m.name not in stale and m.name not in other_leg]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_ppo_mutants_") as tmp:
        copies = [Path(tmp) / f"copy{i}" for i in range(max(1, args.jobs))]
        for copy in copies:
            copy.mkdir()
            make_copy(copy)
        baseline = [t for m in runnable for t in (m.tests or args.tests)]
        code, output, seconds = run_subset(copies[0], args.timeout, list(dict.fromkeys(baseline)) or args.tests)
        if code != 0:
            print(output[-4000:])
            print(f"The unmutated subset fails ({seconds:.0f} s): fix the suite before checking mutations.")
            return 2
        print(f"baseline: the unmutated subset passes in {seconds:.0f} s; running {len(runnable)} mutations "
              f"with {len(copies)} worker(s)", flush=True)
        free = list(copies)

        def work(mutation):
            copy = free.pop()
            try:
                result = run_mutation(mutation, copy, args.timeout, mutation.tests or args.tests)
            finally:
                free.append(copy)
            print(f"  {mutation.name}: {result[0]} ({result[2]:.0f} s)", flush=True)
            return result

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            results = dict(zip([m.name for m in runnable], pool.map(work, runnable)))

    print(f"\n{'mutation':28s} {'file(s)':24s} {'result':7s} {'secs':>5s}  caught by / bug")
    for m in mutations:
        files = ", ".join(sorted({f for f, _, _ in m.edits}))
        if m.name in stale:
            print(f"{m.name:28s} {files:24s} {'STALE':7s} {'':>5s}  {stale[m.name]}")
            continue
        if m.name in other_leg:
            print(f"{m.name:28s} {files:24s} {'VLLM-LEG':7s} {'':>5s}  (vLLM does not import here) {m.bug}")
            continue
        result, test, seconds = results[m.name]
        print(f"{m.name:28s} {files:24s} {result:7s} {seconds:5.0f}  {test or m.bug}")
    caught = sum(r[0] == "caught" for r in results.values())
    counted = len(mutations) - len(other_leg)
    print(f"\nscore: {caught}/{counted} caught ({100 * caught / max(1, counted):.0f}%), {len(stale)} stale, "
          f"{len(other_leg)} left to the vLLM leg, {time.perf_counter() - start:.0f} s")
    return 0 if caught == counted else 1


if __name__ == "__main__":
    sys.exit(main())
