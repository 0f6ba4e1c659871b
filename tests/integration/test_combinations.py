"""Estimators x loss variants x critics x reward lists, in one run each.

Each feature has its own tests (tests/algorithms/test_estimators.py, tests/models/test_critics.py,
tests/rollout/test_scoring.py); these runs cross them, so that a combination nobody tried alone (a group estimator
with a dual clip and a reward list, LoRA and QLoRA, a critic that starts from the one model of a reward list) trains
with finite metrics and moves the weights it should.
"""

import math

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer

PROMPTS = [f"{a} {b}" for a in ("the movie was", "the food was", "the book was", "the show was")
           for b in ("great", "dull", "fun", "bad")]


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def train(models, tokenizer, out, reward, **overrides) -> PPOLMTrainer:
    args = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1,
                num_ppo_epochs=2, max_steps=4, response_length=6, logging_steps=1, learning_rate=1e-2, report_to=[],
                save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, num_generations=2,
                cliprange_low=0.1, cliprange_high=0.3, dual_clip=3.0)
    args.update(overrides)
    trainer = PPOLMTrainer(model=models["policy"], args=PPOConfig(**args), processing_class=tokenizer,
                           reward_model=reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           peft_config=lora())
    return trainer


def check_trains(trainer) -> list[dict]:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    history = [e for e in trainer.state.log_history if "loss/policy_avg" in e]
    assert len(history) == 4 and trainer.iteration == 2
    bad = {k: v for e in history for k, v in e.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    after = dict(trainer.model.named_parameters())
    policy_moved = [n for n in before if "lora_" in n and "critic" not in n and not torch.equal(before[n], after[n])]
    assert policy_moved, "the policy's adapter did not move"
    return history


@pytest.mark.parametrize("estimator,aggregation,quantization", [
    ("gae", "dr_grpo", "4bit"), ("rloo", "seq_mean_token_mean", "none"),
    ("grpo", "dr_grpo", "4bit"), ("reinforce_pp", "token_mean", "none")])
def test_estimator_with_loss_variants_and_a_reward_list(estimator, aggregation, quantization, tiny_models, tokenizer,
                                                        tmp_path):
    trainer = train(tiny_models, tokenizer, tmp_path, [tiny_models["reward"], count_e], reward_weights=[0.5, 2.0],
                    advantage_estimator=estimator, loss_aggregation=aggregation, normalize_each_reward=True,
                    overlong_buffer_length=2, policy_quantization=quantization)
    history = check_trains(trainer)
    rollouts = [e for e in history if "objective/scores" in e]
    names = {k for e in rollouts for k in e if k.startswith("objective/scores/")}
    assert len(names) == 2, names
    assert ("val/explained_variance" in history[0]) == (estimator == "gae")


@pytest.mark.parametrize("critic", ["separate", "reward_lora"])
def test_critic_starts_from_the_one_model_of_a_reward_list(critic, tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    trainer = train(tiny_models, tokenizer, tmp_path, [count_e, tiny_models["reward"]], critic=critic,
                    loss_aggregation="seq_mean_token_mean", reward_quantization="none")
    score_head = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"]).score.weight
    score_head = score_head.detach().float().reshape(-1)
    head = trainer.model.critic.head.weight.detach().float().reshape(-1).cpu()  # the run's is on its device
    assert torch.equal(head, score_head)  # the value head starts as the list's reward model's score head
    critic_before = {n: p.detach().clone() for n, p in trainer.model.critic.named_parameters() if p.requires_grad}
    history = check_trains(trainer)
    critic_after = dict(trainer.model.critic.named_parameters())
    assert any(not torch.equal(critic_before[n], critic_after[n]) for n in critic_before), "the critic did not move"
    assert "val/explained_variance" in history[0]


def test_critic_with_two_reward_models_in_the_list_asks_for_critic_model(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="holds 2 models.*critic_model"):
        train(tiny_models, tokenizer, tmp_path, [tiny_models["reward"], tiny_models["reward"]], critic="reward_lora")
