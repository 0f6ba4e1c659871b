"""Issue 36, the critic's files and resumes: a `save_critic` killed at any point leaves the earlier critic (never half a
file); a folder holds one critic; a damaged saved critic is named with the fix; a checkpoint resumed with another
estimator (allow_config_change_on_resume) resumes the policy and says what happens to the critic."""

import os

import pytest
import safetensors.torch
import torch
from test_critics import make_trainer as critics_trainer
from transformers import TrainerCallback

from hf_ppo import PPOLMTrainer
from hf_ppo.models import critics
from hf_ppo.models.critics import CRITIC_INFO_FILE, CRITIC_STATE_FILE, saved_critic
from hf_ppo.models.value_head import VALUE_HEAD_FILE


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(models, tokenizer, out, peft=None, critic_model=None, **overrides) -> PPOLMTrainer:
    # test_critics' trainer, 2 optimizer steps, 4 prompts x 2 generations per rollout, rewarded by count_e.
    settings = {"max_steps": 2, "num_generations": 2, **overrides}
    return critics_trainer(models, tokenizer, out, peft=peft, reward=count_e, critic_model=critic_model, **settings)


def files(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names}


def moved(trainer, seed: int) -> dict[str, torch.Tensor]:
    """Move every trainable critic tensor (as training would); return a copy of the critic's state."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.critic_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return {k: v.clone() for k, v in trainer.model.critic_state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def shared(tiny_models, tokenizer, tmp_path):
    return make_trainer(tiny_models, tokenizer, tmp_path / "run", lora())


@pytest.fixture
def separate(tiny_models, tokenizer, tmp_path):
    return make_trainer(tiny_models, tokenizer, tmp_path / "run-separate", lora(), critic="separate",
                        critic_model=tiny_models["policy"])


# ---- item 2: a save killed mid-write leaves the earlier critic ---------------------------------------------------
def half_then_killed(tensors, filename, metadata=None):
    data = safetensors.torch.save(tensors, metadata=metadata)
    with open(filename, "wb") as f:
        f.write(data[: len(data) // 2])
    raise KeyboardInterrupt("killed while writing")


def killed_at_second_rename(real=os.replace):
    calls = []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real(src, dst)

    return replace


@pytest.mark.parametrize("where", ["writing critic.safetensors", "between the renames"])
def test_a_save_killed_mid_write_leaves_the_earlier_critic(where, shared, tmp_path, monkeypatch):
    folder = str(tmp_path / "critic")
    earlier = moved(shared, 0)
    shared.model.save_critic(folder)
    earlier_files = files(folder)
    moved(shared, 1)
    with monkeypatch.context() as patch:
        if where == "writing critic.safetensors":
            patch.setattr(critics, "save_file", half_then_killed)
        else:
            patch.setattr(critics.os, "replace", killed_at_second_rename())
        with pytest.raises(KeyboardInterrupt):
            shared.model.save_critic(folder)
    loaded = saved_critic(folder, "shared")  # the earlier critic, whole
    assert same(loaded.state, earlier)
    assert files(folder) == earlier_files
    later = shared.model.save_critic(folder)  # and a later save replaces it, leaving nothing of the killed one
    assert same(saved_critic(later, "shared").state, shared.model.critic_state_dict())
    assert sorted(os.listdir(tmp_path)) == ["critic", "run"]


def test_a_shared_critic_saved_over_a_separate_one_leaves_one_critic(shared, separate, tmp_path):
    folder = str(tmp_path / "critic")
    separate.model.save_critic(folder, separate.processing_class)
    assert "critic/adapter_model.safetensors" in files(folder)
    shared.model.save_critic(folder)
    assert files(folder) == {CRITIC_STATE_FILE, CRITIC_INFO_FILE}
    assert same(saved_critic(folder, "shared").state, shared.model.critic_state_dict())


def test_a_critic_folder_with_the_users_files_is_never_replaced(shared, tmp_path):
    folder = tmp_path / "critic"
    shared.model.save_critic(str(folder))
    (folder / "NOTES.md").write_text("my notes")
    before = {name: (folder / name).read_bytes() for name in files(folder)}
    moved(shared, 1)
    with pytest.raises(ValueError, match=r"files that save_critic did not write \(NOTES.md\).*folder of its own"):
        shared.model.save_critic(str(folder))
    assert {name: (folder / name).read_bytes() for name in files(folder)} == before


# ---- item 8: a damaged saved critic names its file and the fix --------------------------------------------------
def truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


DAMAGE = {
    "truncated critic.safetensors": (False, lambda folder: truncate(os.path.join(folder, CRITIC_STATE_FILE)),
                                     CRITIC_STATE_FILE),
    "unreadable hf_ppo_critic.json": (False, lambda folder: open(os.path.join(folder, CRITIC_INFO_FILE), "w").write(
        '{"critic": "sep'), CRITIC_INFO_FILE),
    "full critic without config.json": (True, lambda folder: os.remove(os.path.join(folder, "config.json")),
                                        "config.json is missing"),
    "full critic with truncated weights": (True, lambda folder: truncate(os.path.join(folder, "model.safetensors")),
                                           "model.safetensors is unreadable"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_saved_critic_names_the_file_and_the_fix(case, tiny_models, tokenizer, separate, tmp_path):
    full, damage, named = DAMAGE[case]
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "full", critic="separate",
                           critic_model=tiny_models["policy"]) if full else separate
    folder = trainer.model.save_critic(str(tmp_path / "critic"), trainer.processing_class)
    damage(folder)
    with pytest.raises(ValueError, match=rf"{os.path.join(folder, '')}.*{named}.*damaged.*Save the critic again"):
        make_trainer(tiny_models, tokenizer, tmp_path / "next", lora() if not full else None, critic="separate",
                     critic_model=folder)


# ---- item 10: a checkpoint resumed with another estimator -------------------------------------------------------
def lora_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.policy_model.named_parameters() if "lora_" in n}


class AtStart(TrainerCallback):
    """The policy's adapter and the critic as the resumed run starts (after the checkpoint is loaded)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.step = state.global_step
        self.policy = {n: p.detach().clone() for n, p in model.policy_model.named_parameters() if "lora_" in n}
        self.critic = {k: v.clone() for k, v in model.critic_state_dict().items()}


def test_a_gae_checkpoint_resumed_as_grpo_resumes_the_policy_and_leaves_the_critic(tiny_models, tokenizer, tmp_path):
    first = make_trainer(tiny_models, tokenizer, tmp_path / "gae", lora(), save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = str(tmp_path / "gae" / "checkpoint-2")
    head = open(os.path.join(checkpoint, VALUE_HEAD_FILE), "rb").read()
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "grpo", lora(), advantage_estimator="grpo",
                           allow_config_change_on_resume=True, max_steps=4)
    resumed.add_callback(start := AtStart())
    with pytest.warns(UserWarning, match=r"without its critic: it was written with advantage_estimator='gae'.*The "
                                         r"policy resumes; the checkpoint's critic \(2 tensors in value_head"
                                         r".safetensors\) is not loaded and stays in the checkpoint, untouched"):
        resumed.train(resume_from_checkpoint=checkpoint)
    assert start.step == 2 and same(lora_weights(first), start.policy) and resumed.state.global_step == 4
    assert open(os.path.join(checkpoint, VALUE_HEAD_FILE), "rb").read() == head


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_a_grpo_checkpoint_resumed_as_gae_says_the_critic_starts_fresh(critic, tiny_models, tokenizer, tmp_path):
    first = make_trainer(tiny_models, tokenizer, tmp_path / "grpo", lora(), advantage_estimator="grpo",
                         save_strategy="steps", save_steps=2)
    first.train()
    extra = dict(critic="separate", critic_model=tiny_models["policy"]) if critic == "separate" else {}
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "gae", lora(), allow_config_change_on_resume=True,
                           max_steps=4, **extra)
    resumed.add_callback(start := AtStart())
    fresh = {k: v.clone() for k, v in resumed.model.critic_state_dict().items()}
    with pytest.warns(UserWarning, match=r"written with advantage_estimator='grpo'.*holds no critic. The policy "
                                         r"resumes; this run's critic starts fresh"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "grpo" / "checkpoint-2"))
    assert start.step == 2 and same(lora_weights(first), start.policy) and resumed.state.global_step == 4
    assert same(fresh, start.critic)


@pytest.mark.parametrize("case", ["empty folder", "first save interrupted"])
def test_a_critic_folder_with_nothing_in_it_says_so(case, shared, tiny_models, tokenizer, tmp_path, monkeypatch):
    folder = str(tmp_path / "critic")
    if case == "empty folder":
        os.makedirs(folder)
    else:
        with monkeypatch.context() as patch:
            patch.setattr(critics, "save_file", half_then_killed)
            with pytest.raises(KeyboardInterrupt):
                shared.model.save_critic(folder)
        assert not os.path.exists(folder)  # nothing half-written where a load would find it
    what = "an empty folder" if case == "empty folder" else "a save_critic to it was interrupted"
    with pytest.raises(ValueError, match=f"holds no critic and no model: {what}.*Save the critic there"):
        make_trainer(tiny_models, tokenizer, tmp_path / "next", lora(), critic="separate", critic_model=folder)
