"""Issue 12, mixed rewards: a list of reward models / callables combined by `reward_weights`, each logged on its own,
optionally normalised on its own, an overlong penalty, the same bad-output checks for every reward, exact resume."""

import json
import os

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.hub.cards import model_sources, write_model_card
from hf_ppo.algorithms.ppo_math import overlong_penalty
from hf_ppo.rollout.scoring import RewardSet, penalize, score_responses

PROMPTS = ["the movie was", "the food was", "the book was", "the show was"]


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def length_reward(prompts, completions):
    return [float(len(c)) for c in completions]


def make_args(out, **overrides) -> PPOConfig:
    # 4 optimizer steps per iteration (2 epochs x 2 minibatches), 8 prompts per rollout.
    defaults = dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2,
        num_ppo_epochs=2, max_steps=8, response_length=6, logging_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, reward_quantization="none",
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(models, tokenizer, out, rewards, peft=True, **overrides):
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return PPOLMTrainer(model=models["policy"], args=make_args(out, **overrides), processing_class=tokenizer,
                        reward_model=rewards, train_dataset=dataset, peft_config=lora() if peft else None)


def batch_of(tokenizer, prompts, completions):
    """Left-padded prompts and right-padded responses as the rollout holds them."""
    queries = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    responses = tokenizer(completions, return_tensors="pt", padding=True, padding_side="right",
                          add_special_tokens=False)
    return dict(queries=queries["input_ids"], query_mask=queries["attention_mask"].bool(),
                responses=responses["input_ids"], response_mask=responses["attention_mask"].bool())


# ---- math: the overlong penalty and step 4 ---------------------------------------------------------------------------
def test_overlong_penalty_hand_computed():
    # L_max 8, buffer 4: no penalty up to 4 tokens, then -(|y| - 4) / 4 * factor, reaching -factor at 8 tokens.
    lengths = torch.tensor([3, 4, 5, 6, 8])
    assert torch.allclose(overlong_penalty(lengths, 8, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert torch.equal(overlong_penalty(torch.tensor([9]), 8, 4, 1.0), torch.tensor([-1.0]))  # beyond L_max: -1


def test_penalize_adds_both_penalties_to_the_combined_score():
    scores = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # lengths 2, 3, 4 of response_length 4
    stopped = torch.tensor([True, True, False])
    out = penalize(scores, stopped, mask, missing_eos_penalty=0.5, overlong_buffer_length=2, overlong_penalty_factor=1.0)
    # lengths 2, 3, 4 with buffer 2 of 4: penalties 0, -0.5, -1; the last never stopped: -0.5 more.
    assert torch.allclose(out, torch.tensor([1.0, 0.5, -0.5]))
    assert torch.equal(penalize(scores, stopped, mask, missing_eos_penalty=None), scores)  # off: untouched


# ---- scoring: the weighted sum, per-reward values, normalisation -----------------------------------------------------
@pytest.fixture(scope="module")
def mixed_run(tiny_models, tokenizer, tmp_path_factory):
    """A LoRA run of 2 iterations with a tiny reward model and a callable, weights 0.5 and 2.0."""
    trainer = make_trainer(tiny_models, tokenizer, tmp_path_factory.mktemp("mixed"), [tiny_models["reward"], count_e],
                           reward_weights=[0.5, 2.0])
    trainer.train()
    return trainer


def test_weighted_sum_of_a_reward_model_and_a_callable(mixed_run, tiny_models, tokenizer):
    from transformers import AutoModelForSequenceClassification

    rewards = mixed_run.rewards
    assert rewards.names == ["reward", "count_e"] and rewards.weights == [0.5, 2.0]
    completions = [" great fun", " the best ever seen"]
    combined, each = rewards.score(**batch_of(tokenizer, PROMPTS[:2], completions), tokenizer=tokenizer,
                                   prompts=PROMPTS[:2], batch_size=2)
    # By hand: the reward model's logit on each prompt + completion alone (no padding), and the e's counted.
    model = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"]).eval()
    logits = [model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(PROMPTS, completions)]
    assert torch.allclose(each["reward"], torch.tensor(logits), atol=1e-5)
    assert each["count_e"].tolist() == [1.0, 6.0]
    assert torch.allclose(combined, torch.tensor([0.5 * logits[0] + 2.0 * 1.0, 0.5 * logits[1] + 2.0 * 6.0]),
                          atol=1e-5)


def test_each_reward_is_logged_and_the_combined_score_is_their_weighted_sum(mixed_run):
    logs = [e for e in mixed_run.state.log_history if "objective/scores" in e]
    assert len(logs) == 2  # one rollout per iteration
    for entry in logs:
        # Means are linear: with no normalisation or penalty, mean(combined) = sum_i w_i * mean(r_i).
        expected = 0.5 * entry["objective/scores/reward"] + 2.0 * entry["objective/scores/count_e"]
        assert entry["objective/scores"] == pytest.approx(expected, abs=1e-4)
        assert all(v == v and abs(v) != float("inf") for v in entry.values() if isinstance(v, float))
    assert mixed_run.state.global_step == 8 and mixed_run.iteration == 2


def test_each_reward_normalised_by_its_own_running_statistics(tokenizer):
    rewards = RewardSet([count_e, length_reward], [None, None], ["count_e", "length_reward"], [1.0, 0.5],
                        normalize_each=True)
    batches = [[" eee", " e", " ", " ee e"], [" the end", " hello", " see", " x"]]
    seen = {"count_e": [], "length_reward": []}
    for completions in batches:
        batch = batch_of(tokenizer, PROMPTS, completions)
        combined, each = rewards.score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4,
                                       gather=lambda t: t)
        for name in seen:
            seen[name] += each[name].tolist()
    # Each reward's statistics are those of all its raw scores so far, its own only.
    normalised = {}
    for (name, values), moments in zip(seen.items(), rewards.moments):
        values = torch.tensor(values, dtype=torch.float64)
        assert moments.count == 8 and moments.mean == pytest.approx(values.mean().item())
        assert moments.var == pytest.approx(values.var(unbiased=False).item())
        normalised[name] = (each[name] - moments.mean) / moments.std
    assert torch.allclose(combined, normalised["count_e"] + 0.5 * normalised["length_reward"], atol=1e-5)
    # Evaluation (no gather) normalises with the statistics it holds and leaves them as they are.
    state = json.dumps(rewards.state_dict())
    again, _ = rewards.score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4)
    assert torch.allclose(again, combined) and json.dumps(rewards.state_dict()) == state


def test_a_single_reward_scores_as_before_and_logs_nothing_of_its_own(tokenizer):
    batch = batch_of(tokenizer, PROMPTS, [" eee", " e", " ", " ee e"])
    alone = score_responses(count_e, **batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4)
    scores, each = RewardSet.single(count_e).score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4,
                                                   gather=lambda t: t)
    assert torch.equal(scores, alone) and each == {}
    assert RewardSet.single(count_e).tokenizer is None  # `trainer.reward_tokenizer` of a single reward, as before


# ---- errors ------------------------------------------------------------------------------------------------------
def bad_reward(prompts, completions):
    return {"score": 1.0}


def test_weights_of_another_length_are_refused(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights has 3 weights but there are 2 rewards \(count_e, "
                                         r"length_reward\)"):
        make_trainer(tiny_models, tokenizer, tmp_path, [count_e, length_reward], reward_weights=[1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0, nan\]: must be None or a non-empty list of finite"):
        make_args(tmp_path, reward_weights=[1.0, float("nan")])
    with pytest.raises(ValueError, match=r"overlong_buffer_length=7: must be None \(off\) or an integer in \[1, "
                                         r"response_length=6\]"):
        make_args(tmp_path, overlong_buffer_length=7)


def test_a_bad_callable_in_the_list_is_named(tiny_models, tokenizer, tmp_path):
    with pytest.raises(TypeError, match=r"Reward 'bad_reward' \(reward_model\[1\]\): The reward function returned "
                                        r"dict"):
        make_trainer(tiny_models, tokenizer, tmp_path, [count_e, bad_reward])
    with pytest.raises(TypeError, match=r"Reward 'list' \(reward_model\[0\]\).*one flat list"):
        make_trainer(tiny_models, tokenizer, tmp_path, [[count_e], count_e])
    with pytest.raises(ValueError, match=r"reward_processing_class must be None or a list with one entry per reward"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                     reward_model=[count_e, length_reward], reward_processing_class=tokenizer,
                     train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), peft_config=lora())


class NaNOnCalls:
    """A reward function returning NaN on the given calls (1-based; call 1 is the construction-time probe)."""

    def __init__(self, calls):
        self.calls, self.n = set(calls), 0

    def __call__(self, prompts, completions):
        self.n += 1
        return [float("nan") if self.n in self.calls else 1.0 for _ in completions]


def test_nan_from_one_reward_drops_the_rollout_naming_it(tiny_models, tokenizer, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, [count_e, NaNOnCalls({3})], normalize_each_reward=True)
    with pytest.warns(UserWarning, match=r"rollout dropped and sampled again \(scores: 8 NaN/inf of 8 responses;.* "
                                         r"from reward 'NaNOnCalls': 8 NaN/inf\)"):
        trainer.train()
    assert trainer.state.global_step == 8 and trainer.iteration == 2
    assert trainer.state.log_history[-2]["nonfinite/dropped_rollouts"] == 1
    # The dropped rollout moved neither reward's statistics: 2 kept rollouts of 8 responses each.
    assert [m.count for m in trainer.rewards.moments] == [16, 16]
    assert all(m.mean == m.mean for m in trainer.rewards.moments)


def test_huge_scores_of_one_reward_warn_naming_it(tiny_models, tokenizer, tmp_path):
    def huge(prompts, completions):
        return [1e6] * len(completions)

    trainer = make_trainer(tiny_models, tokenizer, tmp_path, [count_e, huge], reward_weights=[1.0, 1e-6], max_steps=4)
    with pytest.warns(UserWarning, match=r"Reward 'huge' scores reach 1e\+06.*normalize_each_reward=True"):
        trainer.train()


# ---- exact resume with per-reward statistics ---------------------------------------------------------------------
def logged(trainer):
    return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k and "runtime" not in k
             and k not in ("train_loss", "total_flos")} for e in trainer.state.log_history]


def test_resume_mid_iteration_with_normalize_each_reward_is_exact(tiny_models, tokenizer, tmp_path):
    rewards = [tiny_models["reward"], count_e]
    options = dict(reward_weights=[1.0, 0.25], normalize_each_reward=True, overlong_buffer_length=2)
    straight = make_trainer(tiny_models, tokenizer, tmp_path / "straight", rewards, save_strategy="steps",
                            save_steps=3, **options)
    straight.train()
    with open(tmp_path / "straight" / "checkpoint-3" / "ppo_state.json") as f:
        assert list(json.load(f)["each_reward_moments"]) == ["reward", "count_e"]
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", rewards, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    for (name, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(x, y), name
    assert resumed.rewards.state_dict() == straight.rewards.state_dict()
    assert [m.count for m in resumed.rewards.moments] == [16, 16]
    assert len(logged(straight)) == 9 and logged(straight) == logged(resumed)


# ---- the model card names every reward ---------------------------------------------------------------------------
def test_card_lists_every_reward(tmp_path):
    sources = model_sources("org/policy", ["org/reward-a", count_e], None, None, None, None, True)
    assert sources["reward_model"] == ["org/reward-a", "reward function count_e"]
    write_model_card(tmp_path, repo_id="me/tuned", base_model="org/policy", reward_model=sources["reward_model"],
                     ref_model=None, dataset_names=[], peft_config=None, hyperparameters={}, log_history=[])
    card = (tmp_path / "README.md").read_text()
    assert "| reward model | [org/reward-a](https://huggingface.co/org/reward-a), a reward function (`count_e`) |" in card
    assert os.path.isfile(tmp_path / "README.md")
