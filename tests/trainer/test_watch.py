"""The collapse and reward-hacking watch (hf_ppo/trainer/watch.py): each signature from logged metrics, once; silence on a
healthy run; a run made to collapse (a far too high learning rate) warns, and stops when asked."""

import warnings

import pytest
from datasets import Dataset
from transformers import TrainerControl, TrainerState

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.trainer.watch import CollapseWarning, CollapseWatch

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
    fast = dict(learning_rate=1.0, adaptive_kl=True, num_ppo_epochs=1)
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
