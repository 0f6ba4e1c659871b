"""recipes/ppo.py as a newcomer meets it: --help, misspelled keys, relative paths, what a finished run leaves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from test_recipe import ppo  # recipes/ppo.py, loaded once as a module


def _project(tmp_path: Path, tiny_models: dict, **extra) -> Path:
    """A project folder: configs/run.yaml naming data/ and models/ relative to itself (../data, ../models)."""
    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "data" / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was"]))
    os.symlink(Path(tiny_models["policy"]).parent, root / "models")
    config = {
        "dataset_name": "../data/prompts.jsonl",
        "model_name_or_path": f"../models/{Path(tiny_models['policy']).name}",
        "reward_model_name_or_path": f"../models/{Path(tiny_models['reward']).name}",
        "output_dir": "runs/out",
        "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": "all-linear",
        "policy_quantization": "none", "reward_quantization": "none",
        "response_length": 4, "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1,
        "max_steps": 1, "learning_rate": 1.0e-3, "logging_steps": 1, "num_sample_generations": 0,
        "report_to": "none", "save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "seed": 0,
        **extra,
    }
    (root / "configs" / "run.yaml").write_text(yaml.safe_dump(config))
    return root


def test_help_explains_how_to_run_and_lists_ppo_fields_first():
    text = ppo.build_parser().format_help()
    head = text[:3000]
    assert head.startswith("usage: python recipes/ppo.py [--config CONFIG.yaml]")
    for how in ["--config hf_ppo/cli/configs/demo.yaml", "--learning_rate 5e-6", "accelerate launch",
                "response_length` 53"]:
        assert how in head, how
    titles = ["PPO (hf_ppo.PPOConfig):", "prompts (ScriptArguments):", "models (ModelArguments):",
              "training (transformers.TrainingArguments"]
    positions = [text.index(title) for title in titles]
    assert positions == sorted(positions)
    ppo_section = text[positions[0]:positions[1]]
    assert "--response_length" in ppo_section and "--kl_coef" in ppo_section and "N+ paper" in ppo_section
    assert "--per_device_train_batch_size" not in ppo_section  # a TrainingArguments field
    assert "--per_device_train_batch_size" in text[positions[3]:]


TRL_DERIVED_SIZES = ["local_batch_size", "micro_batch_size", "batch_size", "local_mini_batch_size", "mini_batch_size"]


@pytest.mark.parametrize("where", ["yaml", "cli"])
def test_trl_derived_sizes_are_not_offered_but_still_refused_with_the_fix(tmp_path, tiny_models, where):
    """TRL's sizes that hf_ppo derives are no option `--help` lists (nor a spelling hint suggests); given anyway, in
    the YAML or on the command line, they end in PPOConfig's message naming the fields to set."""
    text = ppo.build_parser("hf-ppo train").format_help()
    listed = [name for name in TRL_DERIVED_SIZES if f"--{name} " in text or f"--{name}," in text]
    assert not listed, f"derived sizes offered in --help: {listed}"
    assert "Derived in hf_ppo" not in text
    root = _project(tmp_path, tiny_models, **({"batch_size": 8} if where == "yaml" else {}))
    argv = ["--config", str(root / "configs" / "run.yaml")] + (["--batch_size", "8"] if where == "cli" else [])
    with pytest.raises(ValueError, match=r"- batch_size=8 cannot be set.*per_device_train_batch_size"):
        ppo.parse_args(argv, command="hf-ppo train")
    if where == "cli":  # a near miss is pointed at an option it may set
        with pytest.raises(ppo.ConfigError) as info:
            ppo.parse_args(["--config", str(root / "configs" / "run.yaml"), "--mini_batch_sizes", "8"])
        assert "unknown key '--mini_batch_sizes'" in str(info.value) and "'--mini_batch_size'" not in str(info.value)


@pytest.mark.parametrize("where", ["yaml", "cli"])
def test_misspelled_key_suggests_the_nearest(tmp_path, tiny_models, where):
    root = _project(tmp_path, tiny_models, **({"lerning_rate": 0.1} if where == "yaml" else {}))
    argv = ["--config", str(root / "configs" / "run.yaml")] + (["--kl_coeff", "0.1"] if where == "cli" else [])
    with pytest.raises(ppo.ConfigError) as info:
        ppo.parse_args(argv)
    message = str(info.value)
    if where == "yaml":
        assert "unknown key 'lerning_rate' in " in message and "Did you mean 'learning_rate'?" in message
    else:
        assert "unknown key '--kl_coeff' on the command line" in message and "Did you mean '--kl_coef'?" in message


def test_relative_paths_resolve_from_cwd_then_the_config_folder(tmp_path, tiny_models, monkeypatch):
    root = _project(tmp_path, tiny_models)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    script_args, model_args, config = ppo.parse_args(["--config", str(root / "configs" / "run.yaml")])
    assert script_args.dataset_name == str(root / "data" / "prompts.jsonl")  # beside the config, not in the cwd
    assert model_args.model_name_or_path == str(root / "models" / Path(tiny_models["policy"]).name)
    assert config.output_dir == str(elsewhere / "runs" / "out")  # outputs go where the run starts
    # Found in the working directory first: a copy there wins over the one beside the config.
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    script_args, _, _ = ppo.parse_args(["--config", str(root / "configs" / "run.yaml"),
                                        "--dataset_name", "data/prompts.jsonl"])
    assert script_args.dataset_name == str(elsewhere / "data" / "prompts.jsonl")
    # A Hub id is left for the Hub.
    _, model_args, _ = ppo.parse_args(["--config", str(root / "configs" / "run.yaml"),
                                       "--reward_model_name_or_path", "org/reward"])
    assert model_args.reward_model_name_or_path == "org/reward"


def test_missing_path_is_named_before_anything_loads(tmp_path, tiny_models, monkeypatch):
    root = _project(tmp_path, tiny_models)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ppo.ConfigError) as info:
        ppo.main(["--config", str(root / "configs" / "run.yaml"), "--model_name_or_path", "outputs/demo/cache/v1/sft"])
    message = str(info.value)
    assert "model_name_or_path='outputs/demo/cache/v1/sft' was not found" in message
    assert str(tmp_path / "outputs/demo/cache/v1/sft") in message  # the working directory
    assert str(root / "configs" / "outputs/demo/cache/v1/sft") in message  # the config's folder
    assert "not a Hub id" in message and "make demo" in message


def test_finished_run_saves_a_portable_policy_with_its_card_and_says_how_to_load_it(tmp_path, tiny_models,
                                                                                  monkeypatch, capsys):
    from peft import AutoPeftModelForCausalLM

    root = _project(tmp_path, tiny_models)
    monkeypatch.chdir(root)
    trainer = ppo.main(["--config", "configs/run.yaml"])
    out = root / "runs" / "out"
    printed = capsys.readouterr().out
    assert f"Saved the policy (LoRA adapter, tokenizer and model card) to {out}" in printed
    assert f"AutoPeftModelForCausalLM.from_pretrained('{out}')" in printed
    assert "merge_and_unload()" in printed and f"push_policy_folder('{out}', 'your-user/out')" in printed

    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(root / "models" / Path(tiny_models["policy"]).name)  # absolute, not "../models/..."
    card = (out / "README.md").read_text()
    assert "[More Information Needed]" not in card and "## How to load" in card and "## Results" in card
    assert str(root) not in card  # no local path in the card
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["log_history"] == trainer.state.log_history

    monkeypatch.chdir(tmp_path)  # the adapter loads from another directory
    model = AutoPeftModelForCausalLM.from_pretrained(str(out))
    assert model.peft_config["default"].r == 4


def test_dict_fields_take_json_on_the_command_line(tiny_models, tmp_path, monkeypatch):
    """As TRL's scripts take them: every dict field of PPOConfig (and TrainingArguments') as a JSON object."""
    root = _project(tmp_path, tiny_models)
    monkeypatch.chdir(root)
    flags = {"model_init_kwargs": {"attn_implementation": "eager"}, "ref_model_init_kwargs": {"revision": "main"},
             "reward_model_init_kwargs": {"num_labels": 1}, "critic_model_init_kwargs": {"dtype": "float32"},
             "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    argv = ["--config", "configs/run.yaml", "--critic", "separate"] + [x for k, v in flags.items()
                                                                       for x in (f"--{k}", json.dumps(v))]
    _, _, config = ppo.parse_args(argv)
    for name, value in flags.items():
        assert getattr(config, name) == value, name
    with pytest.raises(ValueError, match=r"reward_model_init_kwargs=.* is not valid JSON .*--reward_model_init_kwargs"):
        ppo.parse_args(["--config", "configs/run.yaml", "--reward_model_init_kwargs", '{"num_labels": 1'])
