"""`step()` (hf_ppo/trainer/step_api.py) and environments checked where their samples enter.

step(): groups of num_generations must be one prompt's samples; a call past max_steps under a decaying schedule is
refused; save_steps writes checkpoints; empty, float, negative or out-of-embedding ids and malformed scores are
errors naming the argument and index; responses longer than response_length train when they fit the context.
Environments: `rollout` returning dicts / tuples, a string or two-element score, bad token ids, and `sample([])` or
2-D sequences are errors naming the environment, the sample and the fix. Tiny offline models from conftest.py.
"""

import os

import pytest
import torch
from datasets import Dataset
from tests.devices import device_of
from tests.trainer.test_checkpoint import make_args
from transformers import AutoModelForCausalLM

from hf_ppo import Environment, EnvSample, PPOLMTrainer

PROMPT = "the movie was"


def step_trainer(tiny_models, tokenizer, out, model=None, **overrides):
    """A trainer for step(): 2 samples per call, one optimizer step per call unless overridden."""
    settings = {**dict(per_device_train_batch_size=2, num_mini_batches=1, num_ppo_epochs=1, max_steps=4,
                       response_length=4), **overrides}
    return PPOLMTrainer(model=model if model is not None else tiny_models["policy"], processing_class=tokenizer,
                        args=make_args(out, **settings))


def ids(text, tokenizer):
    return torch.tensor(tokenizer.encode(text))


# ---- item 6: groups, the schedule's end, save_steps ------------------------------------------------------------------
def test_step_refuses_groups_that_are_not_one_prompts_samples(tiny_models, tokenizer, tmp_path):
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, per_device_train_batch_size=4, advantage_estimator="grpo",
                           num_generations=2, lr_scheduler_type="constant")
    a, b, c, d = (ids(p, tokenizer) for p in ["the movie was", "the food was", "the book was", "the show was"])
    responses, scores = [torch.tensor([10, 11])] * 4, [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"num_generations=2, and queries\[0:2\] are not one prompt's 2 samples "
                                         r"\(queries\[1\] differs from queries\[0\]\)\. The 2 samples of a prompt "
                                         r"must be consecutive"):
        trainer.step([a, b, c, d], responses, scores)
    with pytest.raises(ValueError, match=r"queries\[2:4\] are not one prompt's 2 samples"):
        trainer.step([a, a.clone(), a, b], responses, scores)
    assert trainer.state.global_step == 0
    trainer.step([a, a.clone(), b, b], responses, scores)  # grouped: trains
    assert trainer.state.global_step == 1


def test_a_step_past_max_steps_under_a_decaying_schedule_is_refused(tiny_models, tokenizer, tmp_path):
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, max_steps=1)  # the default schedule: linear
    queries, responses = [ids(PROMPT, tokenizer)] * 2, [torch.tensor([10, 11])] * 2
    trainer.step(queries, responses, [1.0, 0.0])
    before = {k: v.clone() for k, v in trainer.model.policy_model.state_dict().items()}
    with pytest.raises(ValueError, match=r"this call's optimizer steps 2-2 go past max_steps=1, where the "
                                         r"lr_scheduler_type='linear' schedule ends .* Set max_steps to the number "
                                         r"of step\(\) calls x optimizer_steps_per_iteration \(1 = .*lr_scheduler_type="
                                         r"'constant'"):
        trainer.step(queries, responses, [1.0, 0.0])
    assert trainer.state.global_step == 1
    after = trainer.model.policy_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a constant schedule has no end
    constant = step_trainer(tiny_models, tokenizer, tmp_path / "constant", max_steps=1, lr_scheduler_type="constant")
    for _ in range(2):
        constant.step(queries, responses, [1.0, 0.0])
    assert constant.state.global_step == 2


def test_step_writes_the_checkpoints_save_steps_asks_for(tiny_models, tokenizer, tmp_path):
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, save_strategy="steps", save_steps=2, max_steps=3,
                           lr_scheduler_type="constant")
    queries, responses = [ids(PROMPT, tokenizer)] * 2, [torch.tensor([10, 11])] * 2
    trainer.step(queries, responses, [1.0, 0.0])
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_path))
    trainer.step(queries, responses, [1.0, 0.0])
    trainer.step(queries, responses, [1.0, 0.0])  # max_steps: Trainer saves at the end of training too
    saved = sorted(name for name in os.listdir(tmp_path) if name.startswith("checkpoint-"))
    assert saved == ["checkpoint-2", "checkpoint-3"]
    assert os.path.isfile(tmp_path / "checkpoint-2" / "trainer_state.json")  # complete: Trainer writes it last


def test_a_call_whose_optimizer_steps_jump_past_a_multiple_of_save_steps_ends_with_a_checkpoint(tiny_models, tokenizer,
                                                                                              tmp_path):
    """Two optimizer steps per call, save_steps=3: the second call's steps 3-4 pass step 3, where train() would have
    saved, without ending on it; the call ends with checkpoint-4 (at the end of the call, never half an update).
    The third call's steps 5-6 reach 6: checkpoint-6."""
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, num_mini_batches=2, save_strategy="steps", save_steps=3,
                           max_steps=10, lr_scheduler_type="constant")
    assert trainer.args.optimizer_steps_per_iteration == 2
    queries, responses = [ids(PROMPT, tokenizer)] * 4, [torch.tensor([10, 11])] * 4
    saved = []
    for _ in range(3):
        trainer.step(queries, responses, [1.0, 0.0, 0.5, 0.2])
        saved.append(sorted(name for name in os.listdir(tmp_path) if name.startswith("checkpoint-")))
    assert trainer.state.global_step == 6
    assert saved == [[], ["checkpoint-4"], ["checkpoint-4", "checkpoint-6"]]
    assert os.path.isfile(tmp_path / "checkpoint-4" / "trainer_state.json")


def test_a_prompt_and_response_exactly_filling_the_context_train_and_one_token_more_is_refused(tiny_models,
                                                                                              tokenizer, tmp_path):
    """The policy's context (max_position_embeddings, 256 for the tiny Llama) holds prompt + response exactly: such a
    pair trains, also beside a longer prompt that pads it on the left. One token more is refused, naming both."""
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, lr_scheduler_type="constant")
    context = trainer.model.policy_model.config.max_position_embeddings
    short, long = ids(PROMPT, tokenizer), ids("the food at the old place was", tokenizer)
    assert len(short) < len(long)
    exact = [torch.full((context - len(short),), 10), torch.full((context - len(long),), 11)]
    stats = trainer.step([short, long], exact, [1.0, 0.0])
    assert trainer.state.global_step == 1 and torch.isfinite(torch.tensor(stats["ppo/loss/total"]))
    assert stats["tokens/responses_len_mean"] == (2 * context - len(short) - len(long)) / 2
    over = torch.full((context - len(long) + 1,), 11)
    with pytest.raises(ValueError, match=rf"step\(\): queries\[1\] \({len(long)} tokens\) \+ responses\[1\] "
                                         rf"\({len(over)} tokens\) exceed the policy's context of {context} positions: "
                                         rf"shorten the prompt, or generate at most {context - len(long)} new tokens"):
        trainer.step([short, long], [exact[0], over], [1.0, 0.0])
    assert trainer.state.global_step == 1


def test_step_after_the_collapse_watch_stopped_training_is_refused(tiny_models, tokenizer, tmp_path):
    # A KL threshold below any real KL: the watch fires at the second logged step() and stop_on_collapse stops;
    # train() would end there, so a later step() must not go on training the collapsed policy in silence.
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, lr_scheduler_type="constant", learning_rate=1e-2,
                           logging_steps=1, stop_on_collapse=True, collapse_kl_threshold=1e-9)
    queries, responses = [ids(PROMPT, tokenizer)] * 2, [torch.tensor([10, 11])] * 2
    with pytest.warns(UserWarning, match="Collapse watch"):
        for _ in range(3):
            trainer.step(queries, responses, [1.0, 0.0])
            if trainer.control.should_training_stop:
                break
    assert trainer.control.should_training_stop
    with pytest.raises(ValueError, match=r"step\(\): stop_on_collapse=True and the collapse watch stopped training"):
        trainer.step(queries, responses, [1.0, 0.0])


def test_step_refuses_a_save_strategy_it_cannot_honour(tiny_models, tokenizer, tmp_path):
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, save_strategy="epoch")
    with pytest.raises(ValueError, match=r"save_strategy='epoch' .* step\(\) has neither: set save_strategy='steps'"):
        trainer.step([ids(PROMPT, tokenizer)] * 2, [torch.tensor([10, 11])] * 2, [1.0, 0.0])


# ---- items 6 and 7: step()'s arguments -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checked(tiny_models, tokenizer, tmp_path_factory):
    return step_trainer(tiny_models, tokenizer, tmp_path_factory.mktemp("checked"))


@pytest.mark.parametrize("change, error, message", [
    (lambda q, r, s: (q[:1] + [torch.tensor([], dtype=torch.long)], r, s), ValueError,
     r"step\(\): queries\[1\] is empty"),
    (lambda q, r, s: ([q[0].float()] + q[1:], r, s), TypeError,
     r"step\(\): queries\[0\] has dtype torch.float32: token ids must be integers"),
    (lambda q, r, s: (q, [r[0], torch.tensor([10, -1])], s), ValueError,
     r"step\(\): responses\[1\] holds the token id -1 at position 1, outside 0 <= id < 417"),
    (lambda q, r, s: (q, [torch.tensor([10, 417])] + r[1:], s), ValueError,
     r"step\(\): responses\[0\] holds the token id 417 at position 1, outside 0 <= id < 417, the policy's embedding"),
    (lambda q, r, s: ([torch.tensor([5, 9999])] + q[1:], r, s), ValueError,
     r"step\(\): queries\[0\] holds the token id 9999"),
    (lambda q, r, s: (q, [r[0], r[1].unsqueeze(0)], s), ValueError, r"step\(\): responses\[1\] has shape \(1, 2\)"),
    (lambda q, r, s: (q, r, [1.0, "good"]), TypeError, r"step\(\): scores\[1\] is str 'good': give one number"),
    (lambda q, r, s: (q, r, [torch.tensor([1.0, 2.0]), 0.0]), ValueError, r"step\(\): scores\[0\] has shape \(2,\)"),
], ids=["empty-query", "float-ids", "negative-id", "id-past-embedding", "query-id-past-embedding", "2d-response",
        "string-score", "two-element-score"])
def test_step_refuses_bad_ids_and_scores_naming_the_argument_and_index(checked, tokenizer, change, error, message):
    queries, responses, scores = change([ids(PROMPT, tokenizer)] * 2, [torch.tensor([10, 11])] * 2, [1.0, 0.0])
    with pytest.raises(error, match=message):
        checked.step(queries, responses, scores)
    assert checked.state.global_step == 0


def test_step_refuses_bad_response_masks_naming_them(checked, tokenizer):
    queries, responses = [ids(PROMPT, tokenizer)] * 2, [torch.tensor([10, 11])] * 2
    with pytest.raises(ValueError, match=r"step\(\): response_masks\[1\] is all 0"):
        checked.step(queries, responses, [1.0, 0.0], response_masks=[torch.tensor([1, 1]), torch.tensor([0, 0])])
    with pytest.raises(ValueError, match=r"step\(\): response_masks\[0\] \(shape \(3,\)\) must be 2 flags 0/1"):
        checked.step(queries, responses, [1.0, 0.0], response_masks=[torch.tensor([1, 1, 0]), torch.tensor([1, 1])])


def test_ids_of_padded_embedding_rows_are_accepted(tiny_models, tokenizer, tmp_path):
    # Embedding rows past the tokenizer's vocabulary (padded to a multiple of 8, say) are ids the policy can embed.
    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    model.resize_token_embeddings(len(tokenizer) + 15)
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, model=model, num_sample_generations=1)
    extra = len(tokenizer) + 3  # no text in the tokenizer, a row in the embedding
    queries = [torch.cat([ids(PROMPT, tokenizer), torch.tensor([extra])])] * 2
    stats = trainer.step(queries, [torch.tensor([10, extra, 11])] * 2, [1.0, 0.0])
    assert trainer.state.global_step == 1 and torch.isfinite(torch.tensor(stats["ppo/loss/total"]))
    with pytest.raises(ValueError, match=rf"responses\[0\] holds the token id {len(tokenizer) + 15} .* < "
                                         rf"{len(tokenizer) + 15}"):
        trainer.step(queries, [torch.tensor([10, len(tokenizer) + 15])] * 2, [1.0, 0.0])


# ---- item 11: responses longer than response_length ----------------------------------------------------------------
def test_step_trains_responses_longer_than_response_length_that_fit_the_context(tiny_models, tokenizer, tmp_path):
    trainer = step_trainer(tiny_models, tokenizer, tmp_path, response_length=4, per_device_train_batch_size=2,
                           num_mini_batches=2, gradient_accumulation_steps=1)
    query = ids(PROMPT, tokenizer)
    responses = [torch.arange(10, 17), torch.tensor([10, 11]), torch.arange(20, 29), torch.tensor([12])]
    stats = trainer.step([query] * 4, responses, [1.0, 0.0, 0.5, 0.2])
    assert trainer.state.global_step == 2 and torch.isfinite(torch.tensor(stats["ppo/loss/total"]))
    assert stats["tokens/responses_len_mean"] == pytest.approx((7 + 2 + 9 + 1) / 4)
    context = trainer.model.policy_model.config.max_position_embeddings
    too_long = torch.full((context - len(query) + 1,), 10)
    with pytest.raises(ValueError, match=rf"step\(\): queries\[1\] \({len(query)} tokens\) \+ responses\[1\] "
                                         rf"\({len(too_long)} tokens\) exceed the policy's context of {context}"):
        trainer.step([query] * 4, [responses[0], too_long] + responses[2:], [1.0, 0.0, 0.5, 0.2])
    overlong = step_trainer(tiny_models, tokenizer, tmp_path / "overlong", overlong_buffer_length=2)
    with pytest.raises(ValueError, match=r"responses\[0\] has 7 tokens, more than response_length=4, against which "
                                         r"overlong_buffer_length=2 penalises"):
        overlong.step([query] * 2, [responses[0], responses[1]], [1.0, 0.0])


# ---- item 7: environments ------------------------------------------------------------------------------------------
class Faulty(Environment):
    """Answers each prompt with a policy sample, then returns what `fault` makes of the samples."""

    def __init__(self, fault):
        self.fault = fault

    def rollout(self, prompts, sample):
        return self.fault(prompts, sample)


def good(prompts, sample):
    return [EnvSample(s, torch.ones(len(s), dtype=torch.bool), 1.0) for s in sample([p.ids for p in prompts])]


@pytest.fixture(scope="module")
def env_trainer(tiny_models, tokenizer, tmp_path_factory):
    dataset = Dataset.from_dict({"prompt": ["the movie was", "the food was"] * 2})
    return PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, train_dataset=dataset,
                        environment=Faulty(good), args=make_args(tmp_path_factory.mktemp("env"), response_length=4,
                                                                 per_device_train_batch_size=2, num_mini_batches=1))


def run_rollout(trainer, fault):
    trainer.environment = Faulty(fault)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(trainer.args.rollout_batch_size)])
    device = device_of(trainer.model)  # where training hands the prompts over (`_prepare_inputs`)
    return trainer._rollout({k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()})


FIX = "1-D token tensors, one per conversation to continue"


@pytest.mark.parametrize("fault, error, message", [
    (lambda p, s: [dict(tokens=torch.tensor([10]), policy_mask=torch.tensor([True]), score=1.0)] * 2, TypeError,
     r"Faulty.rollout sample 0 is a dict .*: return hf_ppo.EnvSample\(tokens, policy_mask, score, rewards\) for each "
     r"prompt \(EnvSample\(\*\*d\) from a dict"),
    (lambda p, s: [(torch.tensor([10]), torch.tensor([True]), 1.0)] * 2, TypeError,
     r"Faulty.rollout sample 0 is a tuple"),
    (lambda p, s: [EnvSample(torch.tensor([10]), torch.tensor([True]), "good")] * 2, TypeError,
     r"Faulty.rollout sample 0: score is str 'good': give a number"),
    (lambda p, s: [EnvSample(torch.tensor([10]), torch.tensor([True]), torch.tensor([1.0, 0.0]))] * 2, ValueError,
     r"Faulty.rollout sample 0: score has shape \(2,\)"),
    (lambda p, s: [EnvSample(torch.tensor([10, -4]), torch.tensor([True, False]), 1.0)] * 2, ValueError,
     r"Faulty.rollout sample 0: tokens holds the token id -4 at position 1"),
    (lambda p, s: [EnvSample(torch.tensor([10]), torch.tensor([True]), 1.0),
                   EnvSample(torch.tensor([10, 600]), torch.tensor([True, False]), 1.0)], ValueError,
     r"Faulty.rollout sample 1: tokens holds the token id 600 at position 1, outside 0 <= id < 417"),
    (lambda p, s: [EnvSample(torch.tensor([10.0, 11.0]), torch.tensor([True, True]), 1.0)] * 2, TypeError,
     r"Faulty.rollout sample 0: tokens has dtype torch.float32"),
    (lambda p, s: s([]), ValueError, rf"Faulty.rollout called sample\(\[\]\): there is no sequence to continue. "
                                     rf"Pass sample\(\) a list of {FIX}"),
    (lambda p, s: s([p[0].ids.unsqueeze(0), p[1].ids]), ValueError,
     rf"Faulty.rollout called sample\(\) with sequences\[0\], which has shape \(1, \d+\): token ids must be "
     rf"1-D .*{FIX}"),
    (lambda p, s: s(torch.stack([p[0].ids, p[0].ids])), TypeError,
     rf"Faulty.rollout called sample\(\) with a Tensor of shape \(2, \d+\). Pass sample\(\) a list of {FIX}"),
    (lambda p, s: s([torch.cat([p[0].ids, torch.tensor([999])]), p[1].ids]), ValueError,
     r"Faulty.rollout called sample\(\) with sequences\[0\], which holds the token id 999"),
], ids=["dict", "tuple", "string-score", "two-element-score", "negative-id", "id-past-embedding", "float-ids",
        "sample-empty", "sample-2d-sequence", "sample-2d-tensor", "sample-id-past-embedding"])
def test_bad_environment_output_is_an_error_naming_the_environment_and_sample(env_trainer, fault, error, message):
    with pytest.raises(error, match=message):
        run_rollout(env_trainer, fault)


def test_a_good_environment_still_rolls_out(env_trainer):
    batch = run_rollout(env_trainer, good)
    assert batch is not None and batch.responses.shape == (2, 4)


# ---- a NaN/inf score of one sample -----------------------------------------------------------------------------------
def test_a_nonfinite_score_given_to_step_leaves_its_sample_out_with_a_warning(tiny_models, tokenizer, tmp_path):
    trainer = step_trainer(tiny_models, tokenizer, tmp_path)
    query = ids(PROMPT, tokenizer)
    with pytest.warns(UserWarning, match=r"step\(\) \(its score\) returned inf for row 1 of the batch"):
        stats = trainer.step([query] * 2, [torch.tensor([10, 11]), torch.tensor([12, 13])], [1.0, float("inf")])
    assert trainer.state.global_step == 1 and torch.isfinite(torch.tensor(stats["ppo/loss/total"]))
    assert trainer._guard.unscored == 1 and trainer._guard.dropped_rollouts == 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
