"""bench/learning.py, the learning table: its plan, its table and RESULTS.md block, and one quick run end to end
through the one evaluator every configuration (and the peer) is scored by. The peer's own run needs trl 1.12 in
bench/.venv-trl and is not run here."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def learning():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("learning")
    finally:
        sys.path.remove(str(BENCH))


def fake_run(task, config, seed, reward):
    return {"task": task, "config": config, "seed": seed, "iterations": 30, "responses": 64, "samples": 1920,
            "cpu_seconds": 10.0 + seed, "train_kl": 0.5, "held_out_reward": reward, "reference_reward": -0.1,
            "win_rate": 0.6, "held_out_kl": 1.0}


def test_dry_run_plans_every_configuration_and_the_peer_on_both_tasks(learning, capsys):
    assert learning.main(["--dry-run"]) == []
    out = capsys.readouterr().out
    assert "60 runs of 30 iterations x 64 responses (1920 samples each); 256 held-out prompts" in out
    assert out.count("trl 1.12 PPOTrainer") == 10 and out.count("grpo k=4") == 10


def test_table_gives_mean_and_sd_over_seeds_and_the_reference_row(learning):
    runs = [fake_run("demo", "grpo k=4", s, r) for s, r in enumerate([1.0, 2.0, 3.0])]
    md = learning.table(runs)
    assert "| demo | grpo k=4 | +2.00 +/- 1.00 |  | +0.60 +/- 0.00 | +1.00 +/- 0.00 | 11 | 3 |" in md
    assert "| demo | (the SFT reference, same evaluations) | -0.10 +/- 0.00 |" in md
    assert "| rule |" not in md
    # Beside the peer: the difference of the means +/- twice its Welch standard error.
    runs += [fake_run("demo", learning.PEER, s, r) for s, r in enumerate([0.0, 0.5, 1.0])]
    md = learning.table(runs)
    assert "| demo | grpo k=4 | +2.00 +/- 1.00 | +1.50 +/- 1.29 |" in md  # 2 * sqrt(1/3 + 0.25/3) = 1.29
    assert "| demo | trl 1.12 PPOTrainer | +0.50 +/- 0.50 |  |" in md


def test_results_block_is_appended_once_then_replaced(learning, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nthe timing table\n")
    learning.write_results([fake_run("demo", "rloo k=4", 0, 1.0)], "python bench/learning.py", results)
    learning.write_results([fake_run("demo", "rloo k=4", 0, 2.0)], "python bench/learning.py", results)
    text = results.read_text()
    assert text.startswith("# Results\n\nthe timing table\n") and text.count(learning.BEGIN) == 1
    assert "| demo | rloo k=4 | +2.00 +/- 0.00 |" in text and "| demo | rloo k=4 | +1.00" not in text
    # A shorter budget (--iterations 10) gets a block of its own beside the table's.
    early = dict(fake_run("demo", "rloo k=4", 0, 3.0), iterations=10, samples=640)
    learning.write_results([early], "python bench/learning.py --iterations 10", results)
    text = results.read_text()
    assert text.count(learning.BEGIN) == 1 and "| demo | rloo k=4 | +2.00 +/- 0.00 |" in text
    begin, end = learning.marks(10)
    assert begin != learning.BEGIN and text.count(begin) == 1
    assert "| demo | rloo k=4 | +3.00" in text[text.index(begin):text.index(end)]


def test_a_shorter_budget_keeps_its_results_apart(learning):
    assert learning.sizes(False) == (30, 64, 256) and learning.sizes(False, 10) == (10, 64, 256)
    table_path = learning.result_path("rule", "grpo k=4", 3, False)
    assert learning.result_path("rule", "grpo k=4", 3, False, 30) == table_path
    assert learning.result_path("rule", "grpo k=4", 3, False, 10).parts[-4] == "learning-it10"


@pytest.mark.slow
def test_quick_run_trains_saves_and_is_scored_by_the_evaluator(learning, tmp_path, monkeypatch):
    monkeypatch.setattr(learning, "DEMO_CACHE", tmp_path / "cache")
    monkeypatch.setattr(learning, "OUT", tmp_path / "out")
    result = learning.one("demo", "default (shared head)", 0, quick=True)
    assert result["samples"] == 32 and result["cpu_seconds"] > 0
    # The evaluator loaded the trained adapter, not the SFT base: the policy's samples differ from the reference's
    # in log-probability (a base-only load would give a KL of exactly 0).
    assert result["held_out_kl"] != 0.0 and 0.0 <= result["win_rate"] <= 1.0
    json.dumps(result)  # what launch() saves per run
    # Another configuration at the same seed is compared against the very same reference samples.
    other = learning.one("demo", "rloo k=4", 0, quick=True)
    assert other["reference_reward"] == result["reference_reward"]
    assert other["held_out_reward"] != result["held_out_reward"]
