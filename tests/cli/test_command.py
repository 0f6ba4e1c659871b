"""hf_ppo.cli (the `hf-ppo` command): train, evaluate, demo.
policy prints the table and writes the report; the built wheel installs a working command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hf_ppo.cli.command import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was",
                                                                         "the book was", "the show was"]))
    return str(path)


@pytest.mark.parametrize("command, how", [
    ([], "hf-ppo evaluate --policy"), (["train", "--help"], "hf-ppo train --config recipes/configs/demo.yaml"),
    (["evaluate", "--help"], "hf-ppo evaluate --policy outputs/demo/ppo"),
    (["demo", "--help"], "hf-ppo demo --output_dir outputs/demo")])
def test_help_leads_with_how_to_run_it(command, how, capsys):
    try:
        main(command)
    except SystemExit as stop:
        assert stop.code in (0, None)
    out = capsys.readouterr().out
    assert how in out[:1200]


def test_evaluate_prints_the_table_and_writes_the_report(tiny_models, prompts_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    metrics = main_evaluate(tiny_models, prompts_file, "--judge", tiny_models["reward"], "--num_prompts", "3")
    out = capsys.readouterr().out
    assert "on 3 prompts of" in out and "| reward/reward |" in out and "| judge/reward |" in out
    assert "Side by side: hf_ppo_eval/eval_report.md" in out
    assert (tmp_path / "hf_ppo_eval" / "eval_report.md").read_text().count("| the ") == 3
    saved = json.loads((tmp_path / "hf_ppo_eval" / "metrics.json").read_text())
    assert saved["eval_reward/reward/win_rate"] == metrics["eval_reward/reward/win_rate"]


def main_evaluate(tiny_models, prompts_file, *extra):
    from hf_ppo.cli.command import evaluate

    return evaluate(["--policy", tiny_models["policy"], "--reference", tiny_models["policy"], "--reward_model",
                     tiny_models["reward"], "--dataset", prompts_file, "--response_length", "4", *extra])


def test_a_full_model_policy_needs_a_reference(tiny_models, prompts_file):
    with pytest.raises(SystemExit, match="is a full model: pass --reference"):
        main(["evaluate", "--policy", tiny_models["policy"], "--reward_model", tiny_models["reward"],
              "--dataset", prompts_file])


@pytest.mark.slow
def test_the_built_wheel_installs_a_working_command(tiny_models, prompts_file, tmp_path):
    """Build the wheel from a copy of the sources, install it (no dependencies) in a fresh venv that reads the running
    environment's packages, and run `hf-ppo` from another directory."""
    source = tmp_path / "src"
    for item in ("hf_ppo", "recipes", "pyproject.toml", "README.md"):
        copy = shutil.copytree if (REPO / item).is_dir() else shutil.copy
        copy(REPO / item, source / item, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (REPO / item).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, transformers, pip...
    wheel = next((tmp_path / "dist").glob("hf_ppo-*.whl"))
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": ""}
    hf_ppo = str(venv / "bin" / "hf-ppo")
    where = subprocess.run([str(python), "-c", "import hf_ppo; print(hf_ppo.__file__)"], cwd=elsewhere, env=env,
                           check=True, capture_output=True, text=True).stdout
    assert where.startswith(purelib)  # the installed wheel, not the checkout
    assert "hf-ppo train --config" in subprocess.run([hf_ppo, "--help"], cwd=elsewhere, env=env, check=True,
                                                     capture_output=True, text=True).stdout
    run = subprocess.run([hf_ppo, "evaluate", "--policy", tiny_models["policy"], "--reference", tiny_models["policy"],
                          "--reward_model", tiny_models["reward"], "--dataset", prompts_file, "--response_length",
                          "4", "--num_prompts", "2"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| reward/reward |" in run.stdout and (elsewhere / "hf_ppo_eval" / "eval_report.md").is_file()
    # The wheel carries what the command reads: the card template and the demo config.
    listing = subprocess.run([str(python), "-m", "zipfile", "-l", str(wheel)], check=True, capture_output=True,
                             text=True).stdout
    assert "hf_ppo/hub/templates/policy_card.md.jinja" in listing and "hf_ppo/configs/demo.yaml" in listing
