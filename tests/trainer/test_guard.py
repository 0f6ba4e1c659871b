"""The non-finite guard through `PPOLMTrainer`: +inf, -inf and NaN, each on its own, in the scores, the loss and the
gradients.

- A non-finite loss or gradient skips the optimizer step: the weights AND the optimizer state (Adam's moments and
  step count, which weight decay and momentum would otherwise move) are bitwise what they were before it.
- A row with a non-finite score leaves the update, not the rollout: the rest trains (with a group estimator, the
  row's group leaves with it, except under rloo and grpo, which group by index), one warning per reward names the row, and `nonfinite/unscored_rows` counts them.
- A rollout with no finite score is dropped and sampled again: every running statistic it touched (the reward
  normalisation's moments, each reward's own moments, the KL controller) is back to what it was before it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_ppo import PPOLMTrainer
from tests.integration.test_wiring import config, count_e, paths  # noqa: F401 (paths: the models fixture)
from tests.wiring_models import PROMPTS, clone_batch, rollout_batch_in

BAD = {"+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def optimizer_state(optimizer) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
            for slot, state in optimizer.state_dict()["state"].items() for k, v in
            ((f"{slot}/{name}", value) for name, value in state.items())}


class AfterEachStep(TrainerCallback):
    """Copies of the weights and the optimizer state after every optimizer step."""

    def __init__(self):
        self.weights, self.optimizer = [], []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        self.optimizer.append(optimizer_state(optimizer))


class BadStepTrainer(PPOLMTrainer):
    """Makes optimizer step `bad_step` (1-based, one micro-batch per step) non-finite: its loss (`where="loss"`: a
    return of the micro-batch set to the bad value, so the value loss is non-finite) or one parameter's gradient
    (`where="grad"`, the loss stays finite)."""

    def __init__(self, *args, where: str, value: float, bad_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.where, self.value, self.bad_step, self.calls, self._armed = where, value, bad_step, 0, False
        param = next(p for p in self.model.parameters() if p.requires_grad)
        param.register_hook(self._grad_hook)

    def _grad_hook(self, grad):
        if not self._armed:
            return grad
        self._armed = False
        return torch.full_like(grad, self.value)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls += 1
        if self.calls == self.bad_step and self.where == "loss":
            batch = clone_batch(rollout_batch_in(inputs))
            batch.returns[0, 0] = self.value
            inputs = {**inputs, "batch": batch}
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        assert torch.isfinite(loss) != (self.calls == self.bad_step and self.where == "loss")
        self._armed = self.calls == self.bad_step and self.where == "grad"
        return loss


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("where", ["loss", "grad"])
def test_skipped_step_leaves_weights_and_optimizer_state_bitwise_unchanged(paths, tmp_path, where, bad):
    args = config(tmp_path, per_device_train_batch_size=4, num_ppo_epochs=3, max_steps=3, learning_rate=1e-2,
                  lr_scheduler_type="constant", weight_decay=0.1, response_length=4)
    recorder = AfterEachStep()
    trainer = BadStepTrainer(model=paths["llama"], args=args, reward_model=count_e, callbacks=[recorder],
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}), where=where, value=BAD[bad],
                             bad_step=2)
    with pytest.warns(UserWarning, match=r"optimizer step skipped \((the loss is NaN/inf|the gradient norm is)"):
        trainer.train()
    assert trainer.state.global_step == 3 and len(recorder.weights) == 3
    (w1, w2, w3), (o1, o2, o3) = recorder.weights, recorder.optimizer
    assert set(o1) == set(o2) and any(k.endswith("exp_avg_sq") for k in o1) and any(k.endswith("step") for k in o1)
    for name in w1:
        assert torch.equal(w1[name], w2[name]), f"{name} moved in the skipped step"
    for key in o1:
        assert torch.equal(o1[key], o2[key]) if torch.is_tensor(o1[key]) else o1[key] == o2[key], key
    # The next good step moves them again (the check above could fail).
    assert any(not torch.equal(w2[n], w3[n]) for n in w2)
    assert any(not torch.equal(o2[k], o3[k]) for k in o2 if torch.is_tensor(o2[k]))
    assert trainer.state.log_history[-2]["nonfinite/skipped_steps"] == 1


@pytest.mark.parametrize("bad", list(BAD))
def test_dropped_rollout_restores_every_running_statistic(paths, tmp_path, bad):
    """Rollout 2 scores every response non-finite; when rollout 2 is sampled again (call 3 of the reward function),
    the reward moments, each reward's moments and the KL controller must be as they were before rollout 2."""
    seen, running = [], {}

    def reward(prompts, completions):
        scores = [float(len(c)) for c in completions]
        if "trainer" not in running:  # the probe at construction
            return scores
        trainer = running["trainer"]
        seen.append(copy.deepcopy((trainer.reward_moments.state_dict(), trainer.rewards.state_dict(),
                                   trainer.kl_ctl.state_dict())))
        if len(seen) == 2:
            scores = [BAD[bad]] * len(scores)  # no row left to train on: the whole rollout is dropped
        return scores

    args = config(tmp_path, per_device_train_batch_size=4, max_steps=3, response_length=4, normalize_rewards=True,
                  normalize_each_reward=True, reward_weights=[1.0, 0.5], adaptive_kl=True, kl_coef=0.1,
                  kl_target=0.01, kl_horizon=10)
    trainer = PPOLMTrainer(model=paths["llama"], args=args, reward_model=[reward, count_e],
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    running["trainer"] = trainer
    with pytest.warns(UserWarning, match=r"rollout dropped and sampled again .*from reward 'reward': 4 NaN/inf"):
        trainer.train()
    assert len(seen) == 4 and trainer.iteration == 3
    assert seen[1] == seen[2], "the dropped rollout moved a running statistic"
    assert seen[2] != seen[3], "a kept rollout moves them (the check above could fail)"
    assert seen[1][0]["count"] == 4 and seen[3][0]["count"] == 8
    assert trainer.state.log_history[-2]["nonfinite/dropped_rollouts"] == 1


@pytest.mark.parametrize("bad", list(BAD))
def test_a_single_nonfinite_raw_score_drops_the_rollout_when_nothing_else_is_left(paths, tmp_path, bad):
    """No normalisation and no whitening, every response of the rollout non-finite: +-inf stays an infinity (never
    turns into NaN) all the way to the returns, and with no row left the rollout is dropped and sampled again."""
    calls = []

    def reward(prompts, completions):
        calls.append(len(completions))
        scores = [float(len(c)) for c in completions]
        if len(calls) == 2:  # the first rollout (call 1 is the probe at construction)
            scores = [BAD[bad]] * len(scores)
        return scores

    args = config(tmp_path, per_device_train_batch_size=2, max_steps=2, response_length=4, whiten_advantages=False)
    trainer = PPOLMTrainer(model=paths["llama"], args=args, reward_model=reward,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    with pytest.warns(UserWarning, match=r"rollout dropped and sampled again \(scores: 2 NaN/inf of 2 responses"):
        trainer.train()
    assert trainer.iteration == 2 and trainer.state.log_history[-2]["nonfinite/skipped_steps"] == 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


class InfOnRow:
    """A reward function giving row `row` of every rollout `value` (+inf by default), the others their length."""

    def __init__(self, row: int = 1, value: float = float("inf")):
        self.row, self.value, self.calls, self.rows_seen = row, value, 0, []

    def __call__(self, prompts, completions):
        self.calls += 1
        scores = [float(len(c)) for c in completions]
        if self.calls > 1:  # not the probe at construction
            scores[self.row] = self.value
        return scores


@pytest.mark.parametrize("estimator", [{}, {"advantage_estimator": "grpo", "num_generations": 2}], ids=["gae", "grpo"])
def test_one_inf_row_every_rollout_leaves_that_row_out_and_training_goes_on(paths, tmp_path, recwarn, estimator):
    """Twelve rollouts, each with one +inf row: none is dropped (twelve drops in a row would stop the run at
    max_consecutive_nonfinite=10), one warning names the function and the row, every update trains on the finite
    rows (the weights move and stay finite), and the rows left out are counted (with grpo too the row alone: it
    groups by index, and the other row of its group trains as a group of one)."""
    reward = InfOnRow(row=1)
    args = config(tmp_path, per_device_train_batch_size=4, max_steps=12, response_length=4, learning_rate=1e-2,
                  **estimator)
    trainer = PPOLMTrainer(model=paths["llama"], args=args, reward_model=reward,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.iteration == 12 and reward.calls == 13  # the probe, then one call per rollout: none sampled again
    history = [h for h in trainer.state.log_history if "nonfinite/unscored_rows" in h]
    per_rollout = 1
    assert history[-1]["nonfinite/unscored_rows"] == 12 * per_rollout
    assert history[-1]["nonfinite/dropped_rollouts"] == 0
    named = [str(w.message) for w in recwarn if "returned inf for row 1 of the batch" in str(w.message)]
    assert len(named) == 1 and "'InfOnRow'" in named[0] and "left out of the update" in named[0]
    assert not [w for w in recwarn if "rollout dropped" in str(w.message)]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(math.isfinite(h["objective/scores"]) for h in trainer.state.log_history if "objective/scores" in h)


def test_a_rollout_dropped_for_nonfinite_logprobs_restores_the_reward_moments(paths, tmp_path, monkeypatch):
    """A rollout whose scores are finite but whose old log-probs are NaN (a broken forward) is dropped after its
    scores moved the running statistics: the reward normalisation's moments must be put back as they were, so the
    sample taken again is normalised by the statistics of the rollouts that trained."""
    import hf_ppo.rollout.steps as steps

    real, calls = steps.policy_forward, []

    def forward(*args, **kwargs):
        logprobs, values, entropy = real(*args, **kwargs)
        if kwargs.get("with_entropy"):  # step 5, the policy's own pass
            calls.append(1)
            if len(calls) == 2:
                logprobs = torch.full_like(logprobs, float("nan"))
        return logprobs, values, entropy

    monkeypatch.setattr(steps, "policy_forward", forward)
    seen, running = [], {}

    def reward(prompts, completions):
        if "trainer" in running:
            seen.append(copy.deepcopy(running["trainer"].reward_moments.state_dict()))
        return [float(len(c)) for c in completions]

    args = config(tmp_path, per_device_train_batch_size=4, max_steps=3, response_length=4, normalize_rewards=True)
    trainer = PPOLMTrainer(model=paths["llama"], args=args, reward_model=reward,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    running["trainer"] = trainer
    with pytest.warns(UserWarning, match="rollout dropped and sampled again"):
        trainer.train()
    assert len(seen) == 4 and trainer.iteration == 3
    assert seen[1] == seen[2], "the dropped rollout's scores stayed in the reward moments"
    assert seen[1]["count"] == 4 and seen[3]["count"] == 8
