"""Publishing the policy through the real huggingface_hub client, against the local Hub of `hub_server.py`."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import huggingface_hub
import pytest
import transformers
import torch
from datasets import Dataset
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from huggingface_hub.errors import RepositoryNotFoundError
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.tiny import build_causal_lm, build_tokenizer
from hf_ppo.hub.cards import write_model_card
from hf_ppo.hub.publish import (
    POLICY_ALLOW_PATTERNS,
    HubPushError,
    make_base_path_absolute,
    published_policy_files,
    push_policy_folder,
    resolve_repo_id,
)
from tests.devices import device_of
from tests.hub_fixtures import HUB_ENDPOINT, TEST_ORG, TEST_TOKEN, TEST_USER

ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "README.md", "training_curves.png"}
# Files training leaves beside the policy; none of them may ever reach the Hub.
DECOYS = ["value_head.safetensors", "model_value_head.safetensors", "training_args.bin", "optimizer.pt",
          "scheduler.pt", "rng_state.pth", "trainer_state.json", "checkpoint-2/adapter_model.safetensors",
          "checkpoint-2/training_curves.png", "reward_model/model.safetensors", "ref_model/model.safetensors"]
LOG_HISTORY = [
    {"step": 2, "objective/scores": 0.10, "objective/kl": 0.000, "rollout/response_length": 12.0},
    {"step": 4, "objective/scores": 0.45, "objective/kl": 0.020, "rollout/response_length": 10.5},
    {"step": 6, "objective/scores": 0.30, "objective/kl": 0.050, "rollout/response_length": 9.0},
    {"step": 6, "train_runtime": 1.5},
]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """A tiny Llama + tokenizer saved as a local base model."""
    path = tmp_path_factory.mktemp("base")
    tokenizer = build_tokenizer()
    build_causal_lm(tokenizer, hidden_size=32, num_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _peft_policy(base_dir: Path):
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    # Non-zero B so the adapter changes the outputs and a wrong download would show in the logits.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=False)
    return get_peft_model(base, config), config


def _write_card(folder: Path, repo_id: str, merged: bool = False, base_model: str = "hf-ppo-test/tiny-base"):
    return write_model_card(
        folder, repo_id=repo_id, base_model=base_model, reward_model="hf-ppo-test/tiny-reward", ref_model=None,
        dataset_names=["hf-ppo-test/prompts"], peft_config=None if merged else {"r": 4, "lora_alpha": 8},
        hyperparameters={"kl_coef": 0.05, "cliprange": 0.2}, log_history=LOG_HISTORY, merged=merged,
    )


def _plant_decoys(folder: Path) -> None:
    for name in DECOYS:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"must never be uploaded: " + name.encode())


@pytest.fixture
def adapter_folder(tmp_path, tiny_base) -> Path:
    """A saved LoRA policy (adapter + tokenizer + card + plot) with training leftovers planted beside it."""
    folder = tmp_path / "policy"
    model, _ = _peft_policy(tiny_base)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_base).save_pretrained(folder)
    _write_card(folder, f"{TEST_USER}/tiny-ppo")
    _plant_decoys(folder)
    return folder


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(path.relative_to(folder).as_posix().encode())
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _logits(model, tokenizer) -> torch.Tensor:
    inputs = tokenizer(["the movie was great"], return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


# ---- Which files ----------------------------------------------------------------------------------------------------
def test_endpoint_is_the_local_hub():
    assert huggingface_hub.constants.ENDPOINT == HUB_ENDPOINT
    assert HfApi().endpoint == HUB_ENDPOINT
    assert huggingface_hub.get_token() is None


def test_policy_files_are_top_level_policy_files_only(adapter_folder):
    assert set(published_policy_files(adapter_folder)) == ADAPTER_FILES
    assert "model*.safetensors" in POLICY_ALLOW_PATTERNS


def test_a_hub_id_base_stays_an_id_and_a_relative_folder_becomes_absolute(tmp_path, monkeypatch):
    """`make_base_path_absolute` (the save path's last step): a base given as a relative folder is rewritten as its
    absolute path, so the adapter loads from any directory; a Hub id stays an id (made absolute, `<cwd>/org/base`
    would load on no machine) and adapter_config.json is left byte for byte as PEFT wrote it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "base").mkdir(parents=True)
    for base in ["org/base", "gpt2"]:
        folder = tmp_path / f"adapter-{base.replace('/', '-')}"
        folder.mkdir()
        written = json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"})
        (folder / "adapter_config.json").write_text(written)
        assert make_base_path_absolute(folder) == base
        assert (folder / "adapter_config.json").read_text() == written
    local = tmp_path / "adapter-local"
    local.mkdir()
    (local / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "models/base"}))
    recorded = make_base_path_absolute(local)
    assert os.path.isabs(recorded) and os.path.samefile(recorded, tmp_path / "models" / "base")
    assert json.loads((local / "adapter_config.json").read_text())["base_model_name_or_path"] == recorded
    assert make_base_path_absolute(tmp_path / "models") is None  # no adapter there


# ---- Round trips ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("xet_installed", [True, False], ids=["pipelined-upload", "create-commit"])
def test_push_adapter_round_trip(local_hub, adapter_folder, tiny_base, monkeypatch, xet_installed):
    # With hf_xet installed upload_folder streams through its upload pipeline, without it through
    # create_commit: both must work.
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: xet_installed)
    repo_id = f"{TEST_USER}/tiny-ppo"

    url = push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)

    assert url.startswith(f"{local_hub.url}/{repo_id}/commit/")
    remote = local_hub.files(repo_id)
    assert set(remote) == ADAPTER_FILES | {".gitattributes"}
    for name in ADAPTER_FILES:
        assert remote[name] == (adapter_folder / name).read_bytes(), name
        downloaded = hf_hub_download(repo_id, name)
        assert Path(downloaded).read_bytes() == (adapter_folder / name).read_bytes(), name
    assert any(r["path"] == "/api/validate-yaml" for r in local_hub.requests)  # the card's YAML was checked

    tokenizer = AutoTokenizer.from_pretrained(repo_id)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(adapter_folder).get_vocab()
    from_hub = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), repo_id)
    local = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), adapter_folder)
    torch.testing.assert_close(_logits(from_hub, tokenizer), _logits(local, tokenizer), rtol=0, atol=0)
    inputs = tokenizer(["the food was"], return_tensors="pt")
    out = from_hub.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 4)


@pytest.mark.parametrize("xet_installed", [True, False], ids=["pipelined-upload", "create-commit"])
def test_pushing_an_unchanged_folder_again_makes_no_commit(local_hub, adapter_folder, monkeypatch, xet_installed):
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: xet_installed)
    repo_id = f"{TEST_USER}/tiny-ppo"
    first = push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)
    commits = len(local_hub.repos[repo_id].commits)

    again = push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)

    assert again.oid == first.oid
    assert len(local_hub.repos[repo_id].commits) == commits


def test_push_merged_model_round_trip(local_hub, tmp_path, tiny_base):
    folder = tmp_path / "merged"
    model, _ = _peft_policy(tiny_base)
    model.merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_base).save_pretrained(folder)
    _write_card(folder, f"{TEST_ORG}/tiny-ppo-merged", merged=True)
    _plant_decoys(folder)
    repo_id = f"{TEST_ORG}/tiny-ppo-merged"  # an organisation the token's user belongs to

    push_policy_folder(folder, repo_id, token=TEST_TOKEN)

    remote = set(local_hub.files(repo_id))
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= remote
    assert not remote & set(DECOYS)
    tokenizer = AutoTokenizer.from_pretrained(repo_id)
    from_hub = AutoModelForCausalLM.from_pretrained(repo_id)
    local = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(_logits(from_hub, tokenizer), _logits(local, tokenizer), rtol=0, atol=0)
    assert ModelCard.load(repo_id).data.library_name == "transformers"


def test_push_to_branch_loads_by_revision(local_hub, adapter_folder, tiny_base):
    repo_id = f"{TEST_USER}/tiny-ppo"

    push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN, revision="experiment")

    assert set(local_hub.files(repo_id, "main")) == {".gitattributes"}
    assert set(local_hub.files(repo_id, "experiment")) == ADAPTER_FILES | {".gitattributes"}
    refs = HfApi().list_repo_refs(repo_id)
    assert sorted(b.name for b in refs.branches) == ["experiment", "main"]
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    PeftModel.from_pretrained(base, repo_id, revision="experiment")
    with pytest.raises(Exception):  # main has no adapter
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), repo_id)
    # A second push to the same branch reuses it and only adds the changed file.
    (adapter_folder / "README.md").write_text((adapter_folder / "README.md").read_text() + "\nRetrained.\n")
    push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN, revision="experiment")
    assert local_hub.files(repo_id, "experiment")["README.md"].endswith(b"Retrained.\n")


def test_create_pr_leaves_main_alone(local_hub, adapter_folder):
    repo_id = f"{TEST_USER}/tiny-ppo"
    push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)
    before = local_hub.files(repo_id)
    (adapter_folder / "README.md").write_text("---\ntags: [hf_ppo]\n---\nA better card.\n")

    info = push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN, create_pr=True)

    assert info.pr_url == f"{local_hub.url}/{repo_id}/discussions/1"
    assert local_hub.files(repo_id) == before
    assert local_hub.files(repo_id, "refs/pr/1")["README.md"] == b"---\ntags: [hf_ppo]\n---\nA better card.\n"


def test_create_pr_with_branch_is_refused_before_any_request(local_hub, adapter_folder):
    with pytest.raises(ValueError, match="create_pr"):
        push_policy_folder(adapter_folder, f"{TEST_USER}/x", token=TEST_TOKEN, revision="dev", create_pr=True)
    assert local_hub.requests == []


def test_folder_without_weights_is_refused_before_any_request(local_hub, tmp_path):
    (tmp_path / "README.md").write_text("hello")
    with pytest.raises(ValueError, match="no policy weights"):
        push_policy_folder(tmp_path, f"{TEST_USER}/x", token=TEST_TOKEN)
    assert local_hub.requests == []


def test_private_repo_needs_the_token(local_hub, adapter_folder):
    repo_id = f"{TEST_USER}/tiny-ppo-private"

    push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN, private=True)

    assert HfApi().model_info(repo_id, token=TEST_TOKEN).private is True
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info(repo_id)
    # transformers' wrap of RepoNotFound (before 5.20 with huggingface_hub 1.x: a config it could not read)
    with pytest.raises((OSError, ValueError), match="not a valid model identifier|Unrecognized model"):
        AutoTokenizer.from_pretrained(repo_id)
    # (Not AutoTokenizer with the token: transformers before 5.20 drops it on one of its requests.)
    assert os.path.exists(hf_hub_download(repo_id, "adapter_config.json", token=TEST_TOKEN))


# ---- Failures -------------------------------------------------------------------------------------------------------
FAILURES = {
    "server-error": ("HTTP 500", lambda hub: hub.fail_with(500), lambda hub: hub.fail_with(None)),
    "unauthorized": ("credentials", lambda hub: hub.fail_with(401), lambda hub: hub.fail_with(None)),
    "server-down": ("could not be reached", lambda hub: hub.stop(), lambda hub: hub.start()),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_push_keeps_the_folder_and_can_be_retried(local_hub, adapter_folder, failure):
    expected, break_hub, fix_hub = FAILURES[failure]
    repo_id = f"{TEST_USER}/tiny-ppo"
    before = _folder_digest(adapter_folder)
    break_hub(local_hub)

    with pytest.raises(HubPushError) as info:
        push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)

    message = str(info.value)
    assert repo_id in message and expected in message
    assert "intact" in message and "trainer.push_to_hub()" in message
    assert TEST_TOKEN not in message
    assert _folder_digest(adapter_folder) == before
    fix_hub(local_hub)
    push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)
    assert set(local_hub.files(repo_id)) == ADAPTER_FILES | {".gitattributes"}


@pytest.mark.parametrize("xet_installed", [True, False], ids=["pipelined-upload", "create-commit"])
def test_failed_commit_after_repo_creation(local_hub, adapter_folder, monkeypatch, xet_installed):
    # The repo exists but the commit fails (the client retries it with backoff: skip the sleeping).
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: xet_installed)
    monkeypatch.setattr(huggingface_hub.utils._http.time, "sleep", lambda seconds: None)
    repo_id = f"{TEST_USER}/tiny-ppo"
    local_hub.fail_with(503, path_contains="/commit/")

    with pytest.raises(HubPushError, match="HTTP 503"):
        push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)

    assert set(local_hub.files(repo_id)) == {".gitattributes"}
    local_hub.fail_with(None)
    push_policy_folder(adapter_folder, repo_id, token=TEST_TOKEN)
    assert set(local_hub.files(repo_id)) == ADAPTER_FILES | {".gitattributes"}


def test_wrong_token_is_an_auth_error(local_hub, adapter_folder):
    with pytest.raises(HubPushError, match="refused the credentials") as info:
        push_policy_folder(adapter_folder, f"{TEST_USER}/tiny-ppo", token="hf_not_a_valid_token")
    assert "hf_not_a_valid_token" not in str(info.value)


def test_no_write_access_to_another_namespace(local_hub, adapter_folder):
    with pytest.raises(HubPushError, match="HTTP 403"):
        push_policy_folder(adapter_folder, "someone-else/tiny-ppo", token=TEST_TOKEN)


# ---- Model card -----------------------------------------------------------------------------------------------------
def test_model_card_content_and_metadata(tmp_path, tiny_base):
    folder = tmp_path / "out"
    _, lora = _peft_policy(tiny_base)
    secret = "hf_secret_value_123"
    path = write_model_card(
        folder,
        repo_id=f"{TEST_USER}/tiny-ppo",
        base_model="hf-ppo-test/tiny-base",
        reward_model=str(tiny_base),  # a local path: must not leak
        ref_model=None,
        dataset_names=["hf-ppo-test/prompts", str(tmp_path / "prompts.jsonl")],
        peft_config=lora.to_dict(),  # holds base_model_name_or_path etc.
        hyperparameters={"kl_coef": 0.05, "cliprange": 0.2, "num_ppo_epochs": 4, "output_dir": str(tmp_path),
                         "hub_token": secret, "logging_dir": str(Path.home() / "runs")},
        log_history=LOG_HISTORY,
    )

    assert path == folder / "README.md"
    text = path.read_text()
    card = ModelCard.load(path)
    assert card.data.base_model == "hf-ppo-test/tiny-base"
    assert card.data.library_name == "peft"
    assert {"hf_ppo", "ppo", "rlhf"} <= set(card.data.tags)
    assert card.data.datasets == ["hf-ppo-test/prompts"]
    for section in ["## Models", "## How to load", "## Results", "## Training procedure", "### LoRA hyperparameters",
                    "### PPO hyperparameters", "## Framework versions", "## Citations"]:
        assert section in text, section
    assert "PeftModel.from_pretrained(base, \"hf-ppo-test/tiny-ppo\")" in text
    assert 'AutoModelForCausalLM.from_pretrained("hf-ppo-test/tiny-base")' in text
    assert "base model with the LoRA adapter disabled" in text
    assert "| reward model | a local model |" in text and "a local dataset" in text
    # Final metrics at step 6, the best reward (0.45) at step 4 with its KL and length.
    assert "final (step 6)" in text and "at best reward (step 4)" in text
    assert "| reward (score) | 0.3 | 0.45 | 0.1 | 0.45 |" in text
    assert "| KL to the reference | 0.05 | 0.02 | 0 | 0.05 |" in text
    assert "| response length (tokens) | 9 | 10.5 | 9 | 12 |" in text
    assert "| `r` | `4` |" in text and "| `target_modules` | `q_proj, v_proj` |" in text
    assert "| `kl_coef` | `0.05` |" in text
    for package in ["torch", "transformers", "peft", "trl", "hf_ppo"]:
        assert f"- {package}: " in text
    for arxiv in ["1707.06347", "1909.08593", "2403.17031"]:
        assert arxiv in text
    assert "![Reward, KL, response length and entropy per PPO iteration](training_curves.png)" in text
    assert (folder / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Nothing from this machine.
    for leak in [str(tmp_path), str(tiny_base), str(Path.home()), "/tmp/", secret, f"/{getpass.getuser()}/"]:
        assert leak not in text, leak


def test_model_card_merged_and_local_base(tmp_path, tiny_base):
    path = _write_card(tmp_path, "org/merged", merged=True, base_model=str(tiny_base))
    text = path.read_text()
    card = ModelCard.load(path)
    assert card.data.library_name == "transformers"
    assert card.data.base_model is None  # a local base is not a Hub id
    assert 'AutoModelForCausalLM.from_pretrained("org/merged")' in text and "PeftModel" not in text
    assert "| base model (policy initialisation) | a local model |" in text
    assert "LoRA hyperparameters" not in text
    assert str(tiny_base) not in text


def test_model_card_without_metrics(tmp_path):
    path = write_model_card(tmp_path, repo_id="org/name", base_model=None, reward_model=None, ref_model="org/ref",
                            dataset_names=[], peft_config=None, hyperparameters={}, log_history=[])
    text = path.read_text()
    assert "No training metrics were logged." in text
    assert "[org/ref](https://huggingface.co/org/ref)" in text
    assert not (tmp_path / "training_curves.png").exists() and "training_curves.png" not in text
    ModelCard.load(path)


@pytest.mark.parametrize("hyperparameters,says,never", [
    ({"advantage_estimator": "gae", "critic": "shared"}, "clipped PPO with a value head on the policy's body", "no critic"),
    ({"advantage_estimator": "gae", "critic": "reward_lora"}, "a LoRA critic on the reward model's frozen base",
     "no critic"),
    ({"advantage_estimator": "rloo", "num_generations": 2}, "RLOO (leave-one-out baseline) advantages over 2 responses",
     "GAE"),
    ({"advantage_estimator": "grpo", "num_generations": 4, "scale_rewards": False}, "Dr. GRPO", "GAE"),
])
def test_model_card_names_the_estimator_and_the_critic(tmp_path, hyperparameters, says, never):
    # A GRPO run's card must not describe PPO with a value head and GAE (nor a PPO run's a critic-free one).
    path = write_model_card(tmp_path, repo_id="org/name", base_model=None, reward_model=None, ref_model=None,
                            dataset_names=[], peft_config=None, hyperparameters=hyperparameters, log_history=[])
    text = path.read_text()
    assert says in text and never not in text
    assert f"| `advantage_estimator` | `{hyperparameters['advantage_estimator']}` |" in text


@pytest.mark.slow
def test_card_template_ships_in_the_wheel(tmp_path):
    # Build the wheel from a copy (the working tree stays clean), unpack it as site-packages would hold it, and
    # render a card from there: only importlib.resources can find the template then, not the source fallback.
    repo = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    src.mkdir()
    for name in ["pyproject.toml", "hf_ppo"]:  # what pyproject.toml packages
        copy = shutil.copytree if (repo / name).is_dir() else shutil.copy
        copy(repo / name, src / name)
    for cache in src.rglob("__pycache__"):
        shutil.rmtree(cache)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, timeout=300, capture_output=True)
    wheel = next((tmp_path / "dist").glob("hf_ppo-*.whl"))
    assert "hf_ppo/hub/templates/policy_card.md.jinja" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = ("import sys, hf_ppo.hub as hub; assert hub.__file__.startswith(sys.argv[1]); "
              "hub.write_model_card(sys.argv[2], repo_id='org/name', base_model=None, reward_model=None, "
              "ref_model=None, dataset_names=[], peft_config=None, hyperparameters={}, log_history=[])")
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(site), str(tmp_path / "card")], cwd=tmp_path, env=env,
                   check=True, timeout=300)
    assert ModelCard.load(tmp_path / "card" / "README.md").data.tags == ["hf_ppo", "ppo", "rlhf"]


# ---- Repo id --------------------------------------------------------------------------------------------------------
def test_resolve_repo_id_explicit_needs_no_request(local_hub):
    assert resolve_repo_id("org/name", "/some/dir/out", None) == "org/name"
    assert local_hub.requests == []


def test_resolve_repo_id_under_the_token_user(local_hub):
    assert resolve_repo_id(None, "/some/dir/my-run", TEST_TOKEN) == f"{TEST_USER}/my-run"
    assert resolve_repo_id("named", "/some/dir/my-run", TEST_TOKEN) == f"{TEST_USER}/named"
    assert [r["path"] for r in local_hub.requests] == ["/api/whoami-v2"] * 2


@pytest.mark.parametrize("token", [None, "hf_not_a_valid_token"], ids=["no-token", "bad-token"])
def test_resolve_repo_id_without_user_names_the_fix(local_hub, token):
    with pytest.raises(ValueError, match="hub_model_id") as info:
        resolve_repo_id(None, "/some/dir/my-run", token)
    assert "hf auth login" in str(info.value) and "hub_token" in str(info.value)


def test_resolve_repo_id_hub_down_names_the_fix():
    # No `local_hub`: the port refuses connections.
    with pytest.raises(ValueError, match="hub_model_id"):
        resolve_repo_id(None, "out", TEST_TOKEN)


def test_resolve_repo_id_rejects_invalid_ids():
    with pytest.raises(ValueError, match="hub_model_id"):
        resolve_repo_id("org/bad name!", "out", None)


# ---- publishing through the trainer ----------------------------------------------------------------------------------
# Publishing through the trainer: push only the policy (round trip via a local Hub), failed pushes, resume, and a
# reward model with a different tokenizer.

def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def make_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        num_mini_batches=2, num_ppo_epochs=2, max_steps=8, response_length=8, logging_steps=4, learning_rate=1e-2,
        report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0,
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def folder_digest(folder) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, f))}


def test_train_push_load_generate(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path, local_hub, hub_token):
    repo_id = f"{TEST_USER}/tiny-ppo"
    args = make_args(tmp_path, push_to_hub=True, hub_model_id=repo_id, hub_token=hub_token)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config,
                           )
    trainer.train()
    pushes = []
    trainer.add_callback(type("Pushes", (transformers.TrainerCallback,), {
        "on_push_begin": lambda self, *a, **k: pushes.append(1)})())
    saved = folder_digest(args.output_dir)
    for extra in ({"tags": ["rlhf"]}, {"model_name": "mine", "license": "mit"}):  # Trainer's card arguments
        with pytest.raises(TypeError, match=r"push_to_hub\((license, model_name|tags)=\.\.\.\): hf_ppo's push takes "
                                            r"commit_message.*nothing was saved or pushed"):
            trainer.push_to_hub(**extra)
    assert folder_digest(args.output_dir) == saved and not pushes
    assert repo_id not in local_hub.repos or "adapter_model.safetensors" not in local_hub.files(repo_id)
    trainer.push_to_hub(dataset_name="hf-ppo-test/prompts")
    assert pushes == [1]  # Trainer's on_push_begin, as its own push_to_hub calls it

    pushed = local_hub.files(repo_id)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md",
            "training_curves.png"} <= set(pushed)
    assert not [f for f in pushed if f.startswith("checkpoint") or f in (
        "value_head.safetensors", "training_args.bin", "optimizer.pt", "scheduler.pt", "ppo_state.json")]
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        assert pushed[name] == open(os.path.join(args.output_dir, name), "rb").read()
    card = pushed["README.md"].decode()
    assert "hf_ppo" in card and "rlhf" in card and "hf-ppo-test/prompts" in card
    assert str(tmp_path) not in card and hub_token not in card

    # The pushed adapter loads by repo id from the (local) Hub and generates.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    policy = PeftModel.from_pretrained(base, repo_id, token=hub_token)
    tok = AutoTokenizer.from_pretrained(repo_id, token=hub_token)
    inputs = tok(["the movie was"], return_tensors="pt")
    out = policy.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    trained = dict(trainer.model.pretrained_model.named_parameters())  # on the trainer's device (a GPU where visible)
    for name, value in policy.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(value, trained[name].detach().cpu())


def test_push_to_hub_pushes_the_critic_to_its_own_repo(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path,
                                                        local_hub, hub_token):
    from hf_ppo.hub.publish import push_run_critic
    from hf_ppo.models.critics import CRITIC_INFO_FILE, CRITIC_STATE_FILE

    repo_id, critic_repo = f"{TEST_USER}/tiny-ppo", f"{TEST_USER}/tiny-ppo-critic"
    args = make_args(tmp_path, max_steps=4, hub_model_id=repo_id, hub_token=hub_token, critic="separate",
                     critic_hub_model_id=critic_repo)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    trainer.push_to_hub()
    policy_files, critic_files = set(local_hub.files(repo_id)), set(local_hub.files(critic_repo))
    assert "adapter_model.safetensors" in policy_files and not {CRITIC_STATE_FILE, CRITIC_INFO_FILE} & policy_files
    assert {CRITIC_STATE_FILE, CRITIC_INFO_FILE, "README.md"} <= critic_files
    assert "adapter_model.safetensors" not in critic_files
    assert critic_repo in local_hub.files(repo_id)["README.md"].decode()  # the policy's card names the critic's repo

    again = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, critic="separate"),
                         processing_class=tokenizer, reward_model=tiny_models["reward"],
                         train_dataset=prompts_dataset, peft_config=lora_config, critic_model=critic_repo)
    saved, loaded = trainer.model.critic_state_dict(), again.model.critic_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # A hub_model_id without a namespace resolves to the critic's repo: refused before anything is pushed.
    with pytest.raises(ValueError, match="is the policy's repo: the critic goes to a repo of its own"):
        push_run_critic(trainer.model, tokenizer, args.critic_hub_model_id, critic_repo, private=None, token=hub_token)


def test_push_merged_model(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path, local_hub, hub_token):
    repo_id = f"{TEST_USER}/tiny-ppo-merged"
    args = make_args(tmp_path, max_steps=4, push_to_hub=True, hub_model_id=repo_id, hub_token=hub_token,
                     push_merged_model=True)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    trainer.push_to_hub()
    pushed = set(local_hub.files(repo_id))
    assert "model.safetensors" in pushed and "adapter_config.json" not in pushed

    from transformers import AutoModelForCausalLM

    trained = trainer.model.pretrained_model
    merged = AutoModelForCausalLM.from_pretrained(repo_id, token=hub_token).to(device_of(trained))  # as the trained
    probe = tokenizer(["the movie was great"], return_tensors="pt").to(device_of(trained))
    with torch.no_grad():
        torch.testing.assert_close(merged(**probe).logits, trained(**probe).logits, atol=1e-4, rtol=1e-4)


def test_failed_push_keeps_output_and_can_be_retried(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path,
                                                     local_hub, hub_token):
    from hf_ppo.hub.publish import HubPushError

    repo_id = f"{TEST_USER}/tiny-ppo-retry"
    args = make_args(tmp_path, max_steps=4, push_to_hub=True, hub_model_id=repo_id, hub_token=hub_token)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    local_hub.fail_with(500)
    with pytest.raises(HubPushError, match="retry with trainer.push_to_hub"):
        trainer.push_to_hub()
    saved = folder_digest(args.output_dir)
    assert "adapter_model.safetensors" in saved
    local_hub.fail_with(None)
    trainer.push_to_hub()  # no retraining
    assert folder_digest(args.output_dir) == saved
    assert "adapter_model.safetensors" in local_hub.files(repo_id)


def test_push_without_repo_id_or_user_fails_at_construction(tiny_models, tokenizer, prompts_dataset, tmp_path):
    args = make_args(tmp_path, push_to_hub=True)  # no hub_model_id, no token: no user to push under
    with pytest.raises(ValueError, match="hub_model_id"):
        PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                     train_dataset=prompts_dataset)


@pytest.mark.parametrize("hub_up", [True, False], ids=["hub-404", "hub-down"])
def test_missing_model_id_names_it(tmp_path, prompts_dataset, request, monkeypatch, hub_up):
    if hub_up:
        request.getfixturevalue("local_hub")  # answers 404 at once
    else:
        # The port refuses connections and the client retries with back-off (~45 s of sleeping): skip the sleeps.
        import huggingface_hub

        monkeypatch.setattr(huggingface_hub.utils._http.time, "sleep", lambda seconds: None)
    with pytest.raises(OSError, match="hf-ppo-test/does-not-exist"):
        PPOLMTrainer(model="hf-ppo-test/does-not-exist", args=make_args(tmp_path), reward_model=count_e,
                     train_dataset=prompts_dataset)


def test_reward_model_with_a_different_tokenizer(tiny_models, tokenizer, tmp_path):
    """The reward model reads text in its own vocabulary and chat template: decode, re-template, re-tokenize."""
    from hf_ppo.cli.tiny import CHAT_TEMPLATE, build_reward_model, build_tokenizer
    from hf_ppo.rollout.scoring import score_responses

    reward_tok = build_tokenizer(vocab_size=300)
    reward_tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert reward_tok.get_vocab() != tokenizer.get_vocab() and reward_tok.chat_template != CHAT_TEMPLATE
    reward_dir = tmp_path / "reward300"
    build_reward_model(reward_tok).save_pretrained(reward_dir)
    reward_tok.save_pretrained(reward_dir)
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": "the movie was"}]] * 8})
    args = make_args(tmp_path, per_device_train_batch_size=4, num_mini_batches=1, max_steps=2, num_ppo_epochs=2,
                     reward_quantization="none")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=str(reward_dir), train_dataset=chats)
    assert trainer.reward_tokenizer is not None
    trainer.train()
    assert all(torch.isfinite(torch.tensor(e["objective/scores"])) for e in trainer.state.log_history
               if "objective/scores" in e)

    # The score equals the reward model run by hand on the reward tokenizer's rendering of the conversation.
    batch = trainer.data_collator([trainer.train_dataset[0]])
    response = torch.tensor([tokenizer(" great fun", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]])
    score = score_responses(trainer.reward_model, queries=batch["queries"], query_mask=batch["query_mask"],
                            responses=response, response_mask=torch.ones_like(response, dtype=torch.bool),
                            tokenizer=tokenizer, prompts=batch["prompts"], batch_size=4,
                            reward_tokenizer=trainer.reward_tokenizer)
    text = reward_tok.apply_chat_template([{"role": "user", "content": "the movie was"},
                                           {"role": "assistant", "content": " great fun"}], tokenize=False)
    encoded = reward_tok([text], return_tensors="pt", add_special_tokens=False).to(device_of(trainer.reward_model))
    with torch.no_grad():
        expected = trainer.reward_model(**encoded).logits[0, 0]
    # score_responses returns fp32 scores on its inputs' device (the CPU here), whatever the reward model's.
    torch.testing.assert_close(score[0], expected.float().to(score.device), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_lora", [True, False])
def test_resume_matches_an_uninterrupted_run(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path, use_lora):
    """4 iterations straight == resume from the checkpoint after iteration 2, then 2 more: the same weights and logged
    metrics, bitwise on CPU (RNG states, sampler position, optimizer, scheduler, KL controller and value head are all
    restored, and the same ops run in the same order on the same data)."""
    common = dict(max_steps=16, save_strategy="steps", save_steps=8, adaptive_kl=True, kl_coef=0.1, logging_steps=4)

    def run(out, resume=None, **extra):
        args = make_args(tmp_path, output_dir=str(tmp_path / out), **{**common, **extra})
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                               reward_model=count_e, train_dataset=prompts_dataset,
                               peft_config=lora_config if use_lora else None)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("straight")
    # "Stop" after iteration 2: a fresh trainer (a new process would do the same) resumes from the checkpoint.
    resumed = run("resumed", resume=str(tmp_path / "straight" / "checkpoint-8"))

    def metrics(trainer):
        return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k and "runtime" not in k}
                for e in trainer.state.log_history if "objective/scores" in e]

    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert len(metrics(straight)) == 4 and metrics(straight) == metrics(resumed)
    assert straight.kl_ctl.value == resumed.kl_ctl.value


# ---- i53e: the run record says how the run stopped, truncated and scored, and which dataset it trained on --------
def test_the_run_record_holds_the_stop_truncation_scoring_and_dataset(tmp_path):
    """The record held no stop tokens, max_prompt_length or reward_input_format, so `hf-ppo evaluate` sampled to
    'eos', kept 512 prompt tokens and read the rewards 'auto' whatever the run did; and no dataset, so it could not
    tell the held-out split from the training one. `stop_token_id` is recorded as the one id of `stop_token_ids`."""
    from hf_ppo.hub.publish import read_run_record, record_dataset, run_record

    args = make_args(tmp_path, stop_token=None, stop_token_id=5, max_prompt_length=3, reward_input_format="pair",
                     use_cpu=True)
    record = run_record(args.publish_settings, {"model": "org/base"}, torch.nn.Linear(2, 2), None, None, count_e)
    assert (record["sampling"]["stop_token"], record["sampling"]["stop_token_ids"]) == (None, [5])
    assert record["prompts"]["max_prompt_length"] == 3 and record["scoring"] == {"reward_input_format": "pair"}
    defaults = run_record(make_args(tmp_path, use_cpu=True).publish_settings, {"model": "org/base"},
                          torch.nn.Linear(2, 2), None, None, count_e)
    assert (defaults["sampling"]["stop_token"], defaults["sampling"]["stop_token_ids"]) == ("eos", None)
    assert defaults["prompts"]["max_prompt_length"] == 512 and "dataset" not in defaults
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "hf_ppo_run.json").write_text(json.dumps(record))
    record_dataset(saved, "openai/gsm8k", "main", "train", "test")
    assert read_run_record(saved) == {**record, "dataset": {"name": "openai/gsm8k", "config": "main",
                                                           "train_split": "train", "test_split": "test"}}
    assert sorted(os.listdir(saved)) == ["hf_ppo_run.json"]  # replaced whole, nothing left beside it
    other = tmp_path / "other"
    other.mkdir()
    record_dataset(other, "openai/gsm8k", None, "train", None)  # no record there: none is made
    assert not os.listdir(other)


@pytest.mark.parametrize("text, said", [('{"global_step": 4, "sampl', "cannot be read (JSONDecodeError"),
                                        ("[1, 2]", "holds a JSON list, not the object hf_ppo writes"),
                                        ("\xff\xfe", "cannot be read")])
def test_a_damaged_run_record_is_said_not_ignored_in_silence(tmp_path, text, said):
    """Issue 60 item 10: a corrupt hf_ppo_run.json was ignored without a word (hf-ppo evaluate then used its own
    defaults, not the run's), and one that was JSON but no object raised AttributeError. Both are said, and read
    as no record; a folder without one stays quiet."""
    import re
    import warnings

    from hf_ppo.hub.publish import RUN_RECORD_FILE, read_run_record, record_dataset

    (tmp_path / RUN_RECORD_FILE).write_bytes(text.encode("latin-1"))
    with pytest.warns(UserWarning, match=rf"{RUN_RECORD_FILE} {re.escape(said)}.*it is ignored"):
        assert read_run_record(tmp_path) is None
    with pytest.warns(UserWarning):
        record_dataset(tmp_path, "data.jsonl", None, "train", None)  # left as it is
    assert (tmp_path / RUN_RECORD_FILE).read_bytes() == text.encode("latin-1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_run_record(tmp_path / "none") is None
