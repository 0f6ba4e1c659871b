"""A TRL GRPO user's first five minutes with `hf-ppo train` (issue 61): every GRPOConfig name gets hf_ppo's name or
the reason there is none, and PPOConfig's own refusals come in one line, as every other mistake does."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from hf_ppo.cli import train
from hf_ppo.cli.grpo_names import GRPO_NAMES


def known_keys() -> set[str]:
    return {a.dest for a in train.build_parser("hf-ppo train")._actions}


def test_every_grpo_config_field_is_a_key_or_has_its_hf_ppo_name_or_a_reason():
    from trl import GRPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = sorted(grpo - known_keys() - set(GRPO_NAMES))
    assert not missing, f"GRPOConfig fields hf-ppo train neither takes nor explains: {missing}"
    # No stale entry: each one is a GRPOConfig name that hf-ppo train does not take.
    assert not set(GRPO_NAMES) - grpo and not set(GRPO_NAMES) & known_keys()
    for name, text in GRPO_NAMES.items():  # a name it points to is one hf-ppo train takes
        if text.startswith("hf_ppo calls it "):
            assert text.split()[3].rstrip(":,") in known_keys(), name


@pytest.fixture
def run_yaml(tmp_path, tiny_models):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("the movie was", "the food was")))
    config = {"dataset_name": str(data), "model_name_or_path": tiny_models["policy"],
              "reward_model_name_or_path": tiny_models["reward"], "output_dir": str(tmp_path / "out"),
              "per_device_train_batch_size": 2, "num_mini_batches": 1, "report_to": "none", "use_cpu": True}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "run.yaml")


@pytest.mark.parametrize("argv, expected, not_expected", [
    (["--beta", "0.04"], "unknown key '--beta' on the command line. It is TRL GRPOConfig's: hf_ppo calls it kl_coef",
     None),
    (["--use_vllm", "true"], "It is TRL GRPOConfig's: hf_ppo calls it rollout_engine: vllm", "use_kl_loss"),
    (["--num_iterations", "2"], "hf_ppo calls it num_ppo_epochs", None),
    (["--vllm_mode", "server"], "no server mode", None),
])
def test_grpo_names_get_hf_ppos_name(run_yaml, argv, expected, not_expected):
    with pytest.raises(train.ConfigError) as info:
        train.parse_args(["--config", run_yaml, *argv], "hf-ppo train")
    assert expected in str(info.value)
    assert not_expected is None or not_expected not in str(info.value)


@pytest.mark.parametrize("argv, expected", [
    (["--advantage_estimator", "grpo"], "advantage_estimator='grpo' compares the responses to one prompt: set "
                                        "num_generations >= 2"),
    (["--max_completion_length", "8", "--response_length", "4"], "max_completion_length=8 and response_length=4 both"),
    (["--response_length", "300"], "response_length=300 leaves no room for a prompt in the policy's context of 256"),
])
def test_ppo_config_refusals_are_one_line_on_the_command_line(run_yaml, argv, expected, monkeypatch, capsys):
    monkeypatch.setattr(train.PPOLMTrainer, "__init__", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as stop:
        train.run(["--config", run_yaml, *argv], command="hf-ppo train")
    message = str(stop.value.code)
    assert message.startswith("hf-ppo train: error: ") and expected in message and "\n" not in message, message
    assert "Invalid PPOConfig" not in message and "Traceback" not in capsys.readouterr().err
