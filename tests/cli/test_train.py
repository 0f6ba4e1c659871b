"""recipes/ppo.py end to end on tiny models saved to a temp dir: YAML + overrides, local files, chat, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from hf_ppo.cli import tiny

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


# The recipe settings of a tiny LoRA run on CPU: 2 prompts per iteration, one optimizer step each, nothing saved.
TINY_RUN = {
    "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": "all-linear",
    "policy_quantization": "none", "reward_quantization": "none",
    "response_length": 4, "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1,
    "max_steps": 2, "learning_rate": 1.0e-3, "logging_steps": 1, "num_sample_generations": 0,
    "report_to": "none", "save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "seed": 0,
}

def load_recipe():
    """recipes/ppo.py as a module (recipes/ is not a package: it is run as a script)."""
    spec = importlib.util.spec_from_file_location("ppo_recipe", RECIPES / "ppo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


ppo = load_recipe()


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny policy and reward model (same tokenizer), plus a policy whose tokenizer has no chat template."""
    root = tmp_path_factory.mktemp("models")
    # hidden 64: bitsandbytes CPU 4-bit kernels need in_features >= its block size (64).
    policy, reward = tiny.save_tiny_models(root, hidden_size=64)
    plain_tok = tiny.build_tokenizer(chat_template=None)
    tiny.build_causal_lm(plain_tok, hidden_size=64).save_pretrained(root / "no_template")
    plain_tok.save_pretrained(root / "no_template")
    return {"policy": policy, "reward": reward, "no_template": str(root / "no_template")}


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p, "id": i} for i, p in
                                                   enumerate(["the movie was", "the food was", "the book was",
                                                              "the show was"])])


def tiny_config(tmp_path: Path, models: dict, dataset: str, **extra) -> str:
    """A YAML config for a 2-iteration run (2 prompts per iteration, one optimizer step each)."""
    config = {
        "dataset_name": dataset,
        "model_name_or_path": models["policy"],
        "reward_model_name_or_path": models["reward"],
        "output_dir": str(tmp_path / "out"),
        **TINY_RUN, **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_yaml_config_with_cli_override_trains_and_saves(tmp_path, models, prompts):
    config = tiny_config(tmp_path, models, prompts, policy_quantization="4bit", reward_quantization="4bit")
    trainer = ppo.main(["--config", config, "--max_steps", "1", "--learning_rate", "5e-4"])

    assert trainer.args.max_steps == 1 and trainer.args.learning_rate == 5e-4  # the command line wins
    assert trainer.args.response_length == 4 and trainer.args.policy_quantization == "4bit"  # the YAML is used
    assert trainer.state.global_step == 1
    assert any("objective/scores" in entry for entry in trainer.state.log_history)
    saved = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= saved


def test_prompt_column_is_chosen_and_renamed(tmp_path, models):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": f"the movie was {i}", "answer": "x"} for i in range(4)])
    trainer = ppo.main(["--config", tiny_config(tmp_path, models, data), "--prompt_column", "question"])
    assert trainer.train_dataset[0]["prompt"] == "the movie was 0"
    assert trainer.state.global_step == 2


def test_csv_file(tmp_path, models):
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt\nthe movie was\nthe food was\n")
    trainer = ppo.main(["--config", tiny_config(tmp_path, models, str(csv), max_steps=1)])
    assert trainer.state.global_step == 1


def test_chat_messages_dataset(tmp_path, models):
    rows = [{"messages": [{"role": "user", "content": f"review {w}"}]} for w in ("the movie", "the food")]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    trainer = ppo.main(["--config", tiny_config(tmp_path, models, data, max_steps=1), "--prompt_column", "messages"])
    assert trainer.state.global_step == 1
    # The prompt was rendered with the chat template and its generation prompt.
    decoded = trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"])
    assert decoded.startswith("<|user|>") and decoded.rstrip().endswith("<|assistant|>")


def test_unknown_yaml_key_is_named(tmp_path, models, prompts):
    config = tiny_config(tmp_path, models, prompts, lerning_rate=0.1)
    with pytest.raises(ValueError, match="lerning_rate"):
        ppo.main(["--config", config])


def test_unknown_cli_flag_is_named(tmp_path, models, prompts):
    with pytest.raises(ValueError, match="--kl_coeff"):
        ppo.main(["--config", tiny_config(tmp_path, models, prompts), "--kl_coeff", "0.1"])


def test_missing_prompt_column_lists_columns(tmp_path, models):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "the movie was", "label": 1}] * 4)
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['text', 'label'\].*--prompt_column"):
        ppo.main(["--config", tiny_config(tmp_path, models, data)])


def test_chat_without_template_is_a_clear_error(tmp_path, models):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    config = tiny_config(tmp_path, models, data, model_name_or_path=models["no_template"], prompt_column="messages")
    with pytest.raises(ValueError, match="no chat template"):
        ppo.main(["--config", config])


def test_unsupported_local_file(tmp_path, models):
    data = tmp_path / "prompts.txt"
    data.write_text("the movie was\n")
    with pytest.raises(ValueError, match="json"):
        ppo.main(["--config", tiny_config(tmp_path, models, str(data))])


def test_yaml_picks_the_critic_and_the_estimator(tmp_path, models, prompts):
    # The critic, started from --critic_model_name_or_path (here the policy's checkpoint: its head starts at zero).
    config = tiny_config(tmp_path, models, prompts, critic="separate", critic_model_name_or_path=models["policy"])
    trainer = ppo.main(["--config", config, "--max_steps", "1"])
    assert trainer.model.critic is not None and trainer.state.global_step == 1
    # A zero head after one Adam step at lr 1e-3 (the reward model's score head would be ~N(0, 0.02)).
    assert trainer.model.critic.head.weight.abs().max() < 5e-3
    # A critic-free estimator: no critic at all.
    config = tiny_config(tmp_path, models, prompts, advantage_estimator="rloo", num_generations=2)
    trainer = ppo.main(["--config", config, "--max_steps", "1"])
    assert not trainer.model.has_critic and trainer.state.global_step == 1


# ---- recipes/ppo.py as a newcomer meets it ---------------------------------------------------------------------------
# recipes/ppo.py as a newcomer meets it: --help, misspelled keys, relative paths, what a finished run leaves.

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
