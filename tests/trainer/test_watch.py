"""The collapse and reward-hacking watch (hf_ppo/trainer/watch.py): each signature from logged metrics, once; silence on a
healthy run; a run made to collapse (a far too high learning rate) warns, and stops when asked."""

from __future__ import annotations

import math
import os
import shutil
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import get_last_checkpoint

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.tiny import build_causal_lm
from hf_ppo.trainer.watch import CollapseWarning, CollapseWatch, add_watch
from hf_ppo.trl011 import AutoModelForCausalLMWithValueHead
from hf_ppo.trl011 import PPOConfig as TrlPPOConfig
from hf_ppo.trl011 import PPOTrainer as TrlPPOTrainer
from tests.devices import CUDA, on_device_of

# The runs made to collapse below reproduce CPU runs step by step (the value loss, KL and entropy they pin, the step
# each signature shows at): they are about the watch's logic, not a device or a precision, so they run on the CPU
# (use_cpu=True, fp32) where a GPU is visible too. There the GPU's own sampling RNG and its default bf16 would make
# another run whose signatures show at other steps.
ON_THE_CPU = dict(use_cpu=True)

PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 2})


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def feed(watch, logs_list):
    """Feed logged dicts to the watch; return the warnings it gave and whether it asked to stop."""
    state, control = TrainerState(), TrainerControl()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step, logs in enumerate(logs_list, 1):
            state.global_step = step
            watch.on_log(None, state, control, logs=dict(logs))
    return [str(w.message) for w in record if issubclass(w.category, CollapseWarning)], control.should_training_stop


def watch(**kwargs):
    return CollapseWatch(kl_threshold=kwargs.pop("kl_threshold", None), stop=kwargs.pop("stop", False),
                         last_checkpoint=kwargs.pop("last_checkpoint", lambda: None), kl_reason="3 x kl_target")


def test_length_rising_while_entropy_falls_warns_once_with_its_fixes():
    logs = [{"rollout/response_length": 10 + 2 * i, "policy/entropy_avg": 2.0 - 0.2 * i} for i in range(8)]
    # At the 6th log (the first judged): start = mean of logs 1-3 (length 12, entropy 1.8), now = logs 4-6 (18 >=
    # 1.3 x 12, 1.2 <= 0.7 x 1.8); the logs after it repeat the signature, which warns only once.
    messages, stop = feed(watch(), logs)
    assert len(messages) == 1 and "step 6: responses grew from 12.0 to 18.0 tokens" in messages[0]
    assert "entropy fell from 1.800 to 1.200" in messages[0]
    assert "missing_eos_penalty" in messages[0] and not stop


def test_no_signature_before_two_windows_of_logs_and_none_for_a_steady_run():
    rising = [{"rollout/response_length": 10 + 5 * i, "policy/entropy_avg": 2.0 - 0.3 * i} for i in range(5)]
    assert feed(watch(), rising) == ([], False)  # 5 logs: too few to judge a trend
    steady = [{"rollout/response_length": 8 + i % 2, "policy/entropy_avg": 2.0, "objective/kl": 1.0,
               "policy/clipfrac_avg": 0.1, "loss/value_avg": 0.5 + i % 3} for i in range(20)]
    assert feed(watch(kl_threshold=18.0), steady) == ([], False)


def test_kl_beyond_its_threshold_clip_fraction_and_value_loss():
    logs = [{"objective/kl": kl, "policy/clipfrac_avg": c, "loss/value_avg": v}
            for kl, c, v in [(1, 0.1, 0.1), (2, 0.1, 0.1), (3, 0.1, 0.1), (20, 0.1, 20), (20, 0.1, 20), (20, 0.8, 20)]]
    messages, _ = feed(watch(kl_threshold=18.0), logs)
    # From n logs on, start and now are the first and last min(3, n // 2): value loss at log 4 ((0.1 + 20) / 2 over
    # 0.1: 100.5x), KL at log 5 ((20 + 20) / 2 > 18; (3 + 20) / 2 at log 4 is not), the clip fraction at log 6.
    assert [m[:len("Collapse watch, step 4:")] for m in messages] == [
        "Collapse watch, step 4:", "Collapse watch, step 5:", "Collapse watch, step 6:"]
    assert "rose from 0.1 to 10.1, over 100x" in messages[0] and "whiten_rewards" in messages[0]
    assert "averages 20.00 nats" in messages[1] and "last 2 logs" in messages[1]
    assert "beyond 18 (3 x kl_target)" in messages[1]
    # clip fraction: (0.1 + 0.1 + 0.8) / 3 = 0.33 > 0.3 (0.1 + 0.1 + 0.1 before: fine)
    assert "clip fraction" in messages[2] and "averages 0.33" in messages[2] and "learning_rate" in messages[2]
    messages, _ = feed(watch(kl_threshold=None), logs)
    assert len(messages) == 2 and not any("nats" in m for m in messages)  # no KL check without a threshold


def test_training_reward_beating_the_reference_while_a_judge_loses_is_reward_hacking():
    hacked = {"eval_reward/rm/win_rate_low": 0.7, "eval_judge/judge/win_rate_high": 0.3}
    messages, stop = feed(watch(stop=True, last_checkpoint=lambda: "out/checkpoint-4"), [hacked])
    assert len(messages) == 1 and "'rm'" in messages[0] and "'judge'" in messages[0]
    assert stop and "the last complete checkpoint is out/checkpoint-4" in messages[0]
    unsure = {"eval_reward/rm/win_rate_low": 0.7, "eval_judge/judge/win_rate_high": 0.6}  # the judge may not lose
    assert feed(watch(), [unsure]) == ([], False)


def config(tmp_path, **overrides):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_ppo_epochs=4, max_steps=24,
                    response_length=8, logging_steps=1, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0)
    defaults.update(overrides)
    return PPOConfig(**defaults)


def run(tiny_models, tokenizer, args):
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=PROMPTS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in record if issubclass(w.category, CollapseWarning)]


def test_a_healthy_tiny_run_stays_silent(tiny_models, tokenizer, tmp_path):
    # 6 iterations of one update each: enough logs for every trend to be judged.
    trainer, messages = run(tiny_models, tokenizer, config(tmp_path, learning_rate=1e-5, adaptive_kl=True,
                                                           num_ppo_epochs=1, max_steps=6))
    assert messages == [] and trainer.state.global_step == 6


def test_a_far_too_high_learning_rate_warns_and_stops_when_asked(tiny_models, tokenizer, tmp_path):
    # learning_rate=1: the first update sends KL to the reference to about 42 nats (3 x kl_target = 18) and the
    # value loss from 0.18 to 119, judged at the 2nd iteration (one update each); entropy is below a tenth at the 3rd.
    fast = dict(learning_rate=1.0, adaptive_kl=True, num_ppo_epochs=1, **ON_THE_CPU)
    trainer, messages = run(tiny_models, tokenizer, config(tmp_path, max_steps=6, **fast))
    assert len(messages) == 3 and "step 2: KL to the reference" in messages[0] and "kl_coef" in messages[0]
    assert "step 2: the value loss" in messages[1] and "step 3: the policy's entropy" in messages[2]
    assert "stop_on_collapse=True stops training" in messages[0] and trainer.state.global_step == 6
    trainer, messages = run(tiny_models, tokenizer, config(tmp_path / "stop", max_steps=12, stop_on_collapse=True,
                                                           save_strategy="steps", save_steps=1, **fast))
    assert len(messages) == 2 and trainer.state.global_step == 2  # of 12: KL and value loss at step 2
    assert "training stops now; the last complete checkpoint is" in messages[0] and "checkpoint-1" in messages[0]


def test_stop_on_collapse_needs_the_watch(tmp_path):
    with pytest.raises(ValueError, match="stop_on_collapse=True with watch_collapse=False"):
        config(tmp_path, watch_collapse=False, stop_on_collapse=True)


# ---- the default settings, non-finite metrics, a stop's checkpoint ---------------------------------------------------
# A far too high learning rate under the default settings (a fixed kl_coef, the shared critic) warns; non-finite
# metrics never poison it; a stop by `stop_on_collapse` leaves the checkpoint the warning names the newest one, so
# `resume_from_checkpoint=True` resumes the last good state.

NAN = float("nan")


def default_config(path, **overrides):
    # PPOConfig's defaults (fixed kl_coef=0.05, critic='shared', num_ppo_epochs=4, logging_steps=10) unless overridden.
    defaults = dict(output_dir=str(path), per_device_train_batch_size=4, response_length=8, report_to=[],
                    save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0)
    defaults.update(overrides)
    return PPOConfig(**defaults)


def resumable_run(tiny_models, tokenizer, args, resume=None, callbacks=None):
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=PROMPTS, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    return trainer, [str(w.message) for w in record if issubclass(w.category, CollapseWarning)]


def test_a_far_too_high_learning_rate_warns_under_the_default_settings(tiny_models, tokenizer, tmp_path):
    # The reproduction, logged every step: value loss 0.18 at step 1, ~100 at step 2, thousands at step 3 (so a start
    # of 3 logs held the blow-up); at the 2nd rollout (step 5) KL to the reference went from 0 to ~45 nats and
    # entropy from 6.0 to below 0.5.
    _, messages = resumable_run(tiny_models, tokenizer, default_config(tmp_path / "a", learning_rate=1.0, max_steps=8,
                                                                       logging_steps=1, **ON_THE_CPU))
    heads = [m[:60] for m in messages]
    assert any("step 2: the value loss" in m and "rose from 0.179 to" in m for m in messages), heads
    kl = [m for m in messages if "KL to the reference" in m]
    assert kl and "step 5:" in kl[0] and "beyond 30 (the default with a fixed kl_coef" in kl[0], heads
    assert any("step 5: the policy's entropy" in m and "fell from 6.01 to" in m for m in messages), heads
    # The defaults as they are (logging_steps=10): 20 steps make 2 logs, but the watch reads every rollout, so it
    # speaks at the 2nd (step 5), not at the 2nd log (step 20).
    _, messages = resumable_run(tiny_models, tokenizer, default_config(tmp_path / "b", learning_rate=1.0, max_steps=20,
                                                                       **ON_THE_CPU))
    assert any("step 5: KL to the reference" in m and "over the last rollout" in m for m in messages), messages
    assert any("step 5: the policy's entropy" in m for m in messages), messages


def test_a_healthy_tiny_run_under_the_default_settings_stays_silent(tiny_models, tokenizer, tmp_path):
    _, messages = resumable_run(tiny_models, tokenizer,
                                default_config(tmp_path, learning_rate=1e-5, max_steps=24, logging_steps=1))
    assert messages == []


def test_entropy_collapse_warns_without_a_length_rise():
    logs = [{"rollout/response_length": 8.0, "policy/entropy_avg": e} for e in (6.0, 2.0, 0.5, 0.03)]
    messages = feed(CollapseWatch(kl_threshold=None, stop=False, last_checkpoint=lambda: None), logs)[0]
    # log 3: 6.0 -> 0.5 (0.08 <= 0.1 x its start); the 4th repeats it, and warns no more.
    assert len(messages) == 1 and "step 3: the policy's entropy" in messages[0] and "fell from 6 to 0.5" in messages[0]
    assert "learning_rate" in messages[0]


def test_a_sparse_reward_whose_first_successes_raise_the_value_loss_from_near_zero_is_no_collapse():
    # A 0/1 reward nothing earns at first: the value loss starts near 0, and the first successes raise it 100x and
    # more while it stays small. Only a loss that also passes VALUE_LOSS_FLOOR is an explosion.
    logs = [{"loss/value_avg": v} for v in (1e-4, 2e-4, 0.05, 0.12, 0.2)]
    assert feed(CollapseWatch(kl_threshold=None, stop=False, last_checkpoint=lambda: None), logs)[0] == []
    exploding = [{"loss/value_avg": v} for v in (1e-4, 2e-4, 0.05, 3.0, 40.0)]
    messages = feed(CollapseWatch(kl_threshold=None, stop=False, last_checkpoint=lambda: None), exploding)[0]
    assert len(messages) == 1 and "the value loss" in messages[0]


def test_the_kl_threshold_applies_with_a_fixed_kl_coef(tmp_path):
    def threshold(**overrides):
        (watch,) = add_watch(None, default_config(tmp_path, **overrides), lambda: None)
        return watch.kl_threshold, watch.kl_reason
    assert threshold() == (30.0, "the default with a fixed kl_coef; collapse_kl_threshold sets another")
    assert threshold(collapse_kl_threshold=50.0) == (50.0, "collapse_kl_threshold")
    assert threshold(adaptive_kl=True, kl_target=6.0) == (18.0, "3 x kl_target")


def test_non_finite_values_neither_poison_the_means_nor_fire():
    # A NaN / inf value loss (a step the guard skipped) and a NaN evaluation (no finite score) are left out.
    watch = CollapseWatch(kl_threshold=30.0, stop=False, last_checkpoint=lambda: None)
    quiet = [{"loss/value_avg": v, "objective/kl": k} for v, k in [(0.2, 0.0), (NAN, NAN), (math.inf, 1.0), (0.3, 2.0)]]
    quiet.append({"eval_reward/rm/win_rate_low": NAN, "eval_judge/judge/win_rate_high": 0.3})
    quiet.append({"eval_reward/rm/win_rate_low": 0.7, "eval_judge/judge/win_rate_high": NAN})
    assert feed(watch, quiet)[0] == []
    # The means stayed finite, so a real blow-up after them still warns.
    messages = feed(watch, [{"loss/value_avg": 500.0, "objective/kl": 45.0}] * 2)[0]
    assert any("value loss" in m for m in messages) and any("KL to the reference" in m for m in messages)
    assert watch.history["loss/value_avg"] == [0.2, 0.3, 500.0, 500.0]


class StepAtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def test_a_stop_on_a_save_step_leaves_the_named_checkpoint_the_newest(tiny_models, tokenizer, tmp_path):
    # adaptive_kl: the watch fires with or without the fix of the fixed-kl_coef default, so only the save is tested.
    fast = dict(learning_rate=1.0, adaptive_kl=True, num_ppo_epochs=1, max_steps=12, logging_steps=1,
                stop_on_collapse=True, save_strategy="steps", save_steps=1)
    trainer, messages = resumable_run(tiny_models, tokenizer, default_config(tmp_path, **fast))
    stop = trainer.state.global_step
    assert stop < 12 and stop % fast["save_steps"] == 0  # stopped on a save step
    named = os.path.join(str(tmp_path), f"checkpoint-{stop - 1}")
    assert f"the last complete checkpoint is {named}" in messages[0]
    assert get_last_checkpoint(str(tmp_path)) == named  # what resume_from_checkpoint=True resolves to
    assert not os.path.exists(os.path.join(str(tmp_path), f"checkpoint-{stop}"))
    assert "none is saved after it" in messages[0] and "The model in memory is the collapsed one" in messages[0]
    trainer._save_checkpoint(trainer.model, None)  # save_strategy='best' decides after on_log: refused there too
    assert get_last_checkpoint(str(tmp_path)) == named
    # Another train() on this trainer is watched afresh and saves again.
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    trainer._save_checkpoint(trainer.model, None)
    assert get_last_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), f"checkpoint-{stop}")
    shutil.rmtree(get_last_checkpoint(str(tmp_path)))
    # resume_from_checkpoint=True resumes from the named checkpoint (a sane learning rate this time).
    start = StepAtStart()
    resumable_run(tiny_models, tokenizer,
                  default_config(tmp_path, **{**fast, "learning_rate": 1e-5, "max_steps": stop}),
                  resume=True, callbacks=[start])
    assert start.step == stop - 1


def test_a_stop_saves_no_epoch_end_checkpoint(tiny_models, tokenizer, tmp_path):
    # 8 prompts, 4 per rollout: an epoch is 2 steps, so the stop's epoch end would save the collapsed state.
    fast = dict(learning_rate=1.0, adaptive_kl=True, num_ppo_epochs=1, max_steps=12, logging_steps=1,
                stop_on_collapse=True, save_strategy="epoch")
    trainer, messages = resumable_run(tiny_models, tokenizer, default_config(tmp_path, **fast))
    stop = trainer.state.global_step
    assert stop < 12 and messages
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(tmp_path) if d.startswith("checkpoint-"))
    assert all(step < stop for step in saved), saved


# ---- each guard that keeps a stopped run from saving, reached on its own ----------------------------------------------
# After a stop, five places keep the collapsed state from becoming a checkpoint: the watch's on_log at the signature
# (the stop's own save step) and at any later log, its on_epoch_end and on_evaluate (`control.should_save`), and the
# trainer's `_save_checkpoint` (save_strategy='best' and `step()` decide to save after on_log). In a real run they
# overlap, so each test below reaches one of them with the others out of the way.

def stopped_watch():
    """A watch with stop=True fed two logs on save steps (Trainer's DefaultFlowCallback sets should_save at
    on_step_end, before on_log); KL over its threshold fires at the second. Returns (watch, state, control)."""
    watch = CollapseWatch(kl_threshold=30.0, stop=True, last_checkpoint=lambda: None)
    state, control = TrainerState(), TrainerControl()
    with pytest.warns(CollapseWarning, match="step 2: KL to the reference"):
        for step in (1, 2):
            state.global_step, control.should_save = step, True
            watch.on_log(None, state, control, logs={"objective/kl": 45.0})
            if step == 1:
                assert control.should_save and not watch.stopped  # a save before any signature is left alone
    return watch, state, control


def test_the_log_that_stops_training_turns_off_its_own_steps_save():
    """on_log's guard at the signature: on_log runs before Trainer saves the step, so the stop's own save step
    (save_steps, or the last step) writes no checkpoint of the collapsed state."""
    watch, _, control = stopped_watch()
    assert watch.stopped and control.should_training_stop and not control.should_save


def test_a_log_after_the_stop_turns_off_its_save():
    """on_log's guard for later logs: one that brings no new signature (the same KL, or nothing) still saves nothing."""
    watch, state, control = stopped_watch()
    for logs in ({"objective/kl": 45.0}, {}):
        state.global_step += 1
        control.should_save = True
        watch.on_log(None, state, control, logs=logs)
        assert not control.should_save, logs


@pytest.mark.parametrize("event", ["on_epoch_end", "on_evaluate"])
def test_the_epoch_end_and_an_evaluation_after_the_stop_save_nothing(event):
    """on_epoch_end's and on_evaluate's guard: save_strategy='epoch' asks for a save at the epoch end the stop ends
    training with (and an evaluation may ask for one); the watch turns it off, and only after a stop."""
    fresh = CollapseWatch(kl_threshold=30.0, stop=True, last_checkpoint=lambda: None)
    control = TrainerControl(should_save=True)
    getattr(fresh, event)(None, TrainerState(), control)
    assert control.should_save  # no stop: Trainer's save goes ahead
    watch, state, control = stopped_watch()
    control.should_save = True
    getattr(watch, event)(None, state, control)
    assert not control.should_save


class CollapseAtSecondLog(TrainerCallback):
    """Makes the second training log look like a collapse (a value loss of 1e6, read from the logs), as the watch added
    after it sees it. (KL is read from each rollout, not from the logs: `CollapseWatch.observe_rollout`.)"""

    def __init__(self):
        self.logs = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss/value_avg" in logs:  # a training log (an evaluation's has eval_ metrics only)
            self.logs += 1
            if self.logs == 2:
                logs["loss/value_avg"] = 1e6


class EveryEvaluationIsBest(TrainerCallback):
    """Makes each evaluation a new best (eval_loss falling), so save_strategy='best' asks to save at every one."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_loss"] = -float(state.global_step)


def checkpoints(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("checkpoint-"))


def test_save_strategy_best_after_the_stop_is_refused_by_save_checkpoint(tiny_models, tokenizer, tmp_path):
    """`_save_checkpoint`'s guard: with save_strategy='best' Trainer decides to save after the evaluation, past every
    callback (it overwrites `control.should_save` with "a new best"), so a new best at the stop's step reaches
    `_save_checkpoint`, and only the trainer's own check keeps checkpoint-2 from being written."""
    args = default_config(tmp_path, max_steps=4, num_ppo_epochs=1, logging_steps=1, learning_rate=1e-5,
                          stop_on_collapse=True, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                          save_strategy="best", metric_for_best_model="loss", greater_is_better=False,
                          response_length=4)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=PROMPTS, eval_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 4}),
                           callbacks=[CollapseAtSecondLog(), EveryEvaluationIsBest()])
    with pytest.warns(CollapseWarning, match="step 2: the value loss"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert checkpoints(tmp_path) == ["checkpoint-1"]


def test_a_step_call_that_stops_on_a_save_step_writes_no_checkpoint(tiny_models, tokenizer, tmp_path):
    """`_save_checkpoint`'s guard in `step()`: a call saves after its log, whatever `control.should_save` says, so
    when the watch stops training in a call that reaches a save step, only the trainer's own check keeps the
    collapsed state from becoming the newest checkpoint; the next call is refused."""
    args = default_config(tmp_path, per_device_train_batch_size=2, num_mini_batches=1, num_ppo_epochs=1,
                          max_steps=4, response_length=4, logging_steps=1, learning_rate=1e-5,
                          lr_scheduler_type="constant", stop_on_collapse=True, save_strategy="steps", save_steps=1)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           callbacks=[CollapseAtSecondLog()])
    queries, responses = [torch.tensor(tokenizer.encode("the movie was"))] * 2, [torch.tensor([10, 11])] * 2
    trainer.step(queries, responses, [1.0, 0.0])
    assert checkpoints(tmp_path) == ["checkpoint-1"]
    with pytest.warns(CollapseWarning, match="the last complete checkpoint is .*checkpoint-1"):
        trainer.step(queries, responses, [1.0, 0.0])
    assert trainer.state.global_step == 2 and checkpoints(tmp_path) == ["checkpoint-1"]
    assert get_last_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), "checkpoint-1")
    with pytest.raises(ValueError, match=r"step\(\): stop_on_collapse=True and the collapse watch stopped training"):
        trainer.step(queries, responses, [1.0, 0.0])


# ---- the watch from the config, `step()` and TRL 0.11's `generate()` -------------------------------------------------
# The collapse watch, `step()` and TRL 0.11's `generate()`, pinned end to end.
#
# The watch: the KL threshold the trainer derives from its config (3 x kl_target with `adaptive_kl`, or
# `collapse_kl_threshold`) decides, in a real run, whether a `CollapseWarning` is given; `watch_collapse=False` leaves
# no watch. `step()`: with a reference that differs from the policy (KL != 0, so the KL-penalised reward and the raw
# score differ), each TRL 0.11 statistic holds TRL 0.11's quantity, recomputed here from the models themselves;
# `gradient_accumulation_steps` > 1 gives the update and statistics of the whole minibatch; tokens that
# `response_masks` marks 0 change neither the update nor the loss. `generate()`: a sampled EOS is kept at the end of
# the response and whatever followed it is cut, as TRL 0.11's `generate` did. Tiny offline models from conftest.py.

@pytest.fixture(scope="module")
def other_reference(tokenizer, tmp_path_factory):
    """A causal LM of the policy's shape and tokenizer but other weights (seed 3): KL to it is > 0 from step 1."""
    path = tmp_path_factory.mktemp("other_reference")
    build_causal_lm(tokenizer, seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ---- the collapse watch, from the config to the warning ------------------------------------------------------------
def watch_run(tiny_models, tokenizer, reference, out, **overrides):
    """Two iterations of one update each, logged every step, against `reference`; the trainer and its KL warnings.
    On the CPU (ON_THE_CPU): the KL the thresholds below are set around is a CPU run's."""
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, num_ppo_epochs=1, max_steps=2,
                    response_length=8, logging_steps=1, learning_rate=1e-5, report_to=[], save_strategy="no",
                    num_sample_generations=0, disable_tqdm=True, seed=0, **ON_THE_CPU)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**{**settings, **overrides}),
                           processing_class=tokenizer, reward_model=count_e, ref_model=reference,
                           train_dataset=PROMPTS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in record if issubclass(w.category, CollapseWarning)]


def test_the_kl_threshold_the_config_derives_decides_the_warning_in_a_real_run(tiny_models, tokenizer,
                                                                             other_reference, tmp_path):
    """Pins config -> watch -> warning: with adaptive_kl the KL check fires beyond 3 x kl_target (not kl_target,
    not kl_coef, not the fixed-coefficient 30), judged on each rollout's objective/kl (here one rollout per log);
    collapse_kl_threshold overrides."""
    # kl_target = 0.1: 3 x 0.1 = 0.3 is below the run's KL to the other reference (about 0.7 nats per response).
    trainer, messages = watch_run(tiny_models, tokenizer, other_reference, tmp_path / "fires", adaptive_kl=True,
                                  kl_target=0.1)
    kl = [entry["objective/kl"] for entry in trainer.state.log_history if "objective/kl" in entry]
    assert len(kl) == 2 and 0.4 < kl[1] < 1.0, f"the premise (KL about 0.7 at step 2) no longer holds: {kl}"
    assert len(messages) == 1 and messages[0].startswith(
        f"Collapse watch, step 2: KL to the reference (objective/kl) averages {kl[1]:.2f} nats per response over the "
        "last rollout, beyond 0.3 (3 x kl_target)"), messages
    assert "stop_on_collapse=True stops training" in messages[0]
    # kl_target = 0.4: 3 x 0.4 = 1.2 is above that KL, and kl_target itself (0.4) below it: silent only if the
    # threshold is the multiple.
    trainer, messages = watch_run(tiny_models, tokenizer, other_reference, tmp_path / "silent", adaptive_kl=True,
                                  kl_target=0.4)
    kl = [entry["objective/kl"] for entry in trainer.state.log_history if "objective/kl" in entry]
    assert 0.4 < kl[1] < 1.2 and messages == [], (kl, messages)
    # A fixed kl_coef: 30 nats, far above; collapse_kl_threshold=0.3 names itself.
    _, messages = watch_run(tiny_models, tokenizer, other_reference, tmp_path / "fixed", adaptive_kl=False)
    assert messages == []
    _, messages = watch_run(tiny_models, tokenizer, other_reference, tmp_path / "explicit", adaptive_kl=True,
                            kl_target=0.4, collapse_kl_threshold=0.3)
    assert len(messages) == 1 and "beyond 0.3 (collapse_kl_threshold)" in messages[0]


def test_watch_collapse_false_leaves_no_watch_and_a_collapsing_run_silent(tiny_models, tokenizer, tmp_path):
    """Pins `watch_collapse=False`: no CollapseWatch among the trainer's callbacks, and a learning rate far too high
    (which warns with the watch on, tests/trainer/test_watch.py) gives no CollapseWarning."""
    args = dict(learning_rate=1.0, adaptive_kl=True, max_steps=3)
    on, messages = watch_run(tiny_models, tokenizer, None, tmp_path / "on", **args)
    assert [type(c) for c in on.callback_handler.callbacks].count(CollapseWatch) == 1 and messages
    off, messages = watch_run(tiny_models, tokenizer, None, tmp_path / "off", watch_collapse=False, **args)
    assert not any(isinstance(c, CollapseWatch) for c in off.callback_handler.callbacks)
    assert messages == [] and off.state.global_step == 3


# ---- step(): TRL 0.11's statistics, with KL != 0 -------------------------------------------------------------------
QUERY_TEXTS = ["the movie was", "the food was", "a", "the show was"]
SCORES = [1.0, -0.5, 2.0, 0.25]


def per_token_logprobs(model, query: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(response_t | query, response_<t) of one sequence run alone (no padding), at temperature 1 as TRL 0.11's
    `step()` computed them, and the entropy of each of those next-token distributions: two (len(response),)."""
    ids = torch.cat([query, response]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(query) - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, response.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def greedy_responses(policy, queries: list[torch.Tensor], length: int = 5) -> list[torch.Tensor]:
    """The policy's greedy `length` tokens after each query (EOS held back): one 1-D tensor each."""
    out = []
    for query in queries:
        ids = policy.generate(input_ids=query.unsqueeze(0), do_sample=False, max_new_tokens=length,
                              min_new_tokens=length)
        out.append(ids[0, len(query):])
    return out


def trl_trainer(tiny_models, tokenizer, reference, out, **fields):
    """TRL 0.11's PPOConfig / PPOTrainer, models passed as objects as TRL 0.11 took them: 4 samples per step(), one
    optimizer step (2 x 2 accumulated) per call unless `fields` say otherwise."""
    fields = {"batch_size": 4, "mini_batch_size": 2, "gradient_accumulation_steps": 2, "ppo_epochs": 1,
              "init_kl_coef": 0.2, **fields}
    config = TrlPPOConfig(output_dir=str(out), **fields)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_models["policy"])
    ref_model = None if reference is None else AutoModelForCausalLMWithValueHead.from_pretrained(reference)
    return TrlPPOTrainer(config, model, ref_model=ref_model, tokenizer=tokenizer)


def recorded_rollout(trainer):
    """Keep the rollout batch `step()` trains on (`trainer.rollouts`)."""
    real, trainer.rollouts = trainer._rollout, []

    def rollout(inputs):
        batch = real(inputs)
        trainer.rollouts.append(batch)
        return batch

    trainer._rollout = rollout


def test_step_returns_trl_0_11_statistics_when_kl_is_not_zero(tiny_models, tokenizer, other_reference, tmp_path):
    """Pins each TRL 0.11 key of step()'s statistics to TRL 0.11's quantity (trl/trainer/ppo_trainer.py 0.11.4,
    `record_step_stats` and `loss`), with a reference other than the policy so that the penalised reward, the raw
    score and the per-token and per-response KL means all differ: objective/kl = mean over responses of the summed
    per-token KL log p - log p_ref (at temperature 1, as TRL 0.11's step() computed log-probs), objective/kl_coef =
    the coefficient that penalised this batch (before the adaptive controller moves), objective/entropy = mean summed
    -log p, ppo/policy/entropy = the per-token entropy, ppo/mean_scores and ppo/std_scores = the scores as given,
    ppo/mean_non_score_reward = the per-TOKEN mean of -kl_coef x KL, ppo/loss/policy and ppo/loss/value = TRL's
    losses, ppo/loss/total = policy + vf_coef x value, tokens/*_len_mean = the given lengths; all at
    gradient_accumulation_steps=2."""
    trainer = trl_trainer(tiny_models, tokenizer, other_reference, tmp_path)
    recorded_rollout(trainer)
    queries = [torch.tensor(tokenizer.encode(text)) for text in QUERY_TEXTS]
    policy = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    reference = AutoModelForCausalLM.from_pretrained(other_reference)
    # The policy's greedy 5 tokens (no EOS): likelier under the policy than under the reference, so KL is well above
    # 0; one length for all, so that the mean of the micro-batches' own loss means (what TRL 0.11 logged too) is the
    # whole batch's mean whichever rows the shuffle puts together.
    responses = greedy_responses(policy, queries)
    logprobs, entropy = zip(*[per_token_logprobs(policy, q, r) for q, r in zip(queries, responses)])
    ref_logprobs = [per_token_logprobs(reference, q, r)[0] for q, r in zip(queries, responses)]
    kl = [lp - ref for lp, ref in zip(logprobs, ref_logprobs)]
    coef = 0.2  # init_kl_coef

    stats = trainer.step(queries, responses, [torch.tensor(s) for s in SCORES])
    (batch,) = trainer.rollouts
    for row, (lp, ref) in enumerate(zip(logprobs, ref_logprobs)):  # the batch holds the models' own log-probs
        mask = batch.policy_mask[row]
        lp, ref = on_device_of(trainer.model, lp, ref)  # the trainer's device: a GPU where one is visible
        torch.testing.assert_close(batch.logprobs[row][mask], lp, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batch.ref_logprobs[row][mask], ref, rtol=1e-4, atol=1e-5)

    mean_kl = torch.stack([k.sum() for k in kl]).mean().item()
    assert mean_kl > 1.0, f"the premise: a reference far from the policy (KL {mean_kl:.3f})"
    assert stats["objective/kl"] == pytest.approx(mean_kl, rel=1e-4)
    assert stats["objective/kl_coef"] == pytest.approx(coef)
    assert trainer.kl_ctl.value != coef  # the controller moved after the batch (adap_kl_ctrl=True)
    assert stats["objective/entropy"] == pytest.approx(torch.stack([-lp.sum() for lp in logprobs]).mean().item(),
                                                       rel=1e-4)
    assert stats["ppo/mean_scores"] == pytest.approx(sum(SCORES) / 4)  # the score, not the penalised reward
    assert stats["ppo/std_scores"] == pytest.approx(torch.tensor(SCORES).std().item())
    per_token = (-coef * torch.cat(kl)).mean().item()  # TRL 0.11: masked_mean(non_score_reward, masks)
    assert stats["ppo/mean_non_score_reward"] == pytest.approx(per_token, rel=1e-4)
    assert stats["objective/rlhf_reward"] == pytest.approx(sum(SCORES) / 4 - coef * mean_kl, rel=1e-4)
    assert abs(stats["objective/rlhf_reward"] - stats["ppo/mean_scores"]) > 0.01
    assert stats["ppo/policy/entropy"] == pytest.approx(torch.cat(entropy).mean().item(), rel=1e-4)
    # One optimizer step, its micro-batches all at the rollout's weights: ratio 1 and the values of the rollout, so
    # TRL's losses are masked means of -A (policy) and of (V - R)^2 / 2 (value, the clipped term equal).
    mask = batch.policy_mask
    assert stats["ppo/policy/ratio"] == pytest.approx(1.0) and stats["ppo/policy/clipfrac"] == 0.0
    assert stats["ppo/loss/policy"] == pytest.approx(-batch.advantages[mask].mean().item(), abs=1e-6)
    value_loss = 0.5 * (batch.values - batch.returns)[mask].pow(2).mean().item()
    assert value_loss > 0.01 and stats["ppo/loss/value"] == pytest.approx(value_loss, rel=1e-4)
    assert stats["ppo/loss/total"] == pytest.approx(stats["ppo/loss/policy"] + 0.1 * stats["ppo/loss/value"],
                                                    rel=1e-4, abs=1e-6)  # vf_coef 0.1, TRL 0.11's default
    assert stats["ppo/returns/mean"] == pytest.approx(batch.returns[mask].mean().item(), rel=1e-4)
    assert stats["ppo/policy/advantages_mean"] == pytest.approx(batch.advantages[mask].mean().item(), abs=1e-6)
    assert stats["tokens/queries_len_mean"] == pytest.approx(sum(len(q) for q in queries) / 4)
    assert stats["tokens/responses_len_mean"] == 5
    assert trainer.state.global_step == 1


def test_step_with_gradient_accumulation_gives_the_whole_minibatch_update(tiny_models, tokenizer, tmp_path):
    """Pins step() with gradient_accumulation_steps > 1 (TRL 0.11: one optimizer step per mini_batch_size x
    gradient_accumulation_steps samples): 2 micro-batches of 2 accumulated give the weights, the optimizer step count
    and the statistics (ppo/loss/total the minibatch's loss, not a micro-batch's share) of one micro-batch of 4."""
    queries = [torch.tensor(tokenizer.encode(text)) for text in QUERY_TEXTS]
    responses = greedy_responses(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]), queries)
    scores = [torch.tensor(s) for s in SCORES]
    runs = {}
    for name, mini, accumulation in (("accumulated", 2, 2), ("whole", 4, 1)):
        trainer = trl_trainer(tiny_models, tokenizer, None, tmp_path / name, mini_batch_size=mini,
                              gradient_accumulation_steps=accumulation, ppo_epochs=2, learning_rate=1e-2)
        assert trainer.args.gradient_accumulation_steps == accumulation and trainer.args.num_mini_batches == 1
        runs[name] = trainer, trainer.step(queries, responses, scores)
    (accumulated, acc_stats), (whole, whole_stats) = runs["accumulated"], runs["whole"]
    assert accumulated.state.global_step == whole.state.global_step == 2  # 2 epochs x 1 minibatch
    moved = 0.0
    start = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_models["policy"]).parameters()
    for (name, a), b, before in zip(accumulated.model.named_parameters(), whole.model.parameters(), start):
        if CUDA:
            # A GPU's sums over 2 micro-batches and over 1 batch of 4 differ in the last bits, and Adam turns a
            # gradient element that is rounding noise around 0 into a full +-lr step: on CUDA (seen on an H200) a
            # few such elements differ; all the others must agree as closely as on the CPU.
            close = torch.isclose(a, b, rtol=1e-4, atol=1e-6)
            assert close.float().mean() > 0.999, (name, close.float().mean())
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
        moved = max(moved, (a.detach() - before.detach().to(a.device)).abs().max().item())
    assert moved > 1e-3  # the update is large enough for a wrong one to show
    for key in ("ppo/loss/total", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl", "ppo/policy/ratio",
                "objective/kl", "ppo/mean_scores", "ppo/mean_non_score_reward"):
        assert acc_stats[key] == pytest.approx(whole_stats[key], rel=1e-4, abs=1e-7), key
    assert acc_stats["ppo/loss/value"] > 0.01  # ... and the losses compared are not all ~0


# ---- step(): response_masks reach the loss -------------------------------------------------------------------------
def test_tokens_response_masks_marks_0_change_neither_the_update_nor_the_loss(tiny_models, tokenizer, tmp_path):
    """Pins `response_masks` through step() to the loss: two calls whose responses differ only in the 3 tokens marked
    0 (a tool's output after the policy's answer) train to the same weights with the same losses, KL and entropy;
    without the masks the same two calls train differently (those tokens are then the policy's)."""
    queries = [torch.tensor(tokenizer.encode(text)) for text in QUERY_TEXTS]
    answers = greedy_responses(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]), queries)
    masks = [torch.tensor([1] * 5 + [0] * 3) for _ in queries]

    def run(name, tool_output, response_masks):
        trainer = trl_trainer(tiny_models, tokenizer, None, tmp_path / name, ppo_epochs=2, learning_rate=1e-2)
        responses = [torch.cat([a, torch.tensor(tool_output)]) for a in answers]
        stats = trainer.step(queries, responses, [torch.tensor(s) for s in SCORES], response_masks=response_masks)
        return trainer, stats

    first, first_stats = run("first", [7, 8, 9], masks)
    other, other_stats = run("other", [30, 31, 32], masks)
    for (name, a), b in zip(first.model.named_parameters(), other.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    for key in ("ppo/loss/total", "ppo/loss/policy", "ppo/loss/value", "objective/kl", "objective/entropy",
                "ppo/policy/entropy", "ppo/returns/mean"):
        assert first_stats[key] == pytest.approx(other_stats[key], rel=1e-5, abs=1e-7), key
    unmasked, _ = run("unmasked", [30, 31, 32], None)
    differ = max((a - b).abs().max().item() for a, b in zip(unmasked.model.parameters(), other.model.parameters()))
    assert differ > 1e-4  # the comparison above can fail: the tool's tokens would move the weights


# ---- generate(): a sampled EOS ---------------------------------------------------------------------------------------
class Script(LogitsProcessor):
    """Forces row i's t-th new token to scripts[i][t] (any token past its script): sampling then picks it."""

    def __init__(self, scripts: list[list[int]]):
        self.scripts, self.width = scripts, None

    def __call__(self, input_ids, scores):
        self.width = self.width or input_ids.shape[1]
        t = input_ids.shape[1] - self.width
        forced = torch.full_like(scores, float("-inf"))
        for row, script in enumerate(self.scripts):
            forced[row, script[t] if t < len(script) else 5] = 0.0
        return forced


def test_generate_keeps_a_sampled_eos_at_the_end_and_cuts_what_follows(tiny_models, tokenizer, tmp_path):
    """Pins TRL 0.11's `generate` on a sampled EOS: each response ends with its first EOS, kept (TRL 0.11: "keep the
    eos token at the end"), with neither the padding of a batch nor tokens sampled after it; a response without EOS
    is kept whole; return_prompt prepends the prompt without its left padding; one 1-D prompt gives the (1, length)
    output of `generate`."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    trainer = trl_trainer(tiny_models, tokenizer, None, tmp_path)
    queries = [torch.tensor(tokenizer.encode(text)) for text in ("the movie was", "a", "the food was")]
    # TRL 0.11's documented sampling arguments, and a processor that makes the sampled tokens known.
    kwargs = dict(min_length=-1, top_k=0.0, top_p=1.0, do_sample=True, pad_token_id=pad, max_new_tokens=4)
    scripts = [[10, 11, eos], [12, 13, 14, 15], [eos]]
    out = trainer.generate(queries, return_prompt=False, logits_processor=LogitsProcessorList([Script(scripts)]),
                           **kwargs)
    assert [r.tolist() for r in out] == [[10, 11, eos], [12, 13, 14, 15], [eos]]
    full = trainer.generate(queries, logits_processor=LogitsProcessorList([Script(scripts)]), **kwargs)
    assert [r.tolist() for r in full] == [q.tolist() + s for q, s in zip(queries, scripts)]
    # Generation that does not stop at EOS (another stop id): the response still ends at the first EOS, kept.
    other_stop = tokenizer.convert_tokens_to_ids("<|system|>")
    out = trainer.generate(queries, return_prompt=False, eos_token_id=other_stop,
                           logits_processor=LogitsProcessorList([Script([[10, eos, 11, eos], [eos, 12, 13, 14],
                                                                         [16, 17, 18, 19]])]), **kwargs)
    assert [r.tolist() for r in out] == [[10, eos], [eos], [16, 17, 18, 19]]
    one = trainer.generate(queries[0], logits_processor=LogitsProcessorList([Script([[10, eos]])]), **kwargs)
    assert one.tolist() == [queries[0].tolist() + [10, eos]]
    one = trainer.generate(queries[0], return_prompt=False, logits_processor=LogitsProcessorList([Script([[10, eos]])]),
                           **kwargs)
    assert one.tolist() == [[10, eos]]


# ---- no signal, and the first iteration says so ------------------------------------------------------------------
def always_zero(prompts, completions, **kwargs):
    """A verifiable reward that the model never hits yet."""
    return [0.0] * len(completions)


def test_a_reward_that_gives_every_sample_one_value_warns_once_in_its_first_iteration(tiny_models, tmp_path):
    from hf_ppo.trainer.watch import NoSignalWarning

    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_ppo_epochs=1, max_steps=3,
                     response_length=4, logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, seed=0, num_generations=2,
                     advantage_estimator="grpo")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=[always_zero, count_e],
                           train_dataset=PROMPTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if issubclass(w.category, NoSignalWarning)]
    assert len(said) == 1, said
    assert "PPO iteration 1" in said[0] and "'always_zero' (0 each)" in said[0] and "format reward" in said[0]
    assert "num_generations=4" not in said[0]  # grpo with 2 samples per prompt already compares them
    logged = [e["frac_reward_zero_std"] for e in trainer.state.log_history if "frac_reward_zero_std" in e]
    assert len(logged) == 3 and all(0.0 <= v <= 1.0 for v in logged)


def test_no_signal_warns_once_per_reward_and_suggests_groups_to_a_run_without_them():
    from types import SimpleNamespace

    from hf_ppo.trainer.watch import NoSignal, NoSignalWarning

    watch = NoSignal(SimpleNamespace(advantage_estimator="gae", num_generations=1))
    with pytest.warns(NoSignalWarning, match=r"iteration 1: all 32 .*'exact_answer' \(0 each\) and the combined "
                                             r"score \(0 each\).*num_generations=4"):
        watch.check({None: 0.0, "exact_answer": 0.0}, 1, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check({None: 0.0, "exact_answer": 0.0}, 2, 32)  # said once
    with pytest.warns(NoSignalWarning, match="iteration 3.*'fmt' \\(1 each\\)"):
        watch.check({"fmt": 1.0, "exact_answer": 0.0}, 3, 32)


def no_signal_watch(**overrides):
    from types import SimpleNamespace

    from hf_ppo.trainer.watch import NoSignal

    settings = dict(reward_names=["exact_answer"], parameters=135_000_000, can_stop=True)
    settings.update(overrides)
    return NoSignal(SimpleNamespace(advantage_estimator="grpo", num_generations=4, temperature=1.0,
                                    response_length=40), **settings)


def test_no_signal_names_what_the_run_shows():
    """Issue 61, run A: 0-1 of 16 responses ended within response_length=40, at temperature 1.0 on a 135M model; the
    warning named format rewards, few-shot prompts and k samples, not the cut-off. Run B already had a format reward,
    and the warning advised adding one."""
    from hf_ppo.trainer.watch import NoSignalWarning

    with pytest.warns(NoSignalWarning) as caught:
        no_signal_watch().check({"exact_answer": 0.0, None: 0.0}, 1, 16, {"rollout/eos_rate": 0.0})
    said = str(caught[0].message)
    assert "0 of 16 responses ended within response_length=40: answers are cut off" in said
    assert "raise response_length" in said and "temperature=1 is high for a policy of 135M parameters" in said
    assert "add a format reward" in said
    with pytest.warns(NoSignalWarning) as caught:
        no_signal_watch(reward_names=["exact_answer", "format_reward"]).check(
            {"exact_answer": 0.0}, 1, 16, {"rollout/eos_rate": 0.75})
    said = str(caught[0].message)
    assert "the format reward 'format_reward' is already in the run and varies" in said
    assert "add a format reward" not in said and "cut off" not in said and "the run already has a format reward" in said
    with pytest.warns(NoSignalWarning) as caught:  # a big model, answers that stop, no stop token at all: none of it
        no_signal_watch(parameters=7_000_000_000, can_stop=False).check({"exact_answer": 0.0}, 1, 16,
                                                                       {"rollout/eos_rate": 0.0})
    assert "What this run shows" not in str(caught[0].message)


def test_no_signal_says_again_with_the_count():
    """Run A was told once, at iteration 1, and iterations 2-8 were as empty: the warning comes back every
    REPEAT_AFTER iterations in a row without signal, with the count; a streak broken by signal starts again."""
    from hf_ppo.trainer.watch import REPEAT_AFTER, NoSignalWarning

    watch = no_signal_watch()
    stats = {"rollout/eos_rate": 1.0}
    with pytest.warns(NoSignalWarning):
        watch.check({"exact_answer": 0.0}, 1, 16, stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for iteration in range(2, REPEAT_AFTER):
            watch.check({"exact_answer": 0.0}, iteration, 16, stats)
    with pytest.warns(NoSignalWarning, match=rf"Still no learning signal at PPO iteration {REPEAT_AFTER}: the reward "
                      rf"'exact_answer' \(0 each\) .* last {REPEAT_AFTER} iterations \(iterations 1-{REPEAT_AFTER}, "
                      r"16 responses each\)"):
        watch.check({"exact_answer": 0.0}, REPEAT_AFTER, 16, stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check({}, REPEAT_AFTER + 1, 16, stats)  # signal
        for iteration in range(REPEAT_AFTER + 2, 2 * REPEAT_AFTER + 1):
            watch.check({"exact_answer": 0.0}, iteration, 16, stats)
    with pytest.warns(NoSignalWarning, match=rf"iterations {REPEAT_AFTER + 2}-{2 * REPEAT_AFTER + 1}"):
        watch.check({"exact_answer": 0.0}, 2 * REPEAT_AFTER + 1, 16, stats)


def test_a_trainer_hands_the_watch_the_stop_count_and_the_policys_size(tiny_models, tmp_path):
    from hf_ppo.trainer.watch import NoSignalWarning

    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_ppo_epochs=1, max_steps=1,
                     response_length=3, logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, seed=0, num_generations=2, temperature=1.0,
                     advantage_estimator="grpo", stop_token_id=0)  # a stop id the tiny model never samples
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=always_zero, train_dataset=PROMPTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if issubclass(w.category, NoSignalWarning)]
    assert "0 of 4 responses ended within response_length=3" in said[0], said
    assert "temperature=1 is high for a policy of" in said[0]


# ---- a short, wildly tuned run ---------------------------------------------------------------------------------------
def words(completions, **kwargs):
    """One point per word."""
    return [float(len(c.split())) for c in completions]


@pytest.mark.parametrize("stats_pass_every, step, measured", [(1, 3, 8), (4, 5, 2)])
def test_a_short_wildly_tuned_run_is_called_out_within_the_run(tiny_models, tokenizer, tmp_path, stats_pass_every,
                                                               step, measured):
    """8 iterations of one update each, kl_coef=0, learning_rate=5e-2, a reward of one point per word, the defaults
    otherwise (logging_steps=10: this run logs once, at its end). It degenerates: KL to the reference grows from 0 to
    about 195 nats per response (32 at the 3rd iteration), entropy falls from 6.0 to 2.5, every response runs to
    response_length. The watch reads every rollout that measured the KL, so it says so at the 3rd iteration, not
    never; with kl_coef=0 the reference pass runs on every `stats_pass_every`-th rollout only (the default 4:
    iterations 1 and 5), so there it speaks at the 5th, the cost of the skipped passes."""
    args = default_config(tmp_path, per_device_train_batch_size=8, num_ppo_epochs=1, max_steps=8, kl_coef=0.0,
                          learning_rate=5e-2, response_length=53, apply_chat_template_to_text=False,
                          stats_pass_every=stats_pass_every, **ON_THE_CPU)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=words,
                           train_dataset=Dataset.from_dict({"prompt": list(PROMPTS["prompt"]) * 2}))
    seen = []
    watcher = next(c for c in trainer.callback_handler.callbacks if isinstance(c, CollapseWatch))

    class Rollouts(TrainerCallback):  # what each rollout measured (the logs hold one mean of all eight)
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(watcher.history.get("objective/kl", [None])[-1])

    trainer.add_callback(Rollouts())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in record if issubclass(w.category, CollapseWarning)]
    assert len([h for h in trainer.state.log_history if "objective/kl" in h]) == 1  # one log, at the end
    kl = [m for m in messages if "KL to the reference" in m]
    assert kl and kl[0].startswith(f"Collapse watch, step {step}: KL to the reference"), messages
    assert "beyond 30 (the default with a fixed kl_coef" in kl[0]
    assert len(seen) == 8 and seen[0] == 0.0 and seen[-1] > 30, seen  # it degenerates
    assert len(watcher.history["objective/kl"]) == measured


# ---- issue 63 kind 4: a NaN row beside a uniform reward ------------------------------------------------------------
def test_a_nan_row_beside_a_uniform_reward_still_says_no_signal(tiny_models, tokenizer, tmp_path):
    """Every scored row got 0 and one row NaN (it leaves the update): the scored rows have no spread, so the
    no-signal warning fires; the NaN is not read as spread."""
    from hf_ppo.rollout.steps import uniform_rewards
    from hf_ppo.trainer.watch import NoSignalWarning

    nan = float("nan")
    each = {"zero_or_nan": (torch.tensor([0.0, nan, 0.0, 0.0]), torch.ones(4, dtype=torch.bool))}
    assert uniform_rewards(torch.tensor([0.0, nan, 0.0, 0.0]), each) == {None: 0.0, "zero_or_nan": 0.0}

    calls = []

    def zero_or_nan(prompts, completions):  # the construction probe (the first call) gets finite scores
        calls.append(1)
        return [nan if i == 1 and len(calls) > 1 else 0.0 for i in range(len(completions))]

    trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, reward_model=zero_or_nan,
                           train_dataset=PROMPTS, args=default_config(tmp_path, max_steps=1, num_ppo_epochs=1,
                                                                      **ON_THE_CPU))
    with pytest.warns(NoSignalWarning, match="No learning signal in PPO iteration 1"):
        trainer.train()
