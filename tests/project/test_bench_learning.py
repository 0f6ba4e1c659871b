"""bench/learning.py, the learning table: its plan, its table and RESULTS.md block, and one quick run end to end
through the one evaluator every configuration (and the peer) is scored by. The peer's own run needs trl 1.12 in
bench/.venv-trl and is not run here."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


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
    assert "[learning] 60 runs:" in out
    assert "demo: 30 iterations x 64 responses (1920 samples each); 256 held-out prompts" in out
    assert out.count("trl 1.12 PPOTrainer") == 10 and out.count("grpo k=4") == 10


def test_the_second_table_plans_the_critic_configurations_on_both_new_tasks(learning, capsys):
    """`--tasks long arithmetic` (issue 39): six configurations, 5 seeds on the long task and 3 on the real model,
    and the VAPO recipe's relative settings resolved per task (10x the task's learning rate; a one-iteration
    warm-up: epochs x minibatches x critic updates)."""
    assert learning.main(["--dry-run", "--tasks", "long", "arithmetic"]) == []
    out = capsys.readouterr().out
    assert "[learning] 48 runs:" in out
    assert "long: 30 iterations x 64 responses (1920 samples each); 256 held-out prompts" in out
    assert "arithmetic: 12 iterations x 16 responses (192 samples each); 80 held-out prompts" in out
    assert out.count(learning.VAPO) == 8 and out.count("trl 1.12 PPOTrainer") == 8
    long, arithmetic = (learning.config_overrides(t, learning.VAPO) for t in ("long", "arithmetic"))
    assert long["critic_learning_rate"] == 10 * learning.TASKS["long"].settings["learning_rate"]
    assert long["critic_warmup_steps"] == 4 * 2 * 2 and arithmetic["critic_warmup_steps"] == 2 * 2 * 2
    assert long["lam_length_alpha"] == 0.5 and long["lam_critic"] == 1.0 and long["critic"] == "separate"
    assert learning.config_overrides("long", learning.PEER) is None
    # Every response of the long task is 48 tokens: no stop token, so no EOS penalty either.
    assert learning.TASKS["long"].settings["stop_token"] is None
    assert learning.TASKS["long"].settings["response_length"] == 48


def test_the_loss_family_rows_run_when_named_on_the_arithmetic_task(learning, capsys):
    """Issue 62: a CISPO row and a k3+ KL-loss row beside grpo k=4, 3 seeds, each reaching PPOConfig as named."""
    assert learning.main(["--dry-run", "--tasks", "arithmetic", "--configs", "grpo k=4", "grpo k=4, cispo",
                          "grpo k=4, k3+ KL loss"]) == []
    out = capsys.readouterr().out
    assert "[learning] 9 runs:" in out
    assert learning.config_overrides("arithmetic", "grpo k=4, cispo")["policy_loss"] == "cispo"
    assert learning.config_overrides("arithmetic", "grpo k=4, k3+ KL loss")["kl_loss_estimator"] == "k3+"
    from hf_ppo import PPOConfig
    for name in ("grpo k=4, cispo", "grpo k=4, k3+ KL loss"):
        args = PPOConfig(output_dir="unused", report_to=[], **learning.TASKS["arithmetic"].settings,
                         **learning.config_overrides("arithmetic", name))
        assert (args.loss_settings.policy_loss, args.loss_settings.kl_loss_estimator) == (
            ("cispo", "k3") if "cispo" in name else ("ppo", "k3+"))


def test_the_arithmetic_reward_reads_the_final_number_against_the_answer_column(learning):
    import common

    assert common.final_number("12 + 13 = 25.") == 25 and common.final_number("no number") is None
    chat = [[{"role": "assistant", "content": "3 + 4 = 7"}], [{"role": "assistant", "content": "It is 8, not 7"}]]
    assert learning.arithmetic_reward(chat, answer=["7", "8"]) == [1.0, 0.0]
    assert learning.arithmetic_reward(["The answer is 7", "7 apples"], answer=["7", "8"]) == [1.0, 0.0]
    rows = learning.rows("arithmetic", "held_out", 80)
    assert len(rows["prompt"]) == 80 and rows["prompt"][0].startswith("What is ")


def test_the_peers_arithmetic_reward_reads_the_question_from_the_prompt(learning):
    """trl 1.12 hands its reward model no dataset column: the peer's stand-in must score as hf_ppo's function does,
    reading the sum from the decoded prompt and the final number after the assistant's turn starts."""
    import types

    import torch

    import learning_peer

    texts = {0: "system\nYou are a helpful AI assistant named SmolLM\nuser\nWhat is 3 + 4?\nassistant\n3 + 4 = 7",
             1: "user\nWhat is 13 + 4?\nassistant\n13 + 4 = 18",
             2: "user\nWhat is 10 + 9?\nassistant\nNot 4: the answer is 19."}
    tokenizer = types.SimpleNamespace(pad_token_id=0, batch_decode=lambda ids, **kw: [texts[row[0]] for row in ids])
    model = learning_peer.build_arithmetic_reward_model(tokenizer)
    ids = torch.tensor([[0, 5], [1, 5], [2, 5]])
    hidden = getattr(model, model.base_model_prefix)(ids, attention_mask=torch.ones_like(ids)).hidden_states[-1]
    assert model.score(hidden)[:, -1, 0].tolist() == [1.0, 0.0, 1.0]


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
    # Each task's own budget is its table's: the arithmetic task's 12 iterations are not a shorter budget.
    assert learning.sizes(False, task="arithmetic") == (12, 16, 80)
    assert learning.result_path("arithmetic", "grpo k=4", 0, False, 12).parts[-4] == "learning"
    assert learning.result_path("arithmetic", "grpo k=4", 0, False, 30).parts[-4] == "learning-it30"


def test_the_second_table_has_its_own_block(learning, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    learning.write_results([fake_run("demo", "rloo k=4", 0, 1.0)], "python bench/learning.py", results)
    second = [dict(fake_run("long", learning.VAPO, 0, 2.0)),
              dict(fake_run("arithmetic", "grpo k=4", 0, 0.5), iterations=12, responses=16, samples=192)]
    learning.write_results(second, "python bench/learning.py --tasks long arithmetic", results)
    text = results.read_text()
    begin, end = learning.marks(30, ("long", "arithmetic"))
    block = text[text.index(begin):text.index(end)]
    assert text.count(learning.BEGIN) == 1 and "| demo | rloo k=4 |" not in block
    assert f"| long | {learning.VAPO} | +2.00 +/- 0.00 |" in block and "| arithmetic | grpo k=4 | +0.50" in block
    assert "arithmetic: 12 iterations x 16 responses = 192 samples, 80 held-out prompts" in block
    # The second table also decides against grpo k=4 (issue 39's item 4): a column of its own.
    runs = [fake_run("long", c, s, r) for c, values in ((learning.VAPO, [2.0, 3.0]), ("grpo k=4", [1.0, 1.0]))
            for s, r in enumerate(values)]
    md = learning.table(runs)
    assert "| vs the peer (+/- 2 SE) | vs grpo k=4 (+/- 2 SE) |" in md
    assert f"| long | {learning.VAPO} | +2.50 +/- 0.71 |  | +1.50 +/- 1.00 |" in md  # 2 * sqrt(0.5/2 + 0) = 1.00


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


@pytest.mark.slow
def test_quick_long_horizon_run_of_the_vapo_recipe(learning, tmp_path, monkeypatch):
    """The long task's pipeline with the separate critic, its warm-up, two critic passes, decoupled and
    length-adaptive lambda: every response is 48 tokens, so the actor's lambda is 1 - 1/(0.5 x 48)."""
    monkeypatch.setattr(learning, "DEMO_CACHE", tmp_path / "cache")
    result = learning.one("long", learning.VAPO, 0, quick=True)
    assert result["samples"] == 32 and result["held_out_kl"] != 0.0
