"""The choice of critic (`PPOConfig.critic`): 'separate' (own body, from the reward model or critic_model)
and 'reward_lora' (a LoRA adapter on the reward model's frozen base) train, resume exactly, leave the reward score
and the published policy untouched; the critic warm-up leaves the policy bitwise untouched; bad choices fail at
construction."""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import pytest
import safetensors.torch
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

import hf_ppo.trainer.ppo_trainer as ppo_trainer_module
from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.hub.publish import POLICY_IGNORE_PATTERNS
from hf_ppo.models import critics
from hf_ppo.models.actor_critic import PolicyAndCritic
from hf_ppo.models.critics import CRITIC_INFO_FILE, CRITIC_STATE_FILE, ValueModel, saved_critic
from hf_ppo.models.value_head import VALUE_HEAD_FILE, AutoModelForCausalLMWithValueHead
from hf_ppo.rollout.scoring import reward_model_scores
from tests import plain_ppo
from tests.devices import device_of, on_device_of
from tests.guards import needs_fsdp2
from tests.hub_fixtures import TEST_USER
from tests.wiring_models import PROMPTS, RecordingTrainer, build_wiring_models

TEXTS = ["the movie was great and the plot was fun", "the food was bad", "the book was lovely ."]


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(models, tokenizer, out, peft=None, reward=None, critic_model=None, **overrides) -> PPOLMTrainer:
    # 2 optimizer steps per iteration (1 epoch x 2 minibatches), 8 prompts per rollout.
    args = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2,
                num_ppo_epochs=1, max_steps=4, response_length=6, logging_steps=1, learning_rate=1e-2, report_to=[],
                save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, kl_coef=0.1)
    args.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 4})
    return PPOLMTrainer(model=models["policy"], args=PPOConfig(**args), processing_class=tokenizer,
                        reward_model=reward if reward is not None else models["reward"], train_dataset=dataset,
                        peft_config=peft, critic_model=critic_model)


def fixed_scores(trainer, tokenizer) -> torch.Tensor:
    """The training reward's scores of TEXTS, through the trainer's own `RewardSet` (in its scoring context)."""
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    ids, mask = on_device_of(trainer.reward_model, enc["input_ids"], enc["attention_mask"].bool())
    scores, _ = trainer.rewards.score(queries=ids, query_mask=mask, responses=ids[:, :0],
                                      response_mask=mask[:, :0], tokenizer=tokenizer, prompts=TEXTS, batch_size=4)
    return scores


def critic_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.critic_state_dict().items()}  # CPU tensors may alias the weights


def logged(trainer):
    return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k and "runtime" not in k
             and k not in ("train_loss", "total_flos")} for e in trainer.state.log_history]


# The two critics with a body of their own, each trained 4 steps (2 iterations), saving at step 3 (mid-iteration).
CASES = {
    "separate": dict(critic="separate"),
    "reward_lora_qlora": dict(critic="reward_lora", policy_quantization="4bit", reward_quantization="4bit"),
}


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tiny_models, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    trainer = make_trainer(tiny_models, tokenizer, out, lora(), save_strategy="steps", save_steps=3,
                           **CASES[request.param])
    before = {"critic": critic_state(trainer), "scores": fixed_scores(trainer, tokenizer),
              "reward": {n: p.detach().clone() for n, p in trainer.reward_model.named_parameters()
                         if "lora_" not in n and p.dtype != torch.uint8},
              "policy": {n: p.detach().clone() for n, p in trainer.model.policy_model.named_parameters() if "lora_" in n}}
    trainer.train()
    return request.param, trainer, out, before


def test_critic_trains_with_exact_first_step(run, tiny_models, tokenizer):
    name, trainer, _, before = run
    model = trainer.model
    assert isinstance(model, PolicyAndCritic) and isinstance(model.critic, ValueModel)
    history = trainer.state.log_history
    assert history[0]["objective/kl"] == 0 and history[0]["val/ratio"] == 1  # step 0: policy == reference, ratio 1
    assert all(math.isfinite(v) for e in history for v in e.values() if isinstance(v, float))
    assert {"val/explained_variance", "loss/value_avg"} <= set(history[0])
    after = model.critic_state_dict()
    assert set(after) == set(before["critic"]) and any("lora_" in k for k in after) and "head.weight" in after
    assert not any(k for k in after if "lora_" not in k and not k.startswith("head.")), "LoRA critic trains LoRA + head"
    unchanged = [k for k in after if ("lora_B" in k or k.startswith("head")) and torch.equal(before["critic"][k], after[k])]
    assert not unchanged, unchanged
    now = dict(model.policy_model.named_parameters())
    assert any(not torch.equal(v, now[n]) for n, v in before["policy"].items()), "the policy did not train"
    # Only the critic's own and the policy's trainable tensors are optimised.
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in model.critic_parameters()} <= trained


def test_reward_score_is_untouched_by_the_critic(run, tiny_models, tokenizer):
    name, trainer, _, before = run
    assert torch.equal(fixed_scores(trainer, tokenizer), before["scores"])  # bitwise, after training
    reward_now = dict(trainer.reward_model.named_parameters())
    assert all(torch.equal(v, reward_now[n]) for n, v in before["reward"].items())
    critic = trainer.model.critic
    if name.startswith("reward_lora"):
        # No second base model: the critic's backbone IS the reward model's, and its trained adapter does change
        # what that backbone computes (so the unchanged score above is the scoring context at work).
        assert critic.backbone.get_base_model() is trainer.reward_model.model
        assert trainer.reward_model.is_loaded_in_4bit
        enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
        ids, mask = on_device_of(trainer.reward_model, enc["input_ids"], enc["attention_mask"])
        with torch.no_grad():
            values = critic(ids, mask)
            with critic.disable_adapter():
                plain = critic(ids, mask)
        assert not torch.equal(values, plain)
        # Scored outside the context the critic's loader handed over, the reward would follow the critic's training.
        def scored_in(context):
            with context():
                return reward_model_scores(trainer.reward_model, ids, mask, batch_size=4)

        assert not torch.equal(scored_in(contextlib.nullcontext), scored_in(trainer.rewards.scoring_context))
    else:  # its own copy: no parameter shared with the reward model
        ids = {id(p) for p in trainer.reward_model.parameters()}
        assert not any(id(p) in ids for p in critic.parameters())


def test_critic_starts_from_the_reward_models_score_head(tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    reward = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"])
    score = reward.score.weight.detach().clone()
    # By path (loaded again), as an object (deep-copied: its own weights), and on the reward model itself.
    for critic, source in (("separate", None), ("separate", reward), ("reward_lora", None)):
        trainer = make_trainer(tiny_models, tokenizer, tmp_path / critic, lora(), reward=source, critic=critic)
        head = trainer.model.critic.head.weight.detach().cpu()
        if critic == "reward_lora":  # the head of the reward model as the run holds it: in the compute dtype of a
            # quantized reward (reward_quantization='4bit', the default), bf16 where CUDA is visible, fp32 on the CPU
            assert torch.equal(head, trainer.reward_model.score.weight.detach().float().cpu())
            assert torch.equal(head, score.to(trainer.reward_model.score.weight.dtype).float())
        else:  # a copy of its own, loaded in fp32
            assert torch.equal(head, score.float())
        assert torch.count_nonzero(trainer.model.critic.head.bias) == 0
        if critic == "separate":
            ids = {id(p) for p in trainer.reward_model.parameters()}
            assert not any(id(p) in ids for p in trainer.model.critic.parameters())


def test_resume_mid_iteration_equals_uninterrupted_run(run, tiny_models, tokenizer, tmp_path):
    name, straight, out, _ = run
    saved = load_file(out / "checkpoint-3" / "value_head.safetensors")
    assert set(saved) == set(straight.model.critic_state_dict())  # the critic's LoRA + head
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", lora(), **CASES[name])
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    for (n, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(x, y), n
    a, b = straight.model.critic_state_dict(), resumed.model.critic_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert logged(straight) == logged(resumed)


def test_critic_is_never_saved_or_pushed_with_the_policy(run, tmp_path, local_hub, hub_token):
    name, trainer, _, _ = run
    critic_keys = set(trainer.model.critic_state_dict())
    trainer.hub_model_id = f"{TEST_USER}/tiny-ppo-critic-{name.replace('_', '-')}"
    trainer.args.output_dir = str(tmp_path / "final")
    trainer.push_to_hub(token=hub_token)
    pushed = local_hub.files(trainer.hub_model_id)
    saved = set(os.listdir(tmp_path / "final"))
    assert "adapter_model.safetensors" in pushed and "adapter_model.safetensors" in saved
    assert not [f for f in set(pushed) | saved if "value_head" in f or "critic" in f]
    adapter = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.") for k in adapter) and len(adapter) < len(critic_keys)
    assert "*value_head*" in POLICY_IGNORE_PATTERNS


# ---- warm-up: value-only updates ----------------------------------------------------------------------------------
@pytest.mark.parametrize("critic", ["shared", "reward_lora"])
def test_warmup_moves_only_the_critic(critic, tiny_models, tokenizer, tmp_path):
    with pytest.warns(UserWarning, match="covers the whole run"):  # a critic-only run, on purpose here
        trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora(), critic=critic, critic_warmup_steps=2,
                               max_steps=2)
    model = trainer.model
    critic_ids = {id(p) for p in model.critic_parameters()}
    policy = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if id(p) not in critic_ids}
    critic_before = critic_state(trainer)
    trainer.train()
    now = dict(model.named_parameters())
    # Compared on the CPU: where CUDA is visible, a run whose critic sits on a bitsandbytes model holds its policy on
    # the CPU until train() (Trainer moves no model with a bitsandbytes part at construction), then on the GPU.
    assert all(torch.equal(v, now[n].detach().cpu()) for n, v in policy.items()), "the policy moved during the warm-up"
    assert all(p.grad is None for n, p in model.named_parameters() if id(p) not in critic_ids)
    after = model.critic_state_dict()
    assert any(not torch.equal(critic_before[k], after[k]) for k in after)
    assert trainer.state.log_history[1]["val/ratio"] == 1  # the policy is where it sampled from


# ---- critic_updates_per_step: critic-only passes between the policy's ------------------------------------------------
def test_schedule_interleaves_critic_only_passes_and_keeps_them_on_resume():
    from hf_ppo.rollout.batch import RolloutBatch
    from hf_ppo.trainer.schedule import MinibatchSchedule

    B, R = 4, 2
    batch = RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool),
                         torch.zeros(B, R, dtype=torch.long), torch.ones(B, R, dtype=torch.bool),
                         *[torch.zeros(B, R)] * 3, torch.zeros(B), torch.ones(B, dtype=torch.bool),
                         *[torch.zeros(B, R)] * 4)
    # 2 epochs x 3 critic passes x 2 minibatches x 1 micro-batch = 12 micro-batches; passes 0 and 3 move the policy.
    schedule = MinibatchSchedule.shuffled(batch, num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=1,
                                          critic_passes=3)
    assert schedule.orders.shape == (6, B) and len(schedule) == 12
    flags = [schedule.next()["critic_only"] for _ in range(5)]
    resumed = MinibatchSchedule.from_state_dict(schedule.state_dict(), num_mini_batches=2,
                                                gradient_accumulation_steps=1, critic_passes=3)
    flags += [resumed.next()["critic_only"] for _ in range(7)]
    assert flags == [False] * 2 + [True] * 4 + [False] * 2 + [True] * 4 and resumed.done


def test_critic_only_passes_move_the_critic_and_never_the_policy(tiny_models, tokenizer, tmp_path):
    # 1 epoch x 2 critic passes x 2 minibatches = 4 optimizer steps: steps 1-2 policy + critic, steps 3-4 critic only.
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora(), critic="reward_lora", critic_updates_per_step=2)
    assert trainer.args.optimizer_steps_per_iteration == 4
    model = trainer.model
    critic_ids = {id(p) for p in model.critic_parameters()}
    snapshots = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(({n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in critic_ids},
                              critic_state(trainer)))

    trainer.add_callback(Snapshot())
    trainer.train()
    assert len(snapshots) == 4 and trainer.iteration == 1

    def moved(a, b):
        return any(not torch.equal(a[k], b[k]) for k in a)

    (policy_1, critic_1), (policy_2, critic_2), (policy_3, critic_3), (policy_4, critic_4) = snapshots
    assert moved(policy_1, policy_2), "the policy trains in the policy pass"
    assert not moved(policy_2, policy_3) and not moved(policy_3, policy_4), "the policy moved in a critic-only pass"
    assert moved(critic_2, critic_3) and moved(critic_3, critic_4), "the critic trains in its own passes"


def test_resume_inside_a_critic_only_pass_is_exact(tiny_models, tokenizer, tmp_path):
    # 4 optimizer steps per iteration, 2 iterations, saved at step 3: in the critic-only pass of the first iteration.
    kwargs = dict(critic_updates_per_step=2, lam_critic=1.0, max_steps=8)
    straight = make_trainer(tiny_models, tokenizer, tmp_path / "straight", lora(), save_strategy="steps",
                            save_steps=3, **kwargs)
    straight.train()
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", lora(), **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    for (name, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(x, y), name
    assert logged(straight) == logged(resumed) and resumed.iteration == 2


def test_critic_hub_model_id_is_a_repo_of_its_own(tmp_path):
    def config(**kw):
        return PPOConfig(output_dir=str(tmp_path), report_to=[], **kw)

    assert config(critic_hub_model_id="me/critic", hub_model_id="me/policy").critic_hub_model_id == "me/critic"
    with pytest.raises(ValueError, match="must be a Hub repo id 'namespace/name'"):
        config(critic_hub_model_id="critic")
    with pytest.raises(ValueError, match="is hub_model_id, the policy's repo: .* critic_hub_model_id='me/x-critic'"):
        config(critic_hub_model_id="me/x", hub_model_id="me/x")
    with pytest.raises(ValueError, match="critic_hub_model_id is set, but advantage_estimator='grpo' has no critic"):
        config(critic_hub_model_id="me/critic", advantage_estimator="grpo", num_generations=2)


@needs_fsdp2  # the floor leg's accelerate is refused for FSDP before this check
def test_critic_hub_model_id_is_refused_with_fsdp(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match="critic_hub_model_id is set with FSDP"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], critic_hub_model_id="me/critic")


def test_critic_updates_need_a_value_loss(tmp_path):
    with pytest.raises(ValueError, match="critic_updates_per_step=2 adds critic-only passes"):
        PPOConfig(output_dir=str(tmp_path), critic_updates_per_step=2, vf_coef=0.0, report_to=[])
    with pytest.raises(ValueError, match="critic_updates_per_step=0: must be an integer >= 1"):
        PPOConfig(output_dir=str(tmp_path), critic_updates_per_step=0, report_to=[])


# ---- a critic that outlives the run: save_critic, then critic_model=<that folder> ------------------------------------
SAVED_CASES = {  # name: (critic, LoRA, reward, critic_model the first run starts from)
    "shared": ("shared", True, None, None),
    "separate_lora": ("separate", True, None, None),
    "separate_full": ("separate", False, count_e, "policy"),
    "reward_lora": ("reward_lora", True, None, None),
}


def critic_values(trainer, tokenizer) -> torch.Tensor:
    """The run's values of TEXTS (on the CPU): the shared head through the model, a critic of its own run by itself
    as the model's forward runs it (before train(), a run whose critic sits on a bitsandbytes model may hold its
    policy on the CPU and its critic on the GPU: Trainer moves no model with a bitsandbytes part)."""
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    critic = getattr(trainer.model, "critic", None)
    ids, mask = on_device_of(critic if critic is not None else trainer.model, enc["input_ids"], enc["attention_mask"])
    # Under the run's autocast: a trained run's model is accelerate-prepared (its forward autocasts under bf16, a GPU's
    # default), a fresh run's is not yet; both compute as training does.
    with torch.no_grad(), trainer.accelerator.autocast():
        if critic is not None:
            return critic(input_ids=ids, attention_mask=mask).cpu()
        return trainer.model(input_ids=ids, attention_mask=mask).value.cpu()


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_a_saved_critic_starts_the_next_run_with_its_values(case, tiny_models, tokenizer, tmp_path):
    critic, with_lora, reward, start = SAVED_CASES[case]
    start = tiny_models[start] if start else None
    first = make_trainer(tiny_models, tokenizer, tmp_path / "first", lora() if with_lora else None, reward=reward,
                         critic=critic, critic_model=start)
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: every trainable critic tensor moves
        for p in first.model.critic_parameters():
            p.add_(0.05 * torch.randn_like(p))
    if case == "separate_full":
        with pytest.raises(ValueError, match="pass the policy's tokenizer"):
            first.model.save_critic(str(tmp_path / "critic"))
    folder = first.model.save_critic(str(tmp_path / "critic"), first.processing_class)
    second = make_trainer(tiny_models, tokenizer, tmp_path / "second", lora() if with_lora else None, reward=reward,
                          critic=critic, critic_model=folder)
    saved, loaded = critic_state(first), second.model.critic_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(critic_values(first, tokenizer), critic_values(second, tokenizer))
    if case == "separate_lora":  # also a PEFT adapter folder
        assert os.path.isfile(os.path.join(folder, "critic", "adapter_config.json"))
    if case == "separate_full":  # also a one-label sequence classifier: its score is the value without the bias
        from transformers import AutoModelForSequenceClassification

        classifier = AutoModelForSequenceClassification.from_pretrained(folder)
        enc = tokenizer(TEXTS[:1], return_tensors="pt")
        with torch.no_grad():
            score = classifier(**enc).logits[0, 0]  # on the CPU; the run's model is on its device
            value = first.model(**{k: on_device_of(first.model, v) for k, v in enc.items()}).value[0, -1].cpu()
        torch.testing.assert_close(score + first.model.critic.head.bias[0].cpu(), value)
    assert first.model.save_critic(folder, first.processing_class) == folder  # a saved critic may be replaced
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")  # a model saved there: never overwritten
    with pytest.raises(ValueError, match="already holds files that no save_critic wrote"):
        first.model.save_critic(str(tmp_path / "policy"), first.processing_class)
    with pytest.raises(ValueError, match=f"holds a critic='{critic}' critic, but this run has critic="):
        make_trainer(tiny_models, tokenizer, tmp_path / "third", lora(), critic="shared" if critic != "shared"
                     else "reward_lora", critic_model=folder)


# ---- a critic on the Hub: push_critic_to_hub, then critic_model=<repo id> --------------------------------------------
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
PUSHED_FILES = {  # beside README.md, critic.safetensors, hf_ppo_critic.json and .gitattributes
    "shared": set(),
    "separate_lora": {"critic/adapter_config.json", "critic/adapter_model.safetensors"},
    "separate_full": {"config.json", "model.safetensors"} | TOKENIZER_FILES,
    "reward_lora": {"critic/adapter_config.json", "critic/adapter_model.safetensors"},
}


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_a_pushed_critic_starts_the_next_run_by_repo_id(case, tiny_models, tokenizer, tmp_path, local_hub, hub_token,
                                                        monkeypatch):
    critic, with_lora, reward, start = SAVED_CASES[case]
    start = tiny_models[start] if start else None
    first = make_trainer(tiny_models, tokenizer, tmp_path / "first", lora() if with_lora else None, reward=reward,
                         critic=critic, critic_model=start, max_steps=2)
    first.train()  # one iteration: the critic has moved from its start
    repo_id = f"{TEST_USER}/tiny-critic-{case}"
    first.push_critic_to_hub(repo_id, token=hub_token)

    pushed = local_hub.files(repo_id)
    assert set(pushed) == {".gitattributes", "README.md", "critic.safetensors", "hf_ppo_critic.json",
                           *PUSHED_FILES[case]}  # no policy file: no top-level adapter, no policy weights
    assert load_file(first.model.save_critic(str(tmp_path / "saved"), first.processing_class)
                     + "/critic.safetensors").keys() == critic_state(first).keys()
    card = pushed["README.md"].decode()
    assert "hf_ppo" in card and f'critic="{critic}"' in card and f'critic_model="{repo_id}"' in card
    assert str(tmp_path) not in card and hub_token not in card

    second = make_trainer(tiny_models, tokenizer, tmp_path / "second", lora() if with_lora else None, reward=reward,
                          critic=critic, critic_model=repo_id)
    if case == "shared":  # the head reads the policy's body: its values are the pushed ones on the trained policy
        second.model.policy_model.load_state_dict(first.model.policy_model.state_dict())
    saved, loaded = critic_state(first), second.model.critic_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(critic_values(first, tokenizer), critic_values(second, tokenizer))
    with pytest.raises(ValueError, match=f"holds a critic='{critic}' critic, but this run has critic="):
        make_trainer(tiny_models, tokenizer, tmp_path / "third", lora(), critic="shared" if critic != "shared"
                     else "reward_lora", critic_model=repo_id)
    if case == "separate_lora":  # offline (HF_HUB_OFFLINE=1), the cached critic loads with no request
        import huggingface_hub

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        asked = len(local_hub.requests)
        offline = make_trainer(tiny_models, tokenizer, tmp_path / "offline", lora(), critic=critic,
                               critic_model=repo_id)
        assert len(local_hub.requests) == asked
        assert torch.equal(critic_values(first, tokenizer), critic_values(offline, tokenizer))


def test_a_critic_repo_is_its_own(tiny_models, tokenizer, tmp_path, local_hub, hub_token, monkeypatch):
    from huggingface_hub import HfApi

    from hf_ppo.hub import push_critic

    # A policy (an ordinary model) on the Hub: a critic is never pushed into its repo; as critic_model, it is an
    # ordinary critic source (a causal LM: the value head starts at zero).
    api = HfApi(token=hub_token)
    policy_repo = f"{TEST_USER}/tiny-policy"
    api.create_repo(policy_repo)
    api.upload_folder(repo_id=policy_repo, folder_path=tiny_models["policy"])
    full = make_trainer(tiny_models, tokenizer, tmp_path / "full", reward=count_e, critic="separate",
                        critic_model=policy_repo)
    assert torch.count_nonzero(full.model.critic.head.weight) == 0
    with pytest.raises(ValueError, match="holds files no critic push wrote .* a repo of its own"):
        full.push_critic_to_hub(policy_repo, token=hub_token)
    assert CRITIC_INFO_FILE not in local_hub.files(policy_repo)

    # A critic pushed again replaces the one there: the fully fine-tuned critic's model files go, so the LoRA critic
    # pushed after it loads as a LoRA critic.
    repo_id = f"{TEST_USER}/tiny-critic"
    push_critic(full.model, repo_id, full.processing_class, token=hub_token)  # the function
    assert "config.json" in local_hub.files(repo_id)
    api.upload_file(path_or_fileobj=b"notes", path_in_repo="NOTES.md", repo_id=repo_id)  # the user's own file
    with_lora = make_trainer(tiny_models, tokenizer, tmp_path / "lora", lora(), reward=count_e, critic="separate",
                             critic_model=tiny_models["policy"])
    with torch.no_grad():
        for p in with_lora.model.critic_parameters():
            p.add_(0.05 * torch.randn_like(p))
    asked = len(local_hub.requests)
    with pytest.raises(AttributeError, match="moved: push the critic with trainer.push_critic_to_hub"):
        with_lora.model.push_critic_to_hub(repo_id, token=hub_token)  # a model never publishes itself
    assert len(local_hub.requests) == asked  # nothing was sent
    with_lora.push_critic_to_hub(repo_id, token=hub_token)
    assert set(local_hub.files(repo_id)) == {".gitattributes", "README.md", "critic.safetensors", "hf_ppo_critic.json",
                                             "NOTES.md", *PUSHED_FILES["separate_lora"]}
    again = make_trainer(tiny_models, tokenizer, tmp_path / "again", lora(), reward=count_e, critic="separate",
                         critic_model=repo_id)
    assert torch.equal(critic_values(with_lora, tokenizer), critic_values(again, tokenizer))

    # A Hub that cannot say whether an id is a pushed critic: an error, not a guess (a pushed fully fine-tuned critic
    # also reads as an ordinary sequence classifier, without its head's bias).
    import huggingface_hub

    from hf_ppo.models.critics import saved_critic

    monkeypatch.setattr(huggingface_hub.utils._http.time, "sleep", lambda seconds: None)
    local_hub.fail_with(500, path_contains=CRITIC_INFO_FILE)
    with pytest.raises(OSError, match=f"Could not tell whether critic_model='{TEST_USER}/other' is a critic pushed "
                                      "with push_critic_to_hub: the Hub answered 500"):
        saved_critic(f"{TEST_USER}/other", "separate")


# ---- construction errors --------------------------------------------------------------------------------------------
def test_reward_function_needs_critic_model_or_refuses(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="reward is a function. Pass critic_model="):
        make_trainer(tiny_models, tokenizer, tmp_path, reward=count_e, critic="separate")
    with pytest.raises(ValueError, match="reward_lora.*reward is a function"):
        make_trainer(tiny_models, tokenizer, tmp_path, reward=count_e, critic="reward_lora")
    # The policy's own checkpoint as critic_model: a causal LM has no score head, so the value head starts at zero;
    # without peft_config the critic is fully fine-tuned.
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, reward=count_e, critic="separate",
                           critic_model=tiny_models["policy"])
    critic = trainer.model.critic
    assert torch.count_nonzero(critic.head.weight) == 0
    assert all(p.requires_grad for p in critic.parameters())
    # A model object as critic_model is used as it is (its backbone becomes the critic's).
    from transformers import AutoModelForCausalLM

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, reward=count_e, critic="separate",
                           critic_model=causal_lm)
    assert trainer.model.critic.backbone is causal_lm.model


def test_critic_with_another_vocabulary_is_refused(tiny_models, tokenizer, tmp_path):
    from hf_ppo.cli.tiny import build_reward_model, build_tokenizer

    small = build_tokenizer(vocab_size=300)
    other = tmp_path / "other"
    build_reward_model(small).save_pretrained(other)
    small.save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary differs from the policy's.*critic_model="):
        make_trainer(tiny_models, tokenizer, tmp_path, reward=count_e, critic="separate", critic_model=str(other))
    with pytest.raises(ValueError, match="reward_lora.*policy's tokenizer"):
        make_trainer(tiny_models, tokenizer, tmp_path, reward=str(other), critic="reward_lora")


@pytest.mark.parametrize("overrides, message", [
    (dict(critic="shared", critic_model="policy"), "critic='separate' to train a critic started from critic_model"),
    (dict(critic="reward_lora", critic_model="policy"), "critic_model applies to critic='separate'"),
    (dict(critic="separate", critic_quantization="4bit"), "needs LoRA"),
])
def test_bad_critic_choices_fail_at_construction(overrides, message, tiny_models, tokenizer, tmp_path):
    # A model folder that is no saved critic (a Hub id would first be asked whether it is a pushed critic).
    critic_model = tiny_models.get(overrides.pop("critic_model", None))
    with pytest.raises(ValueError, match=message):
        make_trainer(tiny_models, tokenizer, tmp_path, critic_model=critic_model, **overrides)


def test_warmup_needs_a_value_loss(tmp_path):
    with pytest.raises(ValueError, match="critic_warmup_steps=3 trains only the critic"):
        PPOConfig(output_dir=str(tmp_path), critic_warmup_steps=3, vf_coef=0.0, report_to=[])


@pytest.mark.parametrize("critic", ["separate", "reward_lora"])
def test_gradient_checkpointing_reaches_the_critic(critic, tiny_models, tokenizer, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora(), critic=critic, gradient_checkpointing=True,
                           max_steps=2)
    before = critic_state(trainer)
    trainer.train()
    base = trainer.model.critic.backbone.get_base_model()
    assert getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing  # before 5.23
    after = trainer.model.critic_state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in after if "lora_B" in k)
    assert all(math.isfinite(e["loss/value_avg"]) for e in trainer.state.log_history if "loss/value_avg" in e)


def test_reward_lora_with_a_fully_fine_tuned_policy_uses_the_default_adapter(tiny_models, tokenizer, tmp_path):
    from hf_ppo.models.critics import DEFAULT_CRITIC_LORA

    trainer = make_trainer(tiny_models, tokenizer, tmp_path, critic="reward_lora")  # no peft_config
    ranks = {p.shape[0] for n, p in trainer.model.critic.named_parameters() if "lora_A" in n}
    assert ranks == {DEFAULT_CRITIC_LORA["r"]}
    assert all(p.requires_grad for p in trainer.model.policy_model.parameters())


# ---- TRL 1.12's value_model= -----------------------------------------------------------------------------------------
def test_trls_value_model_is_the_separate_critic(tiny_models, tokenizer, tmp_path):
    """`PPOTrainer(value_model=...)` as TRL 1.12 code passes it (a model object or a path): hf_ppo's separate critic,
    started from that model's score head; conflicting settings stop at construction."""
    from transformers import AutoModelForSequenceClassification

    value = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"], num_labels=1)
    with torch.no_grad():
        value.score.weight.mul_(-3.0)  # not the reward model's head: the critic must start from this one
    dataset = Dataset.from_dict({"prompt": ["the movie was", "the food was"] * 4})
    on_disk = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"]).score.weight  # fp32
    for source in (value, tiny_models["reward"]):
        args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=2,
                         num_ppo_epochs=1, max_steps=2, response_length=4, report_to=[], save_strategy="no",
                         num_sample_generations=0, disable_tqdm=True)
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                               reward_model=tiny_models["reward"], value_model=source, train_dataset=dataset)
        assert trainer.args.critic == "separate" and trainer.model.critic is not None
        # By path: the critic's own copy of the checkpoint, loaded in fp32 (not the training reward model, which
        # reward_quantization='4bit' loads in the compute dtype: bf16 where CUDA is visible).
        expected = value.score.weight if source is value else on_disk
        assert torch.equal(trainer.model.critic.head.weight.detach().cpu(), expected.detach().float().cpu())
    trainer.train()
    assert any("loss/value_avg" in e for e in trainer.state.log_history)

    def build(**kwargs):
        settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[])
        settings.update(kwargs.pop("config", {}))
        return PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**settings), processing_class=tokenizer,
                            reward_model=tiny_models["reward"], train_dataset=dataset, **kwargs)

    with pytest.raises(ValueError, match="Both value_model .* and critic_model"):
        build(value_model=value, critic_model=value)
    with pytest.raises(ValueError, match="uses no critic"):
        build(value_model=value, config={"advantage_estimator": "rloo", "num_generations": 2})
    with pytest.raises(ValueError, match="critic='reward_lora'"):
        build(value_model=value, config={"critic": "reward_lora"})


# ---- the critic's files and resumes ----------------------------------------------------------------------------------
# The critic's files and resumes: a `save_critic` killed at any point leaves the earlier critic (never half a file); a
# folder holds one critic; a damaged saved critic is named with the fix; a checkpoint resumed with another estimator
# (allow_config_change_on_resume) resumes the policy and says what happens to the critic.

def two_step_trainer(models, tokenizer, out, peft=None, critic_model=None, **overrides) -> PPOLMTrainer:
    # test_critics' trainer, 2 optimizer steps, 4 prompts x 2 generations per rollout, rewarded by count_e.
    settings = {"max_steps": 2, "num_generations": 2, **overrides}
    return make_trainer(models, tokenizer, out, peft=peft, reward=count_e, critic_model=critic_model, **settings)


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
    return two_step_trainer(tiny_models, tokenizer, tmp_path / "run", lora())


@pytest.fixture
def separate(tiny_models, tokenizer, tmp_path):
    return two_step_trainer(tiny_models, tokenizer, tmp_path / "run-separate", lora(), critic="separate",
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
    trainer = two_step_trainer(tiny_models, tokenizer, tmp_path / "full", critic="separate",
                           critic_model=tiny_models["policy"]) if full else separate
    folder = trainer.model.save_critic(str(tmp_path / "critic"), trainer.processing_class)
    damage(folder)
    with pytest.raises(ValueError, match=rf"{os.path.join(folder, '')}.*{named}.*damaged.*Save the critic again"):
        two_step_trainer(tiny_models, tokenizer, tmp_path / "next", lora() if not full else None, critic="separate",
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
    first = two_step_trainer(tiny_models, tokenizer, tmp_path / "gae", lora(), save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = str(tmp_path / "gae" / "checkpoint-2")
    head = open(os.path.join(checkpoint, VALUE_HEAD_FILE), "rb").read()
    resumed = two_step_trainer(tiny_models, tokenizer, tmp_path / "grpo", lora(), advantage_estimator="grpo",
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
    first = two_step_trainer(tiny_models, tokenizer, tmp_path / "grpo", lora(), advantage_estimator="grpo",
                         save_strategy="steps", save_steps=2)
    first.train()
    extra = dict(critic="separate", critic_model=tiny_models["policy"]) if critic == "separate" else {}
    resumed = two_step_trainer(tiny_models, tokenizer, tmp_path / "gae", lora(), allow_config_change_on_resume=True,
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
        two_step_trainer(tiny_models, tokenizer, tmp_path / "next", lora(), critic="separate", critic_model=folder)


# ---- each critic's values, read where documented ---------------------------------------------------------------------
# Critics of their own: the value of response token t is the critic's own, read where documented.
#
# GAE's V(s_t) for response token t is the critic's output at the state before that token: the last token of prompt +
# response[:t] (position Q - 1 + t of the unpadded sequence; `rollout.steps.policy_forward` and the trainer's
# `compute_loss` both keep the last R + 1 positions and drop the final one). A critic that reads a consistent
# off-by-one position, or lets the left padding in, still trains self-consistently (rollout and loss agree); only a
# comparison with the critic run by hand over each sequence alone shows it. For every `PPOConfig.critic` (the shared
# head; 'separate' from a `critic_model` with absolute positions, GPT-2; 'separate' with LoRA from the reward model;
# 'reward_lora'; 'separate' from a reward model with a tokenizer of its own) the values the rollout stored and the
# values the loss was given (new and old) are checked against that hand computation, for left-padded prompts of
# different lengths:
#
# - at the first micro-batch (nothing trained yet), a critic started from a one-label reward model is that model's own
#   score (its pooled output) of each prefix: V_t = reward(prompt + response[:t]) (the N+ initialisation);
# - at the second iteration's first micro-batch (the critic has moved), the critic's own modules, copied as they were
#   when that loss was computed, run on prompt + response with no padding and no position ids.
#
# A critic with another vocabulary is refused at construction (above), so "a critic with its own tokenizer" here is
# one whose tokenizer gives the policy's ids their meaning but pads on the right with another pad token: it must still
# read the policy's left-padded ids as they are.

VALUE_CASES = {
    # The shared head on a GPT-2 policy (absolute positions: position ids that ignore the padding show).
    "shared": dict(policy="gpt2", reward="reward", critic="shared", peft=False),
    # A fully fine-tuned critic from critic_model, a GPT-2 sequence classifier (absolute positions again).
    "separate_gpt2_critic_model": dict(policy="llama", reward="reward", critic="separate", critic_model="gpt2_reward",
                                       peft=False),
    "separate_lora": dict(policy="llama", reward="reward", critic="separate", peft=True),
    "reward_lora": dict(policy="llama", reward="reward", critic="reward_lora", peft=True),
    # Started from a reward model whose own tokenizer has the policy's vocabulary but pads on the right with <unk>.
    "separate_own_tokenizer": dict(policy="llama", reward="reward_own_tokenizer", critic="separate", peft=False),
}
SNAPSHOT_CALL = 1  # the second iteration's first micro-batch: one optimizer step after the start
TIGHT = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic_value_models")
    paths = build_wiring_models(root)
    own = str(root / "reward_own_tokenizer")
    shutil.copytree(paths["reward"], own)
    tokenizer = AutoTokenizer.from_pretrained(own)
    tokenizer.padding_side, tokenizer.pad_token = "right", "<unk>"
    tokenizer.save_pretrained(own)
    reloaded = AutoTokenizer.from_pretrained(own)
    policy_pad = AutoTokenizer.from_pretrained(paths["llama"]).pad_token_id
    assert (reloaded.padding_side, reloaded.pad_token) == ("right", "<unk>") and reloaded.pad_token_id != policy_pad
    paths["reward_own_tokenizer"] = own
    return paths


def _args(tmp_path, case) -> PPOConfig:
    # One step per iteration, its one micro-batch the whole (shuffled) rollout; no clipping of the gradient.
    return PPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PROMPTS), gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, max_steps=2, response_length=8, learning_rate=1e-2,
        lr_scheduler_type="constant", max_grad_norm=0.0, temperature=0.7, kl_coef=0.2, vf_coef=0.5,
        missing_eos_penalty=0.5, reward_quantization="none", critic=case["critic"], report_to=[], save_strategy="no",
        num_sample_generations=0, disable_tqdm=True, logging_steps=1, seed=3, apply_chat_template_to_text=False,
        # fp32 where CUDA is visible too (bf16 is the GPU's default): the values are compared with fp32 passes by
        # hand at fp32 tolerances. On the CPU this is the default.
        bf16=False)


@pytest.fixture(scope="module")
def trained(request, paths, tmp_path_factory):
    """One 2-step run per critic: its micro-batches, a copy of the model at the second one, and the (new, old)
    values every `compute_loss` handed to `ppo_loss`."""
    case = VALUE_CASES[request.param]
    given = []
    original = ppo_trainer_module.ppo_loss

    def recording_ppo_loss(logits, values, old, *args, **kwargs):
        given.append((values.detach().clone(), old.values.detach().clone()))
        return original(logits, values, old, *args, **kwargs)

    peft = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if case["peft"] else None
    critic_model = paths[case["critic_model"]] if "critic_model" in case else None
    # The checks need a rollout with a response that stops early (masks matter): seed 3 gives one on the CPU; a GPU's
    # random stream is another, so the next seeds are tried there (the test still fails if none of them gives one).
    for seed in (3, 4, 5, 6):
        given.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ppo_trainer_module, "ppo_loss", recording_ppo_loss)
            args = _args(tmp_path_factory.mktemp(request.param), case)
            args.seed = seed
            trainer = RecordingTrainer(
                model=paths[case["policy"]], args=args,
                reward_model=paths[case["reward"]], train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                peft_config=peft, critic_model=critic_model, snapshot_calls=[SNAPSHOT_CALL])
            trainer.train()
        mask = trainer.micro_batches[SNAPSHOT_CALL].response_mask
        if mask.sum(1).min() < mask.shape[1]:
            break
    assert len(trainer.micro_batches) == len(given) == 2
    return request.param, case, trainer, given


def values_by_hand(model, query: list[int], response: list[int]) -> torch.Tensor:
    """The critic's value of each response token (n,), fp32, from one pass over prompt + response alone (no padding,
    no mask, no position ids): the shared head on the hidden state the LM head reads, or a critic's value head on
    its backbone's last hidden state, at position Q - 1 + t for token t."""
    ids, start = query + response, len(query) - 1
    with torch.no_grad():
        if isinstance(model, AutoModelForCausalLMWithValueHead):
            _, hidden = plain_ppo.run_alone(model.pretrained_model.eval(), ids)
            return torch.stack([plain_ppo.value_of(model.v_head, row) for row in hidden[start:start + len(response)]])
        critic = model.critic.eval()
        hidden = critic.backbone(input_ids=torch.tensor([ids], device=device_of(critic))).last_hidden_state
        hidden = hidden[0, start:start + len(response)]
        return hidden.float() @ critic.head.weight[0].float() + critic.head.bias[0].float()


def prefix_scores(reward_model, query: list[int], response: list[int]) -> torch.Tensor:
    """A one-label reward model's own score (its pooled output) of prompt + response[:t], for each t (n,)."""
    with torch.no_grad():
        return torch.stack([reward_model(input_ids=torch.tensor([query + response[:t]])).logits[0, 0].float()
                            for t in range(len(response))])


def check_values(batch, given, by_hand, label: str) -> None:
    """Row by row: the values of a row's response tokens are by_hand(prompt, response) in the rollout batch and in the
    new and old values the loss got, whatever the row's left padding."""
    new_values, old_values = given
    assert torch.equal(old_values, batch.values), f"{label}: the loss's old values are not the rollout's"
    lengths = batch.query_mask.sum(1)
    assert len(set(lengths.tolist())) > 2 and (~batch.query_mask).any(), "prompts of different lengths, left-padded"
    moving = 0.0
    for i in range(len(batch)):
        query = batch.queries[i][batch.query_mask[i]].tolist()
        n = int(batch.response_mask[i].sum())
        expected = by_hand(query, batch.responses[i][:n].tolist()).cpu()  # compared on the CPU, whatever the device
        torch.testing.assert_close(batch.values[i, :n].cpu(), expected, **TIGHT,
                                   msg=f"{label}: rollout values, row {i}")
        torch.testing.assert_close(new_values[i, :n].detach().float().cpu(), expected, **TIGHT,
                                   msg=f"{label}: the loss's values, row {i}")
        if n > 1:
            moving = max(moving, (expected[1:] - expected[:-1]).abs().max().item())
    # A position read one off must show: the values change from one token to the next by far more than the tolerance.
    assert moving > 1e-3, f"{label}: values almost constant along the response ({moving}); a shift would not show"


@pytest.mark.parametrize("trained", list(VALUE_CASES), indirect=True)
def test_values_are_the_critics_own_at_the_state_before_each_token(trained):
    """Pins the position the value of response token t is read at (the last token of prompt + response[:t]) and that
    left padding changes no value, for every critic kind, in the rollout and in the loss: after one step, against the
    critic's own modules run on each sequence alone. A consistent off-by-one in the critic (rollout and loss read the
    same wrong position), a critic that attends the padding or ignores the position ids fails here."""
    name, case, trainer, given = trained
    model, _ = trainer.snapshots[SNAPSHOT_CALL]
    if case["critic"] == "shared":
        assert isinstance(model, AutoModelForCausalLMWithValueHead)
    else:
        assert isinstance(model, PolicyAndCritic) and isinstance(model.critic, ValueModel)
        assert model.critic.kind == case["critic"]
    batch = trainer.micro_batches[SNAPSHOT_CALL]
    assert batch.response_mask.sum(1).min() < batch.response_mask.shape[1], "some response stopped early"
    check_values(batch, given[SNAPSHOT_CALL], lambda q, r: values_by_hand(model, q, r), f"{name}, moved critic")


@pytest.mark.parametrize("trained", [name for name, case in VALUE_CASES.items() if case["critic"] != "shared"],
                         indirect=True)
def test_a_critic_from_a_reward_model_starts_as_its_score_of_each_prefix(trained, paths):
    """Pins what the N+ initialisation promises, through the whole rollout and loss: before any step, the value of
    response token t of a critic started from a one-label reward model ('separate' by default, from critic_model,
    'reward_lora') is that reward model's score of prompt + response[:t], computed here from the model on disk. A
    critic reading the score one position late (the reward of prompt + response[:t + 1]) or through the padding
    fails here."""
    name, case, trainer, given = trained
    source = paths[case.get("critic_model", case["reward"])]
    reward_model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    check_values(trainer.micro_batches[0], given[0], lambda q, r: prefix_scores(reward_model, q, r),
                 f"{name}, at the start")
