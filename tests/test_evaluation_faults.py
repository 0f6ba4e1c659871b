"""Issue 36, evaluation: NaN/inf scores at evaluation never read as a loss; `hf-ppo evaluate` names missing paths."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.command import main
from hf_ppo.evaluation.evaluator import evaluation_metrics, win_rate
from hf_ppo.evaluation.report import REPORT_FILE, metrics_markdown
from hf_ppo.rollout.reward_calls import RewardFunctionError

PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 2})


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


class Armed:
    """A reward / judge that scores like `count_e` until armed (after the construction probe), then NaN for the
    prompts that contain `nan_for` ("" : every prompt)."""

    def __init__(self, name: str, nan_for: str):
        self.__name__, self.nan_for, self.armed = name, nan_for, False

    def __call__(self, prompts, completions):
        return [math.nan if self.armed and self.nan_for in p else float(c.count("e"))
                for p, c in zip(prompts, completions)]


def trainer_with(tmp_path, tiny_models, tokenizer, *, reward=count_e, judge=None, **overrides):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    num_ppo_epochs=1, max_steps=1, response_length=4, report_to=[], save_strategy="no",
                    num_sample_generations=0, disable_tqdm=True, seed=0)
    defaults.update(overrides)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**defaults), processing_class=tokenizer,
                           reward_model=reward, eval_reward_model=judge, train_dataset=PROMPTS, eval_dataset=PROMPTS)
    for scorer in (reward, judge):
        if hasattr(scorer, "armed"):  # after the construction probe
            scorer.armed = True
    return trainer


def report(trainer) -> str:
    return open(os.path.join(trainer.args.output_dir, REPORT_FILE), encoding="utf-8").read()


# ---- 1. NaN at evaluation is named, counted and left out: never a loss -------------------------------------------

def test_win_rate_refuses_nonfinite_scores_rather_than_counting_them_as_losses():
    with pytest.raises(ValueError, match="NaN/inf scores at 2 of 3 positions"):
        win_rate(torch.tensor([1.0, math.nan, 2.0]), torch.tensor([0.0, 0.0, math.inf]))


def test_evaluation_metrics_leave_out_nonfinite_pairs_and_count_them():
    tensors = {"kl": torch.zeros(4), "policy|length": torch.ones(4), "reference|length": torch.ones(4),
               "policy|stopped": torch.ones(4), "reference|stopped": torch.ones(4),
               "policy|judge/j": torch.tensor([math.nan, 2.0, 2.0, math.nan]),
               "reference|judge/j": torch.tensor([5.0, 1.0, 1.0, 5.0]),
               "policy|reward/r": torch.full((4,), math.nan), "reference|reward/r": torch.zeros(4)}
    metrics = evaluation_metrics(tensors)
    # The two finite pairs are both wins; the NaN pairs are not losses.
    assert metrics["judge/j/win_rate"] == 1.0 and metrics["judge/j/nonfinite"] == 2.0
    assert metrics["judge/j/policy"] == 2.0 and metrics["judge/j/reference"] == 1.0
    for key in ("win_rate", "win_rate_low", "win_rate_high", "policy", "reference"):
        assert math.isnan(metrics[f"reward/r/{key}"]), key
    assert metrics["reward/r/nonfinite"] == 4.0
    table = metrics_markdown(metrics)
    assert "| reward/r | no finite scores | no finite scores | no finite scores (4 prompts NaN/inf) |" in table
    assert "(2 prompts left out: NaN/inf)" in table


def test_a_judge_returning_nan_for_some_prompts_is_named_counted_and_left_out(tiny_models, tokenizer, tmp_path):
    judge = Armed("flaky_judge", nan_for="movie")
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, judge=judge)
    with pytest.warns(UserWarning, match=r"judge 'flaky_judge' returned NaN/inf for 2 eval prompts .*the prompt "
                                         r"'[^']*the movie was'.*left out.*eval_judge/flaky_judge/nonfinite"):
        metrics = trainer.evaluate()
    assert metrics["eval_judge/flaky_judge/nonfinite"] == 2.0
    assert metrics["eval_reward/count_e/nonfinite"] == 0.0
    for key in ("win_rate", "win_rate_low", "win_rate_high", "policy", "reference"):
        assert math.isfinite(metrics[f"eval_judge/flaky_judge/{key}"]), key
    assert "| judge/flaky_judge |" in report(trainer) and "(2 prompts left out: NaN/inf)" in report(trainer)


def test_a_judge_returning_nan_for_every_prompt_gives_nan_not_a_loss(tiny_models, tokenizer, tmp_path):
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, judge=Armed("broken_judge", nan_for=""))
    with pytest.warns(UserWarning, match=r"judge 'broken_judge' returned NaN/inf for 8 eval prompts.*"
                                         r"No prompt has finite scores.*not a loss"):
        metrics = trainer.evaluate()
    for key in ("win_rate", "win_rate_low", "win_rate_high", "policy", "reference"):
        assert math.isnan(metrics[f"eval_judge/broken_judge/{key}"]), key  # never 0.0
    assert metrics["eval_judge/broken_judge/nonfinite"] == 8.0
    assert math.isfinite(metrics["eval_reward/count_e/win_rate"])  # the healthy reward still reports
    text = report(trainer)
    assert "| judge/broken_judge | no finite scores |" in text
    assert "| judge/broken_judge | nan" not in text and "0.000 [0.000, 0.000]" not in text


def test_a_training_reward_returning_nan_at_evaluation_is_no_loss(tiny_models, tokenizer, tmp_path):
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, reward=Armed("nan_reward", nan_for=""))
    with pytest.warns(UserWarning, match=r"reward 'nan_reward' returned NaN/inf for 8 eval prompts"):
        metrics = trainer.evaluate()
    assert math.isnan(metrics["eval_reward/nan_reward/win_rate"]) and math.isnan(metrics["eval_loss"])
    assert metrics["eval_reward/nan_reward/nonfinite"] == 8.0
    assert "| reward/nan_reward | no finite scores |" in report(trainer)


class Raising:
    """A reward / judge that scores 0.0 until armed, then raises a KeyError (a bug of its own)."""

    def __init__(self, name: str):
        self.__name__, self.armed = name, False

    def __call__(self, prompts, completions):
        if self.armed:
            raise KeyError("label")
        return [0.0] * len(prompts)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
@pytest.mark.parametrize("role", ["reward", "judge"])
def test_a_reward_that_raises_at_evaluation_is_named_with_a_prompt(role, tiny_models, tokenizer, tmp_path):
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, **{role: Raising("buggy_scorer")})
    # Named by the reward call (issue 37: the function and its first failing row), its own error chained.
    with pytest.raises(RewardFunctionError, match=r"'buggy_scorer' raised KeyError: 'label'") as raised:
        trainer.evaluate()
    assert isinstance(raised.value.__cause__, KeyError)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "'buggy_scorer'" in notes and "starting with 'the movie was'" in notes
    assert ("eval_reward_model" in notes) == (role == "judge")


# ---- 9. `hf-ppo evaluate` names a path that does not exist ---------------------------------------------------------

@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was"]))
    return str(path)


def evaluate_argv(tiny_models, prompts_file, **changes) -> list[str]:
    given = {"policy": tiny_models["policy"], "reference": tiny_models["policy"], "reward_model": tiny_models["reward"],
             "dataset": prompts_file, "response_length": "2", **changes}
    return ["evaluate"] + [x for flag, value in given.items() if value is not None for x in (f"--{flag}", value)]


def test_a_policy_folder_that_does_not_exist_is_named_not_called_a_full_model(tiny_models, prompts_file, tmp_path):
    missing = str(tmp_path / "outputs" / "ppo-typo")
    with pytest.raises(SystemExit, match=r"--policy '.*ppo-typo' does not exist: no such folder") as stop:
        main(evaluate_argv(tiny_models, prompts_file, policy=missing, reference=None))
    assert "full model" not in str(stop.value)


@pytest.mark.parametrize("flag, name", [("reference", "ref-typo"), ("reward_model", "rm-typo"),
                                        ("judge", "judge-typo"), ("dataset", "prompts-typo.jsonl")])
def test_every_path_argument_that_does_not_exist_is_named(flag, name, tiny_models, prompts_file, tmp_path):
    what = "file" if flag == "dataset" else "folder"
    with pytest.raises(SystemExit, match=rf"--{flag} '.*{name}' does not exist: no such {what}"):
        main(evaluate_argv(tiny_models, prompts_file, **{flag: str(tmp_path / name)}))


def test_a_relative_missing_path_names_the_directory_it_was_read_from(tiny_models, prompts_file, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=rf"--policy 'outputs/demo/ppo' does not exist: no such folder \(relative to "
                                         rf"{tmp_path}\)"):
        main(evaluate_argv(tiny_models, prompts_file, policy="outputs/demo/ppo", reference=None))


def test_a_policy_given_as_a_file_says_to_pass_its_folder(tiny_models, prompts_file):
    weights = os.path.join(tiny_models["policy"], "config.json")
    with pytest.raises(SystemExit, match=r"--policy '.*config.json' is a file.*pass the folder"):
        main(evaluate_argv(tiny_models, prompts_file, policy=weights, reference=None))


def test_a_hub_id_that_is_not_on_the_hub_says_so(tiny_models, prompts_file, local_hub):
    with pytest.raises(SystemExit, match=r"--policy 'hf-ppo-test/no-such-model' is not a local folder, and the Hub "
                                         r"has no model of that id") as stop:
        main(evaluate_argv(tiny_models, prompts_file, policy="hf-ppo-test/no-such-model", reference=None))
    assert "full model" not in str(stop.value)


@pytest.mark.parametrize("flag", ["num_prompts", "batch_size"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, value, tiny_models, prompts_file):
    with pytest.raises(SystemExit, match=rf"--{flag} {value}: give an integer >= 1"):
        main(evaluate_argv(tiny_models, prompts_file) + [f"--{flag}", value])


def test_an_empty_prompts_file_is_named(tiny_models, tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=r"--dataset '.*prompts.jsonl' is an empty file: it holds no prompts"):
        main(evaluate_argv(tiny_models, str(empty)))


def test_a_run_folder_that_holds_no_model_points_at_the_folders_that_do(tiny_models, prompts_file, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--policy '.*run' holds no model.*\['checkpoint-2'\]; pass one of them"):
        main(evaluate_argv(tiny_models, prompts_file, policy=str(run), reference=None))
