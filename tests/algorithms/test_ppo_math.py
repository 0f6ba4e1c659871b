"""hf_ppo.algorithms.ppo_math against numbers worked out by hand, plus the invariances the trainer relies on.

Every expected value carries its arithmetic in a comment. Tensors are float64 where the hand numbers need it.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.utils._python_dispatch

from hf_ppo.algorithms.ppo_math import (AdaptiveKLController, LOSS_AGGREGATIONS, Experience, FixedKLController, LossSettings, RunningMoments, aggregate_loss, compute_gae, compute_rewards, entropy_from_logits, explained_variance, grpo_advantages, kl_estimate, kl_loss_per_token, logprobs_from_logits, loss_normalizer, masked_mean, masked_var, masked_whiten, policy_loss, ppo_loss, reinforce_pp_advantages, rloo_advantages, sequence_to_token_advantages, value_loss)

F64 = torch.float64
T, F = True, False


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, atol=1e-9, rtol=1e-7):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=rtol)


# ---- masked statistics ------------------------------------------------------------------------------------------
def test_masked_mean_all_and_per_row():
    values = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[T, T, F], [T, F, F]])
    close(masked_mean(values, mask), 7.0 / 3.0)  # (1 + 2 + 4) / 3
    close(masked_mean(values, mask, dim=1), [1.5, 4.0])  # row 0: (1 + 2) / 2; row 1: 4 / 1


def test_masked_mean_empty_row_is_zero():
    values = t64([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[T, T], [F, F]])
    close(masked_mean(values, mask, dim=1), [1.5, 0.0])  # (1 + 2) / 2; nothing selected -> 0


def test_masked_var_biased_and_unbiased():
    values = t64([1.0, 3.0, 5.0, 7.0, 100.0])
    mask = torch.tensor([T, T, T, T, F])
    # mean = (1 + 3 + 5 + 7) / 4 = 4; squared deviations 9, 1, 1, 9 -> sum 20
    close(masked_var(values, mask, unbiased=False), 5.0)  # 20 / 4
    close(masked_var(values, mask, unbiased=True), 20.0 / 3.0)  # 20 / (4 - 1)


def test_masked_var_three_values():
    values = t64([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[T, T, F], [T, F, F]])
    # selected 1, 2, 4: mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9
    close(masked_var(values, mask, unbiased=False), 42.0 / 9.0 / 3.0)  # 14/9
    close(masked_var(values, mask, unbiased=True), 42.0 / 9.0 / 2.0)  # 7/3


def test_masked_whiten_shift_and_scale_only():
    values = t64([1.0, 3.0, 5.0, 7.0, 0.0])
    mask = torch.tensor([T, T, T, T, F])
    std = math.sqrt(20.0 / 3.0)  # unbiased variance 20/3 (see above) -> std 2.581989
    expected = [-3.0 / std, -1.0 / std, 1.0 / std, 3.0 / std, 0.0]  # (x - 4) / std; masked slot -> 0
    close(masked_whiten(values, mask), expected, atol=1e-7)
    # shift_mean=False adds the mean 4 back: (x - 4) / std + 4; the masked slot still comes back 0
    expected_no_shift = [4.0 - 3.0 / std, 4.0 - 1.0 / std, 4.0 + 1.0 / std, 4.0 + 3.0 / std, 0.0]
    close(masked_whiten(values, mask, shift_mean=False), expected_no_shift, atol=1e-7)


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), float("-inf"), 1e30])
def test_masked_stats_ignore_values_at_masked_positions(junk):
    torch.manual_seed(0)
    values = torch.randn(3, 6, dtype=F64)
    mask = torch.tensor([[T, T, T, T, F, F], [T, T, T, T, T, T], [T, F, F, F, F, F]])
    dirty = values.clone()
    dirty[~mask] = junk
    close(masked_mean(dirty, mask), masked_mean(values, mask))
    close(masked_mean(dirty, mask, dim=1), masked_mean(values, mask, dim=1))
    for unbiased in (True, False):
        close(masked_var(dirty, mask, unbiased=unbiased), masked_var(values, mask, unbiased=unbiased))
    for shift in (True, False):
        out = masked_whiten(dirty, mask, shift_mean=shift)
        close(out, masked_whiten(values, mask, shift_mean=shift))
        assert torch.all(out[~mask] == 0)
    # the whitened real entries have mean 0 and unbiased variance 1
    w = masked_whiten(dirty, mask)
    close(masked_mean(w, mask), 0.0, atol=1e-9)
    close(masked_var(w, mask), 1.0, atol=1e-6)


# ---- log-probs, entropy --------------------------------------------------------------------------------------------
def test_logprobs_match_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = logprobs_from_logits(logits, tokens)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    # bf16 logits come back as float32 log-probs
    assert logprobs_from_logits(logits.bfloat16(), tokens).dtype == torch.float32


def test_logprobs_hand_example_and_temperature():
    ln2, ln3 = math.log(2.0), math.log(3.0)
    logits = t64([[[0.0, 2 * ln2, 2 * ln3]]])  # exp -> 1, 4, 9 (sum 14)
    tokens = torch.tensor([[1]])
    close(logprobs_from_logits(logits, tokens), [[math.log(4.0 / 14.0)]])  # p(1) = 4/14
    # temperature 2 halves the logits: [0, ln2, ln3] -> exp 1, 2, 3 (sum 6) -> p(1) = 2/6 = 1/3
    close(logprobs_from_logits(logits, tokens, temperature=2.0), [[math.log(1.0 / 3.0)]], atol=1e-6)
    # temperature 2 on token 2: p = 3/6
    close(logprobs_from_logits(logits, torch.tensor([[2]]), temperature=2.0), [[math.log(0.5)]], atol=1e-6)


def test_chunked_logprobs_entropy_and_loss_equal_the_whole_computation():
    """A budget of one position per chunk gives the numbers and the gradients of one chunk for everything."""
    torch.manual_seed(0)
    B, R, V = 3, 7, 50
    base = torch.randn(B, R, V)
    tokens = torch.randint(0, V, (B, R))
    mask = torch.rand(B, R) > 0.2
    old = Experience(tokens, torch.randn(B, R) - 3, torch.randn(B, R), torch.randn(B, R), torch.randn(B, R), mask)
    results = []
    for budget in (1, 2**30):  # 1 byte: one position per chunk; 1 GiB: one chunk
        logits = base.clone().requires_grad_(True)
        values = torch.zeros(B, R, requires_grad=True)
        lp = logprobs_from_logits(logits, tokens, 0.7, memory_bytes=budget)
        ent = entropy_from_logits(logits, 0.7, memory_bytes=budget)
        loss, _ = ppo_loss(logits, values, old, mask.sum().float(),
                           LossSettings(0.7, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.05,
                                        memory_bytes=budget))
        (loss + lp.sum() + ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), loss.detach(), logits.grad))
    for chunked, whole in zip(*results):
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)


class _LargestFloat32(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the size of the largest float32 tensor any operation makes (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel() * 4)
        return out


def test_no_whole_fp32_logits_tensor_is_made_in_the_forward_or_the_backward():
    """bf16 logits (what a bf16 model returns): the log-probs, entropy and loss with their backward never make an
    fp32 tensor larger than the budget, where the whole computation makes one of (batch, len, vocab)."""
    torch.manual_seed(0)
    B, R, V = 2, 64, 4096
    whole_fp32 = B * R * V * 4  # 2 MiB
    budget = 128 * 2**10
    tokens = torch.randint(0, V, (B, R))
    mask = torch.ones(B, R, dtype=torch.bool)
    old = Experience(tokens, torch.full((B, R), -8.0), torch.zeros(B, R), torch.randn(B, R), torch.randn(B, R), mask)

    def largest(memory_bytes):
        logits = torch.randn(B, R, V).bfloat16().requires_grad_(True)
        with _LargestFloat32() as mode:
            loss, _ = ppo_loss(logits, None, old, mask.sum().float(),
                               LossSettings(0.9, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0, entropy_coef=0.01,
                                            memory_bytes=memory_bytes))
            loss.backward()
        assert logits.grad.dtype == torch.bfloat16
        return mode.largest

    assert largest(2**30) >= whole_fp32  # the measure sees the whole tensor when nothing is chunked
    assert largest(budget) <= budget


class _WholeSizeTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The distinct storages of at least `nbytes` that operations make, with their shapes. Each storage is kept
    alive, so that none is counted twice when the allocator hands its address out again; the storage, not the
    tensor, so that autograd may still take a gradient over as `.grad` without copying it."""

    def __init__(self, nbytes: int, exclude: torch.Tensor):
        super().__init__()
        self.nbytes, self.storages, self.skip = nbytes, {}, exclude.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.nbytes:
                storage = t.untyped_storage()
                if storage.data_ptr() != self.skip:
                    self.storages.setdefault(storage.data_ptr(), (storage, tuple(t.shape)))
        return out


@pytest.mark.parametrize("of", ["logprobs", "entropy"])
@pytest.mark.parametrize("budget_positions", [16, 3])  # whole rows (8 positions) per chunk; parts of a row
def test_chunked_backward_makes_one_logits_sized_gradient(budget_positions, of):
    """fp32 logits (an fp32 model's): the backward of the chunked log-probs (entropy) writes every chunk's gradient
    into ONE tensor of the logits' size, the gradient itself, never one zero-filled copy per row of the batch (issue
    50: at SmolLM2's 49k vocabulary and 8 x 129 positions, each copy is 195 MiB)."""
    B, R, V = 5, 8, 64
    logits = torch.randn(B, R, V, requires_grad=True)
    tokens = torch.randint(0, V, (B, R))
    budget = budget_positions * 5 * 4 * V  # about `budget_positions` positions a chunk (3 or 5 fp32 copies each)

    def run(memory_bytes):
        if of == "logprobs":
            return logprobs_from_logits(logits, tokens, 0.7, memory_bytes=memory_bytes)
        return entropy_from_logits(logits, 0.7, memory_bytes=memory_bytes)

    out = run(budget)
    torch.testing.assert_close(out, run(2**30))
    with _WholeSizeTensors(B * R * V * 4, exclude=logits) as made:
        out.sum().backward()
    shapes = [shape for _, shape in made.storages.values()]
    assert len(shapes) <= 1, f"{len(shapes)} logits-sized tensors in the backward: {shapes}"


def test_entropy_uniform_is_log_vocab():
    for vocab in (2, 7, 100):
        logits = torch.full((3, 4, vocab), 1.7)
        torch.testing.assert_close(entropy_from_logits(logits), torch.full((3, 4), math.log(vocab)))


def test_entropy_hand_example_and_temperature():
    ln2, ln3 = math.log(2.0), math.log(3.0)
    logits = t64([[[0.0, 2 * ln2, 2 * ln3]]])
    # T = 2 -> logits [0, ln2, ln3] -> p = 1/6, 1/3, 1/2
    # H = 1/6 ln 6 + 1/3 ln 3 + 1/2 ln 2 = 0.298627 + 0.366204 + 0.346574 = 1.011404
    expected = math.log(6.0) / 6 + ln3 / 3 + ln2 / 2
    close(entropy_from_logits(logits, temperature=2.0), [[expected]], atol=1e-6)
    # T = 1 -> p = 1/14, 4/14, 9/14: H = sum p ln(1/p)
    p = [1 / 14, 4 / 14, 9 / 14]
    close(entropy_from_logits(logits), [[-sum(x * math.log(x) for x in p)]], atol=1e-6)
    # a higher temperature flattens the distribution: entropy rises toward ln 3
    h = [entropy_from_logits(logits, temperature=tmp).item() for tmp in (0.5, 1.0, 2.0, 100.0)]
    assert h == sorted(h) and h[-1] < math.log(3.0) and h[-1] > math.log(3.0) - 1e-3


# ---- KL estimators -----------------------------------------------------------------------------------------------
def test_kl_estimators_hand_values():
    logp = t64([math.log(0.5), math.log(0.25), math.log(0.3)])
    ref = t64([math.log(0.25), math.log(0.5), math.log(0.3)])
    ln2 = math.log(2.0)
    # log ratio = logp - ref = ln 2, -ln 2, 0
    close(kl_estimate(logp, ref, "k1"), [ln2, -ln2, 0.0])
    close(kl_estimate(logp, ref, "k2"), [0.5 * ln2**2, 0.5 * ln2**2, 0.0])  # 0.5 * 0.480453 = 0.240227
    # k3 = (r - 1) - ln r with r = p_ref / p: r = 0.5 -> -0.5 + ln2 = 0.193147; r = 2 -> 1 - ln2 = 0.306853; r = 1 -> 0
    close(kl_estimate(logp, ref, "k3"), [-0.5 + ln2, 1.0 - ln2, 0.0])
    close(kl_estimate(logp, ref), [ln2, -ln2, 0.0])  # default is k1


def test_k3_is_never_negative():
    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-12, 1.5, 200_000, dtype=F64)
    log_ratio = torch.randn(200_000, generator=gen, dtype=F64) * scale
    for dtype in (F64, torch.float32):
        k3 = kl_estimate(log_ratio.to(dtype), torch.zeros_like(log_ratio, dtype=dtype), "k3")
        assert torch.all(k3 >= 0)


def test_k1_and_k3_unbiased_k2_biased_monte_carlo():
    p = t64([0.5, 0.3, 0.2])
    q = t64([0.2, 0.3, 0.5])
    # KL(p||q) = 0.5 ln(0.5/0.2) + 0.3 ln 1 + 0.2 ln(0.2/0.5) = 0.5 * 0.916291 - 0.2 * 0.916291 = 0.274887
    true_kl = 0.3 * math.log(2.5)
    assert true_kl == pytest.approx((p * (p / q).log()).sum().item())
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, logq = p.log()[tokens], q.log()[tokens]
    assert kl_estimate(logp, logq, "k1").mean().item() == pytest.approx(true_kl, abs=0.01)
    assert kl_estimate(logp, logq, "k3").mean().item() == pytest.approx(true_kl, abs=0.01)
    # E[k2] = 0.5 * (0.5 + 0.2) * ln(2.5)^2 = 0.35 * 0.839589 = 0.293856: biased upward by ~0.019
    k2 = kl_estimate(logp, logq, "k2").mean().item()
    assert k2 == pytest.approx(0.35 * math.log(2.5) ** 2, abs=0.005)
    assert k2 - true_kl > 0.01


def test_unknown_kl_estimator_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


# ---- rewards --------------------------------------------------------------------------------------------------------
def test_compute_rewards_score_on_last_real_token():
    kl = t64([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[T, T, T, T], [T, T, F, F], [F, F, F, F]])
    scores = t64([10.0, 20.0, 5.0])
    rewards, non_score = compute_rewards(scores, kl, mask, kl_coef=0.1)
    # -0.1 * KL at real tokens, 0 at pads
    close(non_score, [[-0.1, -0.2, -0.3, -0.4], [-0.1, -0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    close(
        rewards,
        [
            [-0.1, -0.2, -0.3, 9.6],  # -0.4 + 10 on the 4th (last real) token
            [-0.1, 19.8, 0.0, 0.0],  # -0.2 + 20 on the 2nd token, not on the pad slots after it
            [0.0, 0.0, 0.0, 0.0],  # all-masked row: no KL penalty, no score
        ],
    )


def test_compute_rewards_ignores_kl_at_masked_positions():
    kl = t64([[0.5, float("nan"), float("inf")], [0.5, 1.0, 1.0]])
    mask = torch.tensor([[T, F, F], [T, T, F]])
    rewards, non_score = compute_rewards(t64([1.0, 2.0]), kl, mask, kl_coef=0.2)
    close(non_score, [[-0.1, 0.0, 0.0], [-0.1, -0.2, 0.0]])  # -0.2 * 0.5, -0.2 * 1.0
    close(rewards, [[0.9, 0.0, 0.0], [-0.1, 1.8, 0.0]])  # 1 - 0.1; 2 - 0.2


def test_compute_rewards_float32_kl_with_float64_scores():
    kl = torch.tensor([[1.0, 1.0]])
    rewards, _ = compute_rewards(t64([3.0]), kl, torch.tensor([[T, T]]), kl_coef=0.5)
    assert rewards.dtype == torch.float32
    torch.testing.assert_close(rewards, torch.tensor([[-0.5, 2.5]]))  # -0.5 * 1; -0.5 + 3


# ---- GAE --------------------------------------------------------------------------------------------------------------
def test_gae_gamma_one_hand_example():
    rewards = t64([[0.0, 0.0, 1.0]])
    values = t64([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # t=2: delta = 1 + 1*0 - 0.5 = 0.5          A2 = 0.5
    # t=1: delta = 0 + 1*0.5 - 0.5 = 0          A1 = 0 + 0.95 * 0.5 = 0.475
    # t=0: delta = 0                           A0 = 0.95 * 0.475 = 0.45125
    close(adv, [[0.45125, 0.475, 0.5]])
    close(ret, [[0.95125, 0.975, 1.0]])  # A + V
    close(ret, adv + values)


def test_gae_gamma_below_one_hand_example():
    rewards = t64([[1.0, 0.0, 2.0]])
    values = t64([[0.5, 1.0, 0.25]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # gamma * lam = 0.45
    # t=2: delta = 2 + 0.9*0 - 0.25 = 1.75                 A2 = 1.75
    # t=1: delta = 0 + 0.9*0.25 - 1.0 = -0.775             A1 = -0.775 + 0.45*1.75 = 0.0125
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4                 A0 = 1.4 + 0.45*0.0125 = 1.405625
    close(adv, [[1.405625, 0.0125, 1.75]])
    close(ret, [[1.905625, 1.0125, 2.0]])  # 1.405625 + 0.5, 0.0125 + 1.0, 1.75 + 0.25


def test_gae_ignores_masked_trailing_positions():
    rewards = t64([[0.0, 0.0, 1.0, 0.0, 0.0]])
    values = t64([[0.5, 0.5, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[T, T, T, F, F]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    close(adv, [[0.45125, 0.475, 0.5, 0.0, 0.0]])  # same as the 3-token hand example; pads -> 0
    close(ret, [[0.95125, 0.975, 1.0, 0.0, 0.0]])
    # junk after the episode (a value to bootstrap from, a reward, NaN) changes nothing
    for junk_r, junk_v in [(7.0, 3.0), (float("nan"), float("nan")), (-1e9, 1e9)]:
        r2, v2 = rewards.clone(), values.clone()
        r2[0, 3:], v2[0, 3:] = junk_r, junk_v
        adv2, ret2 = compute_gae(r2, v2, mask, gamma=1.0, lam=0.95)
        close(adv2, adv)
        close(ret2, ret)


def test_gae_bootstraps_across_an_environment_segment_hand_example():
    # Two policy turns (positions 0-1 and 4) around an environment's reply (2-3, masked: context, no time steps).
    rewards = t64([[0.0, 0.5, 7.0, 7.0, 1.0]])
    values = t64([[0.5, 0.25, 3.0, 3.0, 0.75]])
    mask = torch.tensor([[T, T, F, F, T]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # gamma * lam = 0.45
    # t=4: delta = 1 + 0.9*0 - 0.75 = 0.25                      A4 = 0.25
    # t=1: V_next = V4 (the next policy token), not V2:
    #      delta = 0.5 + 0.9*0.75 - 0.25 = 0.925                A1 = 0.925 + 0.45*0.25 = 1.0375
    # t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275                  A0 = -0.275 + 0.45*1.0375 = 0.191875
    close(adv, [[0.191875, 1.0375, 0.0, 0.0, 0.25]])
    close(ret, [[0.691875, 1.2875, 0.0, 0.0, 1.0]])


def test_gae_rows_of_different_lengths_equal_each_row_alone():
    torch.manual_seed(0)
    lengths = [6, 4, 1, 0, 3]
    rewards = torch.randn(len(lengths), 6, dtype=F64)
    values = torch.randn(len(lengths), 6, dtype=F64)
    mask = torch.arange(6).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.99, lam=0.9)
    for i, n in enumerate(lengths):
        if n == 0:  # an empty row: all zeros
            assert torch.all(adv[i] == 0) and torch.all(ret[i] == 0)
            continue
        row_mask = torch.ones(1, n, dtype=torch.bool)
        a, r = compute_gae(rewards[i : i + 1, :n], values[i : i + 1, :n], row_mask, gamma=0.99, lam=0.9)
        close(adv[i, :n], a[0])
        close(ret[i, :n], r[0])
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


# ---- policy loss -------------------------------------------------------------------------------------------------------
def test_policy_loss_hand_example():
    # ratios and advantages, cliprange 0.2 (clip range [0.8, 1.2]):
    #   r=1.1, A=+1: unclipped -1.1, clipped -1.1 -> -1.1   (inside the range)
    #   r=1.5, A=+1: unclipped -1.5, clipped -1.2 -> -1.2   (clipped term wins: counted in clipfrac)
    #   r=0.5, A=-1: unclipped  0.5, clipped  0.8 ->  0.8   (clipped term wins: counted)
    #   r=0.5, A=+1: unclipped -0.5, clipped -0.8 -> -0.5   (outside, but the pessimistic unclipped term wins)
    #   r=1.5, A=-2: unclipped  3.0, clipped  2.4 ->  3.0   (outside, unclipped wins)
    #   6th token masked (junk)
    ratios = [1.1, 1.5, 0.5, 0.5, 1.5, 1.0]
    logprobs = t64([[math.log(r) for r in ratios]])
    old_logprobs = torch.zeros_like(logprobs)
    logprobs[0, 5] = 50.0  # a huge ratio at the masked slot must not matter
    advantages = t64([[1.0, 1.0, -1.0, 1.0, -2.0, 1e6]])
    mask = torch.tensor([[T, T, T, T, T, F]])
    loss, clipfrac, approxkl = policy_loss(logprobs, old_logprobs, advantages, mask, cliprange=0.2)
    close(loss, (-1.1 - 1.2 + 0.8 - 0.5 + 3.0) / 5)  # 1.0 / 5 = 0.2
    close(clipfrac, 2.0 / 5.0)  # tokens 2 and 3
    # approx KL = 0.5 * mean(ln r ^ 2):
    #   ln1.1^2 = 0.00908403, ln1.5^2 = 0.16440195 (x2), ln0.5^2 = 0.48045301 (x2) -> sum 1.29879395
    #   0.5 * 1.29879395 / 5 = 0.12987940
    expected_kl = 0.5 * (math.log(1.1) ** 2 + 2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 5
    close(approxkl, expected_kl)
    assert abs(expected_kl - 0.1298794) < 1e-6
    assert not clipfrac.requires_grad and not approxkl.requires_grad


def test_policy_loss_nan_at_masked_positions_does_not_leak():
    logprobs = t64([[math.log(1.5), float("nan")]])
    advantages = t64([[1.0, float("nan")]])
    mask = torch.tensor([[T, F]])
    loss, clipfrac, approxkl = policy_loss(logprobs, torch.zeros_like(logprobs), advantages, mask, 0.2)
    close(loss, -1.2)  # r = 1.5 clipped to 1.2, A = 1
    close(clipfrac, 1.0)
    close(approxkl, 0.5 * math.log(1.5) ** 2)


def test_policy_loss_gradient_is_zero_where_clipped():
    # d loss / d logp = -A * r / n where the unclipped term is active, 0 where the clipped (constant) term wins
    logprobs = t64([[math.log(1.1), math.log(1.5)]]).requires_grad_(True)
    loss, _, _ = policy_loss(logprobs, torch.zeros(1, 2, dtype=F64), t64([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    close(logprobs.grad, [[-1.1 / 2, 0.0]])  # -A * r / n = -1 * 1.1 / 2; clipped token: 0


def test_sequence_level_ratio_is_gspo():
    # Row 0: log-ratios [0.1, 0.3] -> s = e^0.2 = 1.2214 on both tokens, A = +1, clip 0.2: -1.2 each (clipped).
    # Row 1: log-ratio [-0.1] (2nd slot masked, junk) -> s = e^-0.1 = 0.9048, A = +1: -0.9048 (inside the range).
    # Token mean over the 3 real tokens; per token the ratios would be e^0.1, e^0.3 (clipped 1.2), e^-0.1.
    logprobs = t64([[0.1, 0.3], [-0.1, 50.0]]).requires_grad_(True)
    old, advantages = torch.zeros(2, 2, dtype=F64), t64([[1.0, 1.0], [1.0, 1e6]])
    mask = torch.tensor([[T, T], [T, F]])
    loss, clipfrac, _ = policy_loss(logprobs, old, advantages, mask, 0.2, importance_sampling_level="sequence")
    close(loss, (-1.2 - 1.2 - math.exp(-0.1)) / 3)
    close(clipfrac, 2 / 3)
    token, _, _ = policy_loss(logprobs, old, advantages, mask, 0.2)
    close(token, (-math.exp(0.1) - 1.2 - math.exp(-0.1)) / 3)
    # Gradient: row 0 clipped (0); row 1's ratio is its own token's: -A * s / 3.
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0], [-math.exp(-0.1) / 3, 0.0]])
    # Unclipped, a response's ratio spreads evenly over its tokens: each of its n tokens carries s and d s / d logp_t
    # = s / n, so every token gets -A s / N (N = 3 real tokens), whatever its own log-ratio.
    logprobs.grad = None
    wide, _, _ = policy_loss(logprobs, old, advantages, mask, 5.0, importance_sampling_level="sequence")
    wide.backward()
    close(logprobs.grad, [[-math.exp(0.2) / 3] * 2, [-math.exp(-0.1) / 3, 0.0]])
    with pytest.raises(ValueError, match="importance_sampling_level 'group'"):
        policy_loss(logprobs, old, advantages, mask, 0.2, importance_sampling_level="group")


def test_bias_corrected_kl_loss_has_the_unbiased_reverse_kl_gradient():
    # log p - log p_ref = log 2 (p_ref / p = 1/2), ratio pi / pi_old = 1.5.
    # k3 = 1/2 - 1 + log 2 = log 2 - 1/2; d k3 / d logp = 1 - p_ref / p = 1/2 (the forward KL's gradient estimator).
    # Corrected: r * k3 = 1.5 (log 2 - 1/2); its gradient r k3 + r (1 - p_ref/p) = r (log p - log p_ref) = 1.5 log 2,
    # the importance-weighted score-function gradient of KL(pi || pi_ref).
    logprobs = t64([[-1.0]]).requires_grad_(True)
    ref, old = logprobs.detach() - math.log(2.0), logprobs.detach() - math.log(1.5)
    plain = kl_loss_per_token(logprobs, ref)
    close(plain, [[math.log(2.0) - 0.5]])
    plain.sum().backward()
    close(logprobs.grad, [[0.5]])
    logprobs.grad = None
    corrected = kl_loss_per_token(logprobs, ref, old)
    close(corrected, [[1.5 * (math.log(2.0) - 0.5)]])
    corrected.sum().backward()
    close(logprobs.grad, [[1.5 * math.log(2.0)]])


def _random_ppo_batch(seed=0, rows=4, length=7):
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(rows, length, generator=gen, dtype=F64) * 0.3 - 2.0
    old_logprobs = logprobs + torch.randn(rows, length, generator=gen, dtype=F64) * 0.3
    advantages = torch.randn(rows, length, generator=gen, dtype=F64)
    lengths = torch.tensor([7, 2, 5, 3])
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return logprobs, old_logprobs, advantages, mask


def test_policy_loss_normalizer_gradient_accumulation_invariance():
    logprobs, old, adv, mask = _random_ppo_batch()
    total = mask.sum()  # 7 + 2 + 5 + 3 = 17 tokens
    assert total.item() == 17

    full_lp = logprobs.clone().requires_grad_(True)
    full_loss, _, _ = policy_loss(full_lp, old, adv, mask, cliprange=0.2)
    full_loss.backward()

    # two micro-batches of very different token counts (9 and 8), each normalised by the whole minibatch's 17
    micro_lp = logprobs.clone().requires_grad_(True)
    loss_sum = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        loss, _, _ = policy_loss(micro_lp[rows], old[rows], adv[rows], mask[rows], cliprange=0.2, normalizer=total)
        loss.backward()
        loss_sum = loss_sum + loss.detach()
    close(loss_sum, full_loss.detach())
    close(micro_lp.grad, full_lp.grad)
    # a per-micro-batch mean (no normalizer) would NOT give the same loss here: the counts differ (9 vs 8)
    naive = sum(policy_loss(logprobs[r], old[r], adv[r], mask[r], 0.2)[0] for r in (slice(0, 2), slice(2, 4))) / 2
    assert abs(naive.item() - full_loss.item()) > 1e-6
    # a float normalizer works the same as a tensor one
    float_loss, _, _ = policy_loss(logprobs, old, adv, mask, 0.2, normalizer=17.0)
    close(float_loss, full_loss.detach())


# ---- value loss ------------------------------------------------------------------------------------------------------
def test_value_loss_hand_example():
    # cliprange_value 0.2: V_clipped = V_old + clip(V - V_old, -0.2, 0.2)
    #   V=1.0 V_old=0.9 R=1.5: diff 0.1 inside -> Vc=1.0; (1-1.5)^2 = 0.25 both          -> 0.25
    #   V=2.0 V_old=1.0 R=1.5: Vc=1.2; (2-1.5)^2 = 0.25, (1.2-1.5)^2 = 0.09               -> 0.25
    #   V=2.0 V_old=1.0 R=3.0: Vc=1.2; (2-3)^2 = 1.0,  (1.2-3)^2 = 3.24  (clipped wins)   -> 3.24
    #   V=0.0 V_old=1.0 R=2.0: Vc=0.8; (0-2)^2 = 4.0,  (0.8-2)^2 = 1.44                   -> 4.0
    #   5th token masked (junk)
    values = t64([[1.0, 2.0, 2.0, 0.0, 1e6]])
    old_values = t64([[0.9, 1.0, 1.0, 1.0, float("nan")]])
    returns = t64([[1.5, 1.5, 3.0, 2.0, -1e6]])
    mask = torch.tensor([[T, T, T, T, F]])
    loss, clipfrac = value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    close(loss, 0.5 * (0.25 + 0.25 + 3.24 + 4.0) / 4)  # 0.5 * 7.74 / 4 = 0.9675
    close(clipfrac, 1.0 / 4.0)  # only the 3rd token
    # with a normalizer: 0.5 * 7.74 / 8 = 0.48375
    loss_n, _ = value_loss(values, old_values, returns, mask, cliprange_value=0.2, normalizer=8)
    close(loss_n, 0.48375)
    assert not clipfrac.requires_grad


def test_value_loss_gradient_only_through_active_branch():
    values = t64([[1.0, 2.0]]).requires_grad_(True)
    old_values, returns = t64([[0.9, 1.0]]), t64([[1.5, 3.0]])
    loss, _ = value_loss(values, old_values, returns, torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    # token 1 unclipped: d/dV 0.5 * (V - R)^2 / 2 = (1.0 - 1.5) / 2 = -0.25; token 2 clipped (constant in V): 0
    close(values.grad, [[-0.25, 0.0]])


# ---- explained variance ------------------------------------------------------------------------------------------------
def test_explained_variance():
    torch.manual_seed(0)
    returns = torch.randn(3, 8, dtype=F64)
    mask = torch.rand(3, 8) > 0.3
    close(explained_variance(returns, returns, mask), 1.0)  # perfect critic
    close(explained_variance(torch.full_like(returns, 0.7), returns, mask), 0.0, atol=1e-9)  # constant critic
    # hand: R = 1, 2, 3, 4; V = 1, 2, 3, 3 -> R - V = 0, 0, 0, 1
    # Var(R - V) = mean 0.25; (0.0625 * 3 + 0.5625) / 4 = 0.1875; Var(R) = 1.25; EV = 1 - 0.1875 / 1.25 = 0.85
    r = t64([[1.0, 2.0, 3.0, 4.0, 99.0]])
    v = t64([[1.0, 2.0, 3.0, 3.0, -99.0]])
    close(explained_variance(v, r, torch.tensor([[T, T, T, T, F]])), 0.85)


# ---- KL controllers ----------------------------------------------------------------------------------------------
def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 6.0, 100.0):
        ctl.update(kl, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_controller_hand_updates():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=100)  # error 9/6 - 1 = 0.5 -> clipped to 0.2; 0.2 * (1 + 0.2 * 100/10000) = 0.2004
    assert ctl.value == pytest.approx(0.2004, abs=1e-12)

    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(6.6, n_steps=100)  # error 6.6/6 - 1 = 0.1 (inside); 0.2 * (1 + 0.1 * 0.01) = 0.2002
    assert ctl.value == pytest.approx(0.2002, abs=1e-12)

    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(3.0, n_steps=100)  # error 3/6 - 1 = -0.5 -> clipped to -0.2; 0.2 * (1 - 0.002) = 0.1996
    assert ctl.value == pytest.approx(0.1996, abs=1e-12)
    assert ctl.value < 0.2  # below target -> the coefficient decreases

    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(6.0, n_steps=100)  # on target: unchanged
    assert ctl.value == pytest.approx(0.2, abs=1e-15)


def test_adaptive_kl_controller_state_dict_round_trip():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=100)
    ctl.update(9.0, n_steps=100)  # 0.2 * 1.002^2 = 0.2008008
    assert ctl.value == pytest.approx(0.2008008, abs=1e-12)
    restored = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    ctl.update(1.0, 50)
    restored.update(1.0, 50)
    assert restored.value == ctl.value


# ---- running moments ----------------------------------------------------------------------------------------------
def test_running_moments_equal_statistics_of_all_values():
    rm = RunningMoments()
    for chunk in ([1.0, 2.0, 3.0], [4.0, 5.0], [6.0], []):
        rm.update(torch.tensor(chunk))
    # 1..6: mean 3.5; population variance = sum((x - 3.5)^2) / 6 = (6.25 + 2.25 + 0.25) * 2 / 6 = 17.5 / 6 = 2.916667
    assert rm.count == 6
    assert rm.mean == pytest.approx(3.5, abs=1e-12)
    assert rm.var == pytest.approx(17.5 / 6, abs=1e-12)
    assert rm.std == pytest.approx(math.sqrt(17.5 / 6), abs=1e-12)  # 1.707825

    # against torch on random batches of random sizes
    gen = torch.Generator().manual_seed(0)
    rm, seen = RunningMoments(), []
    for n in (1, 5, 17, 3, 64):
        xs = torch.randn(n, generator=gen, dtype=F64) * 3 + 2
        rm.update(xs)
        seen.append(xs)
    everything = torch.cat(seen)
    assert rm.mean == pytest.approx(everything.mean().item(), abs=1e-10)
    assert rm.std == pytest.approx(everything.std(unbiased=False).item(), abs=1e-10)


def test_running_moments_normalize_with_clip_and_state_dict():
    rm = RunningMoments()
    rm.update(torch.tensor([1.0, 3.0]))  # mean 2, population var 1, std 1
    torch.testing.assert_close(rm.normalize(torch.tensor([2.0, 4.0, -10.0])), torch.tensor([0.0, 2.0, -12.0]))
    # (x - 2) / 1 then clipped to [-1.5, 1.5]
    torch.testing.assert_close(rm.normalize(torch.tensor([2.0, 4.0, -10.0]), clip=1.5), torch.tensor([0.0, 1.5, -1.5]))

    restored = RunningMoments()
    restored.load_state_dict(rm.state_dict())
    assert (restored.mean, restored.var, restored.count) == (rm.mean, rm.var, rm.count)
    rm.update(torch.tensor([5.0]))
    restored.update(torch.tensor([5.0]))
    # 1, 3, 5: mean 3, population var (4 + 0 + 4) / 3 = 8/3
    assert restored.mean == pytest.approx(3.0) and restored.var == pytest.approx(8.0 / 3.0)
    assert (restored.mean, restored.var, restored.count) == (rm.mean, rm.var, rm.count)


# ---- critic-free advantage estimators (k consecutive rows per prompt) --------------------------------------------------
def test_rloo_advantages_hand_example_flat_and_grouped():
    # k = 3. Group 1: R = [1, 2, 6]; baselines = mean of the other two: [4, 3.5, 1.5] -> [-3, -1.5, 4.5]
    #         Group 2: R = [4, 4, 4] -> every baseline 4 -> [0, 0, 0]
    flat = t64([1.0, 2.0, 6.0, 4.0, 4.0, 4.0])
    close(rloo_advantages(flat, 3), [-3.0, -1.5, 4.5, 0.0, 0.0, 0.0])
    close(rloo_advantages(flat.reshape(2, 3), 3), [[-3.0, -1.5, 4.5], [0.0, 0.0, 0.0]])
    # k = 2: each baseline is the other response's score: [0, 1] -> [-1, 1]
    close(rloo_advantages(t64([0.0, 1.0]), 2), [-1.0, 1.0])
    # the groups are consecutive rows, not interleaved: [1, 4, 2, 4, 6, 4] is a different grouping
    assert not torch.allclose(rloo_advantages(t64([1.0, 4.0, 2.0, 4.0, 6.0, 4.0]), 3), rloo_advantages(flat, 3))


def test_grpo_advantages_hand_example_with_and_without_std():
    # R = [1, 2, 6]: mean 3, centred [-2, -1, 3]; sample variance (4 + 1 + 9) / 2 = 7, std sqrt(7) = 2.6457513
    scores = t64([1.0, 2.0, 6.0, 4.0, 4.0, 4.0])
    std = math.sqrt(7.0)
    close(grpo_advantages(scores, 3, scale_rewards=True, eps=0.0)[:3], [-2 / std, -1 / std, 3 / std])
    close(grpo_advantages(scores, 3, scale_rewards=True, eps=1e-4)[:3], [-2 / (std + 1e-4), -1 / (std + 1e-4),
                                                                          3 / (std + 1e-4)])
    # Dr. GRPO: no std division -> [-2, -1, 3]; a group of equal scores gives 0 either way (0 / eps)
    close(grpo_advantages(scores, 3, scale_rewards=False), [-2.0, -1.0, 3.0, 0.0, 0.0, 0.0])
    close(grpo_advantages(scores, 3)[3:], [0.0, 0.0, 0.0])
    # k = 2, R = [0, 1]: centred [-0.5, 0.5], sample std sqrt(0.5) = 0.70710678 -> [-0.70710678, 0.70710678]
    close(grpo_advantages(t64([[0.0, 1.0]]), 2, eps=0.0), [[-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]])


@pytest.mark.parametrize("estimator", [rloo_advantages, grpo_advantages])
def test_group_estimators_reject_bad_group_layouts(estimator):
    with pytest.raises(ValueError, match="k >= 2"):
        estimator(t64([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="groups of k=3"):
        estimator(t64([1.0, 2.0, 3.0, 4.0]), 3)
    with pytest.raises(ValueError, match="not grouped by k=3"):
        estimator(t64([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), 3)


def test_reinforce_pp_advantages_hand_example():
    # kl_coef 0.5; row 0 has 3 real tokens, row 1 has 2 (its 3rd KL is junk behind the mask)
    scores = t64([1.0, 3.0])
    kl = t64([[0.2, 0.4, 0.6], [0.5, 1.0, 1e6]])
    mask = torch.tensor([[T, T, T], [T, T, F]])
    # rewards: row 0 [-0.1, -0.2, -0.3 + 1] = [-0.1, -0.2, 0.7]; row 1 [-0.25, -0.5 + 3, 0] = [-0.25, 2.5, 0]
    # returns to go (gamma 1): row 0 [0.4, 0.5, 0.7]; row 1 [2.25, 2.5, 0]
    advantages, returns = reinforce_pp_advantages(scores, kl, mask, kl_coef=0.5)
    close(returns, [[0.4, 0.5, 0.7], [2.25, 2.5, 0.0]])
    # whitened over the 5 real tokens of the whole batch: mean 6.35 / 5 = 1.27, sample variance 4.148 / 4 = 1.037
    real = [0.4, 0.5, 0.7, 2.25, 2.5]
    assert abs(statistics.mean(real) - 1.27) < 1e-12 and abs(statistics.variance(real) - 1.037) < 1e-12
    z = [(x - 1.27) / math.sqrt(1.037 + 1e-8) for x in real]
    close(advantages, [z[:3], z[3:] + [0.0]])

    # REINFORCE++-baseline, k = 2 (both rows one group): mean score 2, centred scores [-1, 1]
    # rewards: row 0 [-0.1, -0.2, -1.3]; row 1 [-0.25, 0.5, 0] -> returns row 0 [-1.6, -1.5, -1.3]; row 1 [0.25, 0.5]
    advantages, returns = reinforce_pp_advantages(scores, kl, mask, kl_coef=0.5, k=2)
    close(returns, [[-1.6, -1.5, -1.3], [0.25, 0.5, 0.0]])
    real = [-1.6, -1.5, -1.3, 0.25, 0.5]
    mean, var = statistics.mean(real), statistics.variance(real)
    assert abs(mean + 0.73) < 1e-12  # -3.65 / 5
    z = [(x - mean) / math.sqrt(var + 1e-8) for x in real]
    close(advantages, [z[:3], z[3:] + [0.0]])


def test_sequence_to_token_advantages():
    mask = torch.tensor([[T, T, F], [T, F, F]])
    close(sequence_to_token_advantages(t64([2.0, -1.0]), mask), [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# ---- loss variants -----------------------------------------------------------------------------------------------------
def test_loss_aggregations_hand_example():
    # per-token losses: row 0 [-1, -2, -3] (3 tokens), row 1 [-4] (1 token), row 2 empty (junk everywhere)
    per_token = t64([[-1.0, -2.0, -3.0, 9.0], [-4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[T, T, T, F], [T, F, F, F], [F, F, F, F]])
    assert loss_normalizer(mask, "token_mean").item() == 4
    assert loss_normalizer(mask, "seq_mean_token_mean").item() == 2  # the empty row is not a sequence
    assert loss_normalizer(mask, "dr_grpo").item() == 2
    close(aggregate_loss(per_token, mask, "token_mean"), -10.0 / 4)  # -2.5
    close(aggregate_loss(per_token, mask, "seq_mean_token_mean"), (-6.0 / 3 + -4.0 / 1) / 2)  # (-2 - 4) / 2 = -3
    # Dr. GRPO: token sums over a constant: max_length defaults to the width 4 -> (-6/4 - 4/4) / 2 = -1.25
    close(aggregate_loss(per_token, mask, "dr_grpo"), -1.25)
    close(aggregate_loss(per_token, mask, "dr_grpo", max_length=10), (-0.6 - 0.4) / 2)  # -0.5
    # a normalizer replaces the count: seq_mean_token_mean with normalizer 4 -> (-2 - 4) / 4 = -1.5
    close(aggregate_loss(per_token, mask, "seq_mean_token_mean", normalizer=4), -1.5)
    with pytest.raises(ValueError, match="Unknown loss_aggregation 'seq_sum'"):
        aggregate_loss(per_token, mask, "seq_sum")
    # policy_loss with ratio 1 has per-token loss -A: the same numbers through the public entry point
    advantages = -per_token
    zeros = torch.zeros_like(per_token)
    close(policy_loss(zeros, zeros, advantages, mask, 0.2, loss_aggregation="seq_mean_token_mean")[0], -3.0)
    close(policy_loss(zeros, zeros, advantages, mask, 0.2, loss_aggregation="dr_grpo",
                      max_length=10)[0], -0.5)


def test_policy_loss_clip_higher_hand_example():
    #   r=1.25, A=+1: [0.8, 1.2] clips to 1.2 -> -1.2;   [0.7, 1.28] keeps 1.25 -> -1.25
    #   r=0.75, A=-1: [0.8, 1.2] clips to 0.8 ->  0.8;   [0.7, 1.28] keeps 0.75 ->  0.75
    #   r=1.5,  A=+1: -1.2 (clipped);                     clips to 1.28 -> -1.28 (clipped)
    logprobs = t64([[math.log(1.25), math.log(0.75), math.log(1.5)]])
    old, advantages = torch.zeros_like(logprobs), t64([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, clipfrac, _ = policy_loss(logprobs, old, advantages, mask, 0.2)
    close(loss, (-1.2 + 0.8 - 1.2) / 3)
    close(clipfrac, 1.0)
    loss, clipfrac, _ = policy_loss(logprobs, old, advantages, mask, 0.2, cliprange_low=0.3, cliprange_high=0.28)
    close(loss, (-1.25 + 0.75 - 1.28) / 3)
    close(clipfrac, 1.0 / 3.0)
    # only the upper bound moves with cliprange_high alone: token 2 is still clipped at 0.8
    loss, _, _ = policy_loss(logprobs, old, advantages, mask, 0.2, cliprange_high=0.28)
    close(loss, (-1.25 + 0.8 - 1.28) / 3)


def test_policy_loss_defaults_unchanged_by_explicit_variant_defaults():
    logprobs, old, adv, mask = _random_ppo_batch(seed=3)
    default = policy_loss(logprobs, old, adv, mask, 0.2, normalizer=17)
    explicit = policy_loss(logprobs, old, adv, mask, 0.2, normalizer=17, cliprange_low=0.2, cliprange_high=0.2,
                           dual_clip=None, loss_aggregation="token_mean")
    assert all(torch.equal(a, b) for a, b in zip(default, explicit))


def test_policy_loss_dual_clip_hand_example():
    # c = 3, cliprange 0.2:
    #   r=5,   A=-1: max(5, 1.2) = 5, bounded by -c*A = 3       -> 3   (dual clip active: no gradient)
    #   r=2,   A=-1: max(2, 1.2) = 2 < 3                         -> 2
    #   r=5,   A=+1: max(-5, -1.2) = -1.2; A > 0 is never bounded -> -1.2
    #   r=0.5, A=-2: max(1.0, 1.6) = 1.6 < 6                     -> 1.6
    logprobs = t64([[math.log(5.0), math.log(2.0), math.log(5.0), math.log(0.5)]]).requires_grad_(True)
    old, advantages = torch.zeros(1, 4, dtype=F64), t64([[-1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    plain, _, _ = policy_loss(logprobs, old, advantages, mask, 0.2)
    close(plain, (5.0 + 2.0 - 1.2 + 1.6) / 4)  # 1.85
    loss, _, _ = policy_loss(logprobs, old, advantages, mask, 0.2, dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2 + 1.6) / 4)  # 1.35
    loss.backward()
    # d/dlogp of -A*r is -A*r / n: token 2: 1 * 2 / 4 = 0.5; the dual-clipped and the clipped tokens: 0
    close(logprobs.grad, [[0.0, 0.5, 0.0, 0.0]])


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_loss_aggregation_gradient_accumulation_invariance(aggregation):
    # 8 sequences of very different lengths (one empty), as one micro-batch of 8 and as two micro-batches of 4
    gen = torch.Generator().manual_seed(1)
    rows, length = 8, 6
    logprobs = torch.randn(rows, length, generator=gen, dtype=F64) * 0.3 - 2.0
    old = logprobs + torch.randn(rows, length, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(rows, length, generator=gen, dtype=F64)
    values, old_values, returns = (torch.randn(rows, length, generator=gen, dtype=F64) for _ in range(3))
    lengths = torch.tensor([6, 1, 4, 0, 2, 6, 3, 5])
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    variants = dict(cliprange_high=0.28, dual_clip=3.0, loss_aggregation=aggregation, max_length=8)

    def loss_of(lp, v, rows, normalizer):
        pg, _, _ = policy_loss(lp[rows], old[rows], adv[rows], mask[rows], 0.2, normalizer, **variants)
        vf, _ = value_loss(v[rows], old_values[rows], returns[rows], mask[rows], 0.2, normalizer,
                           loss_aggregation=aggregation, max_length=8)
        return pg + 0.1 * vf

    full_lp, full_v = logprobs.clone().requires_grad_(True), values.clone().requires_grad_(True)
    full = loss_of(full_lp, full_v, slice(0, 8), None)  # no normalizer: this batch's own
    full.backward()
    normalizer = loss_normalizer(mask, aggregation)
    # 6 + 1 + 4 + 0 + 2 + 6 + 3 + 5 = 27 tokens; 7 sequences (row 3 is empty)
    assert normalizer.item() == (27 if aggregation == "token_mean" else 7)
    micro_lp, micro_v = logprobs.clone().requires_grad_(True), values.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        loss = loss_of(micro_lp, micro_v, rows, normalizer)
        loss.backward()
        total = total + loss.detach()
    close(total, full.detach())
    close(micro_lp.grad, full_lp.grad)
    close(micro_v.grad, full_v.grad)
    # each micro-batch's own normalizer would not add up: 3 vs 4 sequences, 11 vs 16 tokens
    naive = sum(loss_of(logprobs, values, r, None) for r in (slice(0, 4), slice(4, 8))) / 2
    assert abs(naive.item() - full.item()) > 1e-6


def test_truncated_importance_weights_hand_example():
    from hf_ppo.algorithms.policy_losses import truncated_importance_weights

    # pi_old / pi_sampler per token: 1 (the same distribution), 0.5, 1.5, and 4 (above the cap of 2: truncated to 2)
    old = t64([[math.log(0.2), math.log(0.1), math.log(0.3), math.log(0.4)]])
    sampler = t64([[math.log(0.2), math.log(0.2), math.log(0.2), math.log(0.1)]])
    close(truncated_importance_weights(old, sampler, cap=2.0), t64([[1.0, 0.5, 1.5, 2.0]]))


def test_policy_loss_token_weights_scale_each_tokens_loss():
    # the hand example's first three tokens (losses -1.1, -1.2, 0.8), weighted 1, 0.5 and 2: (-1.1 - 0.6 + 1.6) / 3
    logprobs = t64([[math.log(1.1), math.log(1.5), math.log(0.5)]])
    advantages = t64([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[T, T, T]])
    weights = t64([[1.0, 0.5, 2.0]])
    loss, _, _ = policy_loss(logprobs, torch.zeros_like(logprobs), advantages, mask, cliprange=0.2,
                             token_weights=weights)
    close(loss, (-1.1 - 0.6 + 1.6) / 3)


def test_ppo_loss_with_the_sampler_equal_to_the_policy_is_unchanged_by_the_correction():
    torch.manual_seed(0)
    B, R, V = 2, 3, 7
    logits, tokens = torch.randn(B, R, V), torch.randint(0, V, (B, R))
    mask = torch.tensor([[T, T, F], [T, T, T]])
    old_logprobs = torch.randn(B, R) - 2
    old = Experience(tokens, old_logprobs, torch.zeros(B, R), torch.randn(B, R), torch.randn(B, R), mask,
                     sampling_logprobs=old_logprobs.clone())
    settings = LossSettings(1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0)
    normalizer = loss_normalizer(mask, "token_mean")
    plain, _ = ppo_loss(logits, None, old, normalizer, settings)
    corrected, stats = ppo_loss(logits, None, old, normalizer,
                                LossSettings(1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0,
                                             importance_sampling_cap=2.0))
    close(corrected, plain)  # vLLM sampled exactly the policy's distribution: every weight is 1
    close(stats["policy/importance_weight_avg"], torch.tensor(1.0))
    capped_at_2 = LossSettings(1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.0, importance_sampling_cap=2.0)
    likelier = old._replace(sampling_logprobs=old_logprobs + math.log(2.0))  # the sampler drew each token 2x likelier
    close(ppo_loss(logits, None, likelier, normalizer, capped_at_2)[0], plain / 2)  # every weight min(1/2, 2)
    rarer = old._replace(sampling_logprobs=old_logprobs - math.log(3.0))  # the sampler drew each token 3x rarer
    close(ppo_loss(logits, None, rarer, normalizer, capped_at_2)[0], plain * 2)  # every weight min(3, 2) = 2
