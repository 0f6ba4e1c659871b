"""advantage_estimator='auto' (EVPO, Pan et al. 2026): per batch, GAE where the critic explains the returns, else the
group baseline. Hand-built batches for both branches, the threshold's edge and the masks; the rollout's metric; the
construction errors; one short training run."""

import math

import pytest
import torch

from hf_ppo.algorithms.estimators import ESTIMATORS, EstimatorSettings, critic_explains, estimate
from hf_ppo.algorithms.ppo_math import grpo_advantages
from hf_ppo.rollout.steps import unscored_rows
from tests.algorithms.test_estimators import make_args, make_trainer

# 2 prompts x k=2, one real token each (the score lands on it), no KL: the Monte-Carlo return is the score.
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.0])
NO_KL = torch.zeros(4, 1)
ONE = torch.ones(4, 1, dtype=torch.bool)
GOOD = torch.tensor([[0.9], [0.1], [0.8], [0.2]])  # R - V = [.1, -.1, .2, -.2]: Var 0.025 of Var(R) 0.25 -> EV 0.9
FLAT = torch.full((4, 1), 0.5)  # R - V = [.5, -.5, .5, -.5]: Var(R - V) = Var(R) -> EV exactly 0
SETTINGS = EstimatorSettings(kl_coef=1.0, num_generations=2, whiten_advantages=False, advantage_estimator="auto")


def test_critic_explains_by_hand_and_at_the_threshold_edge():
    uses, ev = critic_explains(GOOD, SCORES[:, None], ONE)
    assert bool(uses) and ev.item() == pytest.approx(0.9)
    uses, ev = critic_explains(FLAT, SCORES[:, None], ONE)
    assert ev.item() == 0.0 and not bool(uses)  # EV = 0: the critic does no better than the mean (EVPO: <= 0 loses)
    assert bool(critic_explains(GOOD, SCORES[:, None], ONE, threshold=0.85)[0])
    assert not bool(critic_explains(GOOD, SCORES[:, None], ONE, threshold=0.9 + 1e-6)[0])
    assert bool(critic_explains(FLAT, SCORES[:, None], ONE, threshold=-1e-6)[0])


def test_masked_positions_do_not_change_the_choice():
    # A second, masked position holding garbage values and returns: EV and the choice are the first column's.
    mask = torch.tensor([[True, False]] * 4)
    values = torch.cat([GOOD, torch.tensor([[50.0], [-9.0], [3.0], [7.0]])], 1)
    returns = torch.cat([SCORES[:, None], torch.tensor([[-4.0], [8.0], [0.0], [1.0]])], 1)
    uses, ev = critic_explains(values, returns, mask)
    assert bool(uses) and ev.item() == pytest.approx(0.9)
    uses, ev = critic_explains(values, returns, torch.zeros_like(mask))  # no real token: no evidence for the critic
    assert not bool(uses) and math.isnan(ev.item())


def test_auto_uses_gae_where_the_critic_explains_the_returns():
    out = ESTIMATORS["auto"].compute(SCORES, NO_KL, ONE, GOOD, SETTINGS)
    gae = ESTIMATORS["gae"].compute(SCORES, NO_KL, ONE, GOOD, SETTINGS._replace(advantage_estimator="gae"))
    for key in ("rewards", "non_score_rewards", "advantages", "returns"):
        torch.testing.assert_close(out[key], gae[key])
    torch.testing.assert_close(out["advantages"], SCORES[:, None] - GOOD)  # one token: A = R - V
    assert out["stats"]["objective/auto_uses_gae"].item() == 1.0
    assert out["stats"]["objective/auto_explained_variance"].item() == pytest.approx(0.9)


def test_auto_uses_the_group_baseline_where_the_critic_does_not_and_the_critic_still_learns():
    out = ESTIMATORS["auto"].compute(SCORES, NO_KL, ONE, FLAT, SETTINGS)
    # GRPO over the groups [1, 0] and [1, 0]: (R - mean) / (sample std + eps) = +-0.5 / (0.7071 + 1e-4).
    group = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(out["advantages"], torch.tensor([[group], [-group], [group], [-group]]))
    gae = ESTIMATORS["gae"].compute(SCORES, NO_KL, ONE, FLAT, SETTINGS._replace(advantage_estimator="gae"))
    torch.testing.assert_close(out["returns"], gae["returns"])  # the critic's target either way
    assert out["stats"]["objective/auto_uses_gae"].item() == 0.0


def test_the_group_branch_compares_the_kl_penalised_sequence_returns_over_real_tokens():
    # Two tokens, the second masked for rows 1 and 3; kl_coef 1: R = score - sum KL over real tokens.
    scores = torch.tensor([1.0, 3.0, 0.0, 2.0])
    kl = torch.tensor([[0.5, 0.5], [0.0, 9.0], [1.0, 1.0], [0.0, 9.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    out = ESTIMATORS["auto"].compute(scores, kl, mask, torch.zeros(4, 2), SETTINGS._replace(scale_rewards=False))
    assert out["stats"]["objective/auto_uses_gae"].item() == 0.0  # V = 0 explains nothing: EV = 0
    # R = [0, 3, -2, 2]; Dr. GRPO (scale_rewards=False): R - group mean = [-1.5, 1.5, -2, 2], on real tokens only.
    expected = torch.tensor([[-1.5, -1.5], [1.5, 0.0], [-2.0, -2.0], [2.0, 0.0]])
    torch.testing.assert_close(out["advantages"], expected)
    torch.testing.assert_close(grpo_advantages(torch.tensor([0.0, 3.0, -2.0, 2.0]), 2, scale_rewards=False),
                               expected[:, 0])


def test_the_threshold_setting_decides():
    strict = SETTINGS._replace(auto_ev_threshold=0.95)
    assert ESTIMATORS["auto"].compute(SCORES, NO_KL, ONE, GOOD, strict)["stats"]["objective/auto_uses_gae"] == 0
    lenient = SETTINGS._replace(auto_ev_threshold=-0.5)
    assert ESTIMATORS["auto"].compute(SCORES, NO_KL, ONE, FLAT, lenient)["stats"]["objective/auto_uses_gae"] == 1


def test_with_use_kl_loss_both_branches_see_no_kl():
    kl = torch.ones(4, 1)
    out = estimate(SCORES, kl, ONE, FLAT, SETTINGS._replace(use_kl_loss=True))
    plain = estimate(SCORES, NO_KL, ONE, FLAT, SETTINGS)
    torch.testing.assert_close(out["advantages"], plain["advantages"])
    torch.testing.assert_close(out["non_score_rewards"], -kl)
    assert "stats" in out


def test_a_nan_score_takes_its_whole_group_out_for_auto():
    scores = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    assert unscored_rows(scores, SETTINGS).tolist() == [True, True, False, False]
    assert unscored_rows(scores, SETTINGS._replace(advantage_estimator="gae")).tolist() == [False, True, False, False]


@pytest.mark.parametrize("overrides,message", [
    (dict(advantage_estimator="auto", num_generations=1), r"advantage_estimator='auto' .* set num_generations >= 2"),
    (dict(auto_ev_threshold=0.5), "auto_ev_threshold=0.5 applies to advantage_estimator='auto' only"),
    (dict(advantage_estimator="auto", auto_ev_threshold=1.0), r"auto_ev_threshold=1.0: must be in \[-1, 1\)"),
])
def test_bad_auto_settings_are_refused(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **overrides)


def test_auto_accepts_the_critic_settings_and_scale_rewards(tmp_path):
    args = make_args(tmp_path, advantage_estimator="auto", critic="separate", critic_learning_rate=1e-3,
                     lam_critic=1.0, scale_rewards=False, auto_ev_threshold=0.1)
    assert args.estimator_settings.auto_ev_threshold == 0.1


def test_an_auto_run_trains_its_critic_and_logs_its_choice(tiny_models, tokenizer, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, advantage_estimator="auto", kl_coef=0.1)
    assert trainer.model.has_critic
    head = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "v_head" in n}
    trainer.train()
    rollouts = [e for e in trainer.state.log_history if "objective/auto_uses_gae" in e]
    assert len(rollouts) == 2 and all(e["objective/auto_uses_gae"] in (0.0, 1.0) for e in rollouts)
    assert all(math.isfinite(e["objective/auto_explained_variance"]) for e in rollouts)
    now = dict(trainer.model.named_parameters())
    assert head and any(not torch.equal(head[n], now[n]) for n in head), "the value head did not train"


def test_the_card_says_what_auto_did():
    from hf_ppo.hub.cards import method_texts

    what, how = method_texts({"advantage_estimator": "auto", "num_generations": 4, "critic": "shared"})
    assert "value head" in what and "no critic" not in what and "4 responses" in what
    assert "GAE" in how and "explained variance" in how
