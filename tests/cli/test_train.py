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


@pytest.mark.parametrize("push", [False, True], ids=["save", "push"])
def test_a_run_the_collapse_watch_stopped_saves_and_pushes_no_policy(tmp_path, models, prompts, monkeypatch, capsys,
                                                                    push):
    """The recipe's guard after a collapse stop: the model in memory is the collapsed one (the warning says not to
    save it as the result), so the recipe neither saves it to output_dir nor pushes it, and says why. A KL threshold
    below any real KL (k2 is never negative): the adapter-disabled reference gives KL 0 at step 1, > 0 at step 2."""
    from hf_ppo.trainer.ppo_trainer import PPOLMTrainer
    from hf_ppo.trainer.watch import CollapseWarning

    def never(self, *args, **kwargs):
        raise AssertionError("the collapsed policy was pushed")

    monkeypatch.setattr(PPOLMTrainer, "push_to_hub", never)
    extra = {"push_to_hub": True, "hub_model_id": "me/collapsed"} if push else {}
    config = tiny_config(tmp_path, models, prompts, max_steps=4, learning_rate=1.0, kl_estimator="k2",
                         collapse_kl_threshold=1e-9, stop_on_collapse=True, save_strategy="steps", save_steps=1,
                         **extra)
    with pytest.warns(CollapseWarning, match="step 2: KL to the reference"):
        trainer = ppo.main(["--config", config])
    out = tmp_path / "out"
    assert trainer.state.global_step == 2 and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / "adapter_model.safetensors").exists() and not (out / "README.md").exists()
    printed = capsys.readouterr().out
    assert "stop_on_collapse" in printed and "Saved the policy" not in printed
    assert str(out / "checkpoint-1") in printed


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
    with pytest.raises(ValueError, match=r"batch_size=8 cannot be set.*per_device_train_batch_size"):
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


@pytest.mark.parametrize("flag, expected", [("true", True), ("True", True), ("TRUE", True), ("false", False),
                                            ("False", False)])
def test_resume_from_checkpoint_flag_takes_what_the_yaml_key_takes(tiny_models, tmp_path, monkeypatch, flag, expected):
    """Issue 49 item 4: `--resume_from_checkpoint true` is YAML's `resume_from_checkpoint: true` (the last checkpoint
    in output_dir), `false` is no resume; neither is a folder named "true"."""
    root = _project(tmp_path, tiny_models)
    monkeypatch.chdir(root)
    _, _, config = ppo.parse_args(["--config", "configs/run.yaml", "--resume_from_checkpoint", flag])
    assert config.resume_from_checkpoint is expected
    yaml_root = _project(tmp_path / "yaml", tiny_models, resume_from_checkpoint=expected)
    monkeypatch.chdir(yaml_root)
    _, _, from_yaml = ppo.parse_args(["--config", "configs/run.yaml"])
    assert from_yaml.resume_from_checkpoint is expected


def test_resume_from_checkpoint_true_on_the_command_line_resumes_the_last_checkpoint(tiny_models, tmp_path,
                                                                                      monkeypatch):
    root = _project(tmp_path, tiny_models, save_strategy="steps", save_steps=1, max_steps=2)
    monkeypatch.chdir(root)
    ppo.main(["--config", "configs/run.yaml"])
    assert (root / "runs" / "out" / "checkpoint-2").is_dir()
    resumed = ppo.main(["--config", "configs/run.yaml", "--max_steps", "3", "--resume_from_checkpoint", "True"])
    assert resumed.state.global_step == 3
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3]  # steps 1-2 from the checkpoint
    fresh = ppo.main(["--config", "configs/run.yaml", "--max_steps", "1", "--resume_from_checkpoint", "false"])
    assert fresh.state.global_step == 1


@pytest.mark.parametrize("extra, loader", [({"use_peft": False}, "AutoModelForCausalLM"),
                                           ({"push_merged_model": True}, "AutoModelForCausalLM"),
                                           ({}, "AutoPeftModelForCausalLM")])
def test_the_push_line_loads_what_was_pushed(tiny_models, tmp_path, monkeypatch, capsys, local_hub, hub_token, extra,
                                             loader):
    """Issue 49 item 11: after `push_to_hub: true` the console said AutoPeftModelForCausalLM for every policy; full
    weights (a run without LoRA, or a merged adapter) load with AutoModelForCausalLM, and the line printed loads it."""
    from tests.hub_fixtures import TEST_USER

    repo = f"{TEST_USER}/pushed-{loader.lower()}-{len(extra)}"
    root = _project(tmp_path, tiny_models, push_to_hub=True, hub_model_id=repo, **extra)
    monkeypatch.chdir(root)
    ppo.main(["--config", "configs/run.yaml", "--hub_token", hub_token])
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "load it:" in line)
    assert f"{loader}.from_pretrained({repo!r})" in line, printed
    assert ("AutoPeftModelForCausalLM" in line) == (loader == "AutoPeftModelForCausalLM")
    code = line.split("load it:", 1)[1].strip()
    namespace: dict = {}
    exec(code.replace(f"{repo!r}", f"{repo!r}, token={hub_token!r}"), namespace)  # the line, as printed, loads it
    assert namespace["model"].config.vocab_size > 0


# ---- the YAML's prompt settings reach the record; user errors are one line, before loading --------------------------
def test_the_yaml_system_prompt_and_prompt_column_reach_the_run_record(tmp_path, models):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": f"the movie was {i}", "answer": "x"} for i in range(4)])
    config = tiny_config(tmp_path, models, data, prompt_column="question", system_prompt="Be brief.",
                         max_steps=1)
    trainer = ppo.main(["--config", config, "--max_completion_length", "3", "--response_length", "3"])
    assert trainer.args.response_length == 3  # TRL GRPO's max_completion_length is response_length (one value)
    assert trainer.train_dataset[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    record = json.loads((tmp_path / "out" / "hf_ppo_run.json").read_text())
    assert record["prompts"]["column"] == "question" and record["prompts"]["system_prompt"] == "Be brief."
    assert record["sampling"]["response_length"] == 3


@pytest.mark.parametrize("rows, extra, expected", [
    ([{"text": "the movie was"}] * 4, {}, r"no column 'prompt'; its columns are \['text'\]"),
    ([{"prompt": "the movie was"}] * 4, {"reward_funcs": ["rewards.py:broken"]}, r"'broken' raised KeyError"),
    ([{"prompt": "the movie was"}] * 4, {"reward_funcs": ["rewards.py:words"]}, r"'words'.*not a number|'words'"),
])
def test_user_errors_stop_the_command_in_one_line_before_any_model_loads(tmp_path, models, monkeypatch, capsys,
                                                                         rows, extra, expected):
    """A wrong column or a reward function that fails its probe ended in a 5-10 frame traceback, after the models
    had loaded (27-73 s): one line, before any model loads."""
    import re

    from hf_ppo.cli import train

    (tmp_path / "rewards.py").write_text("def broken(prompts, completions, **kw):\n    return [kw['nope']] * "
                                         "len(prompts)\n\ndef words(prompts, completions, **kw):\n    return "
                                         "['many'] * len(prompts)\n")
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = {"dataset_name": data, "model_name_or_path": models["policy"], "output_dir": str(tmp_path / "out"),
              **TINY_RUN, **(extra or {"reward_model_name_or_path": models["reward"]})}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(train.PPOLMTrainer, "__init__", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as stop:
        train.run(["--config", str(tmp_path / "run.yaml")], command="hf-ppo train")
    message = str(stop.value.code)
    assert message.startswith("hf-ppo train: error: ") and re.search(expected, message), message
    assert "Traceback" not in capsys.readouterr().err


def test_max_completion_length_is_response_length_and_both_at_once_are_refused(tmp_path):
    from hf_ppo import PPOConfig

    assert PPOConfig(output_dir=str(tmp_path), max_completion_length=128, report_to=[]).response_length == 128
    with pytest.raises(ValueError, match="max_completion_length=128 and response_length=64 both set"):
        PPOConfig(output_dir=str(tmp_path), max_completion_length=128, response_length=64, report_to=[])


def test_hf_ppo_train_into_a_folder_a_live_run_holds_stops_before_anything_loads(tiny_models, tmp_path,
                                                                                  monkeypatch):
    """Issue 49 item 1, on the command line: the refusal is one line (`ConfigError`) before any model loads, naming the
    process that holds output_dir and the flag that picks another."""
    import socket
    import subprocess

    root = _project(tmp_path, tiny_models)
    monkeypatch.chdir(root)
    out = root / "runs" / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hf_ppo.trainer.run_lock import acquire; lock = acquire(sys.argv[1]); "
         "print('held', flush=True); sys.stdin.read(); lock.release()", str(out)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(Path(__file__).resolve().parents[2])])},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.communicate()[1][-2000:]
        with pytest.raises(ppo.ConfigError, match=rf"in use by another hf_ppo run: process {holder.pid} on "
                                                  rf"{socket.gethostname()}.*--output_dir PATH"):
            ppo.parse_args(["--config", "configs/run.yaml"])
    finally:
        holder.communicate(input="", timeout=120)
    ppo.parse_args(["--config", "configs/run.yaml"])  # released: the folder is free


# ---- start-up and the end: a reward function called once, the card written once (issue 53) -----------------------
COUNTED_REWARD = '''import json


def counted(prompts, completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # text, or chat messages
    with open({log!r}, "a") as log:
        log.write(json.dumps({{"prompts": [str(p) for p in prompts], "completions": texts}}) + "\\n")
    return [float(len(t)) for t in texts]
'''


class StartUpOver(Exception):
    """Raised by train(): the trainer is built, so every start-up call of a reward function has been made."""


@pytest.mark.parametrize("extra, calls", [
    ({}, 1),
    ({"eval_prompts": True}, 2),  # one probe per prompt set: the evaluation prompts are other prompts
    ({"prompt_column": "question", "system_prompt": "Be brief."}, 1),  # chat prompts, the column renamed
], ids=["train", "train-and-eval", "column-and-system-prompt"])
def test_hf_ppo_train_calls_a_reward_function_once_per_prompt_set_at_start_up(tmp_path, models, monkeypatch, extra,
                                                                              calls):
    """The command probed each reward function before any model loaded, and the trainer probed it again with the same
    prompts: a reward that costs (an API call, a sandboxed run) was called twice. Once now, and the early probe stays
    (the evaluation prompts are probed early too)."""
    from hf_ppo.cli import train

    log = tmp_path / "calls.jsonl"
    (tmp_path / "rewards.py").write_text(COUNTED_REWARD.format(log=str(log)))
    column = extra.get("prompt_column", "prompt")
    data = write_jsonl(tmp_path / "d.jsonl", [{column: f"the movie was {i}", "answer": "x"} for i in range(4)])
    config = {"dataset_name": data, "model_name_or_path": models["policy"], "output_dir": str(tmp_path / "out"),
              "reward_funcs": ["rewards.py:counted"], **TINY_RUN, **extra}
    if config.pop("eval_prompts", False):
        config["dataset_test_split"] = write_jsonl(tmp_path / "e.jsonl", [{"prompt": f"the food was {i}",
                                                                           "answer": "y"} for i in range(2)])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))

    def start_up_over(self, *args, **kwargs):
        raise StartUpOver

    monkeypatch.setattr(train.PPOLMTrainer, "train", start_up_over)
    with pytest.raises(StartUpOver):
        train.main(["--config", str(tmp_path / "run.yaml")], command="hf-ppo train")
    made = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(made) == calls, made
    assert all(c == "" for call in made for c in call["completions"]), made  # probes: empty completions
    assert len({tuple(call["prompts"]) for call in made}) == calls  # never the same prompts twice
    from hf_ppo.rollout import scoring

    assert scoring._probes_made is None  # the memory of the probes made ends with the start-up


@pytest.mark.parametrize("push", [False, True], ids=["save", "push"])
def test_hf_ppo_train_writes_the_card_once_and_a_users_create_model_card_still_rewrites_it(
        tiny_models, tmp_path, monkeypatch, capsys, local_hub, hub_token, push):
    """`hf-ppo train` wrote the card in save_model() and again in create_model_card() (to name the dataset): one
    write now, with the content the second write gave (the dataset named, how to load the saved folder), the save
    message claiming it; a push writes it once too and the Hub gets it. A user's create_model_card(model_name=...,
    dataset_name=...) afterwards still rewrites it."""
    from huggingface_hub import hf_hub_download

    from hf_ppo.hub import cards
    from tests.hub_fixtures import TEST_USER

    repo = f"{TEST_USER}/card-once"
    root = _project(tmp_path, tiny_models, **({"push_to_hub": True, "hub_model_id": repo} if push else {}))
    monkeypatch.chdir(root)
    written = []
    real = cards.write_model_card
    monkeypatch.setattr(cards, "write_model_card", lambda folder, **kw: written.append(kw) or real(folder, **kw))
    trainer = ppo.main(["--config", "configs/run.yaml", "--hub_token", hub_token])
    out = root / "runs" / "out"
    assert len(written) == 1, [w["repo_id"] for w in written]
    readme = out / "README.md"
    text = readme.read_text()
    assert cards.is_hf_ppo_card(readme) and "| datasets | a local dataset |" in text  # the dataset is named
    printed = capsys.readouterr().out
    if push:
        assert written[0]["repo_id"] == repo and not written[0]["saved_locally"]
        pushed = hf_hub_download(repo, "README.md", token=hub_token, cache_dir=str(tmp_path / "dl"))
        assert Path(pushed).read_text() == text  # the Hub has the card written
        return
    assert f"Saved the policy (LoRA adapter, tokenizer and model card) to {out}" in printed
    assert written[0]["saved_locally"] and written[0]["dataset_names"] == [str(root / "data" / "prompts.jsonl")]
    # The same content the second write gave: rendering it again as create_model_card did changes nothing.
    trainer.create_model_card(dataset_name=str(root / "data" / "prompts.jsonl"))
    assert readme.read_text() == text and len(written) == 2
    # A user's own call takes effect: its title and its dataset.
    trainer.create_model_card(model_name="my-ppo-run", dataset_name="org/prompts")
    mine = readme.read_text()
    assert "# my-ppo-run" in mine and "[org/prompts](https://huggingface.co/datasets/org/prompts)" in mine


def test_hf_ppo_train_on_a_full_disk_at_the_final_save_stops_in_one_message_and_its_fix_finishes_the_run(
        tmp_path, tiny_models, monkeypatch, capsys):
    """The end of hf-ppo train on a full disk: not a traceback of safetensors' raw error, but one message naming the
    folder, the space and the last complete checkpoint; the command it names (freed space) resumes from that
    checkpoint and saves the policy. Simulated as tests/trainer/test_checkpoint.py does: the writer fails."""
    from hf_ppo.cli import train
    from tests.full_disk import half_written_then_full

    root = _project(tmp_path, tiny_models, save_strategy="steps", save_steps=1)
    monkeypatch.chdir(root)
    out = root / "runs" / "out"
    with monkeypatch.context() as patch:
        half_written_then_full(out, patch)
        with pytest.raises(SystemExit) as stop:
            train.run(["--config", "configs/run.yaml"], command="hf-ppo train")
    message = str(stop.value.code)
    assert message.startswith(f"hf-ppo train: error: Could not save the policy to {out}: no space left on device")
    assert f"--resume_from_checkpoint true (it resumes from {out / 'checkpoint-1'}" in message
    assert "Traceback" not in capsys.readouterr().err
    assert not (out / "adapter_model.safetensors").exists() and not (out / ".hf_ppo-saving").exists()

    train.run(["--config", "configs/run.yaml", "--resume_from_checkpoint", "true"], command="hf-ppo train")
    assert (out / "adapter_model.safetensors").is_file() and (out / "README.md").is_file()


# ---- i53c: a test split of a local file, a test split nothing evaluates on, `--config=` ---------------------------
def test_a_split_name_on_a_local_dataset_file_is_refused_not_read_as_the_whole_file(tmp_path, models, monkeypatch):
    """`dataset_name: train.jsonl` with `dataset_test_split: test` evaluated on the training file itself (a local
    file has one split, and any split name read all of it), and `dataset_train_split: validation` trained on all of
    it: refused, naming the option and the fix, before any model loads; `--dataset_test_split none` drops the YAML's
    test split, and a test file still reads that file."""
    from hf_ppo.cli import train

    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"the movie was {i}"} for i in range(4)])
    config = tiny_config(tmp_path, models, data, dataset_test_split="test", eval_strategy="steps", eval_steps=1)
    built = []

    def trainer(**kwargs):
        built.append(kwargs)
        raise StartUpOver

    monkeypatch.setattr(train, "PPOLMTrainer", trainer)
    with pytest.raises(train.ConfigError, match=r"--dataset_test_split 'test': .*train\.jsonl' is a local file, which "
                       r"has one split.*--dataset_test_split test\.jsonl.*--dataset_test_split none"):
        train.main(["--config", config], command="hf-ppo train")
    with pytest.raises(train.ConfigError, match=r"--dataset_train_split 'validation': .*leave --dataset_train_split "
                       r"out"):
        train.main(["--config", config, "--dataset_train_split", "validation", "--dataset_test_split", "none"])
    assert built == []
    with pytest.raises(StartUpOver):
        train.main(["--config", config, "--dataset_test_split", "none", "--eval_strategy", "no"])
    assert built[-1]["eval_dataset"] is None
    held_out = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "the food was"}])
    with pytest.raises(StartUpOver):
        train.main(["--config", config, "--dataset_test_split", held_out])
    assert built[-1]["eval_dataset"]["prompt"] == ["the food was"] and len(built[-1]["train_dataset"]) == 4


def test_a_test_split_that_nothing_evaluates_on_is_said(tmp_path, models, prompts):
    """`dataset_test_split` without `eval_strategy` loaded and checked the prompts and never evaluated on them, in
    silence: a warning names both fixes. A held-out file is what `hf-ppo evaluate --dataset <file>` reads after the
    run (issue 61): no warning opens every run for it."""
    import warnings

    from hf_ppo.cli import train

    held_out = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "the food was"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train.parse_args(["--config", tiny_config(tmp_path, models, prompts, dataset_test_split=held_out)],
                         "hf-ppo train")
    config = tiny_config(tmp_path, models, "org/prompts", dataset_test_split="test")
    with pytest.warns(UserWarning, match=r"dataset_test_split=.*eval_strategy is 'no'.*never evaluated on.*"
                      r"--eval_strategy steps --eval_steps N.*--dataset_test_split none"):
        train.parse_args(["--config", config], "hf-ppo train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train.parse_args(["--config", config, "--eval_strategy", "steps", "--eval_steps", "1"], "hf-ppo train")
        train.parse_args(["--config", config, "--dataset_test_split", "none"], "hf-ppo train")


def test_config_with_an_equals_sign_is_read_and_a_second_config_is_refused(tmp_path, models, monkeypatch):
    """`--config=run.yaml` left the YAML unread (TrlParser knows `--config run.yaml` only): "the following arguments
    are required: --dataset_name", or "unknown key '--config'. Did you mean '--config'?". Read as `--config run.yaml`,
    relative paths beside it; two --config are refused by name (the second was "unknown key '--config'")."""
    from hf_ppo.cli import train

    folder = tmp_path / "cfg"
    folder.mkdir()
    write_jsonl(folder / "p.jsonl", [{"prompt": "the movie was"}] * 2)
    config = {"dataset_name": "p.jsonl", "model_name_or_path": models["policy"],
              "reward_model_name_or_path": models["reward"], "output_dir": str(tmp_path / "out"), **TINY_RUN}
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    script_args, _, ppo_config = train.parse_args(["--config=cfg/run.yaml", "--max_steps", "3"], "hf-ppo train")
    assert script_args.dataset_name == str(folder / "p.jsonl") and ppo_config.max_steps == 3
    assert ppo_config.response_length == TINY_RUN["response_length"]  # the YAML was read
    with pytest.raises(train.ConfigError, match=r"--config is given 2 times \(cfg/run\.yaml, other\.yaml\)"):
        train.parse_args(["--config", "cfg/run.yaml", "--config=other.yaml"], "hf-ppo train")


def test_a_dataset_config_given_with_a_local_file_is_said_to_be_ignored(tmp_path):
    """`dataset_config` with a local file was dropped in silence (a file has no configurations): a warning names it
    and the fix; a Hub-less run without one stays quiet."""
    import warnings

    from hf_ppo.cli import train

    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "the movie was"}])
    with pytest.warns(UserWarning, match=r"dataset_config 'main' is ignored: .*train\.jsonl' is a local file, and "
                                         r"only a Hub dataset has configurations\. Leave dataset_config out"):
        loaded = train.load_split(data, "main", "train")
    assert loaded["prompt"] == ["the movie was"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train.load_split(data, None, "train")


# ---- issue 63 kind 4: `none` on the command line over a YAML's number -------------------------------------------------
def test_max_prompt_length_none_on_the_command_line_is_no_limit(tmp_path, models, prompts):
    from hf_ppo.cli import train

    config = tiny_config(tmp_path, models, prompts, max_prompt_length=24)
    assert train.parse_args(["--config", config], "hf-ppo train")[2].max_prompt_length == 24
    for none in ("none", "None", "null"):
        ppo_config = train.parse_args(["--config", config, "--max_prompt_length", none], "hf-ppo train")[2]
        assert ppo_config.max_prompt_length is None, none
        assert ppo_config.vllm_settings.max_model_len is None  # nor a limit derived from it
