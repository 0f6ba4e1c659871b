"""Issue 27: environments (multi-turn episodes, tool calls) and the step API.

The environment's tokens are context: exactly zero gradient and zero KL there; per-position rewards are credited to
the policy token that led to them; the first PPO ratio is exactly 1; a resume part-way through an iteration is
bitwise equal; the NaN guard, missing scores and critic-free estimators work with an environment; `step()` gives the
same update as the built-in loop on the same samples. (GAE over an interleaved sequence: tests/test_ppo_math.py.)
"""

import pytest
import torch
from datasets import Dataset
from test_reliability import assert_same_weights, logged, make_args

from hf_ppo import EnvSample, Environment, PPOLMTrainer
from hf_ppo.rollout.environments import collate, credit_to_policy_tokens
from hf_ppo.algorithms.ppo_math import ppo_loss
from hf_ppo.rollout.steps import compute_advantages

REPLY = [7, 8, 9]  # the environment's reply: three fixed token ids


class TwoTurn(Environment):
    """The policy answers, the environment replies (REPLY), the policy answers again; score = the second answer's
    length, and a per-turn reward of 0.5 on the reply's last token (credited to the first answer's last token)."""

    def __init__(self, score=True, nan_calls=()):
        self.calls, self.seen, self.nan_calls = 0, [], set(nan_calls)

    def rollout(self, prompts, sample):
        self.calls += 1
        first = sample([p.ids for p in prompts], max_new_tokens=3)
        reply = torch.tensor(REPLY)
        contexts = [torch.cat([p.ids, f, reply]) for p, f in zip(prompts, first)]
        self.seen.append(contexts)
        second = sample(contexts, max_new_tokens=3)
        out = []
        for f, s in zip(first, second):
            mask = torch.cat([torch.ones(len(f)), torch.zeros(len(REPLY)), torch.ones(len(s))]).bool()
            rewards = torch.zeros(len(mask))
            rewards[len(f) + len(REPLY) - 1] = 0.5
            score = float("nan") if self.calls in self.nan_calls else float(len(s))
            out.append(EnvSample(torch.cat([f, reply, s]), mask, score, rewards))
        return out


def dataset():
    return Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 4})


def env_trainer(tiny_models, tokenizer, out, environment=None, reward=None, **overrides):
    overrides = {"response_length": 12, **overrides}
    return PPOLMTrainer(model=tiny_models["policy"], args=make_args(out, **overrides), processing_class=tokenizer,
                        reward_model=reward, train_dataset=dataset(), environment=environment or TwoTurn())


def rollout_batch(trainer):
    """One rollout (steps 1-10) of the trainer's first prompts."""
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(trainer.args.rollout_batch_size)])
    return trainer._rollout(inputs)


# ---- the pieces ------------------------------------------------------------------------------------------------------
def test_rewards_are_credited_to_the_policy_token_that_led_to_them():
    mask = torch.tensor([True, True, False, False, True])
    credited = credit_to_policy_tokens(torch.tensor([0.0, 0.0, 0.0, 2.0, 1.0]), mask)
    assert credited.tolist() == [0.0, 2.0, 0.0, 0.0, 1.0]  # the reply's reward goes to the answer before it
    with pytest.raises(ValueError, match="before the policy's first token"):
        credit_to_policy_tokens(torch.tensor([1.0, 0.0]), torch.tensor([False, True]))


@pytest.mark.parametrize("samples, message", [
    ([EnvSample(torch.tensor([1, 2]), torch.tensor([True, True]))], "1 samples for 2 prompts"),
    ([EnvSample(torch.tensor([1, 2]), torch.tensor([True]))] * 2, "a policy_mask of 1"),
    ([EnvSample(torch.arange(5), torch.ones(5, dtype=torch.bool))] * 2, "more than response_length=4"),
    ([EnvSample(torch.tensor([1, 2]), torch.tensor([False, False]))] * 2, "no policy token"),
    ([EnvSample(torch.tensor([1]), torch.tensor([True]), 1.0, torch.tensor([float("nan")]))] * 2, "finite floats"),
])
def test_bad_environment_samples_are_named(samples, message):
    with pytest.raises(ValueError, match=message):
        collate(samples, 2, 4, 0, "cpu")


def test_per_position_rewards_join_gae_rewards_and_critic_free_scores():
    mask = torch.tensor([[True, False, True]])
    step = torch.tensor([[0.5, 0.0, 0.0]])
    zeros = torch.zeros(1, 3)
    common = dict(kl_coef=0.1, kl_estimator="k1", gamma=1.0, lam=1.0, whiten_rewards=False, whiten_advantages=False)
    _, gae = compute_advantages(zeros, zeros, zeros, mask, torch.tensor([2.0]), step_rewards=step, **common)
    assert gae["rewards"].tolist() == [[0.5, 0.0, 2.0]]
    assert gae["advantages"].tolist() == [[2.5, 0.0, 2.0]]  # gamma = lam = 1, V = 0: the rewards still to come
    _, rloo = compute_advantages(zeros, zeros, None, mask.repeat(2, 1), torch.tensor([2.0, 0.0]),
                                 step_rewards=step.repeat(2, 1), advantage_estimator="rloo", num_generations=2,
                                 **common)
    assert rloo["returns"][:, 0].tolist() == [2.5, 0.5]  # the score plus the sum of the per-position rewards


# ---- training on an environment --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env_batch(tiny_models, tokenizer, tmp_path_factory):
    trainer = env_trainer(tiny_models, tokenizer, tmp_path_factory.mktemp("env"))
    return trainer, rollout_batch(trainer)


def test_the_policy_answers_again_after_the_environment_replies(env_batch):
    trainer, batch = env_batch
    env = trainer.environment
    first_turn_contexts = env.seen[0]
    for row in range(len(batch)):
        prompt = batch.queries[row][batch.query_mask[row]]
        assert first_turn_contexts[row][:len(prompt)].tolist() == prompt.tolist()
        assert first_turn_contexts[row][-len(REPLY):].tolist() == REPLY  # the second turn sees the reply
        env_positions = ~batch.policy_mask[row] & batch.response_mask[row]
        assert batch.responses[row][env_positions].tolist() == REPLY
        after_reply = int(env_positions.nonzero().max()) + 1
        assert batch.scores[row] == batch.policy_mask[row, after_reply:].sum()  # the environment's own score


def test_environment_tokens_get_zero_kl_zero_advantage_and_zero_gradient(env_batch):
    trainer, batch = env_batch
    env = batch.response_mask & ~batch.policy_mask
    assert env.any() and (batch.policy_mask & batch.response_mask).any()
    for name in ("rewards", "non_score_rewards", "advantages", "returns"):
        assert torch.all(getattr(batch, name)[env] == 0), name
    # The reply's 0.5 reward sits on the first answer's last token (with its KL penalty).
    last_first = env.long().argmax(1) - 1
    rows = torch.arange(len(batch))
    assert torch.allclose(batch.rewards[rows, last_first] - batch.non_score_rewards[rows, last_first],
                          torch.full((len(batch),), 0.5))
    # Every loss term: d loss / d logits is exactly zero at the environment's positions, non-zero at the policy's.
    logits = torch.randn(*batch.responses.shape, trainer.model.config.vocab_size, requires_grad=True)
    values = torch.randn(batch.responses.shape, requires_grad=True)
    loss, _ = ppo_loss(logits, values, batch.responses, batch.logprobs, batch.values, batch.advantages, batch.returns,
                       batch.policy_mask, batch.policy_mask.sum(), temperature=1.0, cliprange=0.2,
                       cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.01, ref_logprobs=batch.ref_logprobs,
                       kl_loss_coef=0.1)
    loss.backward()
    assert torch.all(logits.grad[env] == 0) and torch.all(values.grad[env] == 0)
    assert logits.grad[batch.policy_mask].abs().sum() > 0 and values.grad[batch.policy_mask].abs().sum() > 0


def test_first_ratio_is_exactly_one_and_the_loss_reads_the_policy_mask(tiny_models, tokenizer, tmp_path, monkeypatch):
    import hf_ppo.trainer.ppo_trainer

    calls, real = [], hf_ppo.trainer.ppo_trainer.ppo_loss
    monkeypatch.setattr(hf_ppo.trainer.ppo_trainer, "ppo_loss", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    trainer = env_trainer(tiny_models, tokenizer, tmp_path, num_ppo_epochs=1, num_mini_batches=1, max_steps=1)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["val/ratio"] == 1.0 and first["policy/approxkl_avg"] == 0.0 and first["objective/kl"] == 0.0
    mask, normalizer = calls[0][7], calls[0][8]  # the whole rollout is the one micro-batch
    assert torch.equal(mask, trainer._schedule.batch.policy_mask) and normalizer == mask.sum()
    assert not torch.equal(mask, trainer._schedule.batch.response_mask)


def test_resume_mid_iteration_with_an_environment_is_bitwise_equal(tiny_models, tokenizer, tmp_path):
    # One iteration of 4 steps, saved after 3: the rollout (with its policy_mask) comes from the checkpoint.
    straight = env_trainer(tiny_models, tokenizer, tmp_path / "straight", save_strategy="steps", save_steps=3,
                           max_steps=4)
    straight.train()
    from safetensors.torch import load_file

    buffer = load_file(str(tmp_path / "straight" / "checkpoint-3" / "rollout_buffer.safetensors"))
    assert not torch.equal(buffer["policy_mask"], buffer["response_mask"])
    resumed = env_trainer(tiny_models, tokenizer, tmp_path / "resumed", max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert_same_weights(straight, resumed)
    assert logged(straight) == logged(resumed)


def test_a_nan_score_from_the_environment_is_dropped_and_sampled_again(tiny_models, tokenizer, tmp_path):
    env = TwoTurn(nan_calls={1})
    trainer = env_trainer(tiny_models, tokenizer, tmp_path, environment=env, num_ppo_epochs=1, num_mini_batches=1, max_steps=1)
    trainer.train()
    assert env.calls == 2 and trainer.state.log_history[0]["nonfinite/dropped_rollouts"] == 1


def test_samples_without_a_score_use_the_rewards_on_the_whole_episode(tiny_models, tokenizer, tmp_path):
    class Unscored(TwoTurn):
        def rollout(self, prompts, sample):
            return [s._replace(score=None if i % 2 else s.score) for i, s in enumerate(super().rollout(prompts, sample))]

    seen = []

    def reward(prompts, completions):
        seen.extend(completions)
        return [100.0] * len(completions)

    def one(prompts, completions):
        return [1.0] * len(completions)

    # Mixed rewards: a weighted list, as without an environment.
    trainer = env_trainer(tiny_models, tokenizer, tmp_path, environment=Unscored(), reward=[reward, one],
                          reward_weights=[1.0, 2.0])
    seen.clear()  # the construction-time probe
    batch = rollout_batch(trainer)
    assert (batch.scores[1::2] == 102).all() and (batch.scores[::2] < 100).all()
    reply_text = tokenizer.decode(REPLY)
    assert all(reply_text in text for text in seen)  # the environment's tokens are part of what is scored


def test_a_missing_score_without_a_reward_model_is_an_error_naming_the_fix(tiny_models, tokenizer, tmp_path):
    class Unscored(TwoTurn):
        def rollout(self, prompts, sample):
            return [s._replace(score=None) for s in super().rollout(prompts, sample)]

    trainer = env_trainer(tiny_models, tokenizer, tmp_path, environment=Unscored())
    with pytest.raises(ValueError, match="EnvSample.score"):
        rollout_batch(trainer)


def test_an_environment_that_is_not_one_fails_at_construction(tiny_models, tokenizer, tmp_path):
    with pytest.raises(TypeError, match="subclass hf_ppo.Environment"):
        env_trainer(tiny_models, tokenizer, tmp_path, environment=object())


def test_critic_free_estimator_with_groups_trains_on_an_environment(tiny_models, tokenizer, tmp_path):
    trainer = env_trainer(tiny_models, tokenizer, tmp_path, advantage_estimator="grpo", num_generations=2,
                          max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.iteration == 1


# ---- the step API ------------------------------------------------------------------------------------------------------
def test_step_gives_the_same_update_as_the_built_in_loop(tiny_models, tokenizer, tmp_path, monkeypatch):
    from scripted_engine import ScriptedEngine

    def count_e(prompts, completions):
        return [float(c.count("e")) for c in completions]

    # Fixed minibatch orders (no shuffle) so both paths split the rollout alike.
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: torch.arange(n, device=kw.get("device")))
    script = [tokenizer.encode(" the food was great and the story was fun", add_special_tokens=False)[:6],
              tokenizer.encode(" the movie was bad but the music was nice", add_special_tokens=False)[:6]]
    settings = dict(max_steps=4, lr_scheduler_type="constant", stop_token=None)
    loop = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path / "loop", **settings),
                        processing_class=tokenizer, reward_model=count_e, train_dataset=dataset())
    loop.rollout_engine = engine = ScriptedEngine(script)
    loop.train()

    queries, query_mask = engine.queries[0]
    prompts = [q[m] for q, m in zip(queries, query_mask)]
    responses = [torch.tensor(script[i % 2]) for i in range(len(prompts))]
    scores = count_e(None, tokenizer.batch_decode(responses, skip_special_tokens=True))
    stepped = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path / "step", **settings),
                           processing_class=tokenizer)
    stats = stepped.step(prompts, responses, [torch.tensor(s) for s in scores])
    assert_same_weights(loop, stepped)
    assert stepped.kl_ctl.value == loop.kl_ctl.value and stepped.state.global_step == 4
    for key in ("objective/kl", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/clipfrac", "ppo/mean_scores"):
        assert isinstance(stats[key], float), key
    assert stats["ppo/mean_scores"] == pytest.approx(sum(scores) / len(scores))


def test_step_masks_environment_tokens_and_checks_its_arguments(tiny_models, tokenizer, tmp_path):
    trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer,
                           args=make_args(tmp_path, per_device_train_batch_size=2, num_mini_batches=1,
                                          num_ppo_epochs=1, max_steps=2))
    queries = [torch.tensor(tokenizer.encode("the movie was"))] * 2
    responses = [torch.tensor([10, 11, 7, 8, 12])] * 2
    masks = [torch.tensor([1, 1, 0, 0, 1])] * 2
    trainer.step(queries, responses, [1.0, 0.0], response_masks=masks)
    assert trainer.state.global_step == 1
    with pytest.raises(ValueError, match="scores must be a list of 2"):
        trainer.step(queries, responses, [1.0])


def test_step_refuses_the_refill_which_samples_train_dataset(tiny_models, tokenizer, tmp_path):
    args = make_args(tmp_path, per_device_train_batch_size=2, num_mini_batches=1, max_steps=2, num_generations=2,
                     drop_uniform_groups=True, max_refill_rounds=1)
    with pytest.raises(ValueError, match="max_refill_rounds=1 refills with prompts sampled from train_dataset, and "
                                         "there is none"):
        PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, args=args)
    trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, args=args,
                           train_dataset=dataset(), reward_model=lambda prompts, completions: [0.0] * len(prompts))
    queries = [torch.tensor(tokenizer.encode("the movie was"))] * 2
    with pytest.raises(ValueError, match=r"step\(\): max_refill_rounds=1 .* set max_refill_rounds=0"):
        trainer.step(queries, [torch.tensor([10, 11])] * 2, [1.0, 0.0])
    assert trainer.state.global_step == 0


def test_a_trl_0_11_loop_trains_with_generate_and_step(tiny_models, tokenizer, tmp_path):
    # The README's TRL 0.11 loop body: generate your own responses, score them, step().
    from scripted_engine import fingerprint

    trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer,
                           args=make_args(tmp_path, per_device_train_batch_size=2, num_mini_batches=2,
                                          num_ppo_epochs=1, max_steps=4, response_length=4))
    before = fingerprint(trainer.model.policy_model)
    query_tensors = [torch.tensor(tokenizer.encode(p)) for p in ["the movie was", "the food was", "a", "the"]]
    for _ in range(2):
        response_tensors = trainer.generate(query_tensors, return_prompt=False, max_new_tokens=4, do_sample=True,
                                            top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)
        assert all(r.dim() == 1 and 0 < len(r) <= 4 for r in response_tensors)
        rewards = [torch.tensor(float(len(r))) for r in response_tensors]
        stats = trainer.step(query_tensors, response_tensors, rewards)
    assert trainer.state.global_step == 4 and fingerprint(trainer.model.policy_model) != before
    assert {"objective/kl", "objective/kl_coef", "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total",
            "ppo/policy/clipfrac", "ppo/policy/approxkl", "ppo/mean_scores", "ppo/learning_rate"} <= set(stats)
    full = trainer.generate(query_tensors[0], max_new_tokens=3, do_sample=False)
    assert full.shape[0] == 1 and full[0, :len(query_tensors[0])].tolist() == query_tensors[0].tolist()


def test_the_tool_use_recipe_runs(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import tool_use

    assert tool_use.calculator("12 * 7") == "84" and tool_use.calculator("3 - 9") == "-6"
    result = tool_use.main(["--output_dir", str(tmp_path), "--quick"])
    assert result["iterations"] == 1 and 0 <= result["success_before"] <= 1 and 0 <= result["success_after"] <= 1
    assert (tmp_path / "tool_use.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "reward_lora"])
def test_the_other_critics_train_on_an_environment(critic, tiny_models, tokenizer, tmp_path):
    from test_reliability import lora

    trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, reward_model=tiny_models["reward"],
                           args=make_args(tmp_path, critic=critic, response_length=12, num_ppo_epochs=1,
                                          num_mini_batches=1, max_steps=1),
                           train_dataset=dataset(), environment=TwoTurn(), peft_config=lora())
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["val/ratio"] == 1.0 and "loss/value_avg" in first
    batch = trainer._schedule.batch
    assert torch.all(batch.returns[batch.response_mask & ~batch.policy_mask] == 0)


def test_evaluate_with_an_environment_says_it_samples_single_turn(tiny_models, tokenizer, tmp_path):
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, response_length=12),
                           processing_class=tokenizer, reward_model=lambda p, c: [1.0] * len(c),
                           train_dataset=dataset(), eval_dataset=dataset(), environment=TwoTurn())
    with pytest.warns(UserWarning, match=r"the environment's episodes .* are not part of this evaluation"):
        trainer.evaluate()
