"""Issue 39, item 1: VAPO's length-adaptive lambda (`lam_length_alpha`) for the actor's GAE advantages.

Each response gets lambda_i = 1 - 1 / (alpha * l_i), l_i its number of real (policy) tokens, clamped at 0; the
critic's returns keep `lam_critic` (or `lam`). Hand-computed GAE with each row's own lambda, the length count (padding
and an environment's tokens are no length), the option through a real tiny PPOLMTrainer rollout, the construction
checks, and the card.
"""

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.algorithms.estimators import ESTIMATORS, EstimatorSettings
from hf_ppo.algorithms.ppo_math import compute_gae, length_adaptive_lam
from scripted_engine import ScriptedEngine

GAE = ESTIMATORS["gae"].compute


# ---- the lambda of each row -----------------------------------------------------------------------------------------
def test_lambda_is_one_minus_one_over_alpha_times_the_length_clamped_at_zero():
    """Pins the formula and its direction (alpha multiplies the length: `1 - alpha / l` is another number) and the
    clamp: a response shorter than 1/alpha tokens, or an empty row, gets lambda 0, never a negative one."""
    lengths = [10, 20, 40, 100, 0]
    mask = torch.tensor([[True] * n + [False] * (100 - n) for n in lengths])
    # alpha 0.05 (VAPO): 1 - 1/(0.05 l) = 1 - 20/l -> [-1 -> 0, 0, 0.5, 0.8, -inf -> 0].
    torch.testing.assert_close(length_adaptive_lam(mask, 0.05), torch.tensor([0.0, 0.0, 0.5, 0.8, 0.0]))


def test_the_length_counts_real_tokens_only():
    """Pins l = the row's True entries: trailing padding (a wider batch) and an environment's tokens between policy
    turns are no response length. Counted as the row's width (or span), lambda would grow with the batch's padding."""
    alpha = 0.5
    narrow = torch.tensor([[True, True, True, True]])
    padded = torch.tensor([[True, True, True, True, False, False, False, False]])
    with_env = torch.tensor([[True, False, False, True, True, True, False, False]])  # 4 policy tokens, 6 wide
    expected = torch.tensor([0.5])  # 1 - 1/(0.5 * 4)
    for mask in (narrow, padded, with_env, padded.int()):
        torch.testing.assert_close(length_adaptive_lam(mask, alpha), expected)


# ---- GAE with each row's own lambda, by hand ------------------------------------------------------------------------
# Two rows of different lengths, the score 1 at each one's last real token, V = 0.5 everywhere (padding included),
# no KL, gamma 1, alpha 1: row 0 has 2 real tokens -> lambda 1 - 1/2 = 0.5; row 1 has 4 -> lambda 0.75.
SCORES = torch.tensor([1.0, 1.0])
MASK = torch.tensor([[True, True, False, False], [True, True, True, True]])
VALUES = torch.full((2, 4), 0.5)
KL = torch.zeros(2, 4)
VAPO = EstimatorSettings(kl_coef=0.0, gamma=1.0, lam=0.95, whiten_advantages=False, lam_length_alpha=1.0)
# deltas: 0 everywhere but the last real token (1 - 0.5 = 0.5); A_t = lambda * A_{t+1} before it.
# row 0: [0.5 * 0.5, 0.5]; row 1: [0.75^3 * 0.5, 0.75^2 * 0.5, 0.75 * 0.5, 0.5].
ACTOR = torch.tensor([[0.25, 0.5, 0.0, 0.0], [0.2109375, 0.28125, 0.375, 0.5]])


def test_gae_uses_each_rows_own_lambda_for_the_actor():
    """Pins the actor's advantages to GAE with lambda 0.5 on the short row and 0.75 on the long one (one lambda for
    the batch, `lam`'s 0.95 or a length counted with padding, gives other numbers)."""
    out = GAE(SCORES, KL, MASK, VALUES, VAPO)
    torch.testing.assert_close(out["advantages"], ACTOR)
    # compute_gae itself takes the (batch,) lambdas.
    torch.testing.assert_close(compute_gae(out["rewards"], VALUES, MASK, 1.0, torch.tensor([0.5, 0.75]))[0], ACTOR)


def test_the_critics_returns_keep_lam_critic_or_lam():
    """Pins that the length-adaptive lambda is the actor's only: the critic's returns are GAE(lam_critic) + V (VAPO's
    decoupled GAE, 1.0: the Monte-Carlo return 1 on every real token), or GAE(lam) + V when lam_critic is None."""
    decoupled = GAE(SCORES, KL, MASK, VALUES, VAPO._replace(lam_critic=1.0))
    torch.testing.assert_close(decoupled["advantages"], ACTOR)
    torch.testing.assert_close(decoupled["returns"], torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    # lam 0.95: row 0 A = [0.475, 0.5]; row 1 A = [0.5 * 0.95^3, 0.5 * 0.95^2, 0.475, 0.5]; returns = A + 0.5.
    coupled = GAE(SCORES, KL, MASK, VALUES, VAPO)
    torch.testing.assert_close(coupled["returns"],
                               torch.tensor([[0.975, 1.0, 0.0, 0.0], [0.9286875, 0.95125, 0.975, 1.0]]))
    off = GAE(SCORES, KL, MASK, VALUES, VAPO._replace(lam_length_alpha=None))
    torch.testing.assert_close(off["returns"], coupled["returns"])
    assert not torch.allclose(off["advantages"], ACTOR)  # without the option the actor's lambda is lam's 0.95


def test_masked_tokens_are_no_time_steps_and_no_length():
    """Pins a multi-turn row (an environment token between the policy's, mask [1, 0, 1, 1]): 3 policy tokens ->
    lambda 1 - 1/3 = 2/3, and the environment token carries the next value back (A = [2/9, 0, 1/3, 0.5])."""
    mask = torch.tensor([[True, False, True, True]])
    out = GAE(torch.tensor([1.0]), torch.zeros(1, 4), mask, torch.full((1, 4), 0.5), VAPO)
    torch.testing.assert_close(out["advantages"], torch.tensor([[2 / 9, 0.0, 1 / 3, 0.5]]))


# ---- through a real tiny PPOLMTrainer rollout -----------------------------------------------------------------------
class RolloutRecorder(PPOLMTrainer):
    """Keeps each rollout batch `_rollout` hands to the update."""

    def _rollout(self, inputs):
        batch = super()._rollout(inputs)
        self.rollouts = [*getattr(self, "rollouts", []), batch]
        return batch


def test_a_trainer_rollout_uses_the_per_row_lambda(tiny_models, tokenizer, tmp_path):
    """Pins `lam_length_alpha` on its way PPOConfig -> rollout_settings -> rollout -> the gae estimator: the rollout's
    advantages are GAE with lambda 1 - 1/(0.5 l) per row (l = 2, 4, 6, 6 policy tokens: scripted stops), its returns
    GAE(lam_critic=1.0). Dropped anywhere on the way, the rows would share `lam`'s 0.95."""
    great, good, bad = (tokenizer.convert_tokens_to_ids(t) for t in ("Ġgreat", "Ġgood", "Ġbad"))
    eos = tokenizer.eos_token_id
    script = [[great, eos, bad, bad, bad, bad], [good, bad, good, eos, bad, bad], [bad] * 5 + [eos], [good] * 6]
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                     num_mini_batches=1, num_ppo_epochs=1, max_steps=1, response_length=6, report_to=[],
                     save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, gamma=1.0,
                     whiten_advantages=False, lam_length_alpha=0.5, lam_critic=1.0, kl_coef=0.05,
                     apply_chat_template_to_text=False)
    trainer = RolloutRecorder(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                              reward_model=lambda prompts, completions, **_: [1.0] * len(completions),
                              train_dataset=Dataset.from_dict({"prompt": ["the movie was", "the food was"] * 4}))
    trainer.rollout_engine = ScriptedEngine(script)
    trainer.train()
    (batch,) = trainer.rollouts
    assert batch.policy_mask.sum(dim=1).tolist() == [2, 4, 6, 6]
    lam = torch.tensor([0.0, 0.5, 2 / 3, 2 / 3])  # 1 - 1/(0.5 * l)
    advantages, _ = compute_gae(batch.rewards, batch.values, batch.policy_mask, 1.0, lam)
    torch.testing.assert_close(batch.advantages, advantages)
    torch.testing.assert_close(batch.returns, compute_gae(batch.rewards, batch.values, batch.policy_mask, 1.0, 1.0)[1])
    one_lam = compute_gae(batch.rewards, batch.values, batch.policy_mask, 1.0, 0.95)[0]
    assert not torch.allclose(batch.advantages, one_lam, atol=1e-4)  # the check above can tell the two apart


# ---- construction: ranges, the estimator, how it composes with lam --------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(lam_length_alpha=0.0), r"lam_length_alpha=0.0: must be None \(off: lam\) or > 0"),
    (dict(lam_length_alpha=-0.05), r"lam_length_alpha=-0.05: must be"),
    (dict(lam_length_alpha=float("nan")), r"lam_length_alpha=nan: must be"),
    (dict(lam_length_alpha=float("inf")), r"lam_length_alpha=inf: must be"),
    (dict(lam_length_alpha=True), r"lam_length_alpha=True: must be"),
    (dict(lam_length_alpha=0.05, advantage_estimator="grpo", num_generations=2),
     "lam_length_alpha is set, but advantage_estimator='grpo' has no critic"),
    (dict(lam_length_alpha=0.05, advantage_estimator="rloo", num_generations=2), "lam_length_alpha is set"),
    (dict(lam_length_alpha=0.05, lam=0.9), "lam=0.9 and lam_length_alpha=0.05 both set the actor's GAE lambda"),
])
def test_bad_lam_length_alpha_settings_are_refused(tmp_path, overrides, message):
    """Pins the refusals: alpha must be a finite number > 0; it means nothing without GAE; and a non-default `lam`
    beside it is ambiguous (which one is the actor's?)."""
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2, **overrides)


def test_good_settings_are_accepted_and_on_the_card(tmp_path):
    """Pins what is legal (with lam_critic, any value; lam at its default) and that the card lists the option."""
    args = PPOConfig(output_dir=str(tmp_path), report_to=[], lam_length_alpha=0.05, lam_critic=1.0,
                     response_length=512)
    assert args.rollout_settings.estimator.lam_length_alpha == 0.05
    assert args.card_hyperparameters["lam_length_alpha"] == 0.05
    assert PPOConfig(output_dir=str(tmp_path), report_to=[]).lam_length_alpha is None  # off by default


def test_an_alpha_that_zeroes_every_lambda_is_warned_about(tmp_path):
    """Pins the warning for alpha x response_length <= 1: every response would get lambda 0 (one-step TD) in silence,
    e.g. VAPO's 0.05 with 16-token responses."""
    with pytest.warns(UserWarning, match=r"lam_length_alpha=0.05 x response_length=16 <= 1"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], lam_length_alpha=0.05, response_length=16)
