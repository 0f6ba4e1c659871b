"""Files and the Hub on the paths a real run takes.

- a critic pushed by a run with `hub_private_repo` is private, like the policy (checked on the local Hub);
- a push into repos created beforehand, holding the `.gitattributes` the real Hub starts every repo with: both the
  policy's and the critic's go through, and the `.gitattributes` stays as it was;
- a resume from a checkpoint written before a setting existed (the field deleted from its saved settings), through
  `trainer.train(resume_from_checkpoint=...)`: resumes exactly at the default, refuses another value;
- a mid-iteration checkpoint whose rollout buffer is missing or truncated: an error naming the file for an explicit
  folder; with `resume_from_checkpoint=True`, the documented fallback (moved aside with a warning naming the file,
  the run resumed exactly from the checkpoint before it);
- a saved fully fine-tuned critic loads, bitwise, after the base model folder it started from is gone.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.trainer.checkpoint import PPO_STATE_FILE, ROLLOUT_BUFFER_FILE, CheckpointError
from tests.devices import on_device_of
from tests.hub_fixtures import TEST_USER

PROMPTS = ["the movie was", "the food was", "the book was", "the show was"] * 4


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def make_args(out, **overrides) -> PPOConfig:
    # 4 optimizer steps per iteration (2 epochs x 2 minibatches of 4), 8 prompts per rollout.
    defaults = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    num_mini_batches=2, num_ppo_epochs=2, max_steps=4, response_length=6, logging_steps=1,
                    learning_rate=1e-2, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0)
    defaults.update(overrides)
    return PPOConfig(**defaults)


def make_trainer(tiny_models, tokenizer, out, critic_model=None, **overrides) -> PPOLMTrainer:
    return PPOLMTrainer(model=tiny_models["policy"], args=make_args(out, **overrides), processing_class=tokenizer,
                        reward_model=count_e, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        critic_model=critic_model)


def assert_same_weights(a, b):
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), name


# ---- the Hub --------------------------------------------------------------------------------------------------------
def test_a_private_run_pushes_its_critic_private_too(tiny_models, tokenizer, tmp_path, local_hub, hub_token):
    """Pins `hub_private_repo` on its way to the critic's repo: push_to_hub (with critic_hub_model_id) and
    push_critic_to_hub must create the critic's repo private, as the policy's; a public critic repo would publish
    what the user marked private. Without the token the private repos are invisible."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    repo, critic_repo, other = (f"{TEST_USER}/private-run", f"{TEST_USER}/private-run-critic",
                                f"{TEST_USER}/private-run-critic-2")
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "out", hub_model_id=repo, hub_token=hub_token,
                           hub_private_repo=True, critic_hub_model_id=critic_repo)
    trainer.push_to_hub()
    trainer.push_critic_to_hub(other)  # called directly: the run's hub_private_repo applies too
    api = HfApi()
    for repo_id in (repo, critic_repo, other):
        assert api.model_info(repo_id, token=hub_token).private is True, f"{repo_id} was created public"
        with pytest.raises(RepositoryNotFoundError):
            api.model_info(repo_id, token=False)
    assert "critic.safetensors" in local_hub.files(critic_repo) and "critic.safetensors" in local_hub.files(other)


GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def test_a_push_into_repos_created_beforehand(tiny_models, tokenizer, tmp_path, local_hub, hub_token):
    """Pins pushes into repos that exist already, as the real Hub makes them (a `.gitattributes` in the first
    commit): the policy's and the critic's pushes both go through (the critic push must not take `.gitattributes`
    for a policy's file and refuse the repo), twice, and never delete or change the `.gitattributes`."""
    from huggingface_hub import HfApi

    repo, critic_repo = f"{TEST_USER}/made-before", f"{TEST_USER}/made-before-critic"
    api = HfApi(token=hub_token)
    for repo_id in (repo, critic_repo):
        api.create_repo(repo_id)
        api.upload_file(path_or_fileobj=GITATTRIBUTES, path_in_repo=".gitattributes", repo_id=repo_id)
        assert set(local_hub.files(repo_id)) == {".gitattributes"}
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "out", hub_model_id=repo, hub_token=hub_token,
                           critic_hub_model_id=critic_repo)
    for _ in range(2):  # a second push replaces the first
        trainer.push_to_hub()
        policy, critic = local_hub.files(repo), local_hub.files(critic_repo)
        assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= set(policy)
        assert {"critic.safetensors", "hf_ppo_critic.json", "README.md"} <= set(critic)
        assert policy[".gitattributes"] == GITATTRIBUTES and critic[".gitattributes"] == GITATTRIBUTES


# ---- resuming -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def straight(tiny_models, tokenizer, tmp_path_factory):
    """One iteration (4 steps) uninterrupted, a checkpoint after every step (1-3 part-way through the iteration)."""
    out = tmp_path_factory.mktemp("straight")
    trainer = make_trainer(tiny_models, tokenizer, out, save_strategy="steps", save_steps=1)
    trainer.train()
    for step in (1, 2, 3):
        assert os.path.isfile(out / f"checkpoint-{step}" / ROLLOUT_BUFFER_FILE)
    return trainer, out


def copy_checkpoints(out, dest, steps) -> None:
    for step in steps:
        shutil.copytree(out / f"checkpoint-{step}", dest / f"checkpoint-{step}")


def drop_setting(folder, name: str) -> None:
    """Make `folder` a checkpoint of an hf_ppo that predates the PPOConfig field `name`."""
    path = folder / PPO_STATE_FILE
    state = json.loads(path.read_text())
    assert name in state["settings"]
    del state["settings"][name]
    path.write_text(json.dumps(state, indent=2))


NEWER_FIELDS = {"use_bias_correction_kl": True, "importance_sampling_level": "sequence", "lam_critic": 1.0}


def test_a_checkpoint_from_before_a_setting_existed_resumes_exactly(straight, tiny_models, tokenizer, tmp_path):
    """Pins the resume of a checkpoint that does not record a setting (written before it existed), through
    train(resume_from_checkpoint=...): at the setting's default it resumes (the older hf_ppo ran as the default
    does), bitwise equal to the run that was never stopped."""
    trainer, out = straight
    copy_checkpoints(out, tmp_path, [3])
    for name in NEWER_FIELDS:
        drop_setting(tmp_path / "checkpoint-3", name)
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 4 and resumed.iteration == 1
    assert_same_weights(trainer, resumed)


@pytest.mark.parametrize("name", list(NEWER_FIELDS))
def test_a_checkpoint_from_before_a_setting_existed_refuses_another_value(name, straight, tiny_models, tokenizer,
                                                                            tmp_path):
    """...and with the setting at another value, the resume is refused naming it as not recorded (a silent resume
    would change the run's objective half-way)."""
    _, out = straight
    copy_checkpoints(out, tmp_path, [3])
    drop_setting(tmp_path / "checkpoint-3", name)
    extra = {"use_kl_loss": True} if name == "use_bias_correction_kl" else {}
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", **{name: NEWER_FIELDS[name]}, **extra)
    with pytest.raises(CheckpointError, match=rf"{name}: checkpoint '\(not recorded\)'"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def _damage(path, how: str) -> None:
    if how == "missing":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_a_mid_iteration_checkpoint_without_its_rollout_buffer_is_an_error_naming_it(how, straight, tiny_models,
                                                                                      tokenizer, tmp_path):
    """Pins the rollout buffer among a mid-iteration checkpoint's required files: resuming from the folder must fail
    naming rollout_buffer.safetensors, never start the iteration's remaining steps on a fresh rollout in silence."""
    _, out = straight
    copy_checkpoints(out, tmp_path, [3])
    _damage(tmp_path / "checkpoint-3" / ROLLOUT_BUFFER_FILE, how)
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed")
    word = "missing rollout_buffer" if how == "missing" else "rollout_buffer.safetensors is unreadable"
    with pytest.raises(CheckpointError, match=word):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_resume_true_sets_a_checkpoint_without_its_rollout_buffer_aside(how, straight, tiny_models, tokenizer,
                                                                        tmp_path):
    """The documented fallback of resume_from_checkpoint=True: the damaged newest checkpoint is moved aside with a
    warning naming the file, and the run resumes from the complete one before it, exactly."""
    trainer, out = straight
    run_dir = tmp_path / "run"
    copy_checkpoints(out, run_dir, [1, 2, 3])
    _damage(run_dir / "checkpoint-3" / ROLLOUT_BUFFER_FILE, how)
    resumed = make_trainer(tiny_models, tokenizer, run_dir)
    with pytest.warns(UserWarning, match=r"Skipping incomplete checkpoint .*checkpoint-3 \(.*rollout_buffer"):
        resumed.train(resume_from_checkpoint=True)
    assert os.path.isdir(run_dir / "incomplete-checkpoint-3") and not os.path.exists(run_dir / "checkpoint-3")
    assert resumed.state.global_step == 4
    assert_same_weights(trainer, resumed)


# ---- a saved critic outlives its base ------------------------------------------------------------------------------
def test_a_saved_full_critic_loads_after_its_base_folder_is_gone(tiny_models, tokenizer, tmp_path):
    """Pins where a fully fine-tuned critic is rebuilt from: its own saved folder (config, weights, tokenizer), not
    the base it started from. With the base folder deleted, critic_model=<the saved folder> must load the saved
    critic bitwise."""
    base = tmp_path / "base"
    shutil.copytree(tiny_models["policy"], base)
    first = make_trainer(tiny_models, tokenizer, tmp_path / "first", critic="separate", critic_model=str(base))
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: the critic is no longer its base
        for p in first.model.critic_parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = first.model.save_critic(str(tmp_path / "critic"), first.processing_class)
    saved = {k: v.clone() for k, v in first.model.critic_state_dict().items()}
    shutil.rmtree(base)
    second = make_trainer(tiny_models, tokenizer, tmp_path / "second", critic="separate", critic_model=folder)
    loaded = second.model.critic_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    enc = tokenizer(["the movie was great", "bad"], return_tensors="pt", padding=True)
    enc = {k: on_device_of(first.model, v) for k, v in enc.items()}  # the models are on the run's device
    with torch.no_grad():
        assert torch.equal(first.model(**enc).value, second.model(**enc).value)


def test_a_saved_lora_critic_whose_base_folder_is_gone_is_an_error_naming_it(tiny_models, tokenizer, tmp_path):
    """A LoRA critic is an adapter on its base: with the base folder deleted it cannot load, and the error names the
    saved critic, the missing base and the fix (not huggingface_hub's "Repo id must be in the form")."""
    from peft import LoraConfig

    base = tmp_path / "base"
    shutil.copytree(tiny_models["policy"], base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    first = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path / "first", critic="separate"),
                         processing_class=tokenizer, reward_model=count_e,
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), critic_model=str(base),
                         peft_config=lora)
    folder = first.model.save_critic(str(tmp_path / "critic"), first.processing_class)
    shutil.rmtree(base)
    with pytest.raises(ValueError, match="LoRA critic .* is an adapter on the base") as err:
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path / "second", critic="separate"),
                     processing_class=tokenizer, reward_model=count_e,
                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}), critic_model=folder, peft_config=lora)
    assert str(base) in str(err.value) and folder in str(err.value) and "critic_model=" in str(err.value)


def test_a_critic_started_from_a_relative_folder_records_it_absolute(tiny_models, tokenizer, tmp_path, monkeypatch):
    """The saved critic named its base as given: "base" relative to the directory the run started in, so a load
    from elsewhere looked for another folder (or a Hub repo of that name). It is recorded absolute, as a saved
    policy's base is."""
    from peft import LoraConfig

    shutil.copytree(tiny_models["policy"], tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path / "run", critic="separate"),
                           processing_class=tokenizer, reward_model=count_e,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), critic_model="base",
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    trainer.model.save_critic(str(tmp_path / "critic"), trainer.processing_class)
    info = json.loads((tmp_path / "critic" / "hf_ppo_critic.json").read_text())
    assert info["base"] == str(tmp_path / "base")
