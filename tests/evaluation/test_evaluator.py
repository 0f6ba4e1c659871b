"""Policy-vs-reference evaluation (hf_ppo/evaluation/): the win rate and its interval by hand, the metrics during
training, the report file, judges that training never sees, the model card."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from fractions import Fraction

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.command import main
from hf_ppo.evaluation.evaluator import evaluation_metrics, pass_at_k, pass_at_k_mean, win_rate
from hf_ppo.evaluation.report import REPORT_FILE, REPORT_MARK, metrics_markdown, write_report
from hf_ppo.rollout import make_rollout_engine
from hf_ppo.rollout.reward_calls import RewardFunctionError
from tests.devices import device_of
from tests.prompt_codes import CodeCheck, LastTokenEngine, coded_prompts, group_codes
from tests.scripted_engine import ScriptedEngine


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
    # probed at construction on the training and on the evaluation prompts, never during training's rollouts
    assert length_judge.calls == 2
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
    assert length_judge.calls == 2 + 2 * 2 + 2  # probes; 2 evaluations x 2 batches of the policy; reference once
    text = open(os.path.join(trainer.args.output_dir, REPORT_FILE)).read()
    assert text.startswith(REPORT_MARK) and "(step 2)" in text
    assert "| reward/count_e |" in text and "| judge/length_judge |" in text
    assert text.count("| the movie was |") == 2 and "count_e: " in text and "length_judge: " in text
    # The model card shows the final evaluation.
    trainer.save_model()
    card = open(os.path.join(trainer.args.output_dir, "README.md")).read()
    assert "Evaluation against the reference (step 2)" in card and "| judge/length_judge |" in card


def test_a_reward_functions_log_metric_is_reported_for_the_policy_and_the_reference_apart(tiny_models, tokenizer,
                                                                                            tmp_path):
    """Issue 61: at evaluation, what a reward function logged with `log_metric` was the mean over both sides' calls.
    A function that logs its own call number: the reference is scored first (once per eval set, then cached), then
    the policy, so the two sides log different values."""
    calls = []

    def counted(prompts, completions, log_metric, **kwargs):
        calls.append(len(completions))
        log_metric("call", float(len(calls)))
        return [0.0] * len(completions)

    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path), processing_class=tokenizer,
                           reward_model=counted, train_dataset=PROMPTS, eval_dataset=PROMPTS.select(range(4)))
    first = len(calls)  # the construction probes (they log nowhere)
    metrics = trainer.evaluate()
    assert metrics["eval_call/reference"] == first + 1 and metrics["eval_call/policy"] == first + 2
    assert "eval_call" not in metrics
    again = trainer.evaluate()  # the reference's responses (and what its scoring logged) are the cached ones
    assert again["eval_call/reference"] == first + 1 and again["eval_call/policy"] == first + 3


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_at_step_zero_the_policy_is_its_reference(tiny_models, tokenizer, tmp_path, bf16):
    """With no training the policy is the reference: KL 0 on its own samples. Under bf16 mixed precision (a GPU's
    default) the reference's pass runs under the policy's autocast too (without it: -0.00018 nats on an H200)."""
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path, bf16=bf16, use_cpu=True),
                           processing_class=tokenizer,
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


# ---- k samples per prompt and pass@k ---------------------------------------------------------------------------------
# Evaluation with k samples per eval prompt (`num_eval_samples`), the unbiased pass@k of Chen et al. 2021 for 0/1
# rewards, per-reward means for the policy and the reference, dataset columns reaching the rewards in `evaluate()`,
# and NaN / None scores left out and counted, never silently read as wrong answers.

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


def test_a_none_on_the_reference_side_alone_leaves_the_pair_out_of_both_sides():
    """Only the reference's reward skipped a row (its None): the pair is not scored, so neither side's mean nor the
    win rate reads it, and `not_applicable` counts it. By hand: rows 0 and 2 are scored; policy 1, 1 -> mean 1.0,
    reference 0.5, 0.0 -> mean 0.25, two wins -> win rate 1.0 (reading row 1 would give 2/3, 5/6 and 2/3)."""
    metrics = evaluation_metrics({**tensors(policy__reward_r=torch.tensor([[1.0], [0.0], [1.0]]),
                                            reference__reward_r=torch.tensor([[0.5], [2.0], [0.0]])),
                                  "applies:policy|reward/r": torch.ones(3, 1),
                                  "applies:reference|reward/r": torch.tensor([[1.0], [0.0], [1.0]])})
    assert metrics["reward/r/not_applicable"] == 1 and metrics["reward/r/nonfinite"] == 0
    assert metrics["reward/r/policy"] == 1.0 and metrics["reward/r/reference"] == 0.25
    assert metrics["reward/r/win_rate"] == 1.0


def test_a_correct_sample_whose_pair_was_not_scored_is_left_out_of_pass_at_k():
    """pass@k reads the scored pairs: a policy sample that is correct, but whose reference sample was NaN (prompt 0,
    sample 1) or None (prompt 1, sample 0), counts neither as correct nor as a sample. By hand, each prompt has n = 3
    scored samples: prompt 0 c = 1, prompt 1 c = 0. pass@1 = (1/3 + 0) / 2, pass@2 = (1 - C(2,2)/C(3,2) + 0) / 2 =
    1/3; no prompt has 4 scored samples, so pass@4 is NaN over 0 prompts."""
    policy = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    reference = torch.tensor([[0.0, math.nan, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    metrics = evaluation_metrics({**tensors(policy__reward_acc=policy, reference__reward_acc=reference),
                                  "applies:policy|reward/acc": torch.ones(2, 4),
                                  "applies:reference|reward/acc": torch.tensor([[1.0] * 4, [0.0, 1.0, 1.0, 1.0]])})
    assert metrics["reward/acc/nonfinite"] == 1 and metrics["reward/acc/not_applicable"] == 1
    assert metrics["reward/acc/pass@1/policy"] == pytest.approx(1 / 6)
    assert metrics["reward/acc/pass@2/policy"] == pytest.approx(1 / 3)
    assert math.isnan(metrics["reward/acc/pass@4/policy"]) and metrics["reward/acc/pass@4/prompts"] == 0
    assert metrics["reward/acc/pass@1/reference"] == 0.0 and metrics["reward/acc/pass@2/reference"] == 0.0
    assert metrics["reward/acc/policy"] == pytest.approx(1 / 6) and metrics["reward/acc/reference"] == 0.0
    # 6 scored pairs: one win (prompt 0, sample 0), five ties.
    assert metrics["reward/acc/win_rate"] == pytest.approx((1 + 0.5 * 5) / 6)


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


def test_evaluate_keeps_each_samples_tokens_with_its_prompts_text_and_columns(tiny_models, tokenizer, tmp_path):
    """num_eval_samples=k: the k rows of a prompt must carry its TOKENS, its text and its dataset columns together
    (`repeated`: one repeat_interleave of all of them), on the policy's and the reference's side, for a training reward
    and a judge, over an uneven last batch too. The engine answers each query row with the row's last prompt token
    (tests/prompt_codes.py); the rewards check that against the row's `code` column and the prompt text, and score the
    row with its `value` column. A repeat for a repeat_interleave, or one side's rows reordered, shows as a mismatch,
    as rows of a group from other prompts, or as a sample scored with another prompt's value."""
    length, k = 4, 3
    data = coded_prompts(tokenizer, 5)  # eval batches of 2, 2 and 1 prompts
    reward, judge = CodeCheck(tokenizer, length), CodeCheck(tokenizer, length, name="code_judge")
    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=2,
                     num_ppo_epochs=1, max_steps=1, response_length=length, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, seed=0, num_eval_samples=k,
                     apply_chat_template_to_text=False)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=reward,
                           eval_reward_model=judge, train_dataset=data, eval_dataset=data)
    reward.reset()  # the construction probes' empty completions
    judge.reset()
    engine = trainer.rollout_engine = LastTokenEngine(length)
    real, gathered = trainer.gather_function, []
    # Each batch's (prompts, k) tensors, as the evaluator gathers them (Trainer gathers its losses there too).
    trainer.gather_function = lambda x: (gathered.append(x) if isinstance(x, dict) else None) or real(x)
    metrics = trainer.evaluate()
    # Each batch sampled by the reference, then by the policy: k consecutive rows per prompt, the prompts in order.
    assert [len(queries) for queries, _ in engine.calls] == [2 * k, 2 * k, 2 * k, 2 * k, k, k]
    codes, problems = group_codes(engine.calls, k)
    assert problems == []
    assert codes == [c for b in (0, 2, 4) for _side in ("reference", "policy") for c in data["code"][b:b + 2]]
    # Every completion met its own prompt's text and columns, in the training reward and in the judge.
    assert reward.rows == judge.rows == 2 * 5 * k
    assert reward.mismatches == [] and judge.mismatches == []
    # Each sample's score is its prompt's value: in every batch's gathered (prompts, k) scores, the means, the report.
    values = torch.tensor(data["value"])[:, None].expand(-1, k)
    assert [len(batch["kl"]) for batch in gathered] == [2, 2, 1]
    for name in ("reward/code_check", "judge/code_judge"):
        for side in ("policy", "reference"):
            assert torch.equal(torch.cat([batch[f"{side}|{name}"].cpu() for batch in gathered]), values), (side, name)
            assert metrics[f"eval_{name}/{side}"] == pytest.approx(sum(data["value"]) / 5)
    expected = [(f"{p} (sample {j}/{k})", tokenizer.decode([c] * length).strip(),
                 f"reward/code_check: {v:g}<br>judge/code_judge: {v:g}")
                for p, c, v in zip(data["prompt"], data["code"], data["value"]) for j in range(1, k + 1)]
    rows = report_rows(trainer)
    assert [tuple(row[:3]) for row in rows] == expected  # the reference's responses and scores
    assert [(row[0], *row[3:]) for row in rows] == expected  # the policy's


@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_num_eval_samples_below_one_is_refused_at_construction(value, tmp_path):
    with pytest.raises(ValueError, match=r"num_eval_samples=.*must be an integer >= 1"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], num_eval_samples=value)


# ---- non-finite scores and missing paths -----------------------------------------------------------------------------
# NaN/inf scores at evaluation never read as a loss; `hf-ppo evaluate` names missing paths.

class Armed:
    """A reward / judge that scores like `count_e` until armed (after the construction probe), then NaN for the
    prompts that contain `nan_for` ("" : every prompt)."""

    def __init__(self, name: str, nan_for: str):
        self.__name__, self.nan_for, self.armed = name, nan_for, False

    def __call__(self, prompts, completions):
        return [math.nan if self.armed and self.nan_for in p else float(c.count("e"))
                for p, c in zip(prompts, completions)]


def trainer_with(tmp_path, tiny_models, tokenizer, *, reward=count_e, judge=None, **overrides):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    num_ppo_epochs=1, max_steps=1, response_length=4, report_to=[], save_strategy="no",
                    num_sample_generations=0, disable_tqdm=True, seed=0)
    defaults.update(overrides)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**defaults), processing_class=tokenizer,
                           reward_model=reward, eval_reward_model=judge, train_dataset=PROMPTS, eval_dataset=PROMPTS)
    for scorer in (reward, judge):
        if hasattr(scorer, "armed"):  # after the construction probe
            scorer.armed = True
    return trainer


def report(trainer) -> str:
    return open(os.path.join(trainer.args.output_dir, REPORT_FILE), encoding="utf-8").read()


# ---- 1. NaN at evaluation is named, counted and left out: never a loss -------------------------------------------

def test_win_rate_refuses_nonfinite_scores_rather_than_counting_them_as_losses():
    with pytest.raises(ValueError, match="NaN/inf scores at 2 of 3 positions"):
        win_rate(torch.tensor([1.0, math.nan, 2.0]), torch.tensor([0.0, 0.0, math.inf]))


def test_evaluation_metrics_leave_out_nonfinite_pairs_and_count_them():
    tensors = {"kl": torch.zeros(4), "policy|length": torch.ones(4), "reference|length": torch.ones(4),
               "policy|stopped": torch.ones(4), "reference|stopped": torch.ones(4),
               "policy|judge/j": torch.tensor([math.nan, 2.0, 2.0, math.nan]),
               "reference|judge/j": torch.tensor([5.0, 1.0, 1.0, 5.0]),
               "policy|reward/r": torch.full((4,), math.nan), "reference|reward/r": torch.zeros(4)}
    metrics = evaluation_metrics(tensors)
    # The two finite pairs are both wins; the NaN pairs are not losses.
    assert metrics["judge/j/win_rate"] == 1.0 and metrics["judge/j/nonfinite"] == 2.0
    assert metrics["judge/j/policy"] == 2.0 and metrics["judge/j/reference"] == 1.0
    for key in ("win_rate", "win_rate_low", "win_rate_high", "policy", "reference"):
        assert math.isnan(metrics[f"reward/r/{key}"]), key
    assert metrics["reward/r/nonfinite"] == 4.0
    table = metrics_markdown(metrics)
    assert "| reward/r | no finite scores | no finite scores | no finite scores (4 prompts NaN/inf) |" in table
    assert "(2 prompts left out: NaN/inf)" in table


def test_a_judge_returning_nan_for_some_prompts_is_named_counted_and_left_out(tiny_models, tokenizer, tmp_path):
    judge = Armed("flaky_judge", nan_for="movie")
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, judge=judge)
    with pytest.warns(UserWarning, match=r"judge 'flaky_judge' returned NaN/inf for 2 eval prompts .*the prompt "
                                         r"'[^']*the movie was'.*left out.*eval_judge/flaky_judge/nonfinite"):
        metrics = trainer.evaluate()
    assert metrics["eval_judge/flaky_judge/nonfinite"] == 2.0
    assert metrics["eval_reward/count_e/nonfinite"] == 0.0
    for key in ("win_rate", "win_rate_low", "win_rate_high", "policy", "reference"):
        assert math.isfinite(metrics[f"eval_judge/flaky_judge/{key}"]), key
    assert "| judge/flaky_judge |" in report(trainer) and "(2 prompts left out: NaN/inf)" in report(trainer)


def test_a_judge_returning_nan_for_every_prompt_gives_nan_not_a_loss(tiny_models, tokenizer, tmp_path):
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, judge=Armed("broken_judge", nan_for=""))
    with pytest.warns(UserWarning, match=r"judge 'broken_judge' returned NaN/inf for 8 eval prompts.*"
                                         r"No prompt has finite scores.*not a loss"):
        metrics = trainer.evaluate()
    for key in ("win_rate", "win_rate_low", "win_rate_high", "policy", "reference"):
        assert math.isnan(metrics[f"eval_judge/broken_judge/{key}"]), key  # never 0.0
    assert metrics["eval_judge/broken_judge/nonfinite"] == 8.0
    assert math.isfinite(metrics["eval_reward/count_e/win_rate"])  # the healthy reward still reports
    text = report(trainer)
    assert "| judge/broken_judge | no finite scores |" in text
    assert "| judge/broken_judge | nan" not in text and "0.000 [0.000, 0.000]" not in text


def test_a_training_reward_returning_nan_at_evaluation_is_no_loss(tiny_models, tokenizer, tmp_path):
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, reward=Armed("nan_reward", nan_for=""))
    with pytest.warns(UserWarning, match=r"reward 'nan_reward' returned NaN/inf for 8 eval prompts"):
        metrics = trainer.evaluate()
    assert math.isnan(metrics["eval_reward/nan_reward/win_rate"]) and math.isnan(metrics["eval_loss"])
    assert metrics["eval_reward/nan_reward/nonfinite"] == 8.0
    assert "| reward/nan_reward | no finite scores |" in report(trainer)


class Raising:
    """A reward / judge that scores 0.0 until armed, then raises a KeyError (a bug of its own)."""

    def __init__(self, name: str):
        self.__name__, self.armed = name, False

    def __call__(self, prompts, completions):
        if self.armed:
            raise KeyError("label")
        return [0.0] * len(prompts)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
@pytest.mark.parametrize("role", ["reward", "judge"])
def test_a_reward_that_raises_at_evaluation_is_named_with_a_prompt(role, tiny_models, tokenizer, tmp_path):
    trainer = trainer_with(tmp_path, tiny_models, tokenizer, **{role: Raising("buggy_scorer")})
    # Named by the reward call (issue 37: the function and its first failing row), its own error chained.
    with pytest.raises(RewardFunctionError, match=r"'buggy_scorer' raised KeyError: 'label'") as raised:
        trainer.evaluate()
    assert isinstance(raised.value.__cause__, KeyError)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "'buggy_scorer'" in notes and "starting with 'the movie was'" in notes
    assert ("eval_reward_model" in notes) == (role == "judge")


# ---- 9. `hf-ppo evaluate` names a path that does not exist ---------------------------------------------------------

@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was"]))
    return str(path)


def evaluate_argv(tiny_models, prompts_file, **changes) -> list[str]:
    given = {"policy": tiny_models["policy"], "reference": tiny_models["policy"], "reward_model": tiny_models["reward"],
             "dataset": prompts_file, "response_length": "2", **changes}
    return ["evaluate"] + [x for flag, value in given.items() if value is not None for x in (f"--{flag}", value)]


def test_a_policy_folder_that_does_not_exist_is_named_not_called_a_full_model(tiny_models, prompts_file, tmp_path):
    missing = str(tmp_path / "outputs" / "ppo-typo")
    with pytest.raises(SystemExit, match=r"--policy '.*ppo-typo' does not exist: no such folder") as stop:
        main(evaluate_argv(tiny_models, prompts_file, policy=missing, reference=None))
    assert "full model" not in str(stop.value)


@pytest.mark.parametrize("flag, name", [("reference", "ref-typo"), ("reward_model", "rm-typo"),
                                        ("judge", "judge-typo"), ("dataset", "prompts-typo.jsonl")])
def test_every_path_argument_that_does_not_exist_is_named(flag, name, tiny_models, prompts_file, tmp_path):
    what = "file" if flag == "dataset" else "folder"
    with pytest.raises(SystemExit, match=rf"--{flag} '.*{name}' does not exist: no such {what}"):
        main(evaluate_argv(tiny_models, prompts_file, **{flag: str(tmp_path / name)}))


def test_a_relative_missing_path_names_the_directory_it_was_read_from(tiny_models, prompts_file, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=rf"--policy 'outputs/demo/ppo' does not exist: no such folder \(relative to "
                                         rf"{tmp_path}\)"):
        main(evaluate_argv(tiny_models, prompts_file, policy="outputs/demo/ppo", reference=None))


def test_a_policy_given_as_a_file_says_to_pass_its_folder(tiny_models, prompts_file):
    weights = os.path.join(tiny_models["policy"], "config.json")
    with pytest.raises(SystemExit, match=r"--policy '.*config.json' is a file.*pass the folder"):
        main(evaluate_argv(tiny_models, prompts_file, policy=weights, reference=None))


def test_a_hub_id_that_is_not_on_the_hub_says_so(tiny_models, prompts_file, local_hub):
    with pytest.raises(SystemExit, match=r"--policy 'hf-ppo-test/no-such-model' is not a local folder, and the Hub "
                                         r"has no model of that id") as stop:
        main(evaluate_argv(tiny_models, prompts_file, policy="hf-ppo-test/no-such-model", reference=None))
    assert "full model" not in str(stop.value)


@pytest.mark.parametrize("flag", ["num_prompts", "batch_size"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, value, tiny_models, prompts_file):
    with pytest.raises(SystemExit, match=rf"--{flag} {value}: give an integer >= 1"):
        main(evaluate_argv(tiny_models, prompts_file) + [f"--{flag}", value])


def test_an_empty_prompts_file_is_named(tiny_models, tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=r"--dataset '.*prompts.jsonl' is an empty file: it holds no prompts"):
        main(evaluate_argv(tiny_models, str(empty)))


def test_a_run_folder_that_holds_no_model_points_at_the_folders_that_do(tiny_models, prompts_file, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--policy '.*run' holds no model.*\['checkpoint-2'\]; pass one of them"):
        main(evaluate_argv(tiny_models, prompts_file, policy=str(run), reference=None))


# ---- which side wins, the interval, the KL, the frozen reference -----------------------------------------------------
# Which side wins, the interval's level, the KL's sign and scale, and that the reference side samples the frozen
# reference after training (a full fine-tune and LoRA), each against numbers worked out here.
#
# The end-to-end tests train a tiny policy for two steps, then evaluate it with a greedy engine (top_k=1: each model's
# completion of a prompt is fixed, so the policy's and the reference's can be told apart by their text) and with a
# scripted engine (known response tokens, so the KL can be summed here from the two models' own log-probs).

# ---- 1. the interval's level: 95%, as documented --------------------------------------------------------------------

N_PROMPTS, N_WINS = 2000, 1400  # one pair per prompt: 1400 wins, 600 losses, no tie


def binomial_quantile(n: int, p: float, q: float) -> int:
    """The smallest x with P(X <= x) >= q for X ~ Binomial(n, p), summed term by term."""
    cdf = 0.0
    for x in range(n + 1):
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
                        + x * math.log(p) + (n - x) * math.log1p(-p))
        if cdf >= q:
            return x
    return n


def bootstrap_bounds(confidence: float) -> tuple[float, float]:
    """The percentile bootstrap's interval with infinitely many resamples, for N_WINS wins of N_PROMPTS 0/1 outcomes:
    resampling the prompts makes the number of wins Binomial(N, N_WINS / N), so its bounds are that binomial's
    (1 - confidence)/2 and (1 + confidence)/2 quantiles, over N."""
    p = N_WINS / N_PROMPTS
    return (binomial_quantile(N_PROMPTS, p, (1 - confidence) / 2) / N_PROMPTS,
            binomial_quantile(N_PROMPTS, p, (1 + confidence) / 2) / N_PROMPTS)


# 1000 resamples put a bound within about 1.7 wins of the binomial's quantile; averaged over 10 seeds, about 0.6.
TOLERANCE = 2.5 / N_PROMPTS
POLICY = torch.cat([torch.ones(N_WINS), torch.zeros(N_PROMPTS - N_WINS)])
REFERENCE = torch.full((N_PROMPTS,), 0.5)


def test_win_rate_interval_is_the_documented_95_percent_bootstrap_of_a_known_binomial():
    """A 90% interval (or quantiles taken at the wrong tails) would pass as 95%: the default interval must be the
    binomial's 2.5% / 97.5% quantiles, and `confidence=0.9` the 5% / 95% ones. The rate is the policy's (0.7), not
    the reference's (0.3)."""
    for other in (0.90, 0.99):  # the check can fail: these bounds lie over two tolerances from the 95% ones
        assert all(abs(a - b) > 2 * TOLERANCE for a, b in zip(bootstrap_bounds(other), bootstrap_bounds(0.95)))
    for confidence, kwargs in ((0.95, {}), (0.90, {"confidence": 0.90})):
        runs = [win_rate(POLICY, REFERENCE, seed=seed, **kwargs) for seed in range(10)]
        assert all(rate == pytest.approx(0.7, abs=1e-12) for rate, _, _ in runs)
        low, high = bootstrap_bounds(confidence)
        assert sum(r[1] for r in runs) / 10 == pytest.approx(low, abs=TOLERANCE), confidence
        assert sum(r[2] for r in runs) / 10 == pytest.approx(high, abs=TOLERANCE), confidence


def test_the_evaluation_metrics_interval_is_95_percent_and_the_report_says_so(tmp_path):
    """The metrics `evaluate()` logs take the module's level: it must be the 95% the docs, the table header and the
    report's text promise."""
    n = N_PROMPTS
    lows, highs = [], []
    for seed in range(10):
        metrics = evaluation_metrics({"kl": torch.zeros(n), "policy|reward/r": POLICY, "reference|reward/r": REFERENCE,
                                      **{f"{side}|{what}": torch.ones(n) for side in ("policy", "reference")
                                         for what in ("length", "stopped")}}, seed=seed)
        assert metrics["reward/r/win_rate"] == pytest.approx(0.7, abs=1e-12)
        lows.append(metrics["reward/r/win_rate_low"])
        highs.append(metrics["reward/r/win_rate_high"])
    low, high = bootstrap_bounds(0.95)
    assert sum(lows) / 10 == pytest.approx(low, abs=TOLERANCE) and sum(highs) / 10 == pytest.approx(high, abs=TOLERANCE)
    assert "policy win rate (95% CI)" in metrics_markdown(metrics)
    text = open(write_report(str(tmp_path), metrics, [], step=0, num_prompts=n), encoding="utf-8").read()
    assert "a 95% bootstrap interval" in text


# ---- 2. after training: the frozen reference, which side wins, the KL -----------------------------------------------

FOUR_PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"]})
K = 2  # samples per prompt and side


class ChangedJudge:
    """A judge (evaluation only): 1.0 for a completion that differs from the untrained model's greedy completion of its
    prompt (`start`, recorded before training), else 0.0; it records every (prompt, completion) it scores."""

    __name__ = "changed"

    def __init__(self):
        self.start: dict[str, str] | None = None
        self.seen: list[tuple[str, str]] = []

    def __call__(self, prompts, completions):
        self.seen.extend(zip(prompts, completions))
        if self.start is None:
            return [0.0] * len(prompts)
        return [float(c != self.start[p]) for p, c in zip(prompts, completions)]


def greedy_engine(trainer):
    """The trainer's sampling settings with top_k=1: each model completes each prompt one way only."""
    sampling = dataclasses.replace(trainer.args.sampling_settings, top_k=1, top_p=1.0, rollout_engine="kv_cache")
    return make_rollout_engine(sampling, trainer.processing_class.pad_token_id, trainer.stop_token_ids)


def evaluate_with(trainer, judge: ChangedJudge, engine) -> dict[str, float]:
    """`evaluate()` sampling with `engine`, the reference sampled afresh (it is cached per eval set)."""
    trainer.evaluator.clear_reference_cache()
    trainer.rollout_engine, judge.seen = engine, []
    return trainer.evaluate()


@pytest.fixture(scope="module", params=["full", "lora"])
def trained(request, tiny_models, tmp_path_factory):
    """A policy trained for two steps (a full fine-tune: KL estimator k1; LoRA, the reference its adapter disabled:
    k3), and its judge, holding the untrained model's greedy completions. fp32 on any machine (bf16=False): the KL
    below is checked against one computed by hand in fp32, which bf16 autocast (a GPU's default) would not match."""
    from peft import LoraConfig

    lora = request.param == "lora"
    args = PPOConfig(output_dir=str(tmp_path_factory.mktemp(request.param)), per_device_train_batch_size=4,
                     per_device_eval_batch_size=4, num_ppo_epochs=1, max_steps=2, response_length=6, report_to=[],
                     save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, num_eval_samples=K,
                     apply_chat_template_to_text=False,
                     learning_rate=1e-2 if lora else 3e-3, kl_estimator="k3" if lora else "k1", bf16=False)
    judge = ChangedJudge()
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=count_e, eval_reward_model=judge,
                           train_dataset=FOUR_PROMPTS, eval_dataset=FOUR_PROMPTS,
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  task_type="CAUSAL_LM") if lora else None)
    assert (trainer.ref_model is None) == lora
    sampler = trainer.rollout_engine
    evaluate_with(trainer, judge, greedy_engine(trainer))  # untrained: the policy is its reference
    start = dict(judge.seen)
    assert len(set(judge.seen)) == len(start) == len(FOUR_PROMPTS)  # greedy: one completion per prompt
    judge.start = start
    trainer.rollout_engine = sampler
    trainer.train()
    return trainer, judge


def report_rows(trainer) -> list[list[str]]:
    """The report's sample rows, as [prompt, reference response, reference score, policy response, policy score]."""
    text = open(os.path.join(trainer.args.output_dir, REPORT_FILE), encoding="utf-8").read()
    table = text.split("| prompt | reference response | reference score | policy response | policy score |")[1]
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def test_after_training_the_reference_side_samples_the_frozen_reference_and_the_policy_side_wins(trained):
    """The reference side must sample the frozen starting model (a full fine-tune's copy; LoRA's base with the adapter
    disabled), never the trained policy, and a judge the trained policy wins must be reported as the policy's win,
    in the metrics and in the report's columns. By hand: the prompts whose greedy completion training changed score 1
    on the policy's side and 0 on the reference's, the others tie at 0."""
    trainer, judge = trained
    metrics = evaluate_with(trainer, judge, greedy_engine(trainer))
    assert len(judge.seen) == 2 * K * len(FOUR_PROMPTS)
    moved = {p for p, c in judge.seen if c != judge.start[p]}
    assert moved, "training changed no greedy completion (or the policy side did not sample the trained policy)"
    n = len(FOUR_PROMPTS)
    assert metrics["eval_judge/changed/reference"] == 0.0  # every reference response: the untrained model's
    assert metrics["eval_judge/changed/policy"] == pytest.approx(len(moved) / n)
    assert metrics["eval_judge/changed/win_rate"] == pytest.approx((len(moved) + 0.5 * (n - len(moved))) / n)
    rows = report_rows(trainer)
    assert len(rows) == K * n
    for prompt, reference, reference_score, policy, policy_score in rows:
        p = prompt.rsplit(" (sample", 1)[0]
        assert "judge/changed: 0" in reference_score, prompt
        assert f"judge/changed: {int(p in moved)}" in policy_score, prompt
        assert (reference == policy) == (p not in moved), prompt


def response_logprobs(model, query: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log pi(response_t | query, response_<t) of each response token, one unpadded row, logits / temperature:
    computed where `model` is (a trainer's model: on a GPU where one is visible), returned on the CPU."""
    with torch.no_grad():
        ids = torch.tensor([query + response], device=device_of(model))
        logits = model(input_ids=ids).logits[0, len(query) - 1:-1].float().cpu()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def test_eval_kl_is_the_per_response_sum_of_policy_against_the_frozen_reference(trained, tiny_models, tokenizer):
    """eval_kl_to_reference must be KL(policy || reference), not the reverse, summed over each response's real tokens
    (as `objective/kl`), not a token mean, and measured against the frozen starting model, averaged over all k samples
    of every prompt. By hand: the scripted responses' log-probs under the trained policy and under the starting model
    loaded afresh from disk, each response cut after its stop token."""
    eos = tokenizer.eos_token_id
    text = " great and the plot was fun but the ending was bad and the music was dull"
    words = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(words) >= 12 and eos not in words
    script = [words[:6], words[6:8] + [eos] + words[8:11], words[3:9]]  # the middle one: 3 real tokens
    engine = ScriptedEngine(script)
    trainer, judge = trained
    metrics = evaluate_with(trainer, judge, engine)
    queries, query_mask = engine.queries[-1]
    assert len(queries) == K * len(FOUR_PROMPTS)
    policy = trainer.model.policy_model
    reference = AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).to(device_of(policy))  # as the policy
    estimator, temperature = trainer.args.kl_estimator, trainer.args.temperature
    per_response = []
    for i, (row, mask) in enumerate(zip(queries.tolist(), query_mask.tolist())):
        query = [t for t, real in zip(row, mask) if real]
        response = script[i % len(script)]
        response = response[:response.index(eos) + 1] if eos in response else response
        log_ratio = (response_logprobs(policy, query, response, temperature)
                     - response_logprobs(reference, query, response, temperature))
        per_token = log_ratio if estimator == "k1" else torch.expm1(-log_ratio) + log_ratio  # k3
        per_response.append(per_token.sum().item())
    expected = sum(per_response) / len(per_response)
    assert abs(expected) > 0.05  # the policy moved: a reversed, token-mean or policy-vs-policy KL reads differently
    assert metrics["eval_kl_to_reference"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


# ---- the report names the policy's real step and shows the system prompt once -------------------------------------
def test_the_report_names_the_step_it_is_given_or_says_it_is_not_known(tmp_path):
    metrics = evaluation_metrics({"kl": torch.zeros(2), "policy|reward/r": torch.ones(2),
                                  "reference|reward/r": torch.zeros(2), "policy|length": torch.ones(2),
                                  "reference|length": torch.ones(2), "policy|stopped": torch.ones(2),
                                  "reference|stopped": torch.ones(2)})
    rows = [("2 + 2?", "4", {"reward/r": 0.0}, "5", {"reward/r": 1.0})]
    path = write_report(str(tmp_path / "known"), metrics, rows, step=120, num_prompts=2, system_prompt="Be brief.")
    text = open(path, encoding="utf-8").read()
    assert "(step 120)" in text.splitlines()[1] and path.endswith("eval_report-step120.md")
    assert text.count("Be brief.") == 1 and "Every prompt opens with the system prompt: Be brief." in text
    path = write_report(str(tmp_path / "unknown"), metrics, rows, step=None, num_prompts=2)
    assert "(training step not recorded)" in open(path, encoding="utf-8").read().splitlines()[1]
    assert sorted(os.listdir(tmp_path / "unknown")) == [REPORT_FILE]  # no eval_report-stepNone.md


def test_report_rows_show_the_last_user_turn_and_the_system_prompt_once(tiny_models, tokenizer, tmp_path):
    """The rows repeated the whole decoded prompt, system prompt and template markup included, on every row."""
    system = "You are a careful reviewer who answers in one word, always, whatever the question is."
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": f"review {w}"}] for w in
                                            ("the movie", "the food", "the book", "the show")]})
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path, system_prompt=system),
                           processing_class=tokenizer, reward_model=count_e, eval_dataset=chats)
    trainer.evaluate()
    text = (tmp_path / "out" / REPORT_FILE).read_text(encoding="utf-8")
    assert text.count(system) == 1
    rows = [line for line in text.splitlines() if line.startswith("| review the")]
    assert len(rows) == 4 and all("&lt;|user|&gt;" not in row for row in rows)


# ---- issue 51: a judge reading a column of the eval dataset ---------------------------------------------------------
def judge_by_answer(completions, **kwargs):
    """An evaluation-only judge in TRL's form, reading the eval rows' `answer` column from kwargs; it records what it
    was given and scores each row by its answer (e 0, o 1, a 2, s 3)."""
    judge_by_answer.seen.extend(zip(kwargs["prompts"], kwargs["answer"]))
    return [float("eoas".index(a)) for a in kwargs["answer"]]


judge_by_answer.seen = []


def test_a_judge_gets_the_eval_rows_column_values_aligned_with_their_prompts(tiny_models, tokenizer, tmp_path):
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path, num_eval_samples=2, response_length=4),
                           processing_class=tokenizer, reward_model=count_e, eval_reward_model=judge_by_answer,
                           train_dataset=QUESTIONS, eval_dataset=QUESTIONS)
    judge_by_answer.seen = []  # the construction probes' calls
    metrics = trainer.evaluate()
    assert all(ANSWER_OF[prompt] == answer for prompt, answer in judge_by_answer.seen), judge_by_answer.seen
    # 4 prompts x 2 samples, for the policy and for the reference: each row once per sample and side.
    assert sorted(judge_by_answer.seen) == sorted(list(ANSWER_OF.items()) * 4)
    assert metrics["eval_judge/judge_by_answer/policy"] == pytest.approx(1.5)  # (0 + 1 + 2 + 3) / 4
    assert metrics["eval_judge/judge_by_answer/reference"] == pytest.approx(1.5)


# ---- issue 58 item 6: the engine is told which weights each side samples, never left to guess -----------------------
class _WeightsEngine(ScriptedEngine):
    """Records, for every generate, the weights it was told (`sampling_weights`) and whether the adapter was on."""

    def __init__(self):
        super().__init__([[5, 6, 7, 8, 9, 10]])
        self.told = []

    def generate(self, model, queries, query_mask):
        from hf_ppo.models.adapters import adapters_enabled
        from hf_ppo.rollout.engines import weights_sampled

        self.told.append((weights_sampled(), model is self.policy, adapters_enabled(model)))
        return super().generate(model, queries, query_mask)


@pytest.mark.parametrize("reference", ["base", "ref_model"])
def test_evaluation_tells_the_engine_which_weights_each_side_samples(reference, tiny_models, tokenizer, tmp_path):
    from peft import LoraConfig

    extra = dict(ref_model=tiny_models["policy"]) if reference == "ref_model" else {}
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args(tmp_path, ref_quantization="none"),
                           processing_class=tokenizer, reward_model=count_e, train_dataset=PROMPTS,
                           eval_dataset=PROMPTS.select(range(4)), peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), **extra)
    engine = trainer.rollout_engine = _WeightsEngine()
    engine.policy = trainer.accelerator.unwrap_model(trainer.model).policy_model
    trainer.evaluate()
    if reference == "base":  # the LoRA policy's base, its adapter disabled: the engine is told "base"
        assert engine.told == [("base", True, False), ("policy", True, True)]
    else:  # a separate reference model: "reference", whatever object it is
        assert engine.told == [("reference", False, True), ("policy", True, True)]
