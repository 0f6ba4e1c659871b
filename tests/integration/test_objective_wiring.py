"""Every PPOConfig field that shapes the objective reaches the loss (or the rollout) the way the equations say.

One short run of `PPOLMTrainer` (tests/wiring_models.py's `RecordingTrainer`) records the rollout it trained on and a
copy of the model at its first micro-batch. Then:

- the rollout's scores, KL penalty and rewards, advantages and returns are recomputed from the recorded log-probs
  and values for the run's reward normalisation and clipping, KL estimator, reward whitening and GAE settings;
- the first micro-batch is "pushed": its old log-probs, old values, advantages, returns and reference log-probs are
  set, token by token, so that the ratio lies above 1 + eps_high, below 1 - eps_low and above the dual-clip bound,
  and the value update lies outside +- cliprange_value. The trainer's `compute_loss` is called on it under several
  settings, and its loss, gradients and clip fractions must be the ones the equations give, recomputed here from
  the tokens with the models run one sequence at a time (tests/plain_ppo.py), sharing no code with hf_ppo.

A setting that is ignored, swapped with another, or routed to the wrong term gives another loss or gradient.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tests import plain_ppo
from tests.integration.test_wiring import config, count_e, paths, real_tokens, rows_of  # noqa: F401 (paths: a fixture)
from tests.wiring_models import PROMPTS, RecordingTrainer, clone_batch

# Per real token k of the first micro-batch (counted row by row), cycled: the ratio new/old policy, the advantage,
# V - V_old, R - V and log p_ref - log p. Ratios stay away from every clip bound used below.
RATIOS = [0.5, 0.85, 1.15, 1.35, 2.0, 4.0, 0.75, 1.25]
ADVANTAGES = [1.0, -1.5, 0.5]
VALUE_MOVES = [0.5, -0.3, 0.05, -0.6, 0.15]
RETURN_GAPS = [0.4, -0.2, 1.0]
REF_GAPS = [0.3, -0.2, 0.1, 0.5]
RUN = dict(kl_coef=0.2, kl_estimator="k2", whiten_rewards=True, whiten_advantages=False, normalize_rewards=True,
           reward_clip=1.5, loss_aggregation="seq_mean_token_mean", temperature=0.9, cliprange=0.2,
           cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0)


@pytest.fixture(scope="module")
def run(paths, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """One optimizer step over a rollout of 8 prompts, 2 micro-batches of 4; a reference other than the policy."""
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_pretrained(paths["llama"])
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    args = config(tmp_path_factory.mktemp("objective_run"), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, **RUN)
    trainer = RecordingTrainer(model=paths["llama"], ref_model=ref, args=args, reward_model=count_e,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), snapshot_calls=[0, 1])
    trainer.train()
    assert len(trainer.micro_batches) == 2
    return trainer


# ---- the rollout: reward normalisation and clipping, the KL estimator in the reward, reward whitening, GAE --------
def test_rollout_follows_the_reward_kl_and_whitening_settings(run):
    tokenizer, args = run.processing_class, run.args
    rows = list(rows_of(run.micro_batches).values())
    assert len(rows) == len(PROMPTS)
    raw = torch.tensor([count_e([""], [tokenizer.decode(real_tokens(b, i, "responses"), skip_special_tokens=True)])[0]
                        for b, i in rows], dtype=torch.float64)
    torch.testing.assert_close(torch.stack([b.scores[i] for b, i in rows]).double().cpu(), raw)  # kept raw
    # The rewards see them normalised by the running moments of the only batch seen so far (population std), then
    # clipped to +- reward_clip.
    scores = ((raw - raw.mean()) / raw.std(unbiased=False)).clamp(-args.reward_clip, args.reward_clip)
    assert scores.abs().max() == args.reward_clip, "the run needs a score that reward_clip clips"

    unwhitened, k1 = [], []
    for (b, i), score in zip(rows, scores.tolist()):
        d = real_tokens(b, i, "logprobs").double() - real_tokens(b, i, "ref_logprobs").double()
        non_score = -args.kl_coef * 0.5 * d ** 2  # k2
        torch.testing.assert_close(real_tokens(b, i, "non_score_rewards").double(), non_score, rtol=1e-4, atol=1e-7)
        k1.append(-args.kl_coef * d)
        rewards = non_score.clone()
        rewards[-1] += score
        unwhitened.append(rewards)
    assert torch.cat(k1).abs().max() > 1e-2, "the reference must differ from the policy (a visible KL)"
    flat = torch.cat(unwhitened)
    scale = 1 / math.sqrt(flat.var().item() + 1e-8)  # whiten_rewards: scaled, the mean kept
    for (b, i), rewards in zip(rows, unwhitened):
        expected = (rewards - flat.mean()) * scale + flat.mean()
        got = real_tokens(b, i, "rewards").double()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        # GAE on the whitened rewards; whiten_advantages=False: the advantages are the raw ones.
        values, advantages, running = real_tokens(b, i, "values").double(), torch.zeros_like(got), 0.0
        for t in reversed(range(len(got))):
            next_value = values[t + 1] if t + 1 < len(got) else 0.0
            running = got[t] + args.gamma * next_value - values[t] + args.gamma * args.lam * running
            advantages[t] = running
        torch.testing.assert_close(real_tokens(b, i, "advantages").double(), advantages, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(real_tokens(b, i, "returns").double(), advantages + values, rtol=1e-4, atol=1e-5)


def test_the_loss_normalizer_follows_loss_aggregation(run):
    _, inputs = run.snapshots[0]
    minibatch = run.micro_batches[:2]
    sequences = sum(int(b.response_mask.any(1).sum()) for b in minibatch)
    assert float(inputs["normalizer"]) == sequences, "seq_mean_token_mean divides by the minibatch's sequences"


# ---- the loss -----------------------------------------------------------------------------------------------------
def _current(model, batch, i, temperature):
    """Differentiable per-token log-probs, values and entropies of row i, the sequence run alone."""
    n = int(batch.response_mask[i].sum())
    prompt, response = batch.queries[i][batch.query_mask[i]].tolist(), batch.responses[i][:n].tolist()
    logits, hidden = plain_ppo.run_alone(model.pretrained_model, prompt + response)
    rows = [logits[len(prompt) + t - 1] for t in range(n)]
    return (torch.stack([plain_ppo.token_logprob(r, tok, temperature) for r, tok in zip(rows, response)]),
            torch.stack([plain_ppo.value_of(model.v_head, hidden[len(prompt) + t - 1]) for t in range(n)]),
            torch.stack([plain_ppo.token_entropy(r, temperature) for r in rows]))


def pushed_batch(model, batch, temperature):
    """The micro-batch with old log-probs/values, advantages, returns and reference log-probs set per token."""
    pushed, k = clone_batch(batch), 0
    with torch.no_grad():
        for i in range(len(batch)):
            logp, values, _ = _current(model, batch, i, temperature)
            for t in range(len(logp)):
                pushed.logprobs[i, t] = logp[t] - math.log(RATIOS[k % len(RATIOS)])
                pushed.advantages[i, t] = ADVANTAGES[k % len(ADVANTAGES)]
                pushed.values[i, t] = values[t] - VALUE_MOVES[k % len(VALUE_MOVES)]
                pushed.returns[i, t] = values[t] + RETURN_GAPS[k % len(RETURN_GAPS)]
                pushed.ref_logprobs[i, t] = logp[t] + REF_GAPS[k % len(REF_GAPS)]
                k += 1
    return pushed


def expected_loss(model, batch, normalizer, s: dict):
    """The PPO loss of micro-batch `batch` from the equations (see tests/plain_ppo.py), and its clip fractions.

    per token: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), with dual clip c (A < 0): min(that, -c A);
    + vf_coef * 1/2 max((V - R)^2, (V_old + clip(V - V_old, +- eps_v) - R)^2) - entropy_coef * H
    + kl_loss_coef * (e^(log p_ref - log p) - 1 - (log p_ref - log p)), that k3 times r with use_bias_correction_kl;
    r is the response's exp(mean_t (log p - log p_old)) on each token with importance_sampling_level "sequence";
    reduced per `loss_aggregation` and divided by the whole minibatch's `normalizer`.
    """
    low = s["cliprange"] if s["cliprange_low"] is None else s["cliprange_low"]
    high = s["cliprange"] if s["cliprange_high"] is None else s["cliprange_high"]
    total, clipped, value_clipped, tokens = 0.0, 0, 0, 0
    for i in range(len(batch)):
        logp, values, entropy = _current(model, batch, i, s["temperature"])
        n = len(logp)
        row_sum = 0.0
        sequence_ratio = torch.exp((logp - batch.logprobs[i, :n]).mean())
        for t in range(n):
            a, token_ratio = batch.advantages[i, t].item(), torch.exp(logp[t] - batch.logprobs[i, t].item())
            ratio = sequence_ratio if s["importance_sampling_level"] == "sequence" else token_ratio
            unclipped_pg, clipped_pg = -a * ratio, -a * torch.clamp(ratio, 1 - low, 1 + high)
            pg = torch.maximum(unclipped_pg, clipped_pg)
            if s["dual_clip"] is not None and a < 0:
                pg = torch.minimum(pg, torch.tensor(-s["dual_clip"] * a, device=pg.device))
            old, ret = batch.values[i, t].item(), batch.returns[i, t].item()
            v_clipped = old + torch.clamp(values[t] - old, -s["cliprange_value"], s["cliprange_value"])
            unclipped_v, clipped_v = (values[t] - ret) ** 2, (v_clipped - ret) ** 2
            d = batch.ref_logprobs[i, t].item() - logp[t]
            kl = (torch.exp(d) - 1 - d) * (token_ratio if s["use_bias_correction_kl"] else 1.0)
            row_sum = row_sum + (pg + s["vf_coef"] * 0.5 * torch.maximum(unclipped_v, clipped_v)
                                 - s["entropy_coef"] * entropy[t] + s["kl_loss_coef"] * kl)
            clipped += bool(clipped_pg > unclipped_pg)
            value_clipped += bool(clipped_v > unclipped_v)
            tokens += 1
        divisor = {"token_mean": 1, "seq_mean_token_mean": n, "dr_grpo": s["response_length"]}
        total = total + row_sum / divisor[s["loss_aggregation"]]
    return total / normalizer, clipped / tokens, value_clipped / tokens


@contextlib.contextmanager
def settings_of(trainer, overrides: dict):
    """The run's args with `overrides` (and the KL controller's coefficient, `kl_ctl_value`) for the block."""
    overrides = dict(overrides)
    kl_value = overrides.pop("kl_ctl_value", trainer.kl_ctl.value)
    saved = {name: getattr(trainer.args, name) for name in overrides}
    saved_kl = trainer.kl_ctl.value
    # object.__setattr__: a built trainer refuses most of these (they are settled at construction, see
    # hf_ppo/trainer/after_build.py); this test asks only what compute_loss reads, so it goes around that refusal.
    try:
        for name, value in overrides.items():
            object.__setattr__(trainer.args, name, value)
        trainer.kl_ctl.value = kl_value
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(trainer.args, name, value)
        trainer.kl_ctl.value = saved_kl


def trainer_loss(trainer, model, inputs, overrides):
    """compute_loss under `overrides`: the loss, the gradients of every parameter, and the logged clip fractions."""
    trainer.model.train()
    trainer.log({})  # flush what training recorded
    model.zero_grad(set_to_none=True)
    with settings_of(trainer, overrides):
        loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    trainer.log({})
    logged = trainer.state.log_history[-1]
    return loss.detach(), grads, logged


def expected_with_grads(model, batch, normalizer, settings):
    model.zero_grad(set_to_none=True)
    loss, clipfrac, value_clipfrac = expected_loss(model, batch, normalizer, settings)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, clipfrac, value_clipfrac


# Each: PPOConfig values for compute_loss (on top of RUN); "kl_ctl_value" sets the KL controller's coefficient.
VARIANTS = {
    "symmetric_clip": {},
    "clip_higher": dict(cliprange_low=0.1, cliprange_high=0.3),
    "clip_higher_reversed": dict(cliprange_low=0.3, cliprange_high=0.1),
    "dual_clip": dict(cliprange_low=0.1, cliprange_high=0.3, dual_clip=3.0),
    "token_mean": dict(loss_aggregation="token_mean"),
    "dr_grpo": dict(loss_aggregation="dr_grpo"),
    "coefficients": dict(vf_coef=0.3, cliprange_value=0.1, entropy_coef=0.05),
    "kl_in_the_loss": dict(advantage_estimator="grpo", kl_ctl_value=0.37),
    "kl_loss_bias_corrected": dict(use_kl_loss=True, use_bias_correction_kl=True, kl_ctl_value=0.37),
    "sequence_ratio": dict(importance_sampling_level="sequence", cliprange_low=0.1, cliprange_high=0.3),
}


def variant_settings(run, name):
    s = dict(RUN, cliprange_low=None, cliprange_high=None, dual_clip=None, kl_loss_coef=0.0,
             response_length=run.args.response_length, advantage_estimator="gae", use_kl_loss=False,
             use_bias_correction_kl=False, importance_sampling_level="token")
    s.update(VARIANTS[name])
    if s["advantage_estimator"] == "grpo" or s["use_kl_loss"]:  # a KL loss term, at the controller's coefficient
        s["kl_loss_coef"] = s["kl_ctl_value"]
    return s


@pytest.fixture(scope="module")
def pushed(run):
    """(model copy, pushed micro-batch, normalizer per aggregation) for the loss tests."""
    # The micro-batch with a response that stopped early (the aggregations differ only then); both micro-batches
    # are computed at the same weights (one optimizer step).
    k = next(k for k in (0, 1) if (run.micro_batches[k].response_mask.sum(1) < run.args.response_length).any())
    model, inputs = run.snapshots[k]
    batch = pushed_batch(model, inputs["batch"], run.args.temperature)
    minibatch = [batch, run.micro_batches[1 - k]]
    normalizers = {"token_mean": sum(b.response_mask.sum().item() for b in minibatch),
                   "seq_mean_token_mean": sum(b.response_mask.any(1).sum().item() for b in minibatch)}
    normalizers["dr_grpo"] = normalizers["seq_mean_token_mean"]
    return model, batch, normalizers


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_gradient_follow_the_objective_settings(run, pushed, variant):
    model, batch, normalizers = pushed
    s = variant_settings(run, variant)
    normalizer = normalizers[s["loss_aggregation"]]
    overrides = {k: v for k, v in VARIANTS[variant].items()}
    loss, grads, logged = trainer_loss(run, model, {"batch": batch, "normalizer": torch.tensor(normalizer)}, overrides)
    want, want_grads, clipfrac, value_clipfrac = expected_with_grads(model, batch, normalizer, s)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    assert set(grads) == set(want_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert logged["policy/clipfrac_avg"] == pytest.approx(clipfrac, abs=1e-6)
    assert logged["val/clipfrac_avg"] == pytest.approx(value_clipfrac, abs=1e-6)


def test_the_pushed_batch_tells_the_settings_apart(run, pushed):
    """Each pair of settings the loss test checks gives a different loss here, so a swap or a dropped setting shows."""
    model, batch, normalizers = pushed
    with torch.no_grad():
        loss = {v: expected_loss(model, batch, normalizers[variant_settings(run, v)["loss_aggregation"]],
                                 variant_settings(run, v))[0].item() for v in VARIANTS}
    pairs = [("clip_higher", "clip_higher_reversed"), ("clip_higher", "symmetric_clip"),
             ("clip_higher_reversed", "symmetric_clip"), ("dual_clip", "clip_higher"),
             ("token_mean", "symmetric_clip"), ("dr_grpo", "symmetric_clip"),
             ("coefficients", "symmetric_clip"), ("kl_in_the_loss", "symmetric_clip"),
             ("kl_loss_bias_corrected", "kl_in_the_loss"), ("sequence_ratio", "clip_higher")]
    for a, b in pairs:
        assert abs(loss[a] - loss[b]) > 1e-3 * abs(loss[b]), (a, b, loss[a], loss[b])


def test_critic_warmup_trains_the_value_head_alone(run, pushed):
    model, batch, normalizers = pushed
    s = variant_settings(run, "symmetric_clip")
    normalizer = normalizers[s["loss_aggregation"]]
    assert run.state.global_step == 1
    _, grads, _ = trainer_loss(run, model, {"batch": batch, "normalizer": torch.tensor(normalizer)},
                               dict(critic_warmup_steps=2))
    _, want_grads, _, _ = expected_with_grads(model, batch, normalizer, s)
    head = {n for n in want_grads if n.startswith("v_head")}
    assert head and set(grads) == head, "during the warm-up only the critic may get gradients"
    for name in head:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    _, grads, _ = trainer_loss(run, model, {"batch": batch, "normalizer": torch.tensor(normalizer)},
                               dict(critic_warmup_steps=1))
    assert set(grads) == set(want_grads), "the warm-up ends at critic_warmup_steps"
