"""The advantage estimators (step 8), the critic-free path and `num_generations` (k responses per prompt).

Hand-computed estimator outputs (where the KL penalty enters), the loss without a critic and with GRPO's KL term,
the sampler's groups under accelerate's sharding, the epoch arithmetic with k, every estimator training with LoRA
and QLoRA with no critic anywhere, an exact resume of a grpo run part-way through an iteration, construction errors.
"""

import math
import os
from dataclasses import fields

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.algorithms.estimators import ESTIMATORS, EstimatorSettings, estimate, kl_loss_coef
from hf_ppo.algorithms.ppo_math import (
    Experience,
    LossSettings,
    compute_gae,
    length_adaptive_lam,
    logprobs_from_logits,
    ppo_loss,
    reinforce_pp_advantages,
)
from hf_ppo.models.value_head import VALUE_HEAD_FILE, AutoModelForCausalLMWithValueHead
from hf_ppo.rollout.batch import RolloutBatch
from hf_ppo.rollout.refill import merge_groups
from hf_ppo.trainer.data import RolloutRepeatSampler
from tests.scripted_engine import ScriptedEngine
# advantage_estimator='auto' (issue 61), the last section
from hf_ppo.algorithms.estimators import critic_explains
from hf_ppo.algorithms.ppo_math import grpo_advantages
from hf_ppo.rollout.steps import unscored_rows

CRITIC_METRICS = {"val/explained_variance", "loss/value_avg", "val/clipfrac_avg"}
PROMPTS = [f"{a} {b}" for a in ("the movie was", "the food was", "the book was", "the show was")
           for b in ("great", "dull", "fun", "bad")]  # 16 distinct prompts


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def make_args(out, **overrides) -> PPOConfig:
    # 8 responses per rollout (4 x 1 x 2 minibatches): 4 prompts x k=2.
    defaults = dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2,
        num_ppo_epochs=1, max_steps=4, response_length=6, logging_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, num_generations=2,
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(models, tokenizer, out, peft=None, reward=count_e, prompts=PROMPTS, model=None, **overrides):
    return PPOLMTrainer(model=model if model is not None else models["policy"], args=make_args(out, **overrides),
                        processing_class=tokenizer, reward_model=reward,
                        train_dataset=Dataset.from_dict({"prompt": prompts}), peft_config=peft)


# ---- step 8: where the KL enters, by hand ---------------------------------------------------------------------------
# 2 prompts x k=2, 2 real tokens each; kl_coef 1. Sequence returns R = score - sum KL = [0, 3, -2, 2].
SCORES = torch.tensor([1.0, 3.0, 0.0, 2.0])
KL = torch.tensor([[0.5, 0.5], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
MASK = torch.ones(4, 2, dtype=torch.bool)
SETTINGS = EstimatorSettings(kl_coef=1.0, num_generations=2, whiten_advantages=False)


def test_rloo_penalises_the_sequence_return_then_leaves_one_out():
    out = ESTIMATORS["rloo"].compute(SCORES, KL, MASK, None, SETTINGS)
    # A_i = R_i - R_other: [0 - 3, 3 - 0, -2 - 2, 2 + 2]
    torch.testing.assert_close(out["advantages"], torch.tensor([[-3.0] * 2, [3.0] * 2, [-4.0] * 2, [4.0] * 2]))
    torch.testing.assert_close(out["returns"], torch.tensor([[0.0] * 2, [3.0] * 2, [-2.0] * 2, [2.0] * 2]))
    torch.testing.assert_close(out["non_score_rewards"], -KL)
    assert not ESTIMATORS["rloo"].kl_in_loss and not ESTIMATORS["rloo"].needs_critic


def test_grpo_advantages_ignore_the_kl_which_is_a_loss_term():
    out = ESTIMATORS["grpo"].compute(SCORES, KL, MASK, None, SETTINGS._replace(scale_rewards=False))
    # Dr. GRPO: score - group mean, group means 2 and 1; the KL does not enter.
    torch.testing.assert_close(out["advantages"], torch.tensor([[-1.0] * 2, [1.0] * 2, [-1.0] * 2, [1.0] * 2]))
    scaled = ESTIMATORS["grpo"].compute(SCORES, torch.zeros_like(KL), MASK, None, SETTINGS)["advantages"]
    std = math.sqrt(2.0)  # sample std of [1, 3] and of [0, 2]
    torch.testing.assert_close(scaled[:, 0], torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (std + 1e-4))
    torch.testing.assert_close(out["non_score_rewards"], -KL)  # reported: what the loss term pays
    torch.testing.assert_close(out["rewards"], torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 0.0], [0.0, 2.0]]))
    at = EstimatorSettings(kl_coef=0.3)
    assert kl_loss_coef(at._replace(advantage_estimator="grpo")) == 0.3
    assert kl_loss_coef(at._replace(advantage_estimator="rloo")) == kl_loss_coef(at) == 0.0


def test_reinforce_pp_and_gae_through_the_interface():
    out = ESTIMATORS["reinforce_pp"].compute(SCORES, KL, MASK, None, SETTINGS)
    advantages, returns = reinforce_pp_advantages(SCORES, KL, MASK, 1.0, k=2)
    torch.testing.assert_close(out["advantages"], advantages)
    # Group-centred scores [-1, 1, -1, 1] at the last token, -KL per token, summed to the end.
    torch.testing.assert_close(returns, torch.tensor([[-2.0, -1.5], [1.0, 1.0], [-3.0, -2.0], [1.0, 1.0]]))
    single = ESTIMATORS["reinforce_pp"].compute(SCORES, KL, MASK, None, SETTINGS._replace(num_generations=1))
    torch.testing.assert_close(single["returns"][:, 0], torch.tensor([0.0, 3.0, -2.0, 2.0]))  # no baseline at k=1
    with pytest.raises(ValueError, match="needs a critic"):
        ESTIMATORS["gae"].compute(SCORES, KL, MASK, None, SETTINGS)


def test_decoupled_gae_lambda_gives_the_critic_its_own_returns():
    # rewards [0, 0, 1] (the score at the last token, no KL), V = 0.5, gamma 1. Deltas: [0, 0, 0.5].
    # lam 0.95 (actor): A = [0.95^2 * 0.5, 0.95 * 0.5, 0.5] = [0.45125, 0.475, 0.5], returns = A + V.
    # lam_critic 1.0: A = [0.5, 0.5, 0.5], so the critic learns returns [1, 1, 1] (the Monte-Carlo return).
    scores, kl, mask, values = torch.tensor([1.0]), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), \
        torch.full((1, 3), 0.5)
    s = EstimatorSettings(kl_coef=0.0, lam=0.95, whiten_advantages=False)
    coupled = ESTIMATORS["gae"].compute(scores, kl, mask, values, s)
    torch.testing.assert_close(coupled["advantages"], torch.tensor([[0.45125, 0.475, 0.5]]))
    torch.testing.assert_close(coupled["returns"], torch.tensor([[0.95125, 0.975, 1.0]]))
    decoupled = ESTIMATORS["gae"].compute(scores, kl, mask, values, s._replace(lam_critic=1.0))
    torch.testing.assert_close(decoupled["advantages"], coupled["advantages"])  # the actor's lam is unchanged
    torch.testing.assert_close(decoupled["returns"], torch.tensor([[1.0, 1.0, 1.0]]))
    # lam_critic 0 (one-step TD targets): returns = r_t + V_{t+1} = [0.5, 0.5, 1.0].
    td = ESTIMATORS["gae"].compute(scores, kl, mask, values, s._replace(lam_critic=0.0))
    torch.testing.assert_close(td["returns"], torch.tensor([[0.5, 0.5, 1.0]]))


def test_use_kl_loss_takes_the_kl_out_of_the_reward_for_every_estimator():
    # One response [score 1 at the last of 2 tokens], KL [0.5, 0.5], kl_coef 1, V = 0, gamma = lam = 1:
    # in the reward, returns are [1 - 1, 1 - 0.5] = [0, 0.5]; as a loss term, the reward is the score alone: [1, 1].
    scores, kl, mask, values = torch.tensor([1.0]), torch.full((1, 2), 0.5), torch.ones(1, 2, dtype=torch.bool), \
        torch.zeros(1, 2)
    s = EstimatorSettings(kl_coef=1.0, lam=1.0, whiten_advantages=False, num_generations=1)
    torch.testing.assert_close(estimate(scores, kl, mask, values, s)["returns"], torch.tensor([[0.0, 0.5]]))
    out = estimate(scores, kl, mask, values, s._replace(use_kl_loss=True))
    torch.testing.assert_close(out["returns"], torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(out["rewards"], torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(out["non_score_rewards"], torch.tensor([[-0.5, -0.5]]))  # still reported
    at = EstimatorSettings(kl_coef=0.3)
    assert kl_loss_coef(at) == 0.0 and kl_loss_coef(at._replace(use_kl_loss=True)) == 0.3
    assert kl_loss_coef(at._replace(advantage_estimator="grpo")) == 0.3
    # Step 8 as the rollout runs it (log-probs in, the KL measured with kl_estimator k1 = log 2 per token).
    from hf_ppo.rollout.steps import compute_advantages

    logp, ref = torch.full((1, 2), -1.0), torch.full((1, 2), -1.0 - math.log(2.0))
    settings = EstimatorSettings(kl_coef=1.0, kl_estimator="k1", gamma=1.0, lam=1.0, whiten_rewards=False,
                                 whiten_advantages=False)
    _, in_reward = compute_advantages(logp, ref, values, mask, scores, settings)
    _, in_loss = compute_advantages(logp, ref, values, mask, scores, settings._replace(use_kl_loss=True))
    torch.testing.assert_close(in_reward["returns"], torch.tensor([[1 - 2 * math.log(2.0), 1 - math.log(2.0)]]))
    torch.testing.assert_close(in_loss["returns"], torch.tensor([[1.0, 1.0]]))


def test_ppo_loss_without_critic_and_with_the_kl_loss_term():
    torch.manual_seed(0)
    logits, responses = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    old = logprobs_from_logits(logits, responses)
    zeros = torch.zeros(2, 3)
    settings = LossSettings(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0)
    rollout = Experience(responses, old, zeros, torch.ones(2, 3), zeros, mask)
    plain, stats = ppo_loss(logits, None, rollout, mask.sum(), settings)
    assert not CRITIC_METRICS & set(stats) and "loss/kl_avg" not in stats
    torch.testing.assert_close(plain, torch.tensor(-1.0))  # ratio 1, advantage 1: -A
    # Reference half as likely on every token: k3 = (1/2 - 1) - log(1/2) = log 2 - 1/2 per token.
    with_kl, stats = ppo_loss(logits, None, rollout._replace(ref_logprobs=old - math.log(2.0)), mask.sum(), settings,
                              kl_loss_coef=0.5)
    torch.testing.assert_close(with_kl, torch.tensor(-1.0 + 0.5 * (math.log(2.0) - 0.5)))
    torch.testing.assert_close(stats["loss/kl_avg"], torch.tensor(math.log(2.0) - 0.5))


# ---- num_generations: the sampler under accelerate's sharding ------------------------------------------------------
@pytest.mark.parametrize("world_size,k", [(1, 1), (1, 4), (2, 2), (2, 4), (4, 2)])
def test_sampler_keeps_groups_whole_on_one_device_and_visits_each_prompt_once(world_size, k):
    """What Trainer does with the train dataloader: accelerate's `prepare_data_loader` (BatchSamplerShard: process r
    takes the r-th of every world_size batches)."""
    from accelerate.data_loader import prepare_data_loader

    num_prompts, per_device, repeat = 27, 4, 3
    sampler = RolloutRepeatSampler(num_prompts, per_device * world_size, repeat, seed=5, num_generations=k)
    prompts_per_iteration = per_device * world_size // k
    iterations = num_prompts // prompts_per_iteration
    assert sampler.num_batches == iterations and len(sampler) == iterations * per_device * world_size * repeat
    shards = []
    for rank in range(world_size):
        loader = DataLoader(list(range(num_prompts)), batch_size=per_device, sampler=sampler, collate_fn=list)
        shard = list(prepare_data_loader(loader, num_processes=world_size, process_index=rank, put_on_device=False))
        assert len(shard) == iterations * repeat  # Trainer's steps per epoch follow from this length
        shards.append(shard)
    seen = []
    for it in range(iterations):
        for rank in range(world_size):
            batches = shards[rank][it * repeat:(it + 1) * repeat]
            assert all(b == batches[0] for b in batches)  # the same rollout batch for every micro-batch
            groups = [batches[0][j:j + k] for j in range(0, per_device, k)]
            assert all(len(set(g)) == 1 for g in groups)  # k copies of one prompt, consecutive
            seen += [g[0] for g in groups]
    assert len(seen) == len(set(seen)) == iterations * prompts_per_iteration  # each prompt at most once per epoch
    sampler.set_epoch(1)
    assert list(sampler) != [i for s in shards for b in s for i in b]


def test_epoch_counts_passes_over_prompts_and_rollouts_hold_groups(tiny_models, tokenizer, tmp_path):
    """8 prompts, 8 responses per rollout, k = 4: 2 prompts per iteration, so one epoch is 4 iterations; every
    prompt is scored k times in a row, once per epoch; `episode` counts responses."""
    calls = []

    def recording(prompts, completions):
        calls.append(prompts)
        return count_e(prompts, completions)

    trainer = make_trainer(tiny_models, tokenizer, tmp_path, reward=recording, prompts=PROMPTS[::2],
                           advantage_estimator="grpo", num_generations=4, max_steps=-1, num_train_epochs=1,
                           num_mini_batches=1, gradient_accumulation_steps=2, response_length=2, logging_steps=4)
    calls.clear()  # the construction-time probe
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.iteration == 4
    assert all(len(c) == 8 and all(len(set(c[i:i + 4])) == 1 for i in (0, 4)) for c in calls)
    per_prompt = [c[i] for c in calls for i in (0, 4)]
    assert sorted(per_prompt) == sorted(PROMPTS[::2])
    assert trainer.state.log_history[-2]["episode"] == 32


# ---- every estimator trains, with no critic anywhere when it has none ----------------------------------------------
@pytest.mark.parametrize("estimator,quantized", [
    ("rloo", False), ("rloo", True), ("grpo", False), ("grpo", True), ("reinforce_pp", False),
    ("reinforce_pp", True), ("gae", False)])
def test_each_estimator_trains_lora_and_qlora(estimator, quantized, tiny_models, tokenizer, tmp_path):
    extra = {"policy_quantization": "4bit"} if quantized else {}
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "out", lora(), advantage_estimator=estimator,
                           save_strategy="steps", save_steps=2, adaptive_kl=True, kl_coef=0.1, **extra)
    model = trainer.model
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    trainer.train()
    history = [e for e in trainer.state.log_history if "loss/policy_avg" in e]
    assert len(history) == 4 and trainer.iteration == 2
    assert all(math.isfinite(v) for e in history for v in e.values() if isinstance(v, float))
    now = dict(model.named_parameters())
    assert any(not torch.equal(lora_before[n], now[n]) for n in lora_before), "LoRA weights did not change"
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    critic_file = load_file(tmp_path / "out" / "checkpoint-2" / VALUE_HEAD_FILE)
    logged = set().union(*history)
    if estimator == "gae":
        assert model.has_critic and CRITIC_METRICS <= logged and set(critic_file) == {"weight", "bias"}
        return
    assert not model.has_critic and model.critic is None and not hasattr(model, "v_head")
    assert not any("v_head" in n or "critic" in n for n, _ in model.named_parameters())
    assert trained == {id(p) for n, p in model.named_parameters() if "lora_" in n}  # the policy's adapter only
    assert critic_file == {}
    assert not CRITIC_METRICS & logged
    assert ("loss/kl_avg" in logged) == (estimator == "grpo")
    rollouts = [e for e in history if "objective/kl_coef" in e]
    assert rollouts[-1]["objective/kl_coef"] != 0.1  # the adaptive controller moved on the measured KL


def uniform_for_most(prompts, completions):
    """0 for every response to a prompt ending in great / dull / fun (12 of the 16): those groups carry no signal."""
    return [0.0 if p.endswith(("great", "dull", "fun")) else float(c.count("e")) for p, c in zip(prompts, completions)]


def dropped_counts(trainer) -> list[float]:
    return [e["rollout/groups_dropped"] for e in trainer.state.log_history if "rollout/groups_dropped" in e]


# ---- exact resume of a critic-free run part-way through an iteration ------------------------------------------------
@pytest.mark.parametrize("refill", [0, 4])
def test_grpo_resume_mid_iteration_is_bitwise_exact(refill, tiny_models, tokenizer, tmp_path):
    # 4 optimizer steps per iteration (2 epochs x 2 minibatches), 2 iterations, saved at step 3; adaptive KL, so the
    # KL loss term's coefficient changes between iterations and must be restored too. With drop_uniform_groups and a
    # reward that gives most groups one score, so the dropped groups' masks must come back with the rollout; with
    # the refill, the first rollout's merged groups come back from the checkpoint and the second one (made after the
    # resume) must draw the same extra prompts.
    kwargs = dict(advantage_estimator="grpo", num_ppo_epochs=2, max_steps=8, adaptive_kl=True, kl_coef=0.1,
                  drop_uniform_groups=True, reward=uniform_for_most, max_refill_rounds=refill)
    straight = make_trainer(tiny_models, tokenizer, tmp_path / "straight", lora(), save_strategy="steps",
                            save_steps=3, **kwargs)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    assert os.path.isfile(checkpoint / "rollout_buffer.safetensors")
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", lora(), **kwargs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(x, y), name
    assert straight.kl_ctl.value == resumed.kl_ctl.value and resumed.iteration == 2

    def logged(trainer):
        return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k
                 and "runtime" not in k and k not in ("train_loss", "total_flos")} for e in trainer.state.log_history]

    assert len(logged(straight)) == 9 and logged(straight) == logged(resumed)
    dropped = dropped_counts(straight)
    assert len(dropped) == 2 and all(d == int(d) and 0 <= d <= 4 for d in dropped) and sum(dropped) > 0
    refilled = [e["rollout/groups_refilled"] for e in straight.state.log_history if "rollout/groups_refilled" in e]
    assert len(refilled) == (2 if refill else 0) and all(n > 0 for n in refilled)


def test_uniform_groups_leave_the_loss_and_its_mean():
    from hf_ppo.algorithms.ppo_math import aggregate_loss, loss_normalizer, uniform_groups
    from hf_ppo.rollout.batch import RolloutBatch
    from hf_ppo.rollout.steps import without_uniform_groups

    assert uniform_groups(torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0]), 2).tolist() == [True, True, False, False,
                                                                                          True, True]
    B, R = 4, 3
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, True]])
    batch = RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool),
                         torch.zeros(B, R, dtype=torch.long), mask, *[torch.zeros(B, R)] * 3, torch.zeros(B),
                         torch.ones(B, dtype=torch.bool), *[torch.zeros(B, R)] * 4)
    kept, dropped = without_uniform_groups(batch, torch.tensor([2.0, 2.0, 0.0, 1.0]), 2)  # group 0 is uniform
    assert dropped.item() == 1.0 and not kept.response_mask[:2].any() and torch.equal(kept.response_mask[2:], mask[2:])
    assert torch.equal(kept.policy_mask, kept.response_mask)  # the loss reads the policy's tokens: dropped there too
    # Per-token losses [1, 2, 3] on every row: token mean over the kept rows' 4 real tokens = (1 + 1 + 2 + 3) / 4.
    losses = torch.tensor([1.0, 2.0, 3.0]).expand(B, R)
    assert aggregate_loss(losses, kept.policy_mask, normalizer=loss_normalizer(kept.policy_mask)).item() == 7 / 4
    assert loss_normalizer(kept.policy_mask, "seq_mean_token_mean").item() == 2  # responses, not 4


# ---- DAPO's refill: dropped groups' places taken by groups with signal from extra prompts -------------------------
def rollout_batch(queries, query_mask, responses, response_mask, scores):
    """A RolloutBatch whose float fields hold the row number (+1) at real positions, to follow rows through a merge."""
    B, R = responses.shape
    rows = torch.arange(1.0, B + 1).unsqueeze(1).expand(B, R) * response_mask
    return RolloutBatch(queries, query_mask, responses, response_mask, *[rows.clone() for _ in range(3)], scores,
                        torch.ones(B, dtype=torch.bool), *[rows.clone() for _ in range(4)])


def test_refill_puts_only_groups_with_signal_in_the_dropped_places_at_the_wider_shape():
    pad = 0
    # Main batch: 3 groups of k=2, prompts 2 wide, responses 3 wide; groups 0 and 2 dropped.
    main = rollout_batch(torch.arange(1, 13).reshape(6, 2), torch.ones(6, 2, dtype=torch.bool),
                         torch.arange(20, 38).reshape(6, 3), torch.ones(6, 3, dtype=torch.bool), torch.arange(6.0))
    dropped = torch.tensor([True, True, False, False, True, True])
    # Extra batch: 3 groups, prompts 4 wide (row 0 left-padded by 2), responses 5 wide; group 0 uniform (no signal).
    query_mask = torch.ones(6, 4, dtype=torch.bool)
    query_mask[0, :2] = False
    response_mask = torch.ones(6, 5, dtype=torch.bool)
    response_mask[3, 2:] = False
    extra = rollout_batch(torch.arange(101, 125).reshape(6, 4) * query_mask, query_mask,
                          torch.arange(200, 230).reshape(6, 5), response_mask, torch.arange(10.0, 16.0))
    merged, left, count = merge_groups(main, dropped, extra, torch.tensor([True, True, False, False, False, False]),
                                       k=2, pad_token_id=pad)
    assert count == 2 and not left.any() and len(merged) == 6
    assert merged.queries.shape == (6, 4) and merged.responses.shape == (6, 5)
    assert all(getattr(merged, f.name).shape == (6, 5) for f in fields(merged) if f.name not in
               ("queries", "query_mask", "scores", "contains_stop"))
    # Dropped group 0 <- extra group 1 (rows 2, 3), dropped group 2 <- extra group 2 (rows 4, 5); never extra group 0.
    assert merged.scores.tolist() == [12.0, 13.0, 2.0, 3.0, 14.0, 15.0]
    for into, take in [(0, 2), (1, 3), (4, 4), (5, 5)]:
        for f in fields(merged):
            assert torch.equal(getattr(merged, f.name)[into], getattr(extra, f.name)[take]), (f.name, into)
    # The kept group: its prompts left-padded (pad, masked), its responses right-padded (pad, masked, 0).
    assert merged.queries[2:4, :2].eq(pad).all() and not merged.query_mask[2:4, :2].any()
    assert torch.equal(merged.queries[2:4, 2:], main.queries[2:4]) and merged.query_mask[2:4, 2:].all()
    assert torch.equal(merged.responses[2:4, :3], main.responses[2:4]) and merged.responses[2:4, 3:].eq(pad).all()
    assert not merged.response_mask[2:4, 3:].any() and not merged.policy_mask[2:4, 3:].any()
    assert torch.equal(merged.advantages[2:4, :3], main.advantages[2:4]) and not merged.advantages[2:4, 3:].any()
    # Fewer donors than holes: the first hole is refilled, the second stays dropped; no donor, nothing changes.
    merged, left, count = merge_groups(main, dropped, extra, torch.tensor([True] * 4 + [False] * 2), k=2,
                                       pad_token_id=pad)
    assert count == 1 and left.tolist() == [False] * 4 + [True] * 2 and merged.scores.tolist()[:2] == [14.0, 15.0]
    unchanged, left, count = merge_groups(main, dropped, extra, torch.ones(6, dtype=torch.bool), k=2, pad_token_id=pad)
    assert unchanged is main and count == 0 and torch.equal(left, dropped)


@pytest.mark.parametrize("other_process_dropped, rounds", [(True, 2), (False, 0)])
def test_refill_rounds_run_while_any_process_has_dropped_groups(other_process_dropped, rounds, monkeypatch):
    # This process has no dropped group; the other one (seen through `gather`) has, or not. Every round gathers
    # across processes, so all of them sample the same number of rounds.
    from types import SimpleNamespace

    from hf_ppo.rollout import refill as rollout_module
    from hf_ppo.rollout import steps

    def fake_rollout(policy, queries, query_mask, prompts, parts, settings, columns=None):
        B = len(prompts)
        batch = rollout_batch(queries, query_mask, torch.ones(B, 2, dtype=torch.long),
                              torch.ones(B, 2, dtype=torch.bool), torch.arange(float(B)))
        return steps.Rollout(batch, {"rollout/groups_dropped": torch.tensor(0.0)}, 1.0, 2.0,
                                      dropped=torch.zeros(B, dtype=torch.bool), generated_tokens=2 * B)

    monkeypatch.setattr(rollout_module, "rollout", fake_rollout)
    drawn = []

    def extra_prompts(round_):
        drawn.append(round_)
        return {"queries": torch.ones(4, 3, dtype=torch.long), "query_mask": torch.ones(4, 3, dtype=torch.bool),
                "prompts": ["x"] * 4}

    parts = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0),
                            gather=lambda flag: torch.cat([flag, torch.tensor([float(other_process_dropped)])]))
    settings = SimpleNamespace(max_refill_rounds=2, estimator=EstimatorSettings(kl_coef=0.0, num_generations=2))
    result = rollout_module.rollout_with_refill(
        None, torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool), ["p"] * 4, parts, settings,
        extra_prompts=extra_prompts)
    assert drawn == list(range(rounds)) and result.stats["rollout/refill_rounds"].item() == rounds
    assert result.stats["rollout/groups_refilled"].item() == 0 and result.stats["rollout/groups_dropped"].item() == 0
    # The cost of every round is counted: seconds and sampled tokens.
    assert (result.generate_seconds, result.score_seconds, result.generated_tokens) == (1 + rounds, 2 + 2 * rounds,
                                                                                         8 * (1 + rounds))


def test_padding_a_rollout_batch_leaves_its_logprobs_and_values(tiny_models, tokenizer):
    # The merged batch is wider than the rollout that sampled a row: the update must see the same numbers there.
    from hf_ppo.rollout.refill import padded
    from hf_ppo.rollout.steps import policy_forward

    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_models["policy"], value_head_init_std=0.5)
    queries = tokenizer(["the movie was", "bad"], return_tensors="pt", padding=True)
    responses = torch.randint(5, 50, (2, 4))
    response_mask = torch.tensor([[True] * 4, [True, True, False, False]])
    batch = rollout_batch(queries["input_ids"], queries["attention_mask"].bool(), responses, response_mask,
                          torch.zeros(2))
    wide = padded(batch, batch.queries.shape[1] + 3, 7, tokenizer.pad_token_id)

    def forward(b):
        return policy_forward(model, b.queries, b.query_mask, b.responses, b.response_mask, temperature=1.0,
                              batch_size=2)

    (logprobs, values, _), (wide_logprobs, wide_values, _) = forward(batch), forward(wide)
    assert torch.allclose(wide_logprobs[:, :4][response_mask], logprobs[response_mask], atol=1e-5)
    assert torch.allclose(wide_values[:, :4][response_mask], values[response_mask], atol=1e-5)


def test_refill_leaves_fewer_groups_dropped_and_logs_it(tiny_models, tokenizer, tmp_path):
    # 12 of the 16 prompts always score 0: a rollout of 4 prompt groups holds 1 with signal on average.
    kwargs = dict(advantage_estimator="grpo", max_steps=8, drop_uniform_groups=True, reward=uniform_for_most)
    plain = make_trainer(tiny_models, tokenizer, tmp_path / "plain", lora(), **kwargs)
    plain.train()
    refilled = make_trainer(tiny_models, tokenizer, tmp_path / "refill", lora(), max_refill_rounds=2, **kwargs)
    refilled.train()
    assert len(dropped_counts(plain)) == len(dropped_counts(refilled)) == 4
    assert sum(dropped_counts(refilled)) < sum(dropped_counts(plain))
    logs = [e for e in refilled.state.log_history if "rollout/groups_dropped" in e]
    assert all(0 <= e["rollout/refill_rounds"] <= 2 for e in logs)
    assert all(e["rollout/groups_refilled"] == int(e["rollout/groups_refilled"]) for e in logs)
    assert sum(e["rollout/groups_refilled"] for e in logs) > 0
    # A round is sampled only while groups are dropped: a rollout left with dropped groups used both rounds.
    assert all(e["rollout/refill_rounds"] == 2 for e in logs if e["rollout/groups_dropped"] > 0)
    assert not any("rollout/groups_refilled" in e for e in plain.state.log_history)
    assert plain.state.log_history[0]["objective/scores"] == refilled.state.log_history[0]["objective/scores"]


# ---- construction errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (dict(advantage_estimator="rloo", num_generations=1), "set num_generations >= 2"),
    (dict(advantage_estimator="grpo", num_generations=3), "must be a multiple of num_generations=3"),
    (dict(advantage_estimator="rloo", critic_learning_rate=1e-3), "critic_learning_rate is set"),
    (dict(advantage_estimator="reinforce_pp", whiten_rewards=True), "whiten_rewards is set"),
    (dict(advantage_estimator="grpo", lam_critic=1.0), "lam_critic is set"),
    (dict(use_bias_correction_kl=True), "use_bias_correction_kl=True corrects the KL loss term"),
    (dict(use_kl_loss=True, kl_coef=0.0), "use_kl_loss=True with kl_coef=0"),
    (dict(importance_sampling_level="group"), "importance_sampling_level='group'"),
    (dict(num_generations=1, drop_uniform_groups=True), "drop_uniform_groups=True compares the responses"),
    (dict(max_refill_rounds=2), "max_refill_rounds=2 refills .* set drop_uniform_groups=True"),
    (dict(max_refill_rounds=-1, drop_uniform_groups=True), r"max_refill_rounds=-1: must be an integer >= 0"),
    (dict(max_refill_rounds=1.5, drop_uniform_groups=True), r"max_refill_rounds=1.5: must be an integer >= 0"),
    (dict(advantage_estimator="rloo", critic_updates_per_step=2), "critic_updates_per_step is set"),
    (dict(num_generations=1, lam_critic=1.5), r"lam_critic=1.5: must be None \(lam\) or in \[0, 1\]"),
    (dict(advantage_estimator="ppo"), "advantage_estimator='ppo'"),
    (dict(num_generations=0), "num_generations"),
    (dict(advantage_estimator="rloo", scale_rewards=False), "scale_rewards='none' applies to advantage_estimator='grpo'"),
    (dict(critic="reward_lora", critic_quantization="4bit"), "critic_quantization is set, but it applies to"),
    (dict(critic_model_init_kwargs={"revision": "main"}), "critic_model_init_kwargs is set, but it applies to"),
])
def test_bad_estimator_settings_are_refused(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **overrides)


def test_too_few_prompts_counts_groups(tiny_models, tokenizer, tmp_path):
    # 8 responses in groups of 2: 4 prompts per iteration, 3 given.
    with pytest.raises(ValueError, match=r"samples 4 prompts .* / num_generations 2\), but train_dataset has 3"):
        make_trainer(tiny_models, tokenizer, tmp_path, prompts=PROMPTS[:3], advantage_estimator="rloo")


def test_value_head_model_with_critic_free_estimator_uses_its_causal_lm(tiny_models, tokenizer, tmp_path):
    given = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_models["policy"])
    with pytest.warns(UserWarning, match="value head .* is not used"):
        trainer = make_trainer(tiny_models, tokenizer, tmp_path, model=given, advantage_estimator="rloo")
    assert trainer.model.policy_model is given.pretrained_model and not trainer.model.has_critic
    assert not any("v_head" in n for n, _ in trainer.model.named_parameters())


# ---- VAPO's length-adaptive lambda (`lam_length_alpha`) --------------------------------------------------------------
# VAPO's length-adaptive lambda (`lam_length_alpha`) for the actor's GAE advantages.
#
# Each response gets lambda_i = 1 - 1 / (alpha * l_i), l_i its number of real (policy) tokens, clamped at 0; the
# critic's returns keep `lam_critic` (or `lam`). Hand-computed GAE with each row's own lambda, the length count
# (padding and an environment's tokens are no length), the option through a real tiny PPOLMTrainer rollout, the
# construction checks, and the card.

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
LAM_SCORES = torch.tensor([1.0, 1.0])
LAM_MASK = torch.tensor([[True, True, False, False], [True, True, True, True]])
VALUES = torch.full((2, 4), 0.5)
LAM_KL = torch.zeros(2, 4)
VAPO = EstimatorSettings(kl_coef=0.0, gamma=1.0, lam=0.95, whiten_advantages=False, lam_length_alpha=1.0)
# deltas: 0 everywhere but the last real token (1 - 0.5 = 0.5); A_t = lambda * A_{t+1} before it.
# row 0: [0.5 * 0.5, 0.5]; row 1: [0.75^3 * 0.5, 0.75^2 * 0.5, 0.75 * 0.5, 0.5].
ACTOR = torch.tensor([[0.25, 0.5, 0.0, 0.0], [0.2109375, 0.28125, 0.375, 0.5]])


def test_gae_uses_each_rows_own_lambda_for_the_actor():
    """Pins the actor's advantages to GAE with lambda 0.5 on the short row and 0.75 on the long one (one lambda for
    the batch, `lam`'s 0.95 or a length counted with padding, gives other numbers)."""
    out = GAE(LAM_SCORES, LAM_KL, LAM_MASK, VALUES, VAPO)
    torch.testing.assert_close(out["advantages"], ACTOR)
    # compute_gae itself takes the (batch,) lambdas.
    torch.testing.assert_close(compute_gae(out["rewards"], VALUES, LAM_MASK, 1.0, torch.tensor([0.5, 0.75]))[0], ACTOR)


def test_the_critics_returns_keep_lam_critic_or_lam():
    """Pins that the length-adaptive lambda is the actor's only: the critic's returns are GAE(lam_critic) + V (VAPO's
    decoupled GAE, 1.0: the Monte-Carlo return 1 on every real token), or GAE(lam) + V when lam_critic is None."""
    decoupled = GAE(LAM_SCORES, LAM_KL, LAM_MASK, VALUES, VAPO._replace(lam_critic=1.0))
    torch.testing.assert_close(decoupled["advantages"], ACTOR)
    torch.testing.assert_close(decoupled["returns"], torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    # lam 0.95: row 0 A = [0.475, 0.5]; row 1 A = [0.5 * 0.95^3, 0.5 * 0.95^2, 0.475, 0.5]; returns = A + 0.5.
    coupled = GAE(LAM_SCORES, LAM_KL, LAM_MASK, VALUES, VAPO)
    torch.testing.assert_close(coupled["returns"],
                               torch.tensor([[0.975, 1.0, 0.0, 0.0], [0.9286875, 0.95125, 0.975, 1.0]]))
    off = GAE(LAM_SCORES, LAM_KL, LAM_MASK, VALUES, VAPO._replace(lam_length_alpha=None))
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


# ---- advantage_estimator='auto' (EVPO, Pan et al. 2026; issue 61) ---------------------------------------------------
# Per batch, GAE where the critic explains the returns, else the group baseline: hand-built batches for both branches,
# the threshold's edge and the masks; the rollout's metric; the construction errors; one short training run.
# 2 prompts x k=2, one real token each (the score lands on it), no KL: the Monte-Carlo return is the score.
AUTO_SCORES = torch.tensor([1.0, 0.0, 1.0, 0.0])
AUTO_NO_KL = torch.zeros(4, 1)
AUTO_ONE = torch.ones(4, 1, dtype=torch.bool)
AUTO_GOOD = torch.tensor([[0.9], [0.1], [0.8], [0.2]])  # R - V = [.1, -.1, .2, -.2]: Var 0.025 of Var(R) 0.25 -> EV 0.9
AUTO_FLAT = torch.full((4, 1), 0.5)  # R - V = [.5, -.5, .5, -.5]: Var(R - V) = Var(R) -> EV exactly 0
AUTO_SETTINGS = EstimatorSettings(kl_coef=1.0, num_generations=2, whiten_advantages=False, advantage_estimator="auto")


def test_critic_explains_by_hand_and_at_the_threshold_edge():
    uses, ev = critic_explains(AUTO_GOOD, AUTO_SCORES[:, None], AUTO_ONE)
    assert bool(uses) and ev.item() == pytest.approx(0.9)
    uses, ev = critic_explains(AUTO_FLAT, AUTO_SCORES[:, None], AUTO_ONE)
    assert ev.item() == 0.0 and not bool(uses)  # EV = 0: the critic does no better than the mean (EVPO: <= 0 loses)
    assert bool(critic_explains(AUTO_GOOD, AUTO_SCORES[:, None], AUTO_ONE, threshold=0.85)[0])
    assert not bool(critic_explains(AUTO_GOOD, AUTO_SCORES[:, None], AUTO_ONE, threshold=0.9 + 1e-6)[0])
    assert bool(critic_explains(AUTO_FLAT, AUTO_SCORES[:, None], AUTO_ONE, threshold=-1e-6)[0])


def test_masked_positions_do_not_change_the_choice():
    # A second, masked position holding garbage values and returns: EV and the choice are the first column's.
    mask = torch.tensor([[True, False]] * 4)
    values = torch.cat([AUTO_GOOD, torch.tensor([[50.0], [-9.0], [3.0], [7.0]])], 1)
    returns = torch.cat([AUTO_SCORES[:, None], torch.tensor([[-4.0], [8.0], [0.0], [1.0]])], 1)
    uses, ev = critic_explains(values, returns, mask)
    assert bool(uses) and ev.item() == pytest.approx(0.9)
    uses, ev = critic_explains(values, returns, torch.zeros_like(mask))  # no real token: no evidence for the critic
    assert not bool(uses) and math.isnan(ev.item())


def test_auto_uses_gae_where_the_critic_explains_the_returns():
    out = ESTIMATORS["auto"].compute(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_GOOD, AUTO_SETTINGS)
    as_gae = AUTO_SETTINGS._replace(advantage_estimator="gae")
    gae = ESTIMATORS["gae"].compute(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_GOOD, as_gae)
    for key in ("rewards", "non_score_rewards", "advantages", "returns"):
        torch.testing.assert_close(out[key], gae[key])
    torch.testing.assert_close(out["advantages"], AUTO_SCORES[:, None] - AUTO_GOOD)  # one token: A = R - V
    assert out["stats"]["objective/auto_uses_gae"].item() == 1.0
    assert out["stats"]["objective/auto_explained_variance"].item() == pytest.approx(0.9)


def test_auto_uses_the_group_baseline_where_the_critic_does_not_and_the_critic_still_learns():
    out = ESTIMATORS["auto"].compute(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_FLAT, AUTO_SETTINGS)
    # GRPO over the groups [1, 0] and [1, 0]: (R - mean) / (sample std + eps) = +-0.5 / (0.7071 + 1e-4).
    group = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(out["advantages"], torch.tensor([[group], [-group], [group], [-group]]))
    as_gae = AUTO_SETTINGS._replace(advantage_estimator="gae")
    gae = ESTIMATORS["gae"].compute(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_FLAT, as_gae)
    torch.testing.assert_close(out["returns"], gae["returns"])  # the critic's target either way
    assert out["stats"]["objective/auto_uses_gae"].item() == 0.0


def test_the_group_branch_compares_the_kl_penalised_sequence_returns_over_real_tokens():
    # Two tokens, the second masked for rows 1 and 3; kl_coef 1: R = score - sum KL over real tokens.
    scores = torch.tensor([1.0, 3.0, 0.0, 2.0])
    kl = torch.tensor([[0.5, 0.5], [0.0, 9.0], [1.0, 1.0], [0.0, 9.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    out = ESTIMATORS["auto"].compute(scores, kl, mask, torch.zeros(4, 2), AUTO_SETTINGS._replace(scale_rewards=False))
    assert out["stats"]["objective/auto_uses_gae"].item() == 0.0  # V = 0 explains nothing: EV = 0
    # R = [0, 3, -2, 2]; Dr. GRPO (scale_rewards=False): R - group mean = [-1.5, 1.5, -2, 2], on real tokens only.
    expected = torch.tensor([[-1.5, -1.5], [1.5, 0.0], [-2.0, -2.0], [2.0, 0.0]])
    torch.testing.assert_close(out["advantages"], expected)
    torch.testing.assert_close(grpo_advantages(torch.tensor([0.0, 3.0, -2.0, 2.0]), 2, scale_rewards=False),
                               expected[:, 0])


def test_the_threshold_setting_decides():
    strict = AUTO_SETTINGS._replace(auto_ev_threshold=0.95)
    used = ESTIMATORS["auto"].compute(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_GOOD, strict)["stats"]
    assert used["objective/auto_uses_gae"] == 0
    lenient = AUTO_SETTINGS._replace(auto_ev_threshold=-0.5)
    used = ESTIMATORS["auto"].compute(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_FLAT, lenient)["stats"]
    assert used["objective/auto_uses_gae"] == 1


def test_with_use_kl_loss_both_branches_see_no_kl():
    kl = torch.ones(4, 1)
    out = estimate(AUTO_SCORES, kl, AUTO_ONE, AUTO_FLAT, AUTO_SETTINGS._replace(use_kl_loss=True))
    plain = estimate(AUTO_SCORES, AUTO_NO_KL, AUTO_ONE, AUTO_FLAT, AUTO_SETTINGS)
    torch.testing.assert_close(out["advantages"], plain["advantages"])
    torch.testing.assert_close(out["non_score_rewards"], -kl)
    assert "stats" in out


def test_a_nan_score_takes_its_whole_group_out_for_auto():
    scores = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    assert unscored_rows(scores, AUTO_SETTINGS).tolist() == [True, True, False, False]
    gae = AUTO_SETTINGS._replace(advantage_estimator="gae")
    assert unscored_rows(scores, gae).tolist() == [False, True, False, False]


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
