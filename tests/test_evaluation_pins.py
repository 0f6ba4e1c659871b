"""Issue 41, evaluation: which side wins, the interval's level, the KL's sign and scale, and that the reference side
samples the frozen reference after training (a full fine-tune and LoRA), each against numbers worked out here.

The end-to-end tests train a tiny policy for two steps, then evaluate it with a greedy engine (top_k=1: each model's
completion of a prompt is fixed, so the policy's and the reference's can be told apart by their text) and with a
scripted engine (known response tokens, so the KL can be summed here from the two models' own log-probs)."""

from __future__ import annotations

import dataclasses

import math
import os
import re

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.evaluation.evaluator import evaluation_metrics, win_rate
from hf_ppo.evaluation.report import REPORT_FILE, metrics_markdown, write_report
from hf_ppo.rollout.engines import make_rollout_engine
from scripted_engine import ScriptedEngine

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

PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"]})
K = 2  # samples per prompt and side


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


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
    k3), and its judge, holding the untrained model's greedy completions."""
    from peft import LoraConfig

    lora = request.param == "lora"
    args = PPOConfig(output_dir=str(tmp_path_factory.mktemp(request.param)), per_device_train_batch_size=4,
                     per_device_eval_batch_size=4, num_ppo_epochs=1, max_steps=2, response_length=6, report_to=[],
                     save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, num_eval_samples=K,
                     apply_chat_template_to_text=False,
                     learning_rate=1e-2 if lora else 3e-3, kl_estimator="k3" if lora else "k1")
    judge = ChangedJudge()
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=count_e, eval_reward_model=judge,
                           train_dataset=PROMPTS, eval_dataset=PROMPTS,
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  task_type="CAUSAL_LM") if lora else None)
    assert (trainer.ref_model is None) == lora
    sampler = trainer.rollout_engine
    evaluate_with(trainer, judge, greedy_engine(trainer))  # untrained: the policy is its reference
    start = dict(judge.seen)
    assert len(set(judge.seen)) == len(start) == len(PROMPTS)  # greedy: one completion per prompt
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
    assert len(judge.seen) == 2 * K * len(PROMPTS)
    moved = {p for p, c in judge.seen if c != judge.start[p]}
    assert moved, "training changed no greedy completion (or the policy side did not sample the trained policy)"
    n = len(PROMPTS)
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
    """log pi(response_t | query, response_<t) of each response token, one unpadded row, logits / temperature."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([query + response])).logits[0, len(query) - 1:-1].float()
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
    assert len(queries) == K * len(PROMPTS)
    policy, reference = trainer.model.policy_model, AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
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
