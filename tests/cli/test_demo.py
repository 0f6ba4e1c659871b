"""The demo as a newcomer sees it: `recipes/demo.py --quick` in a subprocess, its console output, and its policy.

`--quick` runs every stage (SFT, reward model, 2 PPO iterations, the table, the summary) with few steps, so the
console output has the same shape as `make demo`'s; the numbers mean nothing and are not checked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The quick demo prints ~33 lines on a 200-column terminal (stage lines, 3 bars, the saved-policy message, a 10-row
# table, the summary); `make demo` prints the same, nothing grows with training length. (A narrow terminal wraps
# table rows; the rest stays one line each.)
MAX_LINES = 40


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # warnings as a newcomer sees them
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **extra}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Run the quick demo once; return (console output, output dir)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    env = _env(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # Bytes, decoded by hand: text mode would turn tqdm's "\r" redraws into newlines a terminal never shows.
    run = subprocess.run([sys.executable, str(REPO / "recipes" / "demo.py"), "--quick", "--output_dir", str(out)],
                         cwd=REPO, env=env, capture_output=True, timeout=600)
    console = (run.stdout + run.stderr).decode("utf-8", errors="replace")
    assert run.returncode == 0, console[-4000:]
    return console, out


def test_console_fits_on_a_screen_without_warnings_or_metric_dicts(demo):
    console, _ = demo
    lines = console.split("\n")  # tqdm redraws with "\r" on one line; only "\n" makes a new line on screen
    assert len(lines) <= MAX_LINES, console
    assert not re.search(r"warn|Traceback|deprecat", console, re.IGNORECASE), console
    assert "{'" not in console and "'objective/" not in console, console  # no metric dicts
    for stage in ["1/4 SFT policy", "2/4 reward model", "PPO iteration 2/2", "[demo] 4/4 results"]:
        assert stage in console, stage
    ppo_bar = next(line for line in lines if "PPO iteration 2/2" in line)
    assert "reward=" in ppo_bar and "kl_k1=" in ppo_bar  # k1 (the default estimator) can be negative: named
    assert not re.search(r"examples/s|Loading weights|Writing model shards", console)  # no per-file bars


def test_summary_is_printed_and_written(demo):
    console, out = demo
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["optimizer_steps"] == 16 and summary["num_samples"] == 16
    before, after = summary["mean_reward_before"], summary["mean_reward_after"]
    assert f"[demo] mean reward on 16 held-out prompts: {before:+.2f} (SFT) -> {after:+.2f} (PPO)" in console
    assert f"peak {summary['kl']['peak']:.2f}" in console
    assert f"[demo] plot:    {out / 'ppo' / 'training_curves.png'}" in console
    assert Path(summary["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert f"Saved the policy (LoRA adapter, tokenizer and model card) to {out / 'ppo'}" in console


def test_saved_policy_is_portable_and_has_a_real_card(demo):
    _, out = demo
    config = json.loads((out / "ppo" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out / "cache" / "v1-quick" / "sft")  # absolute
    card = (out / "ppo" / "README.md").read_text()
    assert "[More Information Needed]" not in card and "## How to load" in card
    assert "AutoPeftModelForCausalLM.from_pretrained(\"path/to/ppo\")" in card
    assert "trainer_state.json" in os.listdir(out / "ppo")


def test_printed_load_command_works_from_another_directory(demo, tmp_path):
    console, out = demo
    line = next(line for line in console.split("\n") if line.startswith("[demo] load it: "))
    command = shlex.split(line.removeprefix("[demo] load it: "))
    assert command[0] == "python"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, *command[1:]], cwd=elsewhere, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("the movie was"), run.stdout
