"""Issue 36 on the collapse watch (hf_ppo/trainer/watch.py): a far too high learning rate under the default settings
(a fixed kl_coef, the shared critic) warns; non-finite metrics never poison it; a stop by `stop_on_collapse` leaves
the checkpoint the warning names the newest one, so `resume_from_checkpoint=True` resumes the last good state."""

import math
import os
import shutil
import warnings

from datasets import Dataset
from test_watch import count_e, feed
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.trainer.watch import CollapseWarning, CollapseWatch, add_watch

PROMPTS = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 2})
NAN = float("nan")


def config(path, **overrides):
    # PPOConfig's defaults (fixed kl_coef=0.05, critic='shared', num_ppo_epochs=4, logging_steps=10) unless overridden.
    defaults = dict(output_dir=str(path), per_device_train_batch_size=4, response_length=8, report_to=[],
                    save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0)
    defaults.update(overrides)
    return PPOConfig(**defaults)


def run(tiny_models, tokenizer, args, resume=None, callbacks=None):
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
    _, messages = run(tiny_models, tokenizer, config(tmp_path / "a", learning_rate=1.0, max_steps=8, logging_steps=1))
    heads = [m[:60] for m in messages]
    assert any("step 2: the value loss" in m and "rose from 0.179 to" in m for m in messages), heads
    kl = [m for m in messages if "KL to the reference" in m]
    assert kl and "step 5:" in kl[0] and "beyond 30 (the default with a fixed kl_coef" in kl[0], heads
    assert any("step 5: the policy's entropy" in m and "fell from 6.01 to" in m for m in messages), heads
    # The defaults as they are (logging_steps=10): 20 steps make 2 logs, too few for a watch that waited for 6.
    _, messages = run(tiny_models, tokenizer, config(tmp_path / "b", learning_rate=1.0, max_steps=20))
    assert any("step 20: KL to the reference" in m for m in messages), messages
    assert any("step 20: the policy's entropy" in m for m in messages), messages


def test_a_healthy_tiny_run_under_the_default_settings_stays_silent(tiny_models, tokenizer, tmp_path):
    _, messages = run(tiny_models, tokenizer, config(tmp_path, learning_rate=1e-5, max_steps=24, logging_steps=1))
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
        (watch,) = add_watch(None, config(tmp_path, **overrides), lambda: None)
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
    trainer, messages = run(tiny_models, tokenizer, config(tmp_path, **fast))
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
    run(tiny_models, tokenizer, config(tmp_path, **{**fast, "learning_rate": 1e-5, "max_steps": stop}),
        resume=True, callbacks=[start])
    assert start.step == stop - 1


def test_a_stop_saves_no_epoch_end_checkpoint(tiny_models, tokenizer, tmp_path):
    # 8 prompts, 4 per rollout: an epoch is 2 steps, so the stop's epoch end would save the collapsed state.
    fast = dict(learning_rate=1.0, adaptive_kl=True, num_ppo_epochs=1, max_steps=12, logging_steps=1,
                stop_on_collapse=True, save_strategy="epoch")
    trainer, messages = run(tiny_models, tokenizer, config(tmp_path, **fast))
    stop = trainer.state.global_step
    assert stop < 12 and messages
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(tmp_path) if d.startswith("checkpoint-"))
    assert all(step < stop for step in saved), saved
