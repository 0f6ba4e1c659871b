"""Settings whose math is tested on its own, pinned on their way through `PPOConfig` into a real run.

- `use_kl_loss` must take the KL out of the reward in the rollout a run trains on (not only add the loss term);
- `reward_clip` clips the scores the rewards use also without `normalize_rewards`;
- a GRPO run with the bias-corrected KL (a documented combination) builds, trains, and its update carries the KL
  term times the importance ratio, at the KL controller's coefficient;
- several rewards with the same `__name__` each keep a metric and a term of the weighted sum of their own.

Each run is a real `PPOLMTrainer.train()` on the session's tiny models (tests/conftest.py); the micro-batches it trained
on are recorded through `compute_loss` (tests/wiring_models.py's `RecordingTrainer`).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tests import plain_ppo
from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.rollout.scoring import unique_names
from tests.wiring_models import RecordingTrainer

# One fixed score per prompt, two of them beyond +-CLIP, so clipping shows on both sides.
PROMPT_SCORES = {"the movie was": -2.5, "the food was": -0.4, "the book was": 0.7, "the show was": 3.0}
CLIP = 1.0


def score_by_prompt(prompts, completions):
    return [PROMPT_SCORES[p] for p in prompts]


def length_score(prompts, completions):
    return [0.1 * len(c) for c in completions]


def make_args(out, **overrides) -> PPOConfig:
    defaults = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    num_mini_batches=1, num_ppo_epochs=1, max_steps=1, response_length=6, logging_steps=1,
                    learning_rate=1e-2, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0, reward_quantization="none")
    defaults.update(overrides)
    return PPOConfig(**defaults)


def dataset(n: int = 4) -> Dataset:
    """Every prompt of PROMPT_SCORES `n` times (n=1: a rollout of 4 holds each once)."""
    return Dataset.from_dict({"prompt": list(PROMPT_SCORES) * n})


def perturbed_reference(tiny_models):
    """The starting policy with noise on every weight: a reference whose KL to the policy is visible at step 0."""
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref


def real_rows(batch):
    """(row, number of policy tokens) of every row with at least one."""
    return [(i, int(batch.policy_mask[i].sum())) for i in range(len(batch)) if batch.policy_mask[i].any()]


# ---- use_kl_loss and reward_clip, through PPOConfig.rollout_settings into the rollout ------------------------------
@pytest.fixture(scope="module")
def kl_loss_run(tiny_models, tokenizer, tmp_path_factory):
    """gae with use_kl_loss, reward_clip without normalize_rewards, no reward whitening: one rollout of 4 prompts."""
    args = make_args(tmp_path_factory.mktemp("kl_loss_run"), use_kl_loss=True, kl_coef=0.5, reward_clip=CLIP,
                     normalize_rewards=False, whiten_rewards=False)
    trainer = RecordingTrainer(model=tiny_models["policy"], ref_model=perturbed_reference(tiny_models), args=args,
                               processing_class=tokenizer, reward_model=score_by_prompt, train_dataset=dataset(1))
    trainer.train()
    assert len(trainer.micro_batches) == 1
    return trainer


def test_use_kl_loss_takes_the_kl_out_of_the_rewards_of_a_real_run(kl_loss_run):
    """Pins `use_kl_loss` on its way PPOConfig -> rollout_settings -> rollout -> estimator: dropped there, the run
    adds its KL loss term AND keeps -kl_coef * KL in every token's reward (the KL counted twice). The rollout's
    rewards must be the score at the last real token and 0 elsewhere, while `non_score_rewards` still reports
    -kl_coef * KL (k1) for the logs."""
    batch, kl_coef = kl_loss_run.micro_batches[0], kl_loss_run.args.kl_coef
    kl_seen = 0.0
    for i, n in real_rows(batch):
        d = batch.logprobs[i, :n].double() - batch.ref_logprobs[i, :n].double()
        kl_seen = max(kl_seen, d.abs().max().item())
        torch.testing.assert_close(batch.non_score_rewards[i, :n].double(), -kl_coef * d, rtol=1e-5, atol=1e-6)
        rewards = batch.rewards[i, :n].double()
        assert torch.all(rewards[:-1] == 0), f"row {i}: the KL is still in the per-token rewards: {rewards.tolist()}"
    assert kl_seen > 1e-2, "the reference must differ from the policy for the KL to show"


def test_reward_clip_without_normalize_rewards_clips_the_rewards_of_a_real_run(kl_loss_run):
    """Pins `reward_clip` when `normalize_rewards` is off (its own branch in step 7): the reward at the last real
    token is the raw score clipped to +-reward_clip; the batch keeps the raw score."""
    batch = kl_loss_run.micro_batches[0]
    raw = []
    for i, n in real_rows(batch):
        score = batch.scores[i].item()
        raw.append(score)
        assert any(score == pytest.approx(v) for v in PROMPT_SCORES.values()), "the batch keeps the raw score"
        assert batch.rewards[i, n - 1].item() == pytest.approx(max(-CLIP, min(CLIP, score)), abs=1e-6), (i, score)
    assert min(raw) < -CLIP and max(raw) > CLIP, "the run needs scores that the clip clips on both sides"


# ---- a GRPO run with the bias-corrected KL ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo_bias_corrected_run(tiny_models, tokenizer, tmp_path_factory):
    """grpo + use_bias_correction_kl, 2 responses per prompt, two optimizer steps on one rollout; the model copied
    before the second micro-batch (after a step, so the importance ratio is no longer 1)."""
    # bf16=False: fp32 where CUDA is visible too (bf16 is the GPU's default), as the fp32 pass by hand it is compared
    # with (a loss gap of kl_coef * k3 * (r - 1), far below bf16 rounding). On the CPU this is the default.
    args = make_args(tmp_path_factory.mktemp("grpo_bc"), advantage_estimator="grpo", num_generations=2,
                     use_bias_correction_kl=True, kl_coef=0.3, num_ppo_epochs=2, max_steps=2, learning_rate=5e-2,
                     bf16=False)
    trainer = RecordingTrainer(model=tiny_models["policy"], ref_model=perturbed_reference(tiny_models), args=args,
                               processing_class=tokenizer, reward_model=length_score, train_dataset=dataset(),
                               snapshot_calls=[1])
    trainer.train()
    return trainer


def test_grpo_with_the_bias_corrected_kl_trains_and_corrects_the_kl_term(grpo_bias_corrected_run):
    """Pins the documented combination advantage_estimator='grpo' + use_bias_correction_kl: it must be accepted,
    train with finite metrics, and the second step's loss must hold kl_coef * k3 * ratio per token (token mean over
    the minibatch), i.e. differ from the uncorrected loss by kl_coef * sum_t k3_t (r_t - 1) / tokens, with k3 and
    r recomputed here from the model run one sequence at a time."""
    run = grpo_bias_corrected_run
    history = [e for e in run.state.log_history if "loss/policy_avg" in e]
    assert len(history) == 2 and run.iteration == 1
    assert all(math.isfinite(v) for e in history for v in e.values() if isinstance(v, float))
    model, inputs = run.snapshots[1]
    batch, normalizer = inputs["batch"], float(inputs["normalizer"])
    run.model.train()
    with torch.no_grad():
        corrected = run.compute_loss(model, dict(inputs)).item()
        run.args.use_bias_correction_kl = False
        try:
            plain = run.compute_loss(model, dict(inputs)).item()
        finally:
            run.args.use_bias_correction_kl = True
    assert corrected == pytest.approx(run.losses[1].item(), rel=1e-6, abs=1e-7), "the run's loss is the corrected one"

    lm, temperature, kl_coef = model.policy_model, run.args.temperature, run.kl_ctl.value
    expected_gap, ratios = 0.0, []
    with torch.no_grad():
        for i, n in real_rows(batch):
            prompt = batch.queries[i][batch.query_mask[i]].tolist()
            response = batch.responses[i][:n].tolist()
            logits, _ = plain_ppo.run_alone(lm, prompt + response)
            for t in range(n):
                logp = plain_ppo.token_logprob(logits[len(prompt) + t - 1], response[t], temperature).item()
                d = batch.ref_logprobs[i, t].item() - logp
                k3 = math.expm1(d) - d
                ratio = math.exp(logp - batch.logprobs[i, t].item())
                ratios.append(ratio)
                expected_gap += kl_coef * k3 * (ratio - 1)
    assert max(abs(r - 1) for r in ratios) > 1e-3, "after a step the importance ratio must differ from 1"
    expected_gap /= normalizer
    assert abs(expected_gap) > 1e-6, "the correction must be visible at this step"
    assert corrected - plain == pytest.approx(expected_gap, rel=2e-3, abs=1e-7)


# ---- several rewards with the same name ---------------------------------------------------------------------------
def _named(name, value):
    def reward(prompts, completions):
        return [value] * len(completions)

    reward.__name__ = name
    return reward


def test_rewards_with_the_same_name_keep_a_metric_and_a_term_each(tiny_models, tokenizer, tmp_path):
    """Pins `unique_names` on the trainer's path: two reward functions both called `score` (and a third already
    called `score_2`) must each be scored, weighted and logged under a name of its own. Collided names would
    overwrite one reward's scores with another's: its term silently leaves the weighted sum and its metric."""
    rewards = [_named("score", 1.0), _named("score", 3.0), _named("score_2", -2.0)]
    args = make_args(tmp_path, reward_weights=[1.0, 2.0, 0.5])
    trainer = RecordingTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                               reward_model=rewards, train_dataset=dataset())
    names = trainer.rewards.names
    assert len(set(names)) == 3, names
    trainer.train()
    batch = trainer.micro_batches[0]
    assert torch.all(batch.scores == 1.0 * 1.0 + 2.0 * 3.0 + 0.5 * -2.0), batch.scores
    logged = next(e for e in trainer.state.log_history if "objective/scores" in e)
    per_reward = {k: v for k, v in logged.items() if k.startswith("objective/scores/")}
    assert sorted(per_reward.values()) == [-2.0, 1.0, 3.0], per_reward
    assert sorted(v for k, v in logged.items() if k.startswith("rewards/") and k.endswith("/mean")) == [-2.0, 1.0, 3.0]


@pytest.mark.parametrize("names", [["a", "a"], ["a", "a", "a_2"], ["a_2", "a", "a"], ["a", "a", "a", "a_2", "a_3"]])
def test_unique_names_never_collide(names):
    """Pins the numbering of repeated reward names: numbered names must not collide with a reward already named
    like a numbered one (`accuracy`, `accuracy`, `accuracy_2`), and the first of each name keeps it as it is."""
    unique = unique_names(names)
    assert len(set(unique)) == len(names), unique
    assert unique[0] == names[0]
