"""Environments (multi-turn episodes, tool calls) and the step API.

The environment's tokens are context: exactly zero gradient and zero KL there; per-position rewards are credited to
the policy token that led to them; the first PPO ratio is exactly 1; a resume part-way through an iteration is
bitwise equal; the NaN guard, missing scores and critic-free estimators work with an environment; `step()` gives the
same update as the built-in loop on the same samples. (GAE over an interleaved sequence:
tests/algorithms/test_ppo_math.py.)
"""

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM

from hf_ppo import Environment, EnvSample, PPOLMTrainer
from hf_ppo.algorithms.estimators import EstimatorSettings
from hf_ppo.algorithms.ppo_math import LossSettings, ppo_loss
from hf_ppo.rollout.engines import KVCacheSampler, RolloutEngine, SamplingSettings, StaticCacheSampler
from hf_ppo.rollout.environments import collate, credit_to_policy_tokens
from hf_ppo.rollout.steps import RolloutParts, compute_advantages, environment_samples, sample_and_score
from tests.devices import device_of
from tests.trainer.test_checkpoint import assert_same_weights, logged, make_args
from tests.wiring_models import RecordingTrainer

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
    """One rollout (steps 1-10) of the trainer's first prompts, on the policy's device as training hands them over."""
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(trainer.args.rollout_batch_size)])
    device = device_of(trainer.model)
    return trainer._rollout({k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()})


# ---- the pieces ------------------------------------------------------------------------------------------------------
def test_rewards_are_credited_to_the_policy_token_that_led_to_them():
    mask = torch.tensor([True, True, False, False, True])
    credited = credit_to_policy_tokens(torch.tensor([0.0, 0.0, 0.0, 2.0, 1.0]), mask)
    assert credited.tolist() == [0.0, 2.0, 0.0, 0.0, 1.0]  # the reply's reward goes to the answer before it
    with pytest.raises(ValueError, match="before the policy's first token"):
        credit_to_policy_tokens(torch.tensor([1.0, 0.0]), torch.tensor([False, True]))


def test_a_negative_reward_is_credited_as_it_is_and_summed_with_the_others_by_hand():
    """A penalty (a negative reward, e.g. a failed tool call) is credited like any reward: to the policy token at or
    before it, summed with the others credited there. By hand: mask [1, 1, 0, 0, 1, 0] gives the owners
    [0, 1, 1, 1, 4, 4]; rewards [0, 0, -1.5, 0.5, 0, -2] -> token 1 gets -1.5 + 0.5 = -1.0, token 4 gets -2.0. A
    negative reward before the policy's first token is refused as a positive one is."""
    mask = torch.tensor([True, True, False, False, True, False])
    rewards = torch.tensor([0.0, 0.0, -1.5, 0.5, 0.0, -2.0])
    assert credit_to_policy_tokens(rewards, mask).tolist() == [0.0, -1.0, 0.0, 0.0, -2.0, 0.0]
    with pytest.raises(ValueError, match="before the policy's first token"):
        credit_to_policy_tokens(torch.tensor([-1.0, 0.0]), torch.tensor([False, True]))
    # collate: the same credit in the batch's step_rewards, zeros in the padding and for a sample without rewards.
    samples = [EnvSample(torch.tensor([10, 11, 7, 8, 12, 13]), mask, -0.5, rewards),
               EnvSample(torch.tensor([10, 11]), torch.tensor([True, True]), 1.0)]
    out = collate(samples, 2, 8, 0, "cpu")
    assert out.step_rewards.tolist() == [[0.0, -1.0, 0.0, 0.0, -2.0, 0.0, 0.0, 0.0], [0.0] * 8]
    assert out.scores.tolist() == [-0.5, 1.0] and out.given.tolist() == [True, True]


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
    common = EstimatorSettings(kl_coef=0.1, kl_estimator="k1", gamma=1.0, lam=1.0, whiten_rewards=False,
                               whiten_advantages=False)
    _, gae = compute_advantages(zeros, zeros, zeros, mask, torch.tensor([2.0]), common, step_rewards=step)
    assert gae["rewards"].tolist() == [[0.5, 0.0, 2.0]]
    assert gae["advantages"].tolist() == [[2.5, 0.0, 2.0]]  # gamma = lam = 1, V = 0: the rewards still to come
    _, rloo = compute_advantages(zeros, zeros, None, mask.repeat(2, 1), torch.tensor([2.0, 0.0]),
                                 common._replace(advantage_estimator="rloo", num_generations=2),
                                 step_rewards=step.repeat(2, 1))
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
    device = batch.responses.device  # the policy's
    rows = torch.arange(len(batch), device=device)
    assert torch.allclose(batch.rewards[rows, last_first] - batch.non_score_rewards[rows, last_first],
                          torch.full((len(batch),), 0.5, device=device))
    # Every loss term: d loss / d logits is exactly zero at the environment's positions, non-zero at the policy's.
    logits = torch.randn(*batch.responses.shape, trainer.model.config.vocab_size, device=device, requires_grad=True)
    values = torch.randn(batch.responses.shape, device=device, requires_grad=True)
    loss, _ = ppo_loss(logits, values, batch, batch.policy_mask.sum(),
                       LossSettings(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1,
                                    entropy_coef=0.01), kl_loss_coef=0.1)
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
    mask, normalizer = calls[0][2].policy_mask, calls[0][3]  # the whole rollout is the one micro-batch
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


class OnDevice(TwoTurn):
    """`TwoTurn` (whose `torch.cat([p.ids, f, torch.tensor(REPLY)])` needs CPU tensors), recording the device of
    every tensor it is given, and handing `sample` and the trainer everything on `device` (the policy's)."""

    def __init__(self, device):
        super().__init__()
        self.device, self.given = device, []

    def rollout(self, prompts, sample):
        self.given += [p.ids.device for p in prompts]

        def sample_on_device(sequences, max_new_tokens=None):
            new = sample([s.to(self.device) for s in sequences], max_new_tokens=max_new_tokens)
            self.given += [t.device for t in new]
            return new

        return [EnvSample(*(t.to(self.device) if torch.is_tensor(t) else t for t in s))
                for s in super().rollout(prompts, sample_on_device)]


class RecordsDevices(RolloutEngine):
    """The trainer's engine, recording the devices of the prompts it is asked to continue."""

    def __init__(self, engine):
        self.engine, self.devices = engine, []

    def generate(self, model, queries, query_mask):
        self.devices.append((queries.device, query_mask.device))
        return self.engine.generate(model, queries, query_mask)


def test_the_environment_works_on_cpu_tensors_whatever_the_policys_device(tiny_models, tokenizer, tmp_path):
    """An environment written and tested on a CPU runs unchanged on a GPU: `Prompt.ids` and what `sample` returns are
    CPU tensors; the sequences it passes to `sample` and the samples it returns may be on any device (here the
    policy's); the engine samples on the policy's device and the batch lands there. With CUDA visible the policy is
    on the GPU and every one of these crosses devices; on a CPU-only machine they pin the same contract."""
    trainer = env_trainer(tiny_models, tokenizer, tmp_path)
    device = device_of(trainer.model)
    trainer.environment = env = OnDevice(device)
    trainer.rollout_engine = recorder = RecordsDevices(trainer.rollout_engine)
    batch = rollout_batch(trainer)
    assert env.calls == 1 and len(env.given) == 3 * len(batch)  # the prompts, then two turns of new tokens
    assert {d.type for d in env.given} == {"cpu"}
    assert len(recorder.devices) == 2 and set(recorder.devices) == {(device, device)}
    assert batch.responses.device == device and batch.policy_mask.device == device
    for row in range(len(batch)):  # the episodes came through as the environment returned them
        env_positions = ~batch.policy_mask[row] & batch.response_mask[row]
        assert batch.responses[row][env_positions].tolist() == REPLY
        assert batch.scores[row] == batch.policy_mask[row, int(env_positions.nonzero().max()) + 1:].sum()


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
    from tests.scripted_engine import ScriptedEngine

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
    from tests.scripted_engine import fingerprint

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

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import tool_use

    assert tool_use.calculator("12 * 7") == "84" and tool_use.calculator("3 - 9") == "-6"
    result = tool_use.main(["--output_dir", str(tmp_path), "--quick"])
    assert result["iterations"] == 1 and 0 <= result["success_before"] <= 1 and 0 <= result["success_after"] <= 1
    assert (tmp_path / "tool_use.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "reward_lora"])
def test_the_other_critics_train_on_an_environment(critic, tiny_models, tokenizer, tmp_path):
    from tests.trainer.test_checkpoint import lora

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


# ---- environments and the rollout engines, pinned --------------------------------------------------------------------
# Pins of environments and the rollout engines:
#
# - An environment's `sample()` left-pads the sequences it continues: with prompts and turns of different lengths,
#   every continuation is exactly what the policy gives the sequence alone (one row, no padding, no KV cache).
# - `missing_eos_penalty` follows the documented rule (docs/guides/environments.md): it applies when the *policy*
#   never sampled a stop token; a stop token the environment writes itself does not count, and one the policy sampled
#   in an earlier turn does.
# - `rollout/tokens_per_second` counts the tokens the policy sampled: not the environment's, not the padding.
# - Both engines: a row that samples its stop token early gets padding after it (it never starts again), the other
#   rows keep sampling to the end, and step 2 masks everything after the stop token.

# Real prompt lengths 1, 2, 3 and 7 tokens with the tiny tokenizer.
PROMPTS = ["a", "the show", "the movie was", "the food was great and the service"]
STOP_AT = 4  # sequence position (counting real tokens from 0) where `StopsAt` writes EOS
R = 12


class StopsAt(nn.Module):
    """The tiny policy, except that the token at sequence position `STOP_AT` is its stop token (EOS) and EOS and
    padding are impossible anywhere else: a row stops exactly there or never, and no padding comes from the model.
    Positions are the position ids the engines pass (real tokens only), so a prompt of length L < `STOP_AT` stops
    at its new token `STOP_AT - L`, and a longer one never does."""

    def __init__(self, lm, eos: int, pad: int):
        super().__init__()
        self.lm, self.config, self.eos, self.pad = lm, lm.config, eos, pad

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def forward(self, input_ids, position_ids=None, **kwargs):
        out = self.lm(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if position_ids is None:  # an unpadded sequence: positions 0..L-1
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        logits = out.logits.clone()
        forced = position_ids[:, -logits.shape[1]:] + 1 == STOP_AT  # the next token sits at STOP_AT
        logits[..., [self.eos, self.pad]] = float("-inf")
        logits[forced] = float("-inf")
        logits[..., self.eos] = torch.where(forced, 0.0, float("-inf"))
        out.logits = logits
        return out


@pytest.fixture(scope="module")
def stops_at(tiny_models, tokenizer):
    lm = AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).eval()
    return StopsAt(lm, tokenizer.eos_token_id, tokenizer.pad_token_id).eval()


class Holder(nn.Module):
    """What `sample_and_score` / `environment_samples` read of the actor-critic: its `policy_model`."""

    def __init__(self, policy_model):
        super().__init__()
        self.policy_model = policy_model


def engine(kind: str, tokenizer, **overrides):
    settings = dict(response_length=R, temperature=1.0, top_k=1, top_p=1.0, forward_batch_size=8)
    extra = {k: overrides.pop(k) for k in ("check_every",) if k in overrides}
    settings.update(overrides)
    stops = dict(pad_token_id=tokenizer.pad_token_id, stop_token_ids=[tokenizer.eos_token_id])
    if kind == "static":
        return StaticCacheSampler(SamplingSettings(**settings), compile=False, prompt_bucket=16, **stops, **extra)
    return KVCacheSampler(SamplingSettings(**settings), **stops)


@torch.no_grad()
def alone(model, sequence: torch.Tensor, eos: int, limit: int) -> list[int]:
    """Greedy continuation of one unpadded sequence by full forwards (no KV cache, no batch), up to and including
    its first stop token, at most `limit` tokens: what any batched, padded, cached sampler must give."""
    ids, out = sequence[None], []
    while len(out) < limit:
        token = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(token)
        if token == eos:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def encode(tokenizer, prompts):
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


# ---- the engines: early stops --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kv_cache", "static"])
def test_a_row_that_stops_early_gets_padding_and_the_others_sample_to_the_end(kind, stops_at, tokenizer):
    """Pins: a row that stopped starts sampling again (its `done` flag lost or not applied), or the static engine's
    stop check ends every row once any row stopped; and step 2 keeps or masks the wrong tokens around the stop."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    queries, query_mask = encode(tokenizer, PROMPTS)
    lengths = query_mask.sum(1).tolist()
    assert lengths == [1, 2, 3, 7]
    # check_every=8 < R: a stop check that ends the batch when any row stopped would cut row 3 after 8 tokens.
    sampler = engine(kind, tokenizer, check_every=8) if kind == "static" else engine(kind, tokenizer)
    out = sampler.generate(stops_at, queries, query_mask)
    assert out.shape == (len(PROMPTS), R)
    for row, length in enumerate(lengths):
        expected = alone(stops_at, queries[row][query_mask[row]], eos, R)
        end = STOP_AT - length + 1 if length < STOP_AT else R  # tokens up to and including the stop
        assert len(expected) == end and (expected[-1] == eos) == (length < STOP_AT), row
        assert out[row, :end].tolist() == expected, row
        assert (out[row, end:] == pad).all(), row  # after the stop token: padding, never a new start
    # Step 2 on what the engine sampled: the stop token is real, everything after it is masked.
    parts = RolloutParts(sampler, lambda prompts, completions: [0.0] * len(completions), tokenizer, [eos])
    samples = sample_and_score(parts, Holder(stops_at), queries, query_mask, PROMPTS, batch_size=8)
    ends = torch.tensor([STOP_AT - n + 1 if n < STOP_AT else R for n in lengths])
    assert torch.equal(samples.response_mask, torch.arange(R)[None] < ends[:, None])
    assert samples.contains_stop.tolist() == [True, True, True, False]
    assert torch.equal(samples.responses, out)


# ---- environments: sample() continues unpadded sequences ----------------------------------------------------------
ROW_REPLY = [300, 301, 302]  # the environment's reply: 1 to 3 of these tokens, by row


class Replies(Environment):
    """Two policy turns around a reply of a different length per row; records every (sequence, continuation)."""

    def __init__(self):
        self.calls = []

    def rollout(self, prompts, sample):
        first = self.turn(sample, [p.ids for p in prompts], 5)
        replies = [torch.tensor(ROW_REPLY[:1 + row % 3]) for row in range(len(prompts))]
        contexts = [torch.cat([p.ids, f, r]) for p, f, r in zip(prompts, first, replies)]
        second = self.turn(sample, contexts, 4)
        return [EnvSample(torch.cat([f, r, s]), torch.cat([torch.ones(len(f)), torch.zeros(len(r)),
                                                           torch.ones(len(s))]).bool(), 0.0)
                for f, r, s in zip(first, replies, second)]

    def turn(self, sample, sequences, max_new_tokens):
        new = sample(sequences, max_new_tokens=max_new_tokens)
        self.calls.append((sequences, new, max_new_tokens))
        return new


@pytest.mark.parametrize("kind", ["kv_cache", "static"])
def test_sample_continues_each_sequence_as_the_policy_continues_it_alone(kind, stops_at, tokenizer):
    """Pins the padding side of the batch `sample()` builds (right padding, or padding the model attends to):
    prompts of 1-7 tokens, first turns of 2-5 tokens (three rows stop, one is cut at max_new_tokens) and replies of
    1-3 tokens, so every call continues sequences of different lengths."""
    eos = tokenizer.eos_token_id
    queries, query_mask = encode(tokenizer, PROMPTS)
    env = Replies()
    parts = RolloutParts(engine(kind, tokenizer), None, tokenizer, [eos], environment=env)
    out = environment_samples(parts, Holder(stops_at), queries, query_mask, PROMPTS, batch_size=8, response_length=R)
    assert len(env.calls) == 2
    for sequences, continuations, limit in env.calls:
        assert len({len(s) for s in sequences}) == len(sequences)  # every length differs: the padding matters
        for sequence, continuation in zip(sequences, continuations):
            assert continuation.tolist() == alone(stops_at, sequence, eos, limit), sequence.tolist()
    first = [len(c) for c in env.calls[0][1]]
    assert first == [4, 3, 2, 5]  # stopped at STOP_AT, or cut at max_new_tokens
    # The episode as training gets it: policy, reply, policy, then padding, masked.
    for row, sequence in enumerate(env.calls[1][0]):
        episode = torch.cat([sequence[int(query_mask[row].sum()):], env.calls[1][1][row]])
        T = len(episode)
        assert out.responses[row, :T].tolist() == episode.tolist()
        assert (out.responses[row, T:] == tokenizer.pad_token_id).all() and out.response_mask[row].sum() == T
    assert out.contains_stop.tolist() == [True, True, True, False]


# ---- environments: whose stop token counts, and what tokens/second counts -----------------------------------------
class TurnScript(RolloutEngine):
    """Scripted policy turns: call k of `generate` returns `turns[k % len(turns)]` (one row per prompt), whatever the
    model says."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.calls = [torch.tensor(t) for t in turns], 0

    def generate(self, model, queries, query_mask):
        turn = self.turns[self.calls % len(self.turns)]
        self.calls += 1
        return turn[:queries.shape[0]].to(queries.device)


def scripted_episodes(eos: int):
    """Four episodes (turn 1 cut at 4 tokens, the reply, turn 2 cut at 3) and the penalty the documented rule gives
    each with missing_eos_penalty=1: 0. the policy never stops, the environment's reply holds EOS: penalised;
    1. the policy stops in turn 1, not in turn 2: not penalised; 2. nobody stops: penalised; 3. the policy stops in
    turn 2: not penalised."""
    a, b, c, d, e, f, x = 310, 311, 312, 313, 314, 315, 316
    turn1 = [[a, b, c, d, e, f], [a, eos, x, x, x, x], [b, c, d, e, f, a], [c, d, e, f, a, b]]
    turn2 = [[d, e, f, a, b, c], [e, f, a, b, c, d], [f, a, b, c, d, e], [a, eos, x, x, x, x]]
    replies = [[300, eos, 301], [300], [301, 302], [302]]
    return turn1, turn2, replies, [-1.0, 0.0, -1.0, 0.0]


class ScriptedReplies(Environment):
    def __init__(self, replies):
        self.replies = replies

    def rollout(self, prompts, sample):
        first = sample([p.ids for p in prompts], max_new_tokens=4)
        replies = [torch.tensor(r) for r in self.replies]
        second = sample([torch.cat([p.ids, f, r]) for p, f, r in zip(prompts, first, replies)], max_new_tokens=3)
        return [EnvSample(torch.cat([f, r, s]), torch.cat([torch.ones(len(f)), torch.zeros(len(r)),
                                                           torch.ones(len(s))]).bool(), 0.0)
                for f, r, s in zip(first, replies, second)]


def test_missing_eos_penalty_and_tokens_per_second_read_the_policys_tokens(tiny_models, tokenizer, tmp_path):
    """Pins the documented rule of `missing_eos_penalty` with an environment (the policy never sampled a stop token;
    the environment's own EOS does not count, an earlier turn's does), and that `rollout/tokens_per_second` counts
    the policy's tokens: not the environment's (response_mask), not the padding (B x response_length)."""
    eos = tokenizer.eos_token_id
    turn1, turn2, replies, penalties = scripted_episodes(eos)
    trainer = RecordingTrainer(
        model=tiny_models["policy"], processing_class=tokenizer, environment=ScriptedReplies(replies),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        args=make_args(tmp_path, per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1, max_steps=1,
                       response_length=R, missing_eos_penalty=1.0))
    assert list(trainer.stop_token_ids) == [eos]
    trainer.rollout_engine = TurnScript([turn1, turn2])
    trainer.train()
    assert trainer.rollout_engine.calls == 2

    def stop_cut(row, limit):
        return row[:row.index(eos) + 1][:limit] if eos in row else row[:limit]

    expected, policy_tokens, env_tokens = {}, 0, 0
    for t1, reply, t2, penalty in zip(turn1, replies, turn2, penalties):
        first, second = stop_cut(t1, 4), stop_cut(t2, 3)
        expected[tuple(first + reply + second)] = penalty
        policy_tokens, env_tokens = policy_tokens + len(first) + len(second), env_tokens + len(reply)
    batch = trainer.micro_batches[0]
    assert len(batch) == 4
    got = {tuple(batch.responses[row][batch.response_mask[row]].tolist()): float(batch.scores[row])
           for row in range(4)}
    assert got == expected
    log = trainer.state.log_history[0]
    assert log["rollout/eos_rate"] == 0.5
    counted = log["rollout/tokens_per_second"] * log["time/generate"]
    assert policy_tokens == 25 and env_tokens == 7
    assert counted == pytest.approx(policy_tokens, rel=1e-4)
