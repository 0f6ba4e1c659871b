"""bench/crossover.py, the crossover table of issue 50: its word-problem tasks (bench/learning.py's "words1" and
"words2"), its plan and its table. The runs themselves take minutes each and are not run here."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("learning"), importlib.import_module("crossover")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("steps", [1, 2])
def test_word_problems_are_right_distinct_and_held_out_apart(bench, steps):
    learning, _ = bench
    train, held_out = learning.word_problems(steps)
    assert len(train) == 400 and len(held_out) == 64
    questions = [q for q, _ in train + held_out]
    assert len(set(questions)) == len(questions)  # no held-out problem is trained on
    for question, answer in train + held_out:
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        assert len(numbers) == steps + 1
        expected = numbers[0] + numbers[1] - (numbers[2] if steps == 2 else 0)
        assert answer == expected and answer >= 1
        assert ("gives" in question) == (steps == 2)


def test_word_tasks_run_smollm2_with_the_final_number_reward_on_the_answer_column(bench):
    learning, _ = bench
    rows = learning.rows("words2", "held_out", 32)
    assert len(rows["prompt"]) == len(rows["answer"]) == 32
    assert rows["prompt"] == [q for q, _ in learning.word_problems(2)[1][:32]]
    assert learning.reward_of("words1", None) is learning.arithmetic_reward
    assert learning.reward_of("arithmetic", None) is learning.arithmetic_reward
    assert learning.reward_of("rule", None) is learning.rule_reward
    chat = [[{"role": "assistant", "content": "Mia has 7 + 5 = 12 pens."}]]
    assert learning.arithmetic_reward(chat, answer=[rows["answer"][0]]) == [float(rows["answer"][0] == "12")]
    spec = learning.TASKS["words2"]
    assert spec.chat and spec.quantization == "none" and spec.settings["response_length"] == 32
    assert learning.sizes(False, task="words1") == (6, 16, 32)


def test_the_plan_runs_each_task_seed_major_and_resolves_the_relative_settings(bench, capsys):
    learning, crossover = bench
    assert crossover.main(["--dry-run"]) == []
    out = capsys.readouterr().out
    assert "[crossover] 24 runs, one at a time:" in out
    lines = [line.split() for line in out.splitlines()[1:]]
    assert [line[0] for line in lines] == ["words1"] * 12 + ["words2"] * 12
    assert [re.search(r" seed (\d):", line).group(1) for line in out.splitlines()[1:13]] == list("000011112222")
    plain = learning.config_overrides("words1", "shared head, no whitening, critic lr 10x")
    assert plain == {"whiten_advantages": False, "critic_learning_rate": 2e-3}  # 10x the task's learning rate


def fake(task, config, seed, held_out, scores):
    return {"task": task, "config": config, "seed": seed, "iterations": len(scores), "held_out_reward": held_out,
            "reference_reward": 0.05, "train_scores": scores, "held_out_kl": 2.0, "cpu_seconds": 100.0}


def test_the_table_gives_mean_and_se_the_curve_and_the_difference_from_grpo(bench):
    _, crossover = bench
    runs = [fake("words2", "grpo k=4", 0, 0.10, [0.0, 0.1, 0.1, 0.2]),
            fake("words2", "grpo k=4", 1, 0.20, [0.1, 0.1, 0.2, 0.3]),
            fake("words2", "default (shared head)", 0, 0.0, [0.0, 0.0, 0.1, 0.0]),
            fake("words2", "default (shared head)", 1, 0.10, [0.0, 0.1, 0.0, 0.1])]
    md = crossover.table(runs)
    # grpo: held-out 15.0 +/- 5.0 (sd 0.0707 / sqrt 2); the first 2 iterations 5.0 and 10.0 -> 7.5 +/- 2.5; at half
    # the budget (iterations 1-2) the same; at the end (3-4) 15.0 and 25.0 -> 20.0 +/- 5.0; curve 5 10 15 25.
    assert ("| words2 (SFT 5.0%) | grpo k=4 | 15.0 +/- 5.0 |  | 7.5 +/- 2.5 | 7.5 +/- 2.5 | 20.0 +/- 5.0 | 5 10 15 25 | "
            "2.00 +/- 0.00 | 100 | 2 |") in md
    # The head against grpo: -10.0 points +/- 2 x sqrt(0.005/2 + 0.005/2) = 14.1.
    assert "| words2 (SFT 5.0%) | default (shared head) | 5.0 +/- 5.0 | -10.0 +/- 14.1 |" in md
    assert "words1" not in md


def test_the_start_is_the_sft_accuracy_of_every_seed_the_task_ran(bench):
    """The reference's samples are the same for every configuration at a seed: the start is one value per seed,
    so a configuration that ran fewer seeds is shown against the same start as the others."""
    _, crossover = bench
    runs = [dict(fake("words1", "grpo k=4", s, 0.3, [0.2, 0.2]), reference_reward=ref)
            for s, ref in ((0, 0.10), (1, 0.20))]
    runs.append(dict(fake("words1", "default (shared head)", 0, 0.4, [0.2, 0.3]), reference_reward=0.10))
    md = crossover.table(runs)
    assert "| words1 (SFT 15.0%) | grpo k=4 |" in md and "| words1 (SFT 15.0%) | default (shared head) |" in md


def test_auto_is_a_method_choice_on_the_arithmetic_task_at_a_chosen_budget(bench, capsys, monkeypatch, tmp_path):
    """Issue 61: `auto k=4` (advantage_estimator='auto', equal samples with grpo k=4) in the crossover plan, the
    arithmetic task when named, and `--iterations` handed to every run (96 or 192 samples)."""
    learning, crossover = bench
    assert learning.config_overrides("arithmetic", "auto k=4") == {"advantage_estimator": "auto", "num_generations": 4}
    crossover.main(["--dry-run", "--tasks", "arithmetic", "--configs", "auto k=4", "--seeds", "0", "--iterations", "1"])
    assert "arithmetic auto k=4" in " ".join(capsys.readouterr().out.split())
    launched = []
    monkeypatch.setattr(learning, "smollm2", lambda: "unused")
    monkeypatch.setattr(learning, "launch", lambda *a: launched.append(a) or fake(a[0], a[1], a[2], 0.1, [0.0, 0.1]))
    monkeypatch.setattr(learning, "OUT", tmp_path)
    crossover.main(["--tasks", "arithmetic", "--configs", "auto k=4", "grpo k=4", "--seeds", "0", "--iterations", "12"])
    assert [a[:3] for a in launched] == [("arithmetic", "auto k=4", 0), ("arithmetic", "grpo k=4", 0)]
    assert all(a[-1] == 12 for a in launched)
    assert "| arithmetic (SFT 5.0%) | auto k=4 |" in (tmp_path / "crossover-it12.md").read_text()
    # A one-iteration dry run (`--iterations 1`) has a table too (its half budget is its one iteration).
    assert "| words1 (SFT 5.0%) | auto k=4 | 10.0 +/- 0.0 |" in crossover.table([fake("words1", "auto k=4", 0, 0.1,
                                                                                       [0.125])])
