"""Issue 37, evaluation: k samples per eval prompt (`num_eval_samples`), the unbiased pass@k of Chen et al. 2021 for 0/1
rewards, per-reward means for the policy and the reference, dataset columns reaching the rewards in `evaluate()`,
and NaN / None scores left out and counted, never silently read as wrong answers."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.evaluation.evaluator import evaluation_metrics, pass_at_k, pass_at_k_mean, win_rate
from hf_ppo.evaluation.report import REPORT_FILE, metrics_markdown

# ---- pass@k by hand ------------------------------------------------------------------------------------------------

# n = 4 samples, c correct: 1 - C(4 - c, k) / C(4, k), worked out by hand.
BY_HAND = {  # c: (pass@1, pass@2, pass@4)
    0: (0.0, 0.0, 0.0),
    1: (1 / 4, 1 - 3 / 6, 1.0),  # C(3,2)=3, C(4,2)=6; C(3,4)=0
    2: (2 / 4, 1 - 1 / 6, 1.0),  # C(2,2)=1
    3: (3 / 4, 1.0, 1.0),  # C(1,2)=0
    4: (1.0, 1.0, 1.0),
}


@pytest.mark.parametrize("c", range(5))
def test_pass_at_k_matches_the_hand_computed_values_for_four_samples(c):
    for k, expected in zip((1, 2, 4), BY_HAND[c]):
        assert pass_at_k(4, c, k) == pytest.approx(expected, abs=1e-12), (c, k)


def test_pass_at_k_is_exact_where_the_binomials_are_huge():
    """The product form agrees with the exact ratio of binomials (as fractions) where C(n, k) overflows a float."""
    for n, c, k in [(200, 3, 100), (1000, 1, 500), (64, 60, 5), (2000, 10, 1000)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12), (n, c, k)


def test_pass_at_k_edges_a_planted_bug_would_break():
    """All correct is 1, none correct is 0, pass@1 is the fraction correct, and pass@k grows with k."""
    for n in (1, 2, 5, 16):
        for k in range(1, n + 1):
            assert pass_at_k(n, n, k) == 1.0 and pass_at_k(n, 0, k) == 0.0
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == sorted(values)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(*bad)


def test_pass_at_k_mean_averages_prompts_and_leaves_out_those_with_too_few_scored_samples():
    correct = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    scored = torch.tensor([[True] * 4, [True] * 4, [True] * 4, [True, True, False, False]])
    assert pass_at_k_mean(correct, scored, 1) == pytest.approx(((1 / 4 + 1 + 0 + 1 / 2) / 4, 4))
    assert pass_at_k_mean(correct, scored, 2) == pytest.approx(((1 / 2 + 1 + 0 + 1) / 4, 4))
    # The last prompt has 2 scored samples: no pass@4 of its own (not a 0).
    assert pass_at_k_mean(correct, scored, 4) == pytest.approx(((1 + 1 + 0) / 3, 3))
    value, used = pass_at_k_mean(correct, torch.zeros_like(scored), 1)
    assert math.isnan(value) and used == 0


# ---- the metrics from (prompts, k) tensors --------------------------------------------------------------------------

def tensors(**scores) -> dict[str, torch.Tensor]:
    n, k = next(iter(scores.values())).shape
    out = {"kl": torch.zeros(n, k)}
    for side in ("policy", "reference"):
        out[f"{side}|length"], out[f"{side}|stopped"] = torch.ones(n, k), torch.ones(n, k)
    out.update({key.replace("__", "|", 1).replace("_", "/", 1) if "__" in key else key: value
                for key, value in scores.items()})
    return out


def test_evaluation_metrics_report_pass_at_k_for_each_side_of_a_0_1_reward():
    policy = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    reference = torch.tensor([[0.0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]])
    metrics = evaluation_metrics({**tensors(policy__reward_acc=policy, reference__reward_acc=reference)})
    assert metrics["num_samples"] == 4 and metrics["num_prompts"] == 3
    assert metrics["reward/acc/policy"] == pytest.approx(5 / 12)  # the accuracy: mean over every sample
    assert metrics["reward/acc/reference"] == pytest.approx(3 / 12)
    assert metrics["reward/acc/pass@1/policy"] == pytest.approx((1 / 4 + 1 + 0) / 3)
    assert metrics["reward/acc/pass@2/policy"] == pytest.approx((1 / 2 + 1 + 0) / 3)
    assert metrics["reward/acc/pass@4/policy"] == pytest.approx((1 + 1 + 0) / 3)
    assert metrics["reward/acc/pass@1/reference"] == pytest.approx((0 + 2 / 4 + 1 / 4) / 3)
    assert metrics["reward/acc/pass@2/reference"] == pytest.approx((0 + 5 / 6 + 1 / 2) / 3)
    assert metrics["reward/acc/pass@4/reference"] == pytest.approx((0 + 1 + 1) / 3)
    assert metrics["reward/acc/pass@4/prompts"] == 3
    # Sample j of the policy against sample j of the reference: 12 pairs, 3 wins (row 0 j=0, row 1 j=1, 3), 1 loss
    # (row 2 j=3), 8 ties.
    assert metrics["reward/acc/win_rate"] == pytest.approx((3 + 0.5 * 8) / 12)


def test_a_reward_that_is_not_0_1_gets_no_pass_at_k_and_the_table_says_why():
    scores = torch.tensor([[1.0, 0.5], [0.0, 1.0]])
    metrics = evaluation_metrics(tensors(policy__reward_len=scores, reference__reward_len=scores,
                                         policy__reward_acc=torch.ones(2, 2), reference__reward_acc=torch.zeros(2, 2)))
    assert not [key for key in metrics if key.startswith("reward/len/pass@")]
    assert metrics["reward/acc/pass@2/policy"] == 1.0 and metrics["reward/acc/pass@2/reference"] == 0.0
    table = metrics_markdown(metrics)
    assert "- reward/len: no pass@k: its scores are not all 0 or 1." in table
    assert "| reward/acc | policy | 1.000 | 1.000 |" in table and "| reward/acc | reference | 0.000 | 0.000 |" in table


def test_one_sample_per_prompt_adds_no_pass_at_k_and_keeps_the_metrics_as_they_were():
    metrics = evaluation_metrics(tensors(policy__reward_acc=torch.tensor([[1.0], [0.0]]),
                                         reference__reward_acc=torch.tensor([[0.0], [0.0]])))
    assert not [key for key in metrics if "pass@" in key or key.startswith("num_")]
    assert metrics["reward/acc/policy"] == 0.5 and metrics["reward/acc/win_rate"] == 0.75


def test_nan_samples_are_left_out_of_pass_at_k_and_counted_never_read_as_wrong():
    policy = torch.tensor([[1.0, math.nan, 0.0, 0.0], [math.nan, math.nan, math.nan, 1.0]])
    reference = torch.zeros(2, 4)
    metrics = evaluation_metrics(tensors(policy__reward_acc=policy, reference__reward_acc=reference))
    assert metrics["reward/acc/nonfinite"] == 4 and metrics["reward/acc/not_applicable"] == 0
    # Prompt 0: 3 scored samples, 1 correct; prompt 1: 1 scored sample, correct (a NaN read as 0 would give 1/4).
    assert metrics["reward/acc/pass@1/policy"] == pytest.approx((1 / 3 + 1) / 2)
    assert metrics["reward/acc/pass@2/policy"] == pytest.approx(2 / 3)  # prompt 1 has too few samples for pass@2
    assert math.isnan(metrics["reward/acc/pass@4/policy"]) and metrics["reward/acc/pass@4/prompts"] == 0
    assert metrics["reward/acc/policy"] == pytest.approx(2 / 4)
    table = metrics_markdown(metrics)
    assert "(4 samples left out: NaN/inf)" in table and "| reward/acc | policy | 0.667 | 0.667 | n/a |" in table
    assert "pass@4 over 0 of 2 prompts" in table


def test_none_samples_are_left_out_of_the_means_and_pass_at_k_and_counted():
    """A reward function's None (does not apply) arrives as score 0.0 with applies False: it must not count as a
    wrong answer."""
    policy = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    applies = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # sample 1 of prompt 0: None
    metrics = evaluation_metrics({**tensors(policy__reward_acc=policy, reference__reward_acc=torch.zeros(2, 4)),
                                  "applies:policy|reward/acc": applies,
                                  "applies:reference|reward/acc": torch.ones(2, 4)})
    assert metrics["reward/acc/not_applicable"] == 1 and metrics["reward/acc/nonfinite"] == 0
    assert metrics["reward/acc/policy"] == pytest.approx(2 / 7)
    assert metrics["reward/acc/pass@1/policy"] == pytest.approx((2 / 3 + 0) / 2)
    assert metrics["reward/acc/pass@2/policy"] == pytest.approx((1 + 0) / 2)  # prompt 0: C(1,2)=0, certain
    assert metrics["reward/acc/pass@4/prompts"] == 1
    assert "(1 samples left out: None, does not apply)" in metrics_markdown(metrics)


def test_the_win_rate_pairs_samples_by_index_and_bootstraps_over_prompts():
    assert win_rate(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))[0] == 0.5
    # Two prompts of 50 samples each: one always won, one always lost. Resampling the 100 pairs alone would give a
    # narrow interval around 0.5; the prompts are what varies, so the interval spans nearly [0, 1].
    policy = torch.cat([torch.ones(1, 50), torch.zeros(1, 50)])
    rate, low, high = win_rate(policy, 1 - policy)
    assert rate == 0.5 and low == 0.0 and high == 1.0
    with pytest.raises(ValueError, match="one shape"):
        win_rate(torch.zeros(2, 3), torch.zeros(2, 2))


# ---- end to end: trainer.evaluate() with a 0/1 reward reading the `answer` column ---------------------------------

QUESTIONS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"],
                               "answer": ["e", "o", "a", "s"]})
ANSWER_OF = dict(zip(QUESTIONS["prompt"], QUESTIONS["answer"]))


def contains_answer(prompts, completions, answer, **kwargs):
    """A 0/1 reward reading the `answer` column; it records what it was given to check the alignment."""
    contains_answer.seen.extend(zip(prompts, answer))
    return [float(a in c) for c, a in zip(completions, answer)]


contains_answer.seen = []


def skips_the_food(prompts, completions, answer, **kwargs):
    """A 0/1 reward that does not apply (None) to one question."""
    return [None if a == "o" else float(a in c) for c, a in zip(completions, answer)]


def trainer_for(tmp_path, tiny_models, tokenizer, reward, **overrides) -> PPOLMTrainer:
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=2,
                    num_ppo_epochs=1, max_steps=1, response_length=8, report_to=[], save_strategy="no",
                    num_sample_generations=0, disable_tqdm=True, seed=0, temperature=1.5, num_eval_samples=4)
    settings.update(overrides)
    return PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**settings), processing_class=tokenizer,
                        reward_model=reward, train_dataset=QUESTIONS, eval_dataset=QUESTIONS)


def test_evaluate_samples_k_per_prompt_gives_each_the_answer_and_reports_pass_at_k(tiny_models, tokenizer,
                                                                                    tmp_path):
    trainer = trainer_for(tmp_path, tiny_models, tokenizer, contains_answer)
    contains_answer.seen = []
    metrics = trainer.evaluate()
    # 4 prompts x 4 samples, for the policy and for the reference; every completion got its own row's answer.
    assert len(contains_answer.seen) == 2 * 4 * 4
    assert all(ANSWER_OF[prompt] == answer for prompt, answer in contains_answer.seen)
    assert sorted(contains_answer.seen) == sorted([(p, a) for p, a in ANSWER_OF.items()] * 8)
    name = "eval_reward/contains_answer"
    assert metrics["eval_num_samples"] == 4 and metrics["eval_num_prompts"] == 4
    for side in ("policy", "reference"):
        values = [metrics[f"{name}/pass@{k}/{side}"] for k in (1, 2, 4)]
        assert values == sorted(values) and all(0 <= v <= 1 for v in values), (side, values)
        assert values[0] == pytest.approx(metrics[f"{name}/{side}"])  # pass@1 is the accuracy
    assert metrics[f"{name}/pass@4/prompts"] == 4
    text = open(os.path.join(trainer.args.output_dir, REPORT_FILE), encoding="utf-8").read()
    assert "4 eval prompts, 4 responses each" in text
    assert "| score | side | pass@1 | pass@2 | pass@4 |" in text
    for side in ("policy", "reference"):
        shown = " | ".join(f"{metrics[f'{name}/pass@{k}/{side}']:.3f}" for k in (1, 2, 4))
        assert f"| reward/contains_answer | {side} | {shown} |" in text
    assert "(sample 4/4)" in text


def test_evaluate_leaves_a_functions_none_out_of_its_pass_at_k(tiny_models, tokenizer, tmp_path):
    trainer = trainer_for(tmp_path, tiny_models, tokenizer, [contains_answer, skips_the_food])
    metrics = trainer.evaluate()
    name = "eval_reward/skips_the_food"
    assert metrics[f"{name}/not_applicable"] == 4  # the food question's 4 pairs
    assert metrics[f"{name}/pass@4/prompts"] == 3 and metrics["eval_reward/contains_answer/pass@4/prompts"] == 4
    assert metrics["eval_reward/contains_answer/not_applicable"] == 0
    text = open(os.path.join(trainer.args.output_dir, REPORT_FILE), encoding="utf-8").read()
    assert "skips_the_food: None (does not apply)" in text and "pass@4 over 3 of 4 prompts" in text


@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_num_eval_samples_below_one_is_refused_at_construction(value, tmp_path):
    with pytest.raises(ValueError, match=r"num_eval_samples=.*must be an integer >= 1"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], num_eval_samples=value)
