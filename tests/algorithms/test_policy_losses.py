"""The loss family users compare against verl and TRL (issue 62): k3's clamps and k3+, the KL loss term's estimator,
the aggregations' names, the policy losses beside PPO's, the rollout correction's modes, float masks in GAE.

Each oracle is written here from the paper's or the peer's documented definition, one token at a time in plain
Python floats, and fed the same tensors as hf_ppo's vectorised function."""

from __future__ import annotations

import math

import pytest
import torch

from hf_ppo import PPOConfig
from hf_ppo.algorithms.ppo_math import (
    Experience,
    LossSettings,
    aggregate_loss,
    cispo_per_token,
    clip_cov_per_token,
    compute_gae,
    compute_rewards,
    gmpo_per_token,
    gpg_per_token,
    kl_cov_per_token,
    kl_estimate,
    kl_loss_per_token,
    loss_normalizer,
    ppo_loss,
    rollout_correction_weights,
    sapo_per_token,
    variant_policy_loss,
)
from hf_ppo.algorithms.policy_losses import token_covariance
from hf_ppo.trainer.checkpoint import compare_settings

F64 = torch.float64
T, F = True, False


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, atol=1e-9, rtol=1e-7):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol,
                               rtol=rtol)


def config(tmp_path, **fields) -> PPOConfig:
    return PPOConfig(output_dir=str(tmp_path / "run"), report_to=[], **fields)


# Three responses of 4, 2 and 3 real tokens, with junk behind the mask.
MASK = torch.tensor([[T, T, T, T], [T, T, F, F], [T, T, T, F]])
LOGP = t64([[-1.0, -0.5, -2.0, -0.2], [-0.3, -1.5, 9.0, 9.0], [-0.8, -0.1, -3.0, 9.0]])
OLD = t64([[-1.2, -0.5, -1.0, -0.9], [-0.3, -0.2, -9.0, 9.0], [-0.6, -0.4, -1.0, 9.0]])
ADV = t64([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, 7.0, 7.0], [0.5, -1.5, 2.0, 7.0]])


def real_tokens():
    return [(i, t) for i in range(MASK.shape[0]) for t in range(MASK.shape[1]) if MASK[i, t]]


# ---- 1. numerics ---------------------------------------------------------------------------------------------------
def verl_k3(logp: float, ref: float) -> float:
    """verl's documented low_var_kl: kl = ref - logp clamped to [-20, 20]; exp(kl) - kl - 1 clamped to [-10, 10]."""
    kl = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1.0, -10.0), 10.0)


def test_k3_is_clamped_as_verl_does_for_the_penalty_and_the_loss():
    logp, ref = t64([[-0.1, -0.1, -30.0, -1.0]]), t64([[-25.0, -0.1, -0.1, -1.7]])
    expected = [verl_k3(a, b) for a, b in zip(logp[0].tolist(), ref[0].tolist())]
    assert expected[:3] == [10.0, 0.0, 10.0]  # the example: 10, not 9.7e12
    close(kl_estimate(logp, ref, "k3"), [expected])
    close(kl_loss_per_token(logp, ref), [expected])
    close(kl_estimate(logp, ref, "low_var_kl"), [expected])  # verl's name
    # inside the clamps k3 is the textbook (r - 1) - log r, r = p_ref / p: r = e^-0.7 -> e^-0.7 - 1 + 0.7
    close(kl_estimate(logp, ref, "k3")[0, 3], math.exp(-0.7) - 1 + 0.7)


def test_one_ruled_out_token_leaves_the_kl_loss_term_finite_and_bounded():
    logits = torch.zeros(1, 3, 5, dtype=F64, requires_grad=True)
    responses = torch.tensor([[0, 1, 2]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    zeros = torch.zeros(1, 3, dtype=F64)
    ref = t64([[-60.0, math.log(0.2), math.log(0.2)]])  # the reference all but rules out the first token
    old = Experience(responses, torch.full((1, 3), math.log(0.2), dtype=F64), zeros, zeros, zeros, mask, ref)
    s = LossSettings(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0)
    loss, stats = ppo_loss(logits, None, old, loss_normalizer(mask), s, kl_loss_coef=1.0)
    # policy loss 0 (A = 0); the KL term: (10 + 0 + 0) / 3 tokens
    close(stats["loss/kl_avg"], 10.0 / 3)
    close(loss, 10.0 / 3)


def test_gae_and_rewards_take_a_float_mask_and_refuse_a_weight():
    rewards, values = t64([[0.0, 0.0, 1.0, 5.0]]), t64([[0.5, 0.5, 0.5, 9.0]])
    bool_mask = torch.tensor([[T, F, T, F]])
    float_mask = bool_mask.to(F64)
    for got, expected in zip(compute_gae(rewards, values, float_mask, 1.0, 0.95),
                             compute_gae(rewards, values, bool_mask, 1.0, 0.95)):
        close(got, expected)
    kl, scores = t64([[0.1, 0.2, 0.3, 0.4]]), t64([2.0])
    for got, expected in zip(compute_rewards(scores, kl, float_mask, 0.5), compute_rewards(scores, kl, bool_mask, 0.5)):
        close(got, expected)
    # hand numbers: KL -0.05 and -0.15 on the real tokens, the score at the last real one (position 2)
    close(compute_rewards(scores, kl, float_mask, 0.5)[0], [[-0.05, 0.0, 2.0 - 0.15, 0.0]])
    with pytest.raises(ValueError, match="only 0 and 1"):
        compute_gae(rewards, values, float_mask * 0.5, 1.0, 0.95)
    with pytest.raises(ValueError, match="only 0 and 1"):
        compute_rewards(scores, kl, float_mask * 0.5, 0.5)


# ---- 2. KL choices -------------------------------------------------------------------------------------------------
def test_k3_plus_has_k3s_value_and_k2s_gradient_abs_and_verls_names():
    logp = t64([[-0.3, -2.0, -1.0]]).requires_grad_(True)
    ref = t64([[-1.0, -0.5, -1.0]])
    value = kl_estimate(logp, ref, "k3+")
    close(value, kl_estimate(logp.detach(), ref, "k3"))
    value.sum().backward()
    close(logp.grad, [[0.7, -1.5, 0.0]])  # d k2 / d logp = logp - ref
    close(kl_estimate(logp.detach(), ref, "abs"), [[0.7, 1.5, 0.0]])
    close(kl_estimate(logp.detach(), ref, "kl"), [[0.7, -1.5, 0.0]])
    close(kl_estimate(logp.detach(), ref, "mse"), [[0.245, 1.125, 0.0]])
    close(kl_estimate(logp.detach(), ref, "low_var_kl+"), kl_estimate(logp.detach(), ref, "k3"))


def test_k3_plus_gives_the_exact_gradient_of_the_reverse_kl_and_k3_does_not():
    theta = t64([0.3, -0.2, 0.9]).requires_grad_(True)
    q = t64([0.5, 0.3, 0.2])
    true_kl = (theta.softmax(0) * (theta.log_softmax(0) - q.log())).sum()
    (true_grad,) = torch.autograd.grad(true_kl, theta)
    for estimator, matches in (("k3+", True), ("k3", False)):
        logp = theta.log_softmax(0)
        p = logp.exp().detach()  # the expectation over the sampled token, exactly
        loss = (p * kl_loss_per_token(logp, q.log(), estimator=estimator)).sum()
        (grad,) = torch.autograd.grad(loss, theta)
        assert torch.allclose(grad, true_grad, atol=1e-12) is matches


def test_the_kl_loss_estimator_reaches_the_loss(tmp_path):
    logits = torch.zeros(1, 2, 4, dtype=F64)
    responses, mask = torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool)
    zeros = torch.zeros(1, 2, dtype=F64)
    ref = t64([[math.log(0.5), math.log(0.125)]])  # logp = log 0.25 on both: d = -ln 2, +ln 2
    old = Experience(responses, torch.full((1, 2), math.log(0.25), dtype=F64), zeros, zeros, zeros, mask, ref)
    ln2 = math.log(2)
    expected = {"k1": 0.0, "k2": 0.5 * ln2**2, "abs": ln2, "k3": ((1 - ln2) + (-0.5 + ln2)) / 2}
    for estimator, value in expected.items():
        s = LossSettings(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0,
                         kl_loss_estimator=estimator)
        close(ppo_loss(logits, None, old, loss_normalizer(mask), s, kl_loss_coef=1.0)[1]["loss/kl_avg"], value,
              atol=1e-6)  # log-probs are float32
    args = config(tmp_path, kl_loss_estimator="low_var_kl+", kl_estimator="mse", use_kl_loss=True)
    assert (args.kl_loss_estimator, args.kl_estimator) == ("k3+", "k2")
    assert args.loss_settings.kl_loss_estimator == "k3+" and args.estimator_settings.kl_estimator == "k2"
    with pytest.raises(ValueError, match=r"kl_loss_estimator='k4': choose one of k1, k2, k3, k3\+, abs"):
        config(tmp_path, kl_loss_estimator="k4")


# ---- 3. aggregation ------------------------------------------------------------------------------------------------
def test_seq_mean_token_sum_is_verls_and_dr_grpo_keeps_the_old_numbers(tmp_path):
    per_token = t64([[-1.0, -2.0, -3.0, 9.0], [-4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[T, T, T, F], [T, F, F, F], [F, F, F, F]])
    close(aggregate_loss(per_token, mask, "seq_mean_token_sum"), (-6.0 + -4.0) / 2)  # token sums, mean over 2
    close(aggregate_loss(per_token, mask, "dr_grpo", max_length=10), (-0.6 - 0.4) / 2)
    assert config(tmp_path, loss_aggregation="seq-mean-token-sum").loss_aggregation == "seq_mean_token_sum"
    assert config(tmp_path, loss_aggregation="seq-mean-token-mean").loss_aggregation == "seq_mean_token_mean"
    for old_name in ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match=r"now 'dr_grpo' .*sums over the responses"):
            config(tmp_path, loss_aggregation=old_name)
    # a checkpoint that saved the old name resumes as dr_grpo: the same run
    assert compare_settings({"loss_aggregation": "seq_mean_token_sum_norm"}, {"loss_aggregation": "dr_grpo"}) == {}
    assert compare_settings({"loss_aggregation": "seq_mean_token_sum_norm"}, {"loss_aggregation": "token_mean"})


# ---- 4. policy losses ----------------------------------------------------------------------------------------------
def oracle_mean(per_token: dict) -> float:
    """token_mean of {(i, t): loss} over the real tokens."""
    return sum(per_token.values()) / len(per_token)


def test_cispo_is_the_clipped_stop_gradient_weight_times_reinforce():
    logp = LOGP.clone().requires_grad_(True)
    loss = aggregate_loss(cispo_per_token(logp, OLD, ADV, MASK, clip_max=1.5)[0], MASK)
    oracle, grads = {}, {}
    for i, t in real_tokens():  # TRL: -clamp(ratio, max=eps_high).detach() * A * logp
        w = min(math.exp(LOGP[i, t] - OLD[i, t]), 1.5)
        oracle[i, t] = -w * ADV[i, t].item() * LOGP[i, t].item()
        grads[i, t] = -w * ADV[i, t].item() / len(real_tokens())
    close(loss, oracle_mean(oracle))
    loss.backward()
    expected = torch.zeros_like(LOGP)
    for key, g in grads.items():
        expected[key] = g
    close(logp.grad, expected)
    # tokens PPO's clip would leave without a gradient keep one: r = e^0.7 > 1.2 with A > 0 (weight capped at 1.5),
    # r = e^-1.3 < 0.8 with A < 0 (weight r itself)
    close(logp.grad[0, 3], -1.5 * 1.0 / 9)
    close(logp.grad[1, 1], -math.exp(-1.3) * -2.0 / 9)


def test_sapo_is_the_sigmoid_gate_with_the_papers_temperatures():
    loss = aggregate_loss(sapo_per_token(LOGP, OLD, ADV, MASK)[0], MASK)
    oracle = {}
    for i, t in real_tokens():
        r, a = math.exp(LOGP[i, t] - OLD[i, t]), ADV[i, t].item()
        tau = 1.0 if a > 0 else 1.05
        oracle[i, t] = -(4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))) * a
    close(loss, oracle_mean(oracle))
    # at r = 1 the gate's gradient is PPO's: d/dlogp of -f(r) A = -A
    logp = OLD.clone().requires_grad_(True)
    aggregate_loss(sapo_per_token(logp, OLD, ADV, MASK)[0], MASK, normalizer=1.0).backward()
    close(logp.grad, torch.where(MASK, -ADV, torch.zeros_like(ADV)))


def test_gmpo_is_the_geometric_mean_of_the_clipped_token_ratios():
    loss = aggregate_loss(gmpo_per_token(LOGP, OLD, ADV, MASK, 0.4, 0.4)[0], MASK, "seq_mean_token_mean")
    per_response = []
    for i in range(3):
        tokens = [t for t in range(4) if MASK[i, t]]
        terms = []
        for t in tokens:
            lr, a = (LOGP[i, t] - OLD[i, t]).item(), ADV[i, t].item()
            s = 1.0 if a >= 0 else -1.0
            terms.append(s * min(s * lr, s * min(max(lr, -0.4), 0.4)))
        geo = math.exp(sum(terms) / len(terms))
        per_response.append(sum(-ADV[i, t].item() * geo for t in tokens) / len(tokens))
    close(loss, sum(per_response) / 3)
    # a sequence-level advantage: response 0 (A = 1): log-ratios 0.2, 0, -1 -> -0.4 (A > 0 takes the min), 0.7 -> 0.4
    close(gmpo_per_token(LOGP, OLD, ADV, MASK)[0][0, 0], -math.exp((0.2 + 0 - 1.0 + 0.4) / 4))


def test_gpg_is_the_plain_policy_gradient():
    logp = LOGP.clone().requires_grad_(True)
    loss = aggregate_loss(gpg_per_token(logp, ADV)[0], MASK)
    close(loss, oracle_mean({(i, t): -ADV[i, t].item() * LOGP[i, t].item() for i, t in real_tokens()}))
    loss.backward()
    close(logp.grad, torch.where(MASK, -ADV / len(real_tokens()), torch.zeros_like(ADV)))


def test_kl_cov_adds_the_kl_term_on_the_tokens_of_largest_covariance():
    cov = token_covariance(LOGP, ADV, MASK)
    n = len(real_tokens())
    mean_a = sum(ADV[k].item() for k in real_tokens()) / n
    mean_l = sum(LOGP[k].item() for k in real_tokens()) / n
    for i, t in real_tokens():
        close(cov[i, t], (ADV[i, t].item() - mean_a) * (LOGP[i, t].item() - mean_l))
    top = sorted(real_tokens(), key=lambda k: cov[k].item(), reverse=True)[:2]  # ratio 0.25 of 9 tokens -> 2
    per_token, selected = kl_cov_per_token(LOGP, OLD, ADV, MASK, ratio=0.25, coef=0.5)
    assert sorted(map(tuple, selected.nonzero().tolist())) == sorted(top)
    oracle = {}
    for i, t in real_tokens():
        lr = (LOGP[i, t] - OLD[i, t]).item()
        oracle[i, t] = -ADV[i, t].item() * math.exp(lr) + (0.5 * abs(lr) if (i, t) in top else 0.0)
    close(aggregate_loss(per_token, MASK), oracle_mean(oracle))


def test_clip_cov_detaches_unclipped_tokens_whose_covariance_is_in_the_band():
    cov = token_covariance(LOGP, ADV, MASK)
    lb, ub = -0.5, 0.6
    logp = LOGP.clone().requires_grad_(True)
    per_token, touched = clip_cov_per_token(logp, OLD, ADV, MASK, 0.2, 0.2, ratio=1.0, cov_low=lb, cov_high=ub)
    oracle, detached = {}, set()
    for i, t in real_tokens():
        r, a = math.exp(LOGP[i, t] - OLD[i, t]), ADV[i, t].item()
        unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.2)
        if clipped <= unclipped and lb < cov[i, t].item() < ub:  # PPO did not clip it, its covariance in the band
            detached.add((i, t))
        oracle[i, t] = 0.0 if (i, t) in detached else max(unclipped, clipped)
    assert detached and len(detached) < len(real_tokens())
    loss = aggregate_loss(per_token, MASK)
    close(loss, oracle_mean(oracle))
    loss.backward()
    assert all(logp.grad[k] == 0 for k in detached)
    # ratio 2e-4 of 9 tokens: exactly one of the candidates, drawn at random
    one = clip_cov_per_token(LOGP, OLD, ADV, MASK, 0.2, 0.2, 2e-4, lb, ub, torch.Generator().manual_seed(0))[0]
    zeroed = {k for k in real_tokens() if one[k] == 0 and oracle[k] == 0}
    assert len(zeroed) == 1 and zeroed <= detached


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "gpg", "kl_cov", "clip_cov"])
def test_each_policy_loss_reaches_ppo_loss_through_its_settings(name, tmp_path):
    logits = torch.randn(3, 4, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    responses = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [1, 1, 2, 0]])
    from hf_ppo.algorithms.ppo_math import logprobs_from_logits
    logp = logprobs_from_logits(logits, responses)
    zeros = torch.zeros_like(OLD)
    old = Experience(responses, OLD, zeros, ADV, zeros, MASK)
    s = LossSettings(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0, policy_loss=name,
                     kl_cov_ratio=0.25, clip_cov_ratio=1.0, clip_cov_lb=-0.5, clip_cov_ub=0.6)
    loss, stats = ppo_loss(logits, None, old, loss_normalizer(MASK), s)
    expected = variant_policy_loss(logp, OLD, ADV, MASK, s, loss_normalizer(MASK))[0]
    close(loss, expected)
    plain = ppo_loss(logits, None, old, loss_normalizer(MASK), LossSettings(temperature=1.0, cliprange=0.2,
                                                                           cliprange_value=0.2, vf_coef=0.0))[0]
    assert abs(loss.item() - plain.item()) > 1e-6  # not PPO's loss under another name
    args = config(tmp_path, policy_loss=name)
    assert args.loss_settings.policy_loss == name


def test_a_policy_loss_refuses_settings_it_would_ignore(tmp_path):
    with pytest.raises(ValueError, match=r"sapo_temperature_neg=1.2 is a parameter of policy_loss='sapo'"):
        config(tmp_path, policy_loss="cispo", sapo_temperature_neg=1.2)
    with pytest.raises(ValueError, match=r"cliprange_high clips PPO's ratio.*\(its own bounds: cispo_clip_max\)"):
        config(tmp_path, policy_loss="cispo", cliprange_high=0.28)
    with pytest.raises(ValueError, match=r"importance_sampling_level='sequence' with policy_loss='gmpo'"):
        config(tmp_path, policy_loss="gmpo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match=r"clip_cov_lb=5.0 >= clip_cov_ub=1.0"):
        config(tmp_path, policy_loss="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)
    assert config(tmp_path, policy_loss="sapo", importance_sampling_level="sequence").policy_loss == "sapo"


# ---- 6. rollout correction -----------------------------------------------------------------------------------------
def test_rollout_correction_modes_on_the_same_tensors_as_trls_definition():
    old = t64([[-1.0, -1.0, -1.0], [-1.0, -1.0, 5.0]])
    sampler = t64([[-1.5, -0.2, -1.0], [-2.0, -1.5, -5.0]])  # token ratios e^0.5, e^-0.8, 1 | e^1, e^0.5, (masked)
    mask = torch.tensor([[T, T, T], [T, T, F]])
    e = math.exp
    close(rollout_correction_weights(old, sampler, mask, "token_truncate", 2.0),
          [[e(0.5), e(-0.8), 1.0], [2.0, e(0.5), 1.0]])
    close(rollout_correction_weights(old, sampler, mask, "token_mask", 2.0, 0.5),
          [[e(0.5), 0.0, 1.0], [0.0, e(0.5), 1.0]])
    # sequences: e^(0.5 - 0.8 + 0) = e^-0.3 and e^(1 + 0.5) = e^1.5 (the masked token adds nothing)
    close(rollout_correction_weights(old, sampler, mask, "sequence_truncate", 3.0, 0.8),
          [[0.8] * 3, [3.0] * 3])
    close(rollout_correction_weights(old, sampler, mask, "sequence_mask", 5.0, 0.5),
          [[e(-0.3)] * 3, [e(1.5)] * 3])
    close(rollout_correction_weights(old, sampler, mask, "sequence_mask", 3.0), [[e(-0.3)] * 3, [0.0] * 3])


def test_a_rejected_sequence_leaves_the_loss(tmp_path):
    logits = torch.randn(2, 3, 5, dtype=F64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    responses, mask = torch.tensor([[0, 1, 2], [3, 4, 0]]), torch.tensor([[T, T, T], [T, T, F]])
    from hf_ppo.algorithms.ppo_math import logprobs_from_logits
    old_logp = logprobs_from_logits(logits.detach(), responses)
    sampler = old_logp - t64([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])  # response 1: ratio e^2 > 3: rejected
    adv, zeros = t64([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]), torch.zeros(2, 3, dtype=F64)
    old = Experience(responses, old_logp, zeros, adv, zeros, mask, None, sampler)
    s = LossSettings(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0, importance_sampling_cap=3.0,
                     importance_sampling_mode="sequence_mask")
    loss, stats = ppo_loss(logits, None, old, loss_normalizer(mask), s)
    close(loss, -3.0 / 5)  # ratio 1, A = 1 on response 0's 3 tokens; response 1's two count in the mean
    loss.backward()
    assert logits.grad[1].abs().sum() == 0 and logits.grad[0].abs().sum() > 0
    args = config(tmp_path, rollout_engine="vllm", vllm_importance_sampling_cap=3.0,
                  vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_min=0.5)
    assert (args.loss_settings.importance_sampling_mode, args.loss_settings.importance_sampling_min) == (
        "sequence_mask", 0.5)
    with pytest.raises(ValueError, match="set vllm_importance_sampling_cap"):
        config(tmp_path, vllm_importance_sampling_mode="sequence_mask")


# ---- 5. advantages and groups --------------------------------------------------------------------------------------
def test_scale_rewards_batch_is_trls_definition(tmp_path):
    from hf_ppo.algorithms.ppo_math import grpo_advantages
    scores = t64([1.0, 3.0, 5.0, 5.0])
    # TRL: rewards - group mean, divided by the std of all rewards (+ 1e-4): means 2, 5; std of [1, 3, 5, 5] with
    # Bessel's correction: mean 3.5, squares 6.25 + 0.25 + 2.25 + 2.25 = 11 -> sqrt(11 / 3)
    std = math.sqrt(11 / 3)
    close(grpo_advantages(scores, 2, "batch"), [-1 / (std + 1e-4), 1 / (std + 1e-4), 0.0, 0.0])
    close(grpo_advantages(scores, 2, "none"), grpo_advantages(scores, 2, False))
    close(grpo_advantages(scores, 2, "group"), grpo_advantages(scores, 2, True))
    assert config(tmp_path, advantage_estimator="grpo", num_generations=2, scale_rewards="batch"
                  ).estimator_settings.scale_rewards == "batch"
    assert config(tmp_path, advantage_estimator="grpo", num_generations=2, scale_rewards=False).scale_rewards == "none"
    assert config(tmp_path).scale_rewards == "group"
    with pytest.raises(ValueError, match=r"scale_rewards='batch' applies to advantage_estimator='grpo'"):
        config(tmp_path, scale_rewards="batch")
    # a checkpoint that saved the bool resumes as the word
    assert compare_settings({"scale_rewards": False}, {"scale_rewards": "none"}) == {}


def test_groups_named_by_an_index_of_unequal_size_and_groups_of_one():
    from hf_ppo.algorithms.advantages import grpo_advantages, grpo_advantages_by_index, rloo_advantages, \
        rloo_advantages_by_index
    scores, index = t64([1.0, 2.0, 6.0, 4.0, 0.0, 2.0]), torch.tensor([7, 7, 7, 3, 9, 9])
    # group 7: [1, 2, 6] (mean 3, std sqrt 7); group 3: [4] alone (passes through); group 9: [0, 2] (mean 1, std 2^.5)
    close(grpo_advantages_by_index(scores, index, "none"), [-2.0, -1.0, 3.0, 4.0, -1.0, 1.0])
    s7, s9 = math.sqrt(7) + 1e-4, math.sqrt(2) + 1e-4
    close(grpo_advantages_by_index(scores, index), [-2 / s7, -1 / s7, 3 / s7, 4 / (1 + 1e-4), -1 / s9, 1 / s9])
    close(rloo_advantages_by_index(scores, index), [-3.0, -1.5, 4.5, 4.0, -2.0, 2.0])
    # equal groups in consecutive rows: the same numbers as the k-grouped estimators
    equal = torch.tensor([0, 0, 0, 1, 1, 1])
    close(grpo_advantages_by_index(scores, equal), grpo_advantages(scores, 3))
    close(rloo_advantages_by_index(scores, equal), rloo_advantages(scores, 3))
    # rows of a group anywhere in the batch
    close(grpo_advantages_by_index(scores[[0, 3, 1, 2]], index[[0, 3, 1, 2]], "none"), [-2.0, 4.0, -1.0, 3.0])


def test_remax_subtracts_the_greedy_responses_score():
    from hf_ppo.algorithms.advantages import remax_advantages
    close(remax_advantages(t64([1.0, 3.0, 0.0, 2.0]), t64([2.0, 1.0])), [-1.0, 1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="one greedy score per prompt"):
        remax_advantages(t64([1.0, 3.0, 0.0]), t64([2.0, 1.0]))


def test_reinforce_pp_discounts_with_gamma_over_the_policys_tokens():
    from hf_ppo.algorithms.estimators import ESTIMATORS, EstimatorSettings
    from hf_ppo.algorithms.ppo_math import reinforce_pp_advantages
    scores, kl = t64([1.0, 2.0]), torch.zeros(2, 4, dtype=F64)
    mask = torch.tensor([[T, F, T, T], [T, T, F, F]])  # an environment token at row 0's position 1
    # row 0: G = [0.5^2, 0, 0.5, 1] (the masked position is no time step); row 1: [0.5 * 2, 2]
    returns = reinforce_pp_advantages(scores, kl, mask, 0.0, gamma=0.5)[1]
    close(returns, [[0.25, 0.0, 0.5, 1.0], [1.0, 2.0, 0.0, 0.0]])
    close(reinforce_pp_advantages(scores, kl, mask, 0.0)[1], [[1.0, 0.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]])
    s = EstimatorSettings(kl_coef=0.0, gamma=0.5, advantage_estimator="reinforce_pp")
    close(ESTIMATORS["reinforce_pp"].compute(scores, kl, mask, None, s)["returns"], returns)


def test_gamma_is_refused_where_nothing_is_discounted(tmp_path):
    with pytest.raises(ValueError, match=r"gamma=0.9 with advantage_estimator='rloo'"):
        config(tmp_path, advantage_estimator="rloo", num_generations=2, gamma=0.9)
    assert config(tmp_path, advantage_estimator="reinforce_pp", gamma=0.9).estimator_settings.gamma == 0.9


def test_normalize_then_sum_is_trls_definition_in_training_and_raw_in_evaluation(tmp_path):
    from hf_ppo.algorithms.ppo_math import grpo_advantages
    from hf_ppo.rollout.scoring import RewardSet, group_normalized
    a, b = t64([1.0, 3.0, 5.0, 5.0]), t64([0.0, 1.0, 1.0, 1.0])
    every = torch.ones(4, dtype=torch.bool)
    s2, s5 = math.sqrt(2) + 1e-4, math.sqrt(0.5) + 1e-4
    close(group_normalized(a, every, 2), [-1 / s2, 1 / s2, 0.0, 0.0])
    rewards = RewardSet([None, None], [None, None], ["a", "b"], [1.0, 2.0], group_size=2)
    each = {"a": (a, every), "b": (b, every)}
    combined = rewards.combine(each, ["p"] * 4, gather=lambda t: t)
    # TRL: each reward normalised in its group, weighted and summed: a -> [-1/s2, 1/s2, 0, 0], b -> [-.5/s5, .5/s5, 0,
    # 0]; the sum's advantages over the batch: (sum - batch mean) / (batch std + 1e-4)
    trl_sum = t64([-1 / s2 - 1 / s5, 1 / s2 + 1 / s5, 0.0, 0.0])
    close(combined, trl_sum)
    close(grpo_advantages(combined, 2, "batch"), (trl_sum - trl_sum.mean()) / (trl_sum.std() + 1e-4))
    close(rewards.combine(each, ["p"] * 4), a + 2 * b)  # evaluation (no gather): the raw weighted sum
    # a reward that does not apply to a row (None) is left out of its group's statistics
    partly = torch.tensor([T, T, T, F])
    close(group_normalized(t64([1.0, 3.0, 5.0, 100.0]), partly, 2)[2], 0.0)
    args = config(tmp_path, advantage_estimator="grpo", num_generations=2, scale_rewards="batch",
                  multi_objective_aggregation="normalize_then_sum")
    assert (args.reward_settings.multi_objective_aggregation, args.reward_settings.num_generations) == (
        "normalize_then_sum", 2)
    with pytest.raises(ValueError, match="Set advantage_estimator='grpo' and scale_rewards='batch'"):
        config(tmp_path, advantage_estimator="grpo", num_generations=2, multi_objective_aggregation="normalize_then_sum")
