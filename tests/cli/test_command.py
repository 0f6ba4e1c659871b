"""hf_ppo.cli (the `hf-ppo` command): train, evaluate, demo.
policy prints the table and writes the report; the built wheel installs a working command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.command import main
from hf_ppo.models import gguf
from tests.devices import CUDA
from tests.hub_fixtures import TEST_USER

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was",
                                                                         "the book was", "the show was"]))
    return str(path)


@pytest.mark.parametrize("command, how", [
    ([], "hf-ppo evaluate --policy"), (["train", "--help"], "hf-ppo train --config hf_ppo/cli/configs/demo.yaml"),
    (["evaluate", "--help"], "hf-ppo evaluate --policy outputs/demo/ppo"),
    (["demo", "--help"], "hf-ppo demo --output_dir outputs/demo")])
def test_help_leads_with_how_to_run_it(command, how, capsys):
    try:
        main(command)
    except SystemExit as stop:
        assert stop.code in (0, None)
    out = capsys.readouterr().out
    assert how in out[:1200]


def test_the_yaml_configs_have_one_home_that_the_wheel_ships():
    """The YAML configs live in hf_ppo/cli/configs/ alone, package data of hf_ppo.cli: a checkout and an installed
    wheel read them at the same path (no folder elsewhere mapped into the wheel), and the input paths of the offline
    configs, relative to that folder, still reach the checkout's outputs/ (`make demo`'s cache)."""
    import fnmatch
    import tomllib

    import yaml

    from hf_ppo.cli import arithmetic, demo

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools, "the configs are package data of hf_ppo.cli, not a mapped folder"
    home = REPO / "hf_ppo" / "cli" / "configs"
    configs = sorted(p.relative_to(home.parent).as_posix() for p in home.glob("*.yaml"))
    assert {"configs/demo.yaml", "configs/arithmetic.yaml", "configs/gsm8k_ppo.yaml"} <= set(configs)
    shipped = setuptools["package-data"]["hf_ppo.cli"]
    assert all(any(fnmatch.fnmatch(c, pattern) for pattern in shipped) for c in configs), (configs, shipped)
    elsewhere = [p.relative_to(REPO).as_posix() for p in (REPO / "recipes").rglob("*.yaml")
                 if "accelerate" not in p.parts]
    assert not elsewhere, f"YAML configs outside hf_ppo/cli/configs/: {elsewhere}"
    assert demo.demo_config() == home / "demo.yaml" and arithmetic.arithmetic_config() == home / "arithmetic.yaml"
    for config in (demo.demo_config(), arithmetic.arithmetic_config()):
        settings = yaml.safe_load(config.read_text())
        for key in ("dataset_name", "model_name_or_path", "reward_model_name_or_path"):
            if key in settings:
                assert (home / settings[key]).resolve().is_relative_to(REPO / "outputs"), (config.name, key)


def test_evaluate_prints_the_table_and_writes_the_report(tiny_models, prompts_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    metrics = main_evaluate(tiny_models, prompts_file, "--judge", tiny_models["reward"], "--num_prompts", "3")
    out = capsys.readouterr().out
    assert "on 3 prompts of" in out and "| reward/reward |" in out and "| judge/reward |" in out
    assert "Side by side: hf_ppo_eval/eval_report.md" in out
    assert (tmp_path / "hf_ppo_eval" / "eval_report.md").read_text().count("| the ") == 3
    saved = json.loads((tmp_path / "hf_ppo_eval" / "metrics.json").read_text())
    assert saved["eval_reward/reward/win_rate"] == metrics["eval_reward/reward/win_rate"]
    assert "eval_loss" not in saved  # Trainer's: minus the mean training score, no loss of this job (issue 61)


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
    assert "hf_ppo/hub/templates/policy_card.md.jinja" in listing and "hf_ppo/cli/configs/demo.yaml" in listing


# ---- a new user's GGUF checkpoints, `hf-ppo evaluate` and the Hub ----------------------------------------------------
# A new user's path through GGUF checkpoints, `hf-ppo evaluate` and the Hub.
#
# 1. `hf-ppo train` loads a GGUF policy (the tokenizer too), the `.gguf` file itself is a model, and one file reached
#   by several names is converted once; 2. `hf-ppo evaluate` loads each model as the run did (recorded beside the
#   policy), else in full precision, or as told; 3. evaluating a saved adapter against itself is said, and the
#   reference's rows do not depend on the policy evaluated; 4. a pushed adapter names the base's Hub id, not hf_ppo's
#   conversion cache.
#
# The GGUF conversion itself (transformers dequantizing a real file) is tests/integration/test_real_model.py's; here a
# fake conversion copies the tiny policy, so what is pinned is the wiring around it.

PROMPTS = ["the movie was", "the food was", "the book was", "the show was", "the game was", "the song was"]


def length_reward(prompts, completions):
    """Longer answers score higher: deterministic, no model."""
    return [float(len(c)) for c in completions]


@pytest.fixture
def fake_conversion(tiny_models, tmp_path, monkeypatch):
    """A folder holding only `tiny.gguf` (no config, no tokenizer: like a GGUF download), hf_ppo's cache in tmp_path,
    and a conversion that copies the tiny policy (weights and tokenizer); `calls` counts the conversions."""
    folder = tmp_path / "gguf_download"
    folder.mkdir()
    (folder / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "gguf_cache"))
    calls = []

    def convert(name_or_path, gguf_file, source, trust_remote_code, target, role):
        calls.append((name_or_path, gguf_file))
        shutil.copytree(tiny_models["policy"], target)

    monkeypatch.setattr(gguf, "_convert", convert)
    return Namespace(folder=folder, file=folder / "tiny.gguf", calls=calls, cache=tmp_path / "gguf_cache")


def _args(tmp_path, **extra) -> PPOConfig:
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                    num_mini_batches=1, num_ppo_epochs=1, max_steps=1, response_length=4, temperature=0.7,
                    learning_rate=1e-3, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0, use_cpu=True, reward_quantization="none")
    return PPOConfig(**{**settings, **extra})


# ---- 1. GGUF on the command line ----------------------------------------------------------------------------------
def test_hf_ppo_train_loads_a_gguf_policy_and_its_tokenizer(fake_conversion, tiny_models, tmp_path, monkeypatch):
    """`model_init_kwargs: {gguf_file: ...}` in a recipe: the tokenizer was read from the GGUF's folder without the
    file (transformers' sentencepiece/tiktoken error); it comes from the converted folder, as the weights do."""
    from hf_ppo.cli.command import main

    monkeypatch.chdir(tmp_path)
    Path("prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    Path("rewards.py").write_text("def longer(prompts, completions, **kw):\n    return [float(len(c)) for c in "
                                  "completions]\n")
    config = {"dataset_name": "prompts.jsonl", "model_name_or_path": str(fake_conversion.folder),
              "model_init_kwargs": {"gguf_file": "tiny.gguf"}, "reward_funcs": ["rewards.py:longer"],
              "output_dir": "runs/out", "use_peft": True, "lora_r": 4, "lora_alpha": 8,
              "lora_target_modules": "all-linear", "response_length": 4, "per_device_train_batch_size": 2,
              "num_mini_batches": 1, "num_ppo_epochs": 1, "max_steps": 1, "num_sample_generations": 0,
              "report_to": "none", "save_strategy": "no", "use_cpu": True, "disable_tqdm": True}
    Path("run.yaml").write_text(yaml.safe_dump(config))
    main(["train", "--config", "run.yaml"])
    assert len(fake_conversion.calls) == 1  # converted once: the recipe's tokenizer, then the trainer, share it
    record = json.loads(Path("runs/out/hf_ppo_run.json").read_text())
    assert record["base_model"]["gguf_file"] == "tiny.gguf"
    assert record["base_model"]["source"] == str(fake_conversion.folder)


def test_the_gguf_file_itself_is_a_model(fake_conversion, tiny_models, tmp_path):
    """model=<path to a .gguf file> read the file as a folder's config ('not a valid JSON file', then advice about
    logging in): it is the file's folder with gguf_file, converted like it."""
    trainer = PPOLMTrainer(model=str(fake_conversion.file), args=_args(tmp_path), reward_model=length_reward)
    assert fake_conversion.calls == [(str(fake_conversion.folder), "tiny.gguf")]
    assert trainer.model.policy_model.config.num_hidden_layers >= 1
    with pytest.raises(ValueError, match="names another one"):
        gguf.split_gguf_path(str(fake_conversion.file), {"gguf_file": "other.gguf"})


def test_one_gguf_file_by_several_names_is_converted_once(fake_conversion, tmp_path, monkeypatch):
    """The cache was keyed by the names given: the same file by a relative path, a link or an absolute gguf_file
    was converted (517 MB) once per name. It is keyed by the real file."""
    link = tmp_path / "link_to_download"
    os.symlink(fake_conversion.folder, link)
    monkeypatch.chdir(tmp_path)
    names = [(str(fake_conversion.folder), {"gguf_file": "tiny.gguf"}),
             ("gguf_download", {"gguf_file": "tiny.gguf"}),
             (str(link), {"gguf_file": "tiny.gguf"}),
             (str(fake_conversion.file), None),
             ("somewhere/else", {"gguf_file": str(fake_conversion.file)})]
    folders = {gguf.converted(name, kwargs, "policy")[0] for name, kwargs in names}
    assert len(folders) == 1 and len(fake_conversion.calls) == 1
    # Another file (same name, other content) is another conversion.
    os.utime(fake_conversion.file, ns=(1, 1))
    assert gguf.converted(str(fake_conversion.folder), {"gguf_file": "tiny.gguf"}, "policy")[0] not in folders


def test_a_hub_gguf_and_its_downloaded_file_are_converted_once(fake_conversion, tmp_path, local_hub, hub_token):
    """By Hub id, then by the path of the downloaded file (what a user copies from the cache): one conversion."""
    from huggingface_hub import HfApi, hf_hub_download

    repo = f"{TEST_USER}/tiny-gguf"
    api = HfApi(token=hub_token)
    api.create_repo(repo)
    api.upload_file(path_or_fileobj=str(fake_conversion.file), path_in_repo="tiny.gguf", repo_id=repo)
    by_id = gguf.converted(repo, {"gguf_file": "tiny.gguf", "token": hub_token}, "policy")[0]
    downloaded = hf_hub_download(repo, "tiny.gguf", token=hub_token)
    assert gguf.converted(downloaded, None, "policy")[0] == by_id
    assert len(fake_conversion.calls) == 1


# ---- 2. hf-ppo evaluate measures against the reference as trained -------------------------------------------------
def _trained_adapter(tiny_models, tmp_path, **extra):
    """A LoRA policy trained one step on the tiny models, evaluated by its own trainer, then saved."""
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=_args(tmp_path, **extra),
                           reward_model=tiny_models["reward"], train_dataset=prompts, eval_dataset=prompts,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    trainer.train()
    metrics = trainer.evaluate()
    folder = tmp_path / "saved"
    trainer.save_model(str(folder))
    return trainer, metrics, folder


def test_hf_ppo_evaluate_samples_the_reference_training_evaluated_against(tiny_models, tmp_path, monkeypatch):
    """hf-ppo evaluate loaded the reference and the reward model in 4 bits, whatever the run used: for the same
    policy and prompts its reference (and so its KL) was another than trainer.evaluate()'s. Loaded as the run
    recorded (full precision here), the reference's responses and scores are the very ones training evaluated."""
    from hf_ppo.cli.command import evaluate

    # Trained where hf-ppo evaluate runs (it has no device option: a GPU where one is visible), in fp32 on either
    # machine: the two evaluations sample the same tokens only on the same device with the same numerics.
    _, trained, folder = _trained_adapter(tiny_models, tmp_path, use_cpu=not CUDA, bf16=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    monkeypatch.chdir(tmp_path)
    cli = evaluate(["--policy", str(folder), "--reward_model", tiny_models["reward"], "--dataset", str(prompts),
                    "--response_length", "4", "--temperature", "0.7", "--batch_size", "2", "--seed", "0"])
    for key in ("eval_reward/reward/reference", "eval_reference/response_length", "eval_reference/stop_rate"):
        assert cli[key] == pytest.approx(trained[key], abs=1e-6), key
    saved = json.loads((tmp_path / "hf_ppo_eval" / "metrics.json").read_text())
    assert saved["quantization"] == {"policy": "none", "ref": "none", "reward": "none"}
    assert json.loads((folder / "hf_ppo_run.json").read_text())["quantization"] == {
        "policy": "none", "reference": "none", "reward": ["none"]}
    assert saved["precision"] == json.loads((folder / "hf_ppo_run.json").read_text())["precision"] == "fp32"
    # A run recorded in bf16 is evaluated under bf16, as it trained (Trainer's mixed precision; a 4-bit model's
    # compute dtype), on a CPU too.
    record = json.loads((folder / "hf_ppo_run.json").read_text())
    (folder / "hf_ppo_run.json").write_text(json.dumps(dict(record, precision="bf16")))
    seen = {}
    real = PPOLMTrainer.evaluate

    def spy(self, *a, **kw):
        seen["bf16"] = self.args.bf16
        return real(self, *a, **kw)

    monkeypatch.setattr(PPOLMTrainer, "evaluate", spy)
    evaluate(["--policy", str(folder), "--reward_model", tiny_models["reward"], "--dataset", str(prompts),
              "--response_length", "4", "--batch_size", "2", "--output_dir", "bf16"])
    assert seen["bf16"]
    assert json.loads((tmp_path / "bf16" / "metrics.json").read_text())["precision"] == "bf16"


def test_evaluate_quantization_follows_the_record_else_full_precision_or_the_options(tmp_path):
    """Each model's quantization: the option, else the run's record, else 'none' (never a silent 4-bit)."""
    from hf_ppo.cli.command import evaluate_parser, recorded_quantization

    def chosen(folder, *options):
        args = evaluate_parser().parse_args(["--policy", str(folder), "--dataset", "d.jsonl", *options])
        return recorded_quantization(str(folder), args)

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    assert chosen(unknown) == {"policy": "none", "ref": "none", "reward": "none"}
    qlora = tmp_path / "qlora"
    qlora.mkdir()
    (qlora / "hf_ppo_run.json").write_text(json.dumps({"quantization": {
        "policy": "4bit", "reference": "4bit", "reward": ["8bit", None]}, "reference": None}))
    assert chosen(qlora) == {"policy": "4bit", "ref": "4bit", "reward": "8bit"}
    assert chosen(qlora, "--ref_quantization", "none", "--reward_quantization", "4bit") == {
        "policy": "4bit", "ref": "none", "reward": "4bit"}
    with pytest.raises(SystemExit):
        chosen(qlora, "--ref_quantization", "3bit")


@pytest.mark.parametrize("flags, precision", [({"bf16": True}, "bf16"), ({"fp16": True}, "fp16"), ({}, "fp32")])
def test_the_run_record_names_the_compute_dtype(flags, precision, tmp_path):
    import types

    from hf_ppo.hub.cards import PublishSettings
    from hf_ppo.hub.publish import run_record

    args = types.SimpleNamespace(**{"bf16": False, "fp16": False, **flags})
    settings = PublishSettings(hyperparameters={}, precision=PPOConfig.precision.fget(args))
    record = run_record(settings, {"model": "org/base"}, torch.nn.Linear(2, 2), None, None, length_reward)
    assert record["precision"] == precision


def test_evaluate_precision_follows_the_record_else_fp32_or_the_option(tmp_path, monkeypatch, capsys):
    """The compute dtype: --precision, else the run's record, else fp32; fp16 without a GPU is said and falls back."""
    from hf_ppo.cli.command import evaluate_parser, recorded_precision

    def chosen(folder, *options):
        args = evaluate_parser().parse_args(["--policy", str(folder), "--dataset", "d.jsonl", *options])
        return recorded_precision(str(folder), args)

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    assert chosen(unknown) == ("fp32", None)
    run = tmp_path / "bf16"
    run.mkdir()
    (run / "hf_ppo_run.json").write_text(json.dumps({"precision": "bf16"}))
    assert chosen(run) == ("bf16", None) and chosen(run, "--precision", "fp32") == ("fp32", None)
    (run / "hf_ppo_run.json").write_text(json.dumps({"precision": "fp16"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    precision, note = chosen(run)
    assert precision == "fp32" and "the run trained in fp16" in note and "fp16 needs a GPU" in note
    assert "--precision fp16" in chosen(unknown, "--precision", "fp16")[1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chosen(run) == ("fp16", None)


# ---- 3. evaluating a saved adapter from Python ----------------------------------------------------------------------
def _saved_lora(tiny_models, folder, r: int) -> str:
    """A LoRA adapter with random (nonzero) weights on the tiny policy, saved as save_model() would."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(r)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear",
                                            init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(folder)
    return str(folder)


def test_evaluating_a_saved_adapter_against_itself_is_said(tiny_models, tokenizer, tmp_path):
    """PPOLMTrainer(model=<saved adapter>, eval_dataset=...).evaluate() took the adapter as its own reference (KL 0,
    win rate ~0.5) in silence. It says so and names the base to pass; with ref_model=<base> it measures."""
    adapter = _saved_lora(tiny_models, tmp_path / "adapter", r=4)
    prompts = Dataset.from_dict({"prompt": PROMPTS[:2]})
    itself = PPOLMTrainer(model=adapter, args=_args(tmp_path), processing_class=tokenizer,
                          reward_model=length_reward, eval_dataset=prompts)
    with pytest.warns(UserWarning, match="the reference is the policy itself") as caught:
        assert itself.evaluate()["eval_kl_to_reference"] == 0.0
    assert f"ref_model={tiny_models['policy']!r}" in str(caught[0].message)
    against_base = PPOLMTrainer(model=adapter, args=_args(tmp_path, ref_quantization="none"),
                                processing_class=tokenizer, reward_model=length_reward, eval_dataset=prompts,
                                ref_model=tiny_models["policy"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*the reference is the policy itself")
        assert against_base.evaluate()["eval_kl_to_reference"] != 0.0


def _ends_at_once(tiny_models, tokenizer):
    """The tiny policy made to say its end-of-sequence token first, every time (a bias on its output layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 1e4
    model.lm_head = head
    return model


def test_the_reference_rows_do_not_depend_on_the_policy_evaluated(tiny_models, tokenizer, tmp_path):
    """Two policies, one reference, the same prompts and seed: the reference was sampled from the global generator
    after the previous batches' policy samples, so a policy that stops early (fewer draws) changed the reference's
    later rows. Its sampling is seeded on its own: the same responses, scores and lengths."""
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    reports = []
    for name, policy in (("tiny", tiny_models["policy"]), ("ends", _ends_at_once(tiny_models, tokenizer))):
        args = _args(tmp_path / name, ref_quantization="none")
        trainer = PPOLMTrainer(model=policy, args=args, processing_class=tokenizer, reward_model=length_reward,
                               eval_dataset=prompts, ref_model=tiny_models["policy"])
        metrics = trainer.evaluate()
        report = (Path(args.output_dir) / "eval_report.md").read_text()
        reports.append((metrics, [row.split("|")[2:4] for row in report.splitlines() if row.startswith("| the ")]))
    (first, rows_a), (second, rows_b) = reports
    assert len(rows_a) == len(PROMPTS) and rows_a == rows_b  # the reference's response and score, row by row
    for key in ("eval_reward/length_reward/reference", "eval_reference/response_length"):
        assert first[key] == second[key]
    assert first["eval_policy/response_length"] > second["eval_policy/response_length"] == 1.0


# ---- 4. a pushed adapter names its base's Hub id ------------------------------------------------------------------
def test_a_pushed_adapter_names_the_base_hub_id(fake_conversion, tiny_models, tmp_path, local_hub, hub_token):
    """An adapter trained on a GGUF checkpoint named hf_ppo's local conversion folder as its base, on the Hub too:
    it loaded only on the machine that trained it. With hub_base_model_id the pushed adapter_config.json names the
    Hub id (the local one keeps the folder it was trained on); the origin is recorded beside the policy."""
    repo = f"{TEST_USER}/gguf-ppo"
    args = _args(tmp_path, hub_model_id=repo, hub_token=hub_token, model_init_kwargs={"gguf_file": "tiny.gguf"},
                 hub_base_model_id="HuggingFaceTB/SmolLM2-135M-Instruct")
    trainer = PPOLMTrainer(model=str(fake_conversion.folder), args=args, reward_model=length_reward,
                           peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    trainer.push_to_hub()
    pushed = json.loads(local_hub.files(repo)["adapter_config.json"])
    assert pushed["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    local = json.loads((Path(args.output_dir) / "adapter_config.json").read_text())
    assert local["base_model_name_or_path"].startswith(str(fake_conversion.cache))
    assert json.loads((Path(args.output_dir) / "hf_ppo_run.json").read_text())["base_model"] == {
        "source": str(fake_conversion.folder), "gguf_file": "tiny.gguf",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert "hf_ppo_run.json" not in local_hub.files(repo)


def test_pushing_an_adapter_on_a_local_base_names_both_fixes(fake_conversion, tmp_path, local_hub, hub_token):
    """Without hub_base_model_id the push goes on (the adapter as it is) but says why it will not load elsewhere and
    what to set: hub_base_model_id, or push_merged_model."""
    args = _args(tmp_path, hub_model_id=f"{TEST_USER}/gguf-ppo", hub_token=hub_token,
                 model_init_kwargs={"gguf_file": "tiny.gguf"})
    trainer = PPOLMTrainer(model=str(fake_conversion.folder), args=args, reward_model=length_reward,
                           peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    with pytest.warns(UserWarning, match="GGUF file 'tiny.gguf'") as caught:
        trainer.push_to_hub()
    message = str(caught[0].message)
    assert "hub_base_model_id" in message and "push_merged_model=True" in message
    with pytest.raises(ValueError, match="hub_base_model_id="):
        _args(tmp_path, hub_base_model_id="/home/me/models/base")


def test_the_record_gives_a_lora_reference_the_policy_base_quantization():
    """A LoRA run's reference is its base with the adapter disabled (ref_model=None): recorded in the policy's
    quantization, not ref_quantization (which only a reference loaded by id/path gets)."""
    from hf_ppo.hub.cards import PublishSettings
    from hf_ppo.hub.publish import run_record

    class Loaded4bit(torch.nn.Module):
        is_loaded_in_4bit = True

    class Loaded8bit(torch.nn.Module):
        is_loaded_in_8bit = True

    settings = PublishSettings(hyperparameters={})
    sources = {"model": "org/base", "ref_model": "org/sft"}
    record = run_record(settings, sources, Loaded4bit(), None, None, [Loaded8bit(), length_reward])
    assert record["quantization"] == {"policy": "4bit", "reference": "4bit", "reward": ["8bit", None]}
    assert record["reference"] is None
    assert run_record(settings, sources, Loaded4bit(), Loaded8bit(), None, length_reward)["quantization"][
        "reference"] == "8bit"


# ---- a metrics.json or eval_report.md of the user's is kept ------------------------------------------------------
def test_evaluate_keeps_a_users_metrics_and_report_and_never_points_at_them(tiny_models, prompts_file, tmp_path,
                                                                           monkeypatch, capsys):
    """`hf-ppo evaluate --output_dir DIR` overwrote DIR/metrics.json whoever wrote it, and its last line pointed at
    DIR/eval_report.md even when that was the user's file it had kept. Both are treated as save_model() treats
    README.md: hf_ppo's own (stamped) files are rewritten, a user's is kept byte for byte with a warning, and the
    console names what was written and what was not."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "hf_ppo_eval"
    out.mkdir()
    mine_metrics, mine_report = '{"my": "numbers"}\n', "# My own notes\n"
    (out / "metrics.json").write_text(mine_metrics)
    (out / "eval_report.md").write_text(mine_report)
    with pytest.warns(UserWarning) as caught:
        main_evaluate(tiny_models, prompts_file, "--num_prompts", "2")
    printed = capsys.readouterr().out
    assert (out / "metrics.json").read_text() == mine_metrics and (out / "eval_report.md").read_text() == mine_report
    messages = " ".join(str(w.message) for w in caught)
    assert "hf_ppo_eval/metrics.json exists and was not written by hf_ppo" in messages
    assert "hf_ppo_eval/eval_report.md exists and was not written by hf_ppo" in messages
    assert "Side by side: hf_ppo_eval/eval_report.md" not in printed
    last = printed.rstrip().splitlines()[-1]
    assert last.startswith("Not written: hf_ppo_eval/eval_report.md and hf_ppo_eval/metrics.json") and \
        "--output_dir" in last, last
    # hf_ppo's own files are rewritten: a run into a fresh folder, then again into it.
    for _ in range(2):
        main_evaluate(tiny_models, prompts_file, "--num_prompts", "2", "--output_dir", "fresh")
        printed = capsys.readouterr().out
        assert "Side by side: fresh/eval_report.md" in printed and "Metrics: fresh/metrics.json" in printed
    saved = json.loads((tmp_path / "fresh" / "metrics.json").read_text())
    assert saved["written_by"] == "hf-ppo evaluate" and "eval_reward/reward/win_rate" in saved


# ---- issues 50 item 3 and 49 item 10: hf-ppo evaluate prompts and samples as the run trained -----------------------
SYSTEM = "Answer in one word."


def _trained_with_prompting(tiny_models, tmp_path):
    """A LoRA policy trained one step with the Python API on a 'question' column, a system prompt and its own
    sampling settings, saved."""
    questions = Dataset.from_dict({"question": PROMPTS, "id": list(range(len(PROMPTS)))})
    args = _args(tmp_path, system_prompt=SYSTEM, prompt_column="question", response_length=3, temperature=0.9,
                 top_k=7)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=length_reward,
                           train_dataset=questions, peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                                           target_modules="all-linear"))
    trainer.train()
    folder = tmp_path / "saved"
    trainer.save_model(str(folder))
    return folder


def _evaluated(monkeypatch, argv: list[str]) -> dict:
    """What `hf-ppo evaluate` gave the trainer: its sampling settings and its first eval prompt."""
    from hf_ppo.cli.command import evaluate

    seen = {}
    real = PPOLMTrainer.evaluate

    def spy(self, *a, **kw):
        seen.update(args=self.args, prompt=self.eval_dataset[0]["prompt"])
        return real(self, *a, **kw)

    monkeypatch.setattr(PPOLMTrainer, "evaluate", spy)
    evaluate(argv)
    return seen


def test_the_run_record_carries_how_the_run_prompted_and_sampled(tiny_models, tmp_path):
    folder = _trained_with_prompting(tiny_models, tmp_path)
    record = json.loads((folder / "hf_ppo_run.json").read_text())
    assert record["prompts"] == {"column": "question", "system_prompt": SYSTEM, "apply_chat_template_to_text": None,
                                 "format": "chat", "max_prompt_length": 512}
    assert record["sampling"] == {"response_length": 3, "temperature": 0.9, "top_k": 7, "top_p": 1.0, "min_p": 0.0,
                                  "forward_batch_size": 64, "rollout_engine": "kv_cache", "stop_token": "eos",
                                  "stop_token_ids": None}
    assert record["global_step"] == 1


def test_hf_ppo_evaluate_prompts_and_samples_as_the_run_trained(tiny_models, tmp_path, monkeypatch, capsys):
    """Evaluating on the training file fed other prompts (no system prompt, the 'prompt' column) and sampled 53
    tokens at 0.7: the run record's settings are the defaults now, each option overrides its own."""
    folder = _trained_with_prompting(tiny_models, tmp_path)
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": p}) + "\n" for p in PROMPTS[:4]))
    monkeypatch.chdir(tmp_path)
    Path("rewards.py").write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in "
                                  "completions]\n")
    base = ["--policy", str(folder), "--reward_funcs", "rewards.py:length", "--dataset", str(data),
            "--batch_size", "2", "--disable_tqdm"]
    seen = _evaluated(monkeypatch, base)
    assert seen["prompt"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]}]
    assert (seen["args"].response_length, seen["args"].temperature, seen["args"].top_k) == (3, 0.9, 7)
    out = capsys.readouterr().out
    assert "as the run trained" in out and "--system_prompt" in out and "--response_length" in out
    report = (tmp_path / "hf_ppo_eval" / "eval_report.md").read_text()
    assert "(step 1)" in report.splitlines()[1]  # the policy's own step, not the evaluating trainer's 0
    seen = _evaluated(monkeypatch, base + ["--system_prompt", "", "--response_length", "2", "--temperature", "1.0",
                                           "--apply_chat_template_to_text", "false"])
    assert seen["prompt"] == PROMPTS[0]  # no system prompt, the text as it is
    assert (seen["args"].response_length, seen["args"].temperature) == (2, 1.0)
    # A record written before these keys existed: the defaults, as before.
    record = json.loads((folder / "hf_ppo_run.json").read_text())
    for key in ("prompts", "sampling", "global_step"):
        record.pop(key)
    (folder / "hf_ppo_run.json").write_text(json.dumps(record))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    seen = _evaluated(monkeypatch, ["--policy", str(folder), "--reward_funcs", "rewards.py:length", "--dataset",
                                    "prompts.jsonl", "--disable_tqdm", "--apply_chat_template_to_text", "false"])
    assert seen["prompt"] == PROMPTS[0] and (seen["args"].response_length, seen["args"].temperature) == (53, 0.7)
    assert "(training step not recorded)" in (tmp_path / "hf_ppo_eval" / "eval_report.md").read_text()
    # Issue 49 item 10: a run whose text prompts went through the chat template (apply_chat_template_to_text: true)
    # is evaluated through it too, not on raw text.
    (folder / "hf_ppo_run.json").write_text(json.dumps(dict(record, prompts={
        "column": None, "system_prompt": None, "apply_chat_template_to_text": True, "format": "chat"})))
    seen = _evaluated(monkeypatch, ["--policy", str(folder), "--reward_funcs", "rewards.py:length", "--dataset",
                                    "prompts.jsonl", "--disable_tqdm"])
    assert seen["prompt"] == [{"role": "user", "content": PROMPTS[0]}] and seen["args"].apply_chat_template_to_text


def test_the_chat_template_warning_names_an_option_hf_ppo_evaluate_takes(tiny_models, tmp_path, monkeypatch):
    """The warning said `apply_chat_template_to_text=True`, which `hf-ppo evaluate` refused as an unknown option."""
    from hf_ppo.cli.command import evaluate_parser

    with pytest.warns(UserWarning, match="--apply_chat_template_to_text true") as caught:
        PPOLMTrainer(model=tiny_models["policy"], args=_args(tmp_path), reward_model=length_reward,
                     eval_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    flag = str(next(w.message for w in caught if "chat template" in str(w.message)))
    option = flag[flag.index("`--apply_chat_template_to_text"):].split("`")[1].split()
    args = evaluate_parser().parse_args(["--policy", "p", "--dataset", "d", *option])
    assert args.apply_chat_template_to_text == "true"


def test_a_wrong_prompt_column_is_one_line_before_any_model_loads(tiny_models, tmp_path, monkeypatch):
    from hf_ppo.cli.command import evaluate

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "2+2?"}) + "\n")
    monkeypatch.setattr(PPOLMTrainer, "__init__", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit, match=r"no column 'prompt'; its columns are \['question'\].*--prompt_column"):
        evaluate(["--policy", tiny_models["policy"], "--reference", tiny_models["policy"], "--reward_funcs",
                  "hf_ppo.rewards.exact_answer", "--dataset", str(data)])


def test_evaluate_samples_with_ppoconfigs_defaults_when_nothing_is_recorded():
    from hf_ppo.cli.command import SAMPLING_DEFAULTS

    declared = PPOConfig.__dataclass_fields__
    assert {name: declared[name].default for name in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS


# ---- i53c: the run's own reference, a split of a local file ------------------------------------------------------
def _recorded_adapter_folder(folder: Path, base: str, record: dict) -> str:
    """A saved LoRA policy folder as far as `hf-ppo evaluate` reads it before building the trainer: its adapter's
    base, the tokenizer, and the run record."""
    from transformers import AutoTokenizer

    folder.mkdir()
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
    (folder / "hf_ppo_run.json").write_text(json.dumps(record))
    return str(folder)


def test_hf_ppo_evaluate_compares_against_the_reference_the_run_gave(tiny_models, prompts_file, tmp_path,
                                                                     monkeypatch, capsys):
    """A LoRA run trained with `ref_model_name_or_path` (an SFT model, not the adapter's base) was evaluated against
    the base: another reference than training's (KL, win rates), loaded in the recorded reference's quantization,
    and nothing said so. The recorded reference is the default, said in one line; a relative path to the same
    folder keeps its recorded quantization; a recorded folder that is gone is named; with none recorded (the
    adapter disabled), the base."""
    import hf_ppo.trainer
    from hf_ppo.cli.command import evaluate

    built = []

    def trainer(**kwargs):
        built.append(kwargs)
        raise RuntimeError("built")

    monkeypatch.setattr(hf_ppo.trainer, "PPOLMTrainer", trainer)
    sft = tmp_path / "sft"
    shutil.copytree(tiny_models["reward"], sft)  # any folder of a model: only its name is passed on here
    quantization = {"policy": "none", "reference": "4bit", "reward": ["none"]}
    policy = _recorded_adapter_folder(tmp_path / "ppo", tiny_models["policy"],
                                      {"reference": str(sft), "quantization": quantization})
    run = ["--policy", policy, "--reward_model", tiny_models["reward"], "--dataset", prompts_file, "--output_dir",
           str(tmp_path / "eval")]
    with pytest.raises(RuntimeError, match="built"):
        evaluate(run)
    assert built[-1]["ref_model"] == str(sft) and built[-1]["args"].ref_quantization == "4bit"
    assert f"reference {str(sft)!r}, the one the run trained against" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="built"):
        evaluate([*run, "--reference", "sft"])  # the same folder, relative: as recorded
    assert built[-1]["ref_model"] == "sft" and built[-1]["args"].ref_quantization == "4bit"
    with pytest.raises(RuntimeError, match="built"):
        evaluate([*run, "--reference", tiny_models["policy"]])  # another reference: nothing says how it loaded
    assert built[-1]["args"].ref_quantization == "none"
    gone = _recorded_adapter_folder(tmp_path / "gone", tiny_models["policy"],
                                    {"reference": str(tmp_path / "moved"), "quantization": quantization})
    with pytest.raises(SystemExit, match=r"evaluated against the reference '.*moved'.*not there any more: pass "
                       r"--reference"):
        evaluate([*run[:1], gone, *run[2:]])
    inside = _recorded_adapter_folder(tmp_path / "inside", tiny_models["policy"],
                                      {"reference": None, "quantization": quantization})
    with pytest.raises(RuntimeError, match="built"):
        evaluate([*run[:1], inside, *run[2:]])
    assert built[-1]["ref_model"] == tiny_models["policy"]


def test_hf_ppo_evaluate_refuses_a_split_of_a_local_file(tiny_models, prompts_file, monkeypatch):
    """`--dataset prompts.jsonl --dataset_split test` read the whole file as 'test' in silence (a local file has one
    split): refused before any model loads, naming the option; a Hub dataset's missing split names --dataset_split,
    not hf-ppo train's --dataset_train_split."""
    from hf_ppo.cli.command import evaluate

    monkeypatch.setattr(PPOLMTrainer, "__init__", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit, match=r"--dataset_split 'test': .*prompts\.jsonl' is a local file, which has one "
                       r"split.*leave --dataset_split out"):
        evaluate(["--policy", tiny_models["policy"], "--reference", tiny_models["policy"], "--reward_model",
                  tiny_models["reward"], "--dataset", prompts_file, "--dataset_split", "test"])
    folder = Path(prompts_file).parent  # a folder of data files: a dataset of one split, 'train'
    with pytest.raises(SystemExit, match=r"has no split 'test'; it has \['train'\]\. Choose one with "
                       r"--dataset_split\.$"):
        evaluate(["--policy", tiny_models["policy"], "--reference", tiny_models["policy"], "--reward_model",
                  tiny_models["reward"], "--dataset", str(folder), "--dataset_split", "test"])


# ---- i53e: hf-ppo evaluate stops, truncates, scores and splits as the run trained --------------------------------
TRAIN_QUESTIONS, TEST_QUESTIONS = PROMPTS[:4], ["the park was", "the trip was"]


def _trained_by_hf_ppo_train(tiny_models, tmp_path, monkeypatch, every_id: list[int]) -> Path:
    """`hf-ppo train` on a local dataset folder with a train and a test split, every token id but the pad a stop
    token (each response ends at its first token), prompts cut to 3 tokens and the reward model reading 'concat';
    the saved policy's folder."""
    from hf_ppo.cli.command import main

    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    for split, questions in (("train", TRAIN_QUESTIONS), ("test", TEST_QUESTIONS)):
        Path(f"data/{split}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in questions))
    config = {"dataset_name": "data", "dataset_train_split": "train", "dataset_test_split": "test",
              "model_name_or_path": tiny_models["policy"], "reward_model_name_or_path": tiny_models["reward"],
              "output_dir": "runs/out", "use_peft": True, "lora_r": 4, "lora_alpha": 8,
              "lora_target_modules": "all-linear", "response_length": 4, "per_device_train_batch_size": 2,
              "num_mini_batches": 1, "num_ppo_epochs": 1, "max_steps": 1, "num_sample_generations": 0,
              "report_to": "none", "save_strategy": "no", "use_cpu": True, "disable_tqdm": True,
              "stop_token": None, "stop_token_ids": every_id, "max_prompt_length": 3,
              "reward_input_format": "concat", "reward_quantization": "none"}
    Path("run.yaml").write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the test split is loaded and not evaluated on (eval_strategy 'no')
        main(["train", "--config", "run.yaml"])
    return tmp_path / "runs" / "out"


def _built(argv: list[str]) -> dict:
    """The keyword arguments `hf-ppo evaluate` built its trainer with (the trainer itself is not built)."""
    import hf_ppo.trainer
    from hf_ppo.cli.command import evaluate

    built = {}

    def trainer(**kwargs):
        built.update(kwargs)
        raise RuntimeError("built")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(RuntimeError, match="built"):
        patch.setattr(hf_ppo.trainer, "PPOLMTrainer", trainer)
        evaluate(argv)
    return built


def test_hf_ppo_evaluate_stops_truncates_scores_and_splits_as_the_run_trained(tiny_models, tokenizer, tmp_path,
                                                                                monkeypatch, capsys):
    """The run record held no stop tokens, max_prompt_length, reward_input_format or dataset: evaluate sampled to
    'eos' (responses ran past the training stop), kept 512 prompt tokens, read the rewards 'auto', and scored the
    'train' split (the training prompts), all in silence. The recorded values are the defaults now; an option
    still wins and is said to differ; the training split is evaluated if asked, with a warning; an older record
    keeps today's defaults, in one line naming what it lacks."""
    every_id = [i for i in range(len(tokenizer)) if i != tokenizer.pad_token_id]
    folder = _trained_by_hf_ppo_train(tiny_models, tmp_path, monkeypatch, every_id)
    monkeypatch.chdir(tmp_path)
    record = json.loads((folder / "hf_ppo_run.json").read_text())
    assert record["sampling"]["stop_token"] is None and record["sampling"]["stop_token_ids"] == every_id
    assert record["prompts"]["max_prompt_length"] == 3 and record["scoring"] == {"reward_input_format": "concat"}
    assert record["dataset"] == {"name": str(tmp_path / "data"), "config": None, "train_split": "train",
                                 "test_split": "test"}
    base = ["--policy", str(folder), "--reward_model", tiny_models["reward"], "--dataset", "data", "--batch_size",
            "2", "--disable_tqdm"]
    seen = _evaluated(monkeypatch, base)
    args = seen["args"]
    assert (args.stop_token, args.stop_token_ids, args.max_prompt_length, args.reward_input_format) == (
        None, every_id, 3, "concat")
    assert seen["prompt"] == TEST_QUESTIONS[0]  # the held-out split, not 'train'
    metrics = json.loads((tmp_path / "hf_ppo_eval" / "metrics.json").read_text())
    assert metrics["eval_policy/response_length"] == metrics["eval_reference/response_length"] == 1.0
    assert metrics["eval_policy/stop_rate"] == 1.0  # every response ended at the training stop
    assert metrics["dataset"] == {"name": "data", "config": None, "split": "test", "training_prompts": False}
    assert metrics["not_as_trained"] == {} and metrics["not_recorded"] == []
    out = capsys.readouterr().out
    assert "--dataset_split 'test': the split the run held out" in out and "max_prompt_length 3" in out
    # The training split, asked for: evaluated, with the warning that says what they are.
    with pytest.warns(UserWarning, match=r"these are the training prompts: split 'train' of 'data'.*pass "
                                         r"--dataset_split test"):
        built = _built(base + ["--dataset_split", "train"])
    assert built["eval_dataset"][0]["prompt"] == TRAIN_QUESTIONS[0]
    # An option wins over the record, and the console says it differs from training.
    built = _built(base + ["--max_prompt_length", "6", "--stop_token", "eos", "--reward_input_format",
                                        "pair"])
    args = built["args"]
    assert (args.stop_token, args.stop_token_ids, args.max_prompt_length, args.reward_input_format) == (
        "eos", None, 6, "pair")
    out = capsys.readouterr().out
    differs = out[out.index("not as the run trained (its hf_ppo_run.json): "):]
    first_ids = ", ".join(map(str, every_id[:3]))
    for said in ("max_prompt_length 6 (trained: 3)", "reward_input_format 'pair' (trained: 'concat')",
                 "stop_token 'eos' (trained: None)", f"stop_token_ids None (trained: [{first_ids}"):
        assert said in differs.splitlines()[0], said
    # The same stop ids given again are not "another stop".
    _built(base + ["--stop_token_ids", *map(str, every_id)])
    assert "not as the run trained" not in capsys.readouterr().out
    # A record written before these keys: today's defaults, and one line naming what it could not read.
    for section, key in (("prompts", "max_prompt_length"), ("sampling", "stop_token"), ("sampling", "stop_token_ids")):
        del record[section][key]
    del record["scoring"], record["dataset"]
    (folder / "hf_ppo_run.json").write_text(json.dumps(record))
    built = _built(base)
    args = built["args"]
    assert (args.stop_token, args.stop_token_ids, args.max_prompt_length, args.reward_input_format) == (
        "eos", None, 512, "auto")
    assert built["eval_dataset"][0]["prompt"] == TRAIN_QUESTIONS[0]
    out = capsys.readouterr().out
    assert "does not record max_prompt_length, stop_token, stop_token_ids, reward_input_format: evaluating with " \
           "PPOConfig's defaults" in out
    assert "does not record the dataset it trained on" in out


def test_hf_ppo_evaluate_warns_on_the_training_file_and_names_the_held_out_one(tiny_models, tmp_path, monkeypatch):
    """A run that trained on a local file and held out another: evaluating the training file is said (naming the
    held-out file); the held-out file is not; a run that held nothing out says so."""
    from hf_ppo.cli.command import evaluate_parser, evaluation_dataset

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    for path in (train, test):
        path.write_text(json.dumps({"prompt": "x"}) + "\n")
    policy = _recorded_adapter_folder(tmp_path / "ppo", tiny_models["policy"], {"dataset": {
        "name": str(train), "config": None, "train_split": "train", "test_split": str(test)}})

    def resolved(*argv):
        return evaluation_dataset(policy, evaluate_parser().parse_args(["--policy", policy, *argv]))

    monkeypatch.chdir(tmp_path)
    dataset, notes, warning = resolved("--dataset", "train.jsonl")
    assert dataset["split"] == "train" and dataset["training_prompts"] and not notes
    assert "these are the training prompts: the file" in warning and f"pass --dataset {test}" in warning
    dataset, _, warning = resolved("--dataset", str(test))
    assert dataset["training_prompts"] is False and warning is None
    record = json.loads(Path(policy, "hf_ppo_run.json").read_text())
    record["dataset"].update(name="org/prompts", config="main", test_split=None)
    Path(policy, "hf_ppo_run.json").write_text(json.dumps(record))
    dataset, notes, warning = resolved("--dataset", "org/prompts")
    assert dataset == {"name": "org/prompts", "config": "main", "split": "train", "training_prompts": True}
    assert "--dataset_config 'main', the run's" in notes[0] and "it held none out" in warning
    dataset, _, warning = resolved("--dataset", "org/prompts", "--dataset_config", "other", "--dataset_split",
                                   "validation")
    assert dataset["config"] == "other" and dataset["split"] == "validation" and warning is None


def test_every_sampling_setting_of_the_record_is_an_evaluate_option_and_its_default(tmp_path):
    """A sampling setting (`SamplingSettings`, min_p included) reaches `hf-ppo evaluate` without being named there:
    an option of its name, the run record's value as its default, PPOConfig's default without a record."""
    from hf_ppo.cli.command import PROMPTING_DEFAULTS, evaluate_parser, recorded_prompting
    from hf_ppo.rollout.engines import SAMPLING_FIELDS

    assert "min_p" in SAMPLING_FIELDS
    (tmp_path / "hf_ppo_run.json").write_text(json.dumps({"sampling": {"min_p": 0.1, "top_p": 0.9}}))
    base = ["--policy", str(tmp_path), "--dataset", "p.jsonl"]
    settings, recorded = recorded_prompting(str(tmp_path), evaluate_parser().parse_args(base))
    assert (settings["min_p"], settings["top_p"]) == (0.1, 0.9) and {"min_p", "top_p"} <= set(recorded)
    settings, _ = recorded_prompting(str(tmp_path), evaluate_parser().parse_args([*base, "--min_p", "0.2"]))
    assert settings["min_p"] == 0.2
    assert set(SAMPLING_FIELDS) <= set(PROMPTING_DEFAULTS)  # a new sampling setting is added to SAMPLING_DEFAULTS
    assert all(PROMPTING_DEFAULTS[name] == getattr(PPOConfig, name) for name in SAMPLING_FIELDS)


def test_the_sampling_options_parse_as_their_fields_types_whatever_parsed_ppoconfig_before():
    """HfArgumentParser resolves PPOConfig's field types in place: the options' types must not depend on it."""
    from transformers import HfArgumentParser

    from hf_ppo.cli.command import evaluate_parser

    for _ in range(2):
        args = evaluate_parser().parse_args(["--policy", "p", "--dataset", "d", "--response_length", "4",
                                             "--top_k", "3", "--temperature", "1", "--top_p", "1", "--min_p", "0"])
        assert [type(getattr(args, n)) for n in ("response_length", "top_k", "temperature", "top_p", "min_p")] == \
            [int, int, float, float, float]
        HfArgumentParser(PPOConfig)
