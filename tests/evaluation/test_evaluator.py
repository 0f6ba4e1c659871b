"""Policy-vs-reference evaluation (hf_ppo/evaluation/): the win rate and its interval by hand, the metrics during
training, the report file, judges that training never sees, the model card."""

import math
import os

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.evaluation.report import REPORT_FILE, REPORT_MARK
from hf_ppo.evaluation.evaluator import win_rate


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def length_judge(prompts, completions):
    """A judge that training never sees: it counts the calls made to it."""
    length_judge.calls += 1
    return [float(len(c)) for c in completions]


length_judge.calls = 0


def args(tmp_path, **overrides):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    per_device_eval_batch_size=4, num_ppo_epochs=1, max_steps=2, response_length=6, logging_steps=1,
                    learning_rate=1e-3, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0)
    defaults.update(overrides)
    return PPOConfig(**defaults)


PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 2})


def test_win_rate_counts_ties_half_by_hand():
    rate, low, high = win_rate(torch.tensor([2.0, 1.0, 3.0, 0.0]), torch.tensor([1.0, 1.0, 5.0, -1.0]))
    assert rate == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert low <= rate <= high and 0 <= low and high <= 1


def test_win_rate_all_wins_is_one_and_the_interval_is_seeded():
    assert win_rate(torch.arange(5.0) + 1, torch.arange(5.0)) == (1.0, 1.0, 1.0)
    p, r = torch.randn(50, generator=torch.Generator().manual_seed(1)), torch.zeros(50)
    assert win_rate(p, r, seed=3) == win_rate(p, r, seed=3)
    rate, low, high = win_rate(p, r, seed=3)
    assert low < rate < high and high - low < 0.4  # 50 prompts: about +-0.14 around the rate
    with pytest.raises(ValueError, match="one shape"):
        win_rate(torch.zeros(3), torch.zeros(2))


def test_evaluate_compares_policy_and_reference_and_writes_the_report(tiny_models, tokenizer, tmp_path):
    length_judge.calls = 0
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path, eval_strategy="steps", eval_steps=1),
                           processing_class=tokenizer, reward_model=count_e, eval_reward_model=length_judge,
                           train_dataset=PROMPTS, eval_dataset=PROMPTS)
    assert length_judge.calls == 1  # probed once at construction, never during training's rollouts
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_reward/count_e/win_rate" in e]
    assert [e["step"] for e in evals] == [1, 2]
    last = evals[-1]
    for name in ("reward/count_e", "judge/length_judge"):
        assert last[f"eval_{name}/win_rate_low"] <= last[f"eval_{name}/win_rate"] <= last[f"eval_{name}/win_rate_high"]
    assert math.isfinite(last["eval_kl_to_reference"])
    assert 0 < last["eval_reference/response_length"] <= 6 and 0 <= last["eval_policy/stop_rate"] <= 1
    # The reference is sampled once per eval set: both evaluations compared against the same responses.
    assert evals[0]["eval_reward/count_e/reference"] == evals[1]["eval_reward/count_e/reference"]
    assert length_judge.calls == 1 + 2 * 2 + 2  # probe; 2 evaluations x 2 batches of the policy; reference once
    text = open(os.path.join(trainer.args.output_dir, REPORT_FILE)).read()
    assert text.startswith(REPORT_MARK) and "(step 2)" in text
    assert "| reward/count_e |" in text and "| judge/length_judge |" in text
    assert text.count("| the movie was |") == 2 and "count_e: " in text and "length_judge: " in text
    # The model card shows the final evaluation.
    trainer.save_model()
    card = open(os.path.join(trainer.args.output_dir, "README.md")).read()
    assert "Evaluation against the reference (step 2)" in card and "| judge/length_judge |" in card


def test_at_step_zero_the_policy_is_its_reference(tiny_models, tokenizer, tmp_path):
    """With no training the policy is the reference: KL 0 on its own samples."""
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path), processing_class=tokenizer,
                           reward_model=count_e, train_dataset=PROMPTS, eval_dataset=PROMPTS.select(range(4)))
    metrics = trainer.evaluate()
    assert metrics["eval_kl_to_reference"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["eval_loss"] == pytest.approx(-metrics["eval_reward/count_e/policy"])


def test_a_report_file_hf_ppo_did_not_write_is_left_alone(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / REPORT_FILE).write_text("my notes\n")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path), processing_class=tokenizer,
                           reward_model=count_e, train_dataset=PROMPTS, eval_dataset=PROMPTS.select(range(4)))
    with pytest.warns(UserWarning, match="not written by hf_ppo"):
        metrics = trainer.evaluate()
    assert "eval_reward/count_e/win_rate" in metrics
    assert (out / REPORT_FILE).read_text() == "my notes\n"
