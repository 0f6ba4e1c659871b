"""Issue 62, "groups of unequal size and groups of one": rloo and grpo group the rollout's rows by prompt index
(verl's uid), so a row that leaves the update (a NaN/inf score: a reward's, or an environment's episode that could
not finish) leaves its group alone and the others keep training as a smaller group; dynamic sampling's refill fills
only the groups left with no row. The oracles are written here from the definitions, one group at a time."""

import math

import pytest
import torch

from hf_ppo.algorithms.estimators import EstimatorSettings
from hf_ppo.rollout.engines import SamplingSettings
from hf_ppo.rollout.refill import merge_groups, whole_groups
from hf_ppo.rollout.steps import (RolloutParts, RolloutSettings, compute_advantages, group_index, rollout,
                                  uniform_scored_groups, unscored_rows)
from tests.algorithms.test_estimators import rollout_batch
from tests.rollout.test_steps import PROMPTS, R, length_and_e, lora_policy, one_inf, prompt_batch, script  # noqa: F401
from tests.scripted_engine import ScriptedEngine

EPS = 1e-4


def grpo_oracle(scores: list[float], index: list[int], scale: str) -> list[float]:
    """GRPO by group, one group at a time: a group of one passes its score through (verl)."""
    out = []
    for i, r in enumerate(scores):
        group = [s for s, g in zip(scores, index) if g == index[i]]
        if len(group) == 1:
            out.append(r / (1 + EPS) if scale == "group" else r)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        out.append((r - mean) / (std + EPS) if scale == "group" else r - mean)
    return out


def rloo_oracle(scores: list[float], index: list[int]) -> list[float]:
    """RLOO by group: each score minus the mean of the others of its group; a group of one passes it through."""
    out = []
    for i, r in enumerate(scores):
        others = [s for j, (s, g) in enumerate(zip(scores, index)) if g == index[i] and j != i]
        out.append(r - sum(others) / len(others) if others else r)
    return out


def hand_built(B=6, T=3):
    torch.manual_seed(1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2:] = False
    logp, ref = -torch.rand(B, T), -torch.rand(B, T)
    return logp, ref, mask


@pytest.mark.parametrize("scale", ["group", "none"])
def test_grpo_advantages_through_the_rollout_step_follow_unequal_groups_by_index(scale):
    logp, ref, mask = hand_built()
    scores = [1.0, 2.0, 6.0, 4.0, -1.0, 1.0]
    index = [7, 7, 5, 7, 9, 9]  # group 7: rows 0, 1, 3; group 5: row 2 alone; group 9: rows 4, 5
    settings = EstimatorSettings(kl_coef=0.1, num_generations=2, advantage_estimator="grpo", scale_rewards=scale)
    _, out = compute_advantages(logp, ref, None, mask, torch.tensor(scores), settings, index=torch.tensor(index))
    expected = torch.tensor(grpo_oracle(scores, index, scale)).unsqueeze(1).expand_as(mask) * mask
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


def test_rloo_advantages_through_the_rollout_step_follow_unequal_groups_by_index():
    logp, ref, mask = hand_built()
    scores, index = [1.0, 2.0, 6.0, 4.0, -1.0, 1.0], [0, 0, 0, 1, 2, 2]
    settings = EstimatorSettings(kl_coef=0.1, num_generations=2, advantage_estimator="rloo", whiten_advantages=False)
    _, out = compute_advantages(logp, ref, None, mask, torch.tensor(scores), settings, index=torch.tensor(index))
    kl = (logp - ref) * mask  # k1, summed into each response's return (RLOO's KL in the reward)
    returns = [s - 0.1 * float(k) for s, k in zip(scores, kl.sum(1))]
    expected = torch.tensor(rloo_oracle(returns, index)).unsqueeze(1).expand_as(mask) * mask
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


def test_group_index_and_the_uniform_test_over_the_scored_rows():
    assert group_index(4, 2).tolist() == [0, 0, 1, 1]
    assert group_index(4, 2, torch.tensor([False, True, False, False])).tolist() == [0, 5, 1, 1]
    unscored = torch.tensor([False, True, False, False, False, False])
    assert uniform_scored_groups(torch.tensor([1.0, 0.0, 1.0, 2.0, 0.0, 2.0]), unscored, 3).tolist() == \
        [True] * 3 + [False] * 3
    assert uniform_scored_groups(torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([True, True, False, True]),
                                 2).tolist() == [True] * 4  # no row left, and one row left: no spread
    grpo = EstimatorSettings(kl_coef=0.0, num_generations=2, advantage_estimator="grpo")
    assert unscored_rows(torch.tensor([1.0, float("nan"), 2.0, 3.0]), grpo).tolist() == [False, True, False, False]


def test_a_refill_fills_only_groups_with_no_row_left():
    # Group 0 lost only its row 0 (a NaN score): its row 1 trains, so it is no hole; group 2 is wholly dropped.
    main = rollout_batch(torch.arange(1, 13).reshape(6, 2), torch.ones(6, 2, dtype=torch.bool),
                         torch.arange(20, 38).reshape(6, 3), torch.ones(6, 3, dtype=torch.bool), torch.arange(6.0))
    extra = rollout_batch(torch.arange(101, 113).reshape(6, 2), torch.ones(6, 2, dtype=torch.bool),
                          torch.arange(200, 218).reshape(6, 3), torch.ones(6, 3, dtype=torch.bool),
                          torch.arange(10.0, 16.0))
    dropped = torch.tensor([True, False, False, False, True, True])
    extra_dropped = torch.tensor([False, True, True, True, False, False])  # group 0 keeps a row: a donor
    assert whole_groups(dropped, 2).tolist() == [False, False, True]
    merged, left, count = merge_groups(main, dropped, extra, extra_dropped, k=2, pad_token_id=0)
    assert count == 1 and merged.scores.tolist() == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0]
    assert left.tolist() == [True, False, False, False, False, True]  # the donor's own dropped row stays dropped


def test_a_row_scored_inf_leaves_its_group_alone_and_its_neighbour_trains_as_a_group_of_one(lora_policy, tokenizer):
    """grpo, k = 2: row 2 is scored inf; row 3, the other response to its prompt, keeps its masks and gets its own
    score through (a group of one), and the first group is unchanged."""
    queries, query_mask = prompt_batch(tokenizer)
    parts = RolloutParts(ScriptedEngine(script(tokenizer)), one_inf, tokenizer, [tokenizer.eos_token_id])
    settings = RolloutSettings(SamplingSettings(response_length=R, temperature=0.7, forward_batch_size=3),
                               EstimatorSettings(kl_coef=0.05, num_generations=2, advantage_estimator="grpo"))
    with pytest.warns(UserWarning, match="returned inf"):
        result = rollout(lora_policy, queries, query_mask, PROMPTS, parts, settings)
    batch = result.batch
    assert result.unscored.tolist() == [False, False, True, False]
    assert not batch.policy_mask[2].any() and batch.policy_mask[[0, 1, 3]].any(1).all()
    scores = batch.scores.tolist()
    expected = grpo_oracle([scores[0], scores[1], scores[3]], [0, 0, 1], "group")
    got = [batch.advantages[row][batch.policy_mask[row]] for row in (0, 1, 3)]
    for value, tokens in zip(expected, got):
        assert torch.allclose(tokens, torch.full_like(tokens, value), atol=1e-4)


def test_an_environment_episode_that_ends_early_without_a_score_leaves_only_itself(tiny_models, tokenizer, tmp_path):
    """An environment that could not finish episode 2 gives it no usable score (NaN); under grpo with k = 2 the other
    response to that prompt keeps training as a group of one (its score through), the first group as a pair."""
    from hf_ppo.rollout.environments import EnvSample
    from tests.rollout.test_environments import TwoTurn, env_trainer, rollout_batch as env_rollout_batch

    class EndsEarly(TwoTurn):
        def rollout(self, prompts, sample):
            out = [episode._replace(rewards=None) for episode in super().rollout(prompts, sample)]  # the score alone
            first = out[2]
            cut = int(first.policy_mask.long().argmin()) or len(first.tokens)  # the first answer alone
            out[2] = EnvSample(first.tokens[:cut], first.policy_mask[:cut], float("nan"), None)
            return out

    trainer = env_trainer(tiny_models, tokenizer, tmp_path, environment=EndsEarly(), advantage_estimator="grpo",
                          num_generations=2, per_device_train_batch_size=4)
    with pytest.warns(UserWarning, match="nan"):
        batch = env_rollout_batch(trainer)
    rows = [row for row in range(len(batch)) if row != 2]
    assert not batch.policy_mask[2].any() and batch.policy_mask[rows].any(1).all()
    scores = batch.scores.tolist()
    expected = grpo_oracle([scores[row] for row in rows], [row // 2 for row in rows], "group")
    assert expected[2] == pytest.approx(scores[3] / (1 + EPS))  # row 3: a group of one, its score through
    for row, value in zip(rows, expected):
        tokens = batch.advantages[row][batch.policy_mask[row]]
        assert torch.allclose(tokens, torch.full_like(tokens, value), atol=1e-4), row
