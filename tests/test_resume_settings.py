"""The resume comparison covers every PPOConfig field that changes what a run computes.

The fields come from the dataclass itself (PPOConfig's fields minus TrainingArguments'), so a new field is compared
on resume unless it is added, with its reason, to the reviewed list below. Each field is changed alone on a copy of
the settings and `checkpoint.compare_settings` must name it (or, for the reviewed list, must not).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from transformers import TrainingArguments

from hf_ppo import PPOConfig
from hf_ppo.trainer.checkpoint import compare_settings, default_settings, settings

# Reviewed: PPOConfig fields a resume may change, each with why it does not change what training computes.
MAY_CHANGE_ON_RESUME = {
    "model_init_kwargs": "loading kwargs; may hold a Hub token, so never written to the checkpoint",
    "ref_model_init_kwargs": "loading kwargs; may hold a Hub token, so never written to the checkpoint",
    "reward_model_init_kwargs": "loading kwargs; may hold a Hub token, so never written to the checkpoint",
    "num_sample_generations": "how many sample completions are logged; no effect on training",
    "num_eval_samples": "how many responses evaluation samples per prompt; no effect on training",
    "push_merged_model": "what is pushed to the Hub after training",
    "critic_hub_model_id": "where push_to_hub pushes the critic after training",
    "max_consecutive_nonfinite": "when the guard gives up, not what a good step computes",
    "watch_collapse": "the collapse watch reads the logs; it computes nothing training uses",
    "stop_on_collapse": "when the watch stops the run, not what a step computes",
    "collapse_kl_threshold": "when the watch warns, not what a step computes",
    "allow_config_change_on_resume": "the switch of this very comparison",
    "total_episodes": "TRL's run length (sets max_steps): a resume may run longer",
    "num_total_batches": "TRL's run length (sets max_steps): a resume may run longer",
    "dataset_num_proc": "tokenization workers; the same tokens either way",
    "ds3_gather_for_generation": "TRL's ZeRO-3 option, ignored by hf_ppo",
    "exp_name": "TRL's experiment name (run_name): logging only",
    "print_metrics": "console output only",
}
# TrainingArguments fields that fix the batch geometry and the prompt order: compared as well.
GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
PPO_FIELDS = sorted({f.name for f in dataclasses.fields(PPOConfig)}
                    - {f.name for f in dataclasses.fields(TrainingArguments)})


class Changed:
    """A value no field holds; `settings` stores it as its str()."""

    def __str__(self):
        return "<changed on resume>"


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return PPOConfig(output_dir=str(tmp_path_factory.mktemp("resume_settings")), report_to=[])


def changed_names(args, name) -> set[str]:
    other = copy.copy(args)
    object.__setattr__(other, name, Changed())
    return set(compare_settings(settings(args), settings(other)))


def test_the_reviewed_list_names_only_real_fields():
    assert set(MAY_CHANGE_ON_RESUME) <= set(PPO_FIELDS), set(MAY_CHANGE_ON_RESUME) - set(PPO_FIELDS)
    assert all(reason.strip() for reason in MAY_CHANGE_ON_RESUME.values())


@pytest.mark.parametrize("name", [n for n in PPO_FIELDS if n not in MAY_CHANGE_ON_RESUME] + list(GEOMETRY))
def test_every_field_that_changes_the_run_is_compared_on_resume(args, name):
    assert changed_names(args, name) == {name}, (
        f"PPOConfig.{name} is not compared on resume: compare it (hf_ppo/trainer/checkpoint.py), or, if changing it on resume "
        "cannot change what training computes, add it with its reason to MAY_CHANGE_ON_RESUME")


@pytest.mark.parametrize("name", sorted(MAY_CHANGE_ON_RESUME))
def test_fields_that_may_change_are_not_compared(args, name):
    assert changed_names(args, name) == set(), f"{name} is compared on resume but listed as free to change"


@pytest.mark.parametrize("name", [n for n in PPO_FIELDS if n not in MAY_CHANGE_ON_RESUME])
def test_a_checkpoint_from_before_a_field_existed_resumes_at_its_default(args, name):
    """A checkpoint written by an hf_ppo without `name` ran as its default does: resuming with the default is no
    change (upgrading hf_ppo mid-run keeps the run); any other value is named."""
    older = {k: v for k, v in settings(args).items() if k != name}
    assert compare_settings(older, settings(args), default_settings(args)) == {}
    other = copy.copy(args)
    object.__setattr__(other, name, Changed())
    changed = compare_settings(older, settings(other), default_settings(args))
    assert set(changed) == {name} and "(not recorded)" in changed[name]
