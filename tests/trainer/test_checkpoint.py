"""Never lose a run: crashes inside a checkpoint write, exact resume part-way through an iteration, NaN and
huge rewards, resume with changed settings, and every bad config value, data row and reward output refused."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.rollout.scoring import check_reward_values
from hf_ppo.trainer.checkpoint import CheckpointError, compare_settings, default_settings, problems, settings
from hf_ppo.trainer.guard import NonFiniteError
from tests.full_disk import half_written_then_full


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def make_args(out, **overrides) -> PPOConfig:
    # 4 optimizer steps per iteration (2 epochs x 2 minibatches), 8 prompts per rollout.
    defaults = dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2,
        num_ppo_epochs=2, max_steps=8, response_length=6, logging_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, adaptive_kl=True, kl_coef=0.1,
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(models, tokenizer, out, peft=None, reward=count_e, **overrides):
    dataset = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 4})
    return PPOLMTrainer(model=models["policy"], args=make_args(out, **overrides), processing_class=tokenizer,
                        reward_model=reward, train_dataset=dataset, peft_config=peft)


def logged(trainer):
    """Every logged training metric, minus timings (the only things that may differ between two runs)."""
    return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k and "runtime" not in k
             and k not in ("train_loss", "total_flos")} for e in trainer.state.log_history]


def assert_same_weights(a, b):
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), name


# ---- exact resume part-way through an iteration -------------------------------------------------------------------
@pytest.fixture(scope="module", params=[True, False], ids=["lora", "full"])
def straight_run(request, tiny_models, tokenizer, tmp_path_factory):
    """8 steps (2 iterations) uninterrupted, saving at steps 3 and 6: both part-way through an iteration."""
    out = tmp_path_factory.mktemp("straight")
    peft = lora() if request.param else None
    trainer = make_trainer(tiny_models, tokenizer, out, peft, save_strategy="steps", save_steps=3)
    trainer.train()
    return trainer, out, peft


def test_resume_mid_iteration_equals_uninterrupted_run(straight_run, tiny_models, tokenizer, tmp_path):
    straight, out, peft = straight_run
    assert os.path.isfile(out / "checkpoint-3" / "rollout_buffer.safetensors")  # 3 of the iteration's 4 steps done
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", peft)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert_same_weights(straight, resumed)
    assert straight.kl_ctl.value == resumed.kl_ctl.value and resumed.iteration == 2
    # Every logged metric, bitwise (the resumed history holds steps 1-3 from the checkpoint, then its own 4-8).
    assert len(logged(straight)) == 9 and logged(straight) == logged(resumed)


def test_resume_with_changed_settings_is_an_error_listing_each(straight_run, tiny_models, tokenizer, tmp_path):
    _, out, peft = straight_run
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "changed", peft, kl_coef=0.3, num_mini_batches=1,
                           per_device_train_batch_size=8)
    with pytest.raises(CheckpointError) as err:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    message = str(err.value)
    assert "kl_coef: checkpoint 0.1, now 0.3" in message and "num_mini_batches: checkpoint 2, now 1" in message
    assert "per_device_train_batch_size: checkpoint 4, now 8" in message
    assert "allow_config_change_on_resume=True" in message


def test_resume_with_changed_settings_opt_in_applies_new_values(straight_run, tiny_models, tokenizer, tmp_path):
    _, out, peft = straight_run
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "changed", peft, kl_coef=0.3, adaptive_kl=False,
                           cliprange=0.1, allow_config_change_on_resume=True)
    with pytest.warns(UserWarning, match=r"changed settings.*cliprange.*kl_coef.*rollout is discarded"):
        trainer._load_from_checkpoint(str(out / "checkpoint-6"))
    assert trainer.kl_ctl.value == 0.3  # the new coefficient, not the checkpoint's adapted one
    assert trainer.iteration == 2 and trainer._schedule is None  # a fresh rollout serves the rest of the iteration


def count_a(prompts, completions):
    return [float(c.count("a")) for c in completions]


def test_resume_with_other_reward_functions_is_refused_naming_them(straight_run, tiny_models, tokenizer, tmp_path):
    """The checkpoint records its rewards: another function, or one more (with normalize_each_reward off, nothing
    else would notice), is refused as a changed setting is; allow_config_change_on_resume lets it through."""
    _, out, peft = straight_run
    for reward, now in ((count_a, "count_a (function tests.trainer.test_checkpoint.count_a)"),
                        ([count_e, count_a], "count_e (function tests.trainer.test_checkpoint.count_e), count_a")):
        trainer = make_trainer(tiny_models, tokenizer, tmp_path / "changed", peft, reward=reward)
        with pytest.raises(CheckpointError) as err:
            trainer.train(resume_from_checkpoint=str(out / "checkpoint-6"))
        message = str(err.value)
        assert "rewards: checkpoint [count_e (function tests.trainer.test_checkpoint.count_e)], now [" in message
        assert now in message and "allow_config_change_on_resume=True" in message
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "allowed", peft, reward=[count_e, count_a],
                           normalize_each_reward=True, allow_config_change_on_resume=True)
    with pytest.warns(UserWarning, match=r"changed settings.*rewards: checkpoint \[count_e"):
        trainer._load_from_checkpoint(str(out / "checkpoint-6"))
    assert trainer.iteration == 2
    with open(out / "checkpoint-6" / "ppo_state.json") as f:
        assert json.load(f)["rewards"] == [{"name": "count_e",
                                            "function": "tests.trainer.test_checkpoint.count_e"}]


# ---- a crash inside a checkpoint write ----------------------------------------------------------------------------
def _raise_after(owner, name, in_checkpoint="checkpoint-4"):
    """Wrap owner.name: run it, then raise (a kill right after that file was written) when saving `in_checkpoint`."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        if any(in_checkpoint in str(a) for a in [*args, *kwargs.values()]):
            raise KeyboardInterrupt(f"killed after {name}")
        return result
    return wrapped


def _truncating_save_to_json(real):
    """TrainerState.save_to_json that is killed half-way through writing checkpoint-4's trainer_state.json."""
    def save_to_json(self, json_path):
        if "checkpoint-4" not in json_path:
            return real(self, json_path)
        text = json.dumps({"global_step": self.global_step, "log_history": self.log_history}, indent=2)
        with open(json_path, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt("killed while writing trainer_state.json")
    return save_to_json


@pytest.fixture(scope="module")
def reference_4_steps(tiny_models, tokenizer, tmp_path_factory):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path_factory.mktemp("ref4"), lora(), max_steps=4,
                           num_ppo_epochs=1)
    trainer.train()
    return trainer


# Killed after the PPO part, after Trainer's weights, after its RNG state (its optimizer comes just before), and half-way
# through trainer_state.json; test_killed_process_mid_save_resumes kills inside ppo_state.json.
@pytest.mark.parametrize("crash", ["value_head", "policy", "rng", "trainer_state"])
def test_crash_while_saving_keeps_previous_checkpoint(crash, reference_4_steps, tiny_models, tokenizer, lora_config,
                                                      tmp_path, monkeypatch):
    import transformers

    from hf_ppo.trainer import checkpoint as ckpt

    out = tmp_path / "out"
    kwargs = dict(max_steps=4, num_ppo_epochs=1, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = make_trainer(tiny_models, tokenizer, out, lora_config, **kwargs)
    if crash in ("value_head", "ppo_state"):
        target = "value_head.safetensors" if crash == "value_head" else "ppo_state.json"
        monkeypatch.setattr(ckpt, "_atomic_write", _raise_after(ckpt, "_atomic_write", f"checkpoint-4/{target}"))
    elif crash == "trainer_state":
        monkeypatch.setattr(transformers.TrainerState, "save_to_json",
                            _truncating_save_to_json(transformers.TrainerState.save_to_json))
    else:
        name = {"policy": "_save", "optimizer": "_save_optimizer_and_scheduler", "rng": "_save_rng_state"}[crash]
        monkeypatch.setattr(trainer, name, _raise_after(trainer, name))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    monkeypatch.undo()

    # The previous checkpoint survived rotation (save_total_limit=1) and is complete; the new one is not.
    assert problems(str(out / "checkpoint-2")) == []
    issues = problems(str(out / "checkpoint-4"))
    assert issues

    # An explicit path to the incomplete checkpoint: an error naming what is missing (before anything is loaded).
    resumed = make_trainer(tiny_models, tokenizer, out, lora_config, **kwargs)
    with pytest.raises(CheckpointError, match=r"checkpoint-4: .*(missing|unreadable)"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert not os.path.isdir(out / "checkpoint-4")  # moved out of Trainer's sight
    os.replace(out / "incomplete-checkpoint-4", out / "checkpoint-4")  # as the kill left it, for the True case

    # True: the incomplete checkpoint is skipped with a warning naming it; the run resumes from checkpoint-2 and ends
    # exactly where an uninterrupted run ends.
    with pytest.warns(UserWarning, match=r"Skipping incomplete checkpoint .*checkpoint-4"):
        resumed.train(resume_from_checkpoint=True)
    assert_same_weights(reference_4_steps, resumed)
    assert problems(str(out / "checkpoint-4")) == []


def test_crash_during_rotation_resumes_from_the_new_checkpoint(tiny_models, tokenizer, lora_config, tmp_path,
                                                               monkeypatch):
    import transformers.trainer

    out = tmp_path / "out"
    kwargs = dict(max_steps=4, num_ppo_epochs=1, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = make_trainer(tiny_models, tokenizer, out, lora_config, **kwargs)
    calls = []

    def killed_rotation(**kw):
        calls.append(kw)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed during rotation")
    monkeypatch.setattr(transformers.trainer, "rotate_checkpoints", killed_rotation)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    monkeypatch.undo()
    assert problems(str(out / "checkpoint-2")) == [] and problems(str(out / "checkpoint-4")) == []


def test_truncated_files_are_errors_naming_the_file(reference_4_steps, tiny_models, tokenizer, lora_config, tmp_path):
    out = tmp_path / "out"
    kwargs = dict(max_steps=2, num_ppo_epochs=1, save_strategy="steps", save_steps=2)
    make_trainer(tiny_models, tokenizer, out, lora_config, **kwargs).train()
    folder = out / "checkpoint-2"
    for name in ("value_head.safetensors", "ppo_state.json", "adapter_model.safetensors", "optimizer.pt"):
        broken = tmp_path / f"broken-{name}" / "checkpoint-2"
        shutil.copytree(folder, broken)
        with open(broken / name, "r+b") as f:
            f.truncate(os.path.getsize(broken / name) // 2)
        trainer = make_trainer(tiny_models, tokenizer, tmp_path / "other", lora_config, **kwargs)
        with pytest.raises(CheckpointError, match=rf"{name} is unreadable"):
            trainer._load_from_checkpoint(str(broken))


def test_killed_process_mid_save_resumes(tiny_models, tokenizer, lora_config, tmp_path):
    """A real SIGKILL while the second checkpoint is being written (the child kills itself from inside the write)."""
    import subprocess
    import sys
    import textwrap

    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from datasets import Dataset
        from transformers import AutoTokenizer
        from peft import LoraConfig
        from hf_ppo import PPOConfig, PPOLMTrainer
        from tests.trainer.test_checkpoint import count_e
        import hf_ppo.trainer.checkpoint as ckpt
        torch.set_num_threads(1)
        real = ckpt._atomic_write
        def write(path, data):
            if "checkpoint-4" in path and path.endswith("ppo_state.json"):
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 3])
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            real(path, data)
        ckpt._atomic_write = write
        args = PPOConfig(output_dir={str(out)!r}, per_device_train_batch_size=4, num_mini_batches=2, num_ppo_epochs=1,
                         max_steps=4, response_length=6, learning_rate=1e-2, report_to=[], save_strategy="steps",
                         save_steps=2, num_sample_generations=0, disable_tqdm=True, seed=0, adaptive_kl=True,
                         kl_coef=0.1)
        dataset = Dataset.from_dict({{"prompt": ["the movie was", "the food was"] * 8}})
        PPOLMTrainer(model={tiny_models["policy"]!r}, args=args,
                     processing_class=AutoTokenizer.from_pretrained({tiny_models["policy"]!r}),
                     reward_model=count_e, train_dataset=dataset,  # the resume's reward (recorded, compared)
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                            task_type="CAUSAL_LM")).train()  # the lora_config fixture's
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert result.returncode == -9, result.stderr.decode()[-2000:]
    assert problems(str(out / "checkpoint-2")) == []
    assert any("ppo_state.json" in p for p in problems(str(out / "checkpoint-4")))
    resumed = make_trainer(tiny_models, tokenizer, out, lora_config, num_ppo_epochs=1, max_steps=4, logging_steps=10)
    with pytest.warns(UserWarning, match=r"Skipping incomplete checkpoint .*checkpoint-4 \(missing trainer_state"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4 and resumed.iteration == 2


# ---- non-finite numbers ------------------------------------------------------------------------------------------
class NaNOnCalls:
    """A forward hook on the reward model's score head: NaN scores on the given rollout numbers (1-based)."""

    def __init__(self, calls):
        self.calls, self.n = set(calls), 0

    def __call__(self, module, inputs, output):
        self.n += 1
        return output * float("nan") if self.n in self.calls else output


def _reward_model(tiny_models):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"])


def test_nan_reward_model_rollout_is_dropped_and_sampled_again(tiny_models, tokenizer, lora_config, tmp_path):
    reward = _reward_model(tiny_models)
    reward.score.register_forward_hook(NaNOnCalls({2}))
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora_config, reward=reward, reward_quantization="none",
                           save_strategy="steps", save_steps=4)
    with pytest.warns(UserWarning, match=r"rollout dropped and sampled again \(scores: 8 NaN/inf of 8 responses"):
        trainer.train()
    assert trainer.state.global_step == 8 and trainer.iteration == 2
    assert trainer.state.log_history[-2]["nonfinite/dropped_rollouts"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_persistent_nan_stops_with_the_last_good_checkpoint(tiny_models, tokenizer, lora_config, tmp_path):
    from safetensors.torch import load_file

    reward = _reward_model(tiny_models)
    reward.score.register_forward_hook(NaNOnCalls(range(2, 100)))
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora_config, reward=reward, reward_quantization="none",
                           save_strategy="steps", save_steps=4, max_consecutive_nonfinite=3)
    with pytest.raises(NonFiniteError, match=r"3 non-finite events in a row.*scores: 8 NaN/inf.*"
                                             r"last complete checkpoint is .*checkpoint-4"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    for name in ("adapter_model.safetensors", "value_head.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "checkpoint-4" / name).values())


def test_huge_scores_warn_and_never_give_silent_inf(tiny_models, tokenizer, lora_config, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora_config, reward=lambda p, c: [1e20] * len(c),
                           max_consecutive_nonfinite=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.warns(UserWarning, match=r"scores reach 1e\+20.*normalize_rewards"):
        with pytest.raises(NonFiniteError, match=r"loss is NaN/inf.*Scores reached 1e\+20.*normalize_rewards"):
            trainer.train()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name  # both skipped steps left every weight as it was


def test_huge_scores_with_normalize_rewards_train(tiny_models, tokenizer, lora_config, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora_config, reward=lambda p, c: [1e20 * len(x) for x in c],
                           normalize_rewards=True, max_steps=4)
    trainer.train()
    assert trainer.state.log_history[-2]["nonfinite/skipped_steps"] == 0
    assert all(math.isfinite(e.get("loss", 0.0)) for e in trainer.state.log_history)


def test_nonfinite_weights_are_never_saved(tiny_models, tokenizer, lora_config, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "run", lora_config)
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "lora_" in n).fill_(float("nan"))
    with pytest.raises(RuntimeError, match="hold NaN/inf"):
        trainer.save_model(str(tmp_path / "saved"))
    assert not os.path.exists(tmp_path / "saved")


# ---- bad values refused at construction ----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("max_prompt_length", 0), ("max_prompt_length", -3), ("kl_coef", -0.1), ("kl_coef", float("nan")),
    ("reward_clip", 0.0), ("reward_clip", -1.0), ("cliprange", 0.0), ("cliprange_value", 0.0), ("gamma", 1.5),
    ("gamma", -0.1), ("lam", 1.01), ("kl_target", 0.0), ("kl_horizon", 0), ("top_k", -1), ("vf_coef", -1.0),
    ("entropy_coef", float("inf")), ("missing_eos_penalty", float("nan")), ("critic_learning_rate", 0.0),
    ("local_rollout_forward_batch_size", 0), ("num_ppo_epochs", 0), ("num_mini_batches", 0), ("response_length", 0),
    ("temperature", 0.0), ("top_p", 0.0), ("min_p", -0.1), ("min_p", 1.5), ("max_consecutive_nonfinite", 0), ("num_sample_generations", -1),
    ("stop_token_id", -2), ("per_device_train_batch_size", 0),
])
def test_each_bad_config_value_is_refused(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r}: must be"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], **{field: value})


def test_all_config_errors_listed_at_once(tmp_path):
    with pytest.raises(ValueError) as err:
        PPOConfig(output_dir=str(tmp_path), report_to=[], gamma=2.0, kl_coef=-1.0, top_k=-5)
    assert all(f"{name}=" in str(err.value) for name in ("gamma", "kl_coef", "top_k"))


def test_good_edge_values_are_accepted(tmp_path):
    with pytest.warns(UserWarning, match="vf_coef=0 with advantage_estimator='gae'"):  # legal, but said
        PPOConfig(output_dir=str(tmp_path), report_to=[], gamma=0.0, lam=1.0, kl_coef=0.0, top_k=0,
                  max_prompt_length=None, reward_clip=None, entropy_coef=-0.01, vf_coef=0.0)
    PPOConfig(output_dir=str(tmp_path), report_to=[], missing_eos_penalty=0.0, cliprange=0.99, reward_weights=[0, 1],
              critic_warmup_steps=9, max_steps=10)


# Settings each legal alone that together would make a part of the objective a no-op or invert it (the README's
# "Errors at construction" lists each): an error when PPOConfig is built, before any model loads.
@pytest.mark.parametrize("settings, message", [
    ({"missing_eos_penalty": -1.0}, r"missing_eos_penalty=-1.0: must be None or >= 0 .*pays the policy"),
    ({"reward_weights": [0, 0.0]}, r"every weight is 0"),
    ({"cliprange_low": 1.0}, r"cliprange_low=1.0: the lower clip bound .* can never bind"),
    ({"cliprange": 1.5}, r"cliprange=1.5: the lower clip bound"),
    ({"kl_estimator": "k4"}, r"kl_estimator='k4': choose one of k1, k2, k3, k3\+, abs \(or verl's names"),
    ({"adaptive_kl": True, "kl_coef": 0.0}, r"adaptive_kl=True with kl_coef=0: .*never acts"),
], ids=["negative-eos-penalty", "zero-weights", "clip-low-never-binds",
        "cliprange-never-binds", "unknown-kl-estimator", "adaptive-kl-from-zero"])
def test_settings_that_would_silently_train_nothing_fail_at_construction(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir=str(tmp_path), report_to=[], **settings)


@pytest.mark.parametrize("warmup", [10, 50])
def test_a_warmup_covering_the_whole_run_says_the_policy_will_not_train(tmp_path, warmup):
    """A critic-only run can be meant (the critic first, then a resume with a longer max_steps): a warning."""
    with pytest.warns(UserWarning, match=rf"critic_warmup_steps={warmup} covers the whole run .*policy ends where"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], critic_warmup_steps=warmup, max_steps=10)


def test_a_warmup_covering_an_epoch_derived_run_says_so(tiny_models, tokenizer, tmp_path):
    """max_steps unset: 16 prompts / 8 per iteration = 2 iterations x 4 optimizer steps x 1 epoch = 8 steps."""
    with pytest.warns(UserWarning, match=r"critic_warmup_steps=8 covers the whole run \(1 epoch\(s\) of 2 iteration"
                                         r"\(s\) x 4 optimizer steps = 8 steps\)"):
        make_trainer(tiny_models, tokenizer, tmp_path, max_steps=-1, num_train_epochs=1, critic_warmup_steps=8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*covers the whole run")
        make_trainer(tiny_models, tokenizer, tmp_path, max_steps=-1, num_train_epochs=2, critic_warmup_steps=8)


def test_a_negative_entropy_bonus_warns(tmp_path):
    with pytest.warns(UserWarning, match=r"entropy_coef=-0.01 is negative: the loss pays the policy for lower entropy"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], entropy_coef=-0.01)


@pytest.mark.parametrize("rows, message", [
    ({"prompt": ["the movie was", None, "x"]}, r"row 1 is None"),
    ({"messages": [["hello", "world"]] * 2}, r"row 0, turn 0 is a str"),
    ({"messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}]]},
     r"row 1, turn 0 needs a 'role' \(string\) and a 'content'"),
])
def test_bad_data_rows_are_named(tokenizer, rows, message):
    from hf_ppo.trainer.data import prepare_prompts

    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match=message):
        prepare_prompts(Dataset.from_dict(rows), tok, "train_dataset", max_prompt_length=16, response_length=4,
                        context=None)


@pytest.mark.parametrize("values, message", [
    ({"a": 1.0, "b": 2.0}, r"returned dict a dict with keys \['a', 'b'\]"),
    (torch.ones(2, 1), r"Tensor of shape \(2, 1\).*squeeze"),
    (np.ones((2, 2)), r"ndarray of shape \(2, 2\)"),
    (["good", "bad"], r"non-number at position 0: str 'good'"),
    ([1.0, None], r"non-number at position 1: NoneType"),
    (3.0, r"returned float 3.0"),
    ("1.0", r"returned str"),
    ((x for x in [1.0, 2.0]), r"returned generator"),
    ([1.0], r"returned 1 scores for 2 completions"),
])
def test_bad_reward_outputs_say_what_came_back(values, message):
    with pytest.raises((TypeError, ValueError), match=message):
        check_reward_values(values, 2)


@pytest.mark.parametrize("values", [[1.0, 2], (1.0, True), torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]),
                                    [np.float32(1.0), torch.tensor(2.0)], [float("nan"), 1.0]])
def test_good_reward_outputs(values):
    scores = check_reward_values(values, 2)
    assert scores.shape == (2,) and scores.dtype == torch.float32


# ---- only hf_ppo's files --------------------------------------------------------------------------------------------
def _foreign_checkpoint(out, step: int) -> dict:
    """Another program's `checkpoint-N` in the output folder: its files and their bytes."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"not hf_ppo's")
    (folder / "notes.txt").write_text("written by another trainer")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_another_programs_checkpoints_are_never_moved_or_replaced(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    before = _foreign_checkpoint(out, 100)
    trainer = make_trainer(tiny_models, tokenizer, out, max_steps=2, save_strategy="steps", save_steps=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*incomplete checkpoint")  # it claims no cause it did not see
        trainer.train()  # a fresh run: the foreign folder stays as it is, where it is
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-100").iterdir()} == before
    assert not (out / "incomplete-checkpoint-100").exists()
    assert (out / "checkpoint-2" / "hf_ppo_checkpoint.json").is_file()  # hf_ppo's own carry its marker
    # Resuming "from the latest" when the latest is not hf_ppo's: an error naming it, the folder untouched.
    resumed = make_trainer(tiny_models, tokenizer, out, max_steps=4, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match=r"checkpoint-100: hf_ppo did not write it"):
        resumed.train(resume_from_checkpoint=True)
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-100").iterdir()} == before


def test_a_save_never_replaces_another_programs_checkpoint_of_the_same_step(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    before = _foreign_checkpoint(out, 2)
    trainer = make_trainer(tiny_models, tokenizer, out, max_steps=2, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match=r"checkpoint-2 exists and was not written by hf_ppo"):
        trainer.train()
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir()} == before


def test_a_rotation_that_would_delete_another_programs_checkpoint_is_refused(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    before = _foreign_checkpoint(out, 1)
    trainer = make_trainer(tiny_models, tokenizer, out, max_steps=4, save_strategy="steps", save_steps=1,
                           save_total_limit=1)
    with pytest.raises(CheckpointError, match=r"save_total_limit=1 would let Trainer delete checkpoints .* hf_ppo did "
                                              r"not write \(checkpoint-1: no hf_ppo_checkpoint.json\)"):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before the first step
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-1").iterdir()} == before


def test_an_incomplete_checkpoint_is_never_moved_onto_another_programs_folder(tmp_path):
    from hf_ppo.trainer.checkpoint import MARKER_FILE, hide_incomplete

    ours = tmp_path / "checkpoint-3"
    ours.mkdir()
    (ours / MARKER_FILE).write_text("{}")  # hf_ppo's, incomplete (no PPO state, no weights)
    theirs = tmp_path / "incomplete-checkpoint-3"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("another program's")
    assert hide_incomplete(str(tmp_path)) == []
    assert (theirs / "notes.txt").read_text() == "another program's" and (ours / MARKER_FILE).is_file()


# ---- resume tells the truth ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_checkpoint(tiny_models, tokenizer, tmp_path_factory):
    """checkpoint-2 of a LoRA run (r=8), saved with the optimizer and without it."""
    folders = {}
    for only_model in (False, True):
        out = tmp_path_factory.mktemp("lora_run")
        make_trainer(tiny_models, tokenizer, out, lora(), max_steps=2, num_ppo_epochs=1, num_mini_batches=2,
                     save_strategy="steps", save_steps=2, save_only_model=only_model).train()
        folders[only_model] = str(out / "checkpoint-2")
    return folders


def test_a_checkpoint_saved_without_optimizer_resumes_with_a_warning_that_says_so(lora_checkpoint, tiny_models,
                                                                                 tokenizer, tmp_path):
    resumed = make_trainer(tiny_models, tokenizer, tmp_path, lora(), max_steps=4, num_ppo_epochs=1,
                           num_mini_batches=2, save_only_model=True)
    with pytest.warns(UserWarning, match=r"save_only_model=True .*optimizer's moments and the learning-rate "):
        resumed.train(resume_from_checkpoint=lora_checkpoint[True])
    assert resumed.state.global_step == 4


def test_a_lora_checkpoint_resumed_without_peft_config_names_the_missing_argument(lora_checkpoint, tiny_models,
                                                                                 tokenizer, tmp_path):
    resumed = make_trainer(tiny_models, tokenizer, tmp_path, None, max_steps=4, num_ppo_epochs=1, num_mini_batches=2)
    with pytest.raises(CheckpointError, match=r"holds a LoRA adapter .*pass the peft_config the run started with"):
        resumed.train(resume_from_checkpoint=lora_checkpoint[False])


def test_another_lora_rank_on_resume_is_named(lora_checkpoint, tiny_models, tokenizer, tmp_path):
    from peft import LoraConfig

    other = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    resumed = make_trainer(tiny_models, tokenizer, tmp_path, other, max_steps=4, num_ppo_epochs=1, num_mini_batches=2)
    with pytest.raises(CheckpointError, match=r"another LoRA configuration \(r: checkpoint 8, this run 4\)"):
        resumed.train(resume_from_checkpoint=lora_checkpoint[False])


# ---- every PPOConfig field, walked ---------------------------------------------------------------------------------
# A bad value for each PPO field (derived from the dataclass below, so a new field cannot be forgotten): each must be
# refused when PPOConfig is built, before any model loads.
BAD_VALUES = {
    "model_init_kwargs": "[1]", "ref_model_init_kwargs": "{not json", "reward_model_init_kwargs": "[1]",
    "critic_model_init_kwargs": "[1]", "policy_quantization": "3bit", "ref_quantization": "fp8",
    "reward_quantization": "2bit", "critic_quantization": "3bit", "disable_dropout": "false",
    "reward_input_format": "xml", "rollout_engine": "sglang", "stop_token": "eot", "stop_token_ids": [-1],
    "whiten_advantages": "no", "whiten_rewards": "yes", "critic": "twin", "advantage_estimator": "ppo2",
    "scale_rewards": "false", "loss_aggregation": "sum", "cliprange_low": 0.0, "cliprange_high": -0.1,
    "dual_clip": 1.0, "kl_estimator": "k4", "adaptive_kl": "true", "normalize_rewards": "on", "reward_weights": [],
    "normalize_each_reward": "off", "overlong_buffer_length": 0, "push_merged_model": "yes",
    "total_episodes": 0, "num_total_batches": 0, "local_batch_size": 8, "micro_batch_size": 8, "batch_size": 8,
    "local_mini_batch_size": 8, "mini_batch_size": 8, "allow_config_change_on_resume": "yes", "print_metrics": "1",
    "max_prompt_length": 0, "kl_coef": -0.1, "reward_clip": 0.0, "cliprange": 0.0, "cliprange_value": 0.0,
    "gamma": 1.5, "lam": 1.01, "kl_target": 0.0, "kl_horizon": 0, "stats_pass_every": -1, "top_k": -1, "vf_coef": -1.0,
    "entropy_coef": float("inf"), "missing_eos_penalty": -1.0,
    "critic_learning_rate": -1.0, "critic_warmup_steps": -1, "num_generations": 0, "overlong_penalty_factor": -1.0,
    "local_rollout_forward_batch_size": 0, "num_ppo_epochs": 0, "num_mini_batches": 0, "response_length": 0,
    "temperature": 0.0, "top_p": 0.0, "min_p": 1.5, "max_consecutive_nonfinite": 0, "num_sample_generations": -1, "num_eval_samples": 0,
    "stop_token_id": -2, "logits_memory_mb": 0, "dataset_num_proc": 0, "sft_model_path": "", "reward_model_path": " ",
    "lam_critic": 1.5, "lam_length_alpha": 0.0, "critic_updates_per_step": 0, "max_refill_rounds": -1,
    "importance_sampling_level": "group", "use_kl_loss": "yes", "use_bias_correction_kl": 1,
    "drop_uniform_groups": "on", "watch_collapse": "true", "stop_on_collapse": "false", "collapse_kl_threshold": 0.0,
    "critic_hub_model_id": "no-namespace", "apply_chat_template_to_text": "yes", "hub_base_model_id": "/home/me/base",
    "prompt_column": "", "system_prompt": 5, "max_completion_length": 0,
    "vllm_gpu_memory_utilization": 0.0, "vllm_max_model_len": 1, "vllm_dtype": "int4", "vllm_enable_sleep_mode": "yes",
    "vllm_importance_sampling_cap": 0.5,
    # issue 62: the loss family
    "kl_loss_estimator": "k4", "policy_loss": "ppo3", "cispo_clip_max": 0.0, "sapo_temperature_pos": 0.0,
    "sapo_temperature_neg": -1.0, "gmpo_cliprange": 0.0, "clip_cov_ratio": 0.0, "clip_cov_lb": float("nan"),
    "clip_cov_ub": float("inf"), "kl_cov_ratio": 1.5, "kl_cov_coef": -1.0,
    "vllm_importance_sampling_mode": "sequence", "vllm_importance_sampling_min": 0.0,
    "multi_objective_aggregation": "sum",
    "auto_ev_threshold": 1.0,
}
# Reviewed: fields for which every value of their type is legal (a name, a label).
ACCEPTS_ANY_VALUE = {
    "model_adapter_name": "the name of one of the policy's adapters (checked against the policy when it loads)",
    "ref_adapter_name": "likewise, for the reference adapter",
    "exp_name": "TRL's run label, used as run_name",
    "ds3_gather_for_generation": "TRL's ZeRO-3 option: any value is ignored with a warning",
}


def ppo_fields() -> list[str]:
    from dataclasses import fields

    from transformers import TrainingArguments

    base = {f.name for f in fields(TrainingArguments)}
    return [f.name for f in fields(PPOConfig) if f.name not in base]


def test_every_ppo_field_has_a_bad_value_or_a_reviewed_reason():
    missing = [n for n in ppo_fields() if n not in BAD_VALUES and n not in ACCEPTS_ANY_VALUE]
    assert not missing, f"PPOConfig fields without a bad value in BAD_VALUES nor a reason in ACCEPTS_ANY_VALUE: {missing}"
    assert not set(BAD_VALUES) - set(ppo_fields()) and not set(ACCEPTS_ANY_VALUE) - set(ppo_fields())


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_each_ppo_field_refuses_its_bad_value_at_construction(tmp_path, name):
    with pytest.raises(ValueError, match=name):
        PPOConfig(output_dir=str(tmp_path), report_to=[], **{name: BAD_VALUES[name]})


# ---- the settings compared on resume ---------------------------------------------------------------------------------
# The resume comparison covers every PPOConfig field that changes what a run computes.
#
# The fields come from the dataclass itself (PPOConfig's fields minus TrainingArguments'), so a new field is compared
# on resume unless it is added, with its reason, to the reviewed list below. Each field is changed alone on a copy of
# the settings and `checkpoint.compare_settings` must name it (or, for the reviewed list, must not).

# Reviewed: PPOConfig fields a resume may change, each with why it does not change what training computes.
MAY_CHANGE_ON_RESUME = {
    "model_init_kwargs": "loading kwargs; may hold a Hub token, so never written to the checkpoint",
    "ref_model_init_kwargs": "loading kwargs; may hold a Hub token, so never written to the checkpoint",
    "reward_model_init_kwargs": "loading kwargs; may hold a Hub token, so never written to the checkpoint",
    "num_sample_generations": "how many sample completions are logged; no effect on training",
    "num_eval_samples": "how many responses evaluation samples per prompt; no effect on training",
    "push_merged_model": "what is pushed to the Hub after training",
    "critic_hub_model_id": "where push_to_hub pushes the critic after training",
    "max_consecutive_nonfinite": "when the guard gives up, not what a good step computes",
    "watch_collapse": "the collapse watch reads the logs; it computes nothing training uses",
    "stop_on_collapse": "when the watch stops the run, not what a step computes",
    "collapse_kl_threshold": "when the watch warns, not what a step computes",
    "stats_pass_every": "which rollouts also run the passes no update reads, for the metrics; not what a step computes",
    "allow_config_change_on_resume": "the switch of this very comparison",
    "total_episodes": "TRL's run length (sets max_steps): a resume may run longer",
    "num_total_batches": "TRL's run length (sets max_steps): a resume may run longer",
    "dataset_num_proc": "tokenization workers; the same tokens either way",
    "ds3_gather_for_generation": "TRL's ZeRO-3 option, ignored by hf_ppo",
    "exp_name": "TRL's experiment name (run_name): logging only",
    "print_metrics": "console output only",
    "prompt_column": "which column holds the prompts: the data, which a resume may change as it may change the dataset",
    "system_prompt": "part of the prompts, which a resume may change as it may change the dataset",
    "max_completion_length": "TRL's name for response_length, which is compared",
    "vllm_gpu_memory_utilization": "how much memory vLLM's copy of the policy takes; it samples the policy either way",
    "vllm_max_model_len": "how long a sequence vLLM's copy holds (prompts and responses fit it or are refused)",
    "vllm_dtype": "the dtype of vLLM's copy: the old log-probs stay the policy's own, so the update is the same",
    "vllm_enable_sleep_mode": "whether vLLM frees its memory between rollouts; what it samples is the same",
}
# TrainingArguments fields that fix the batch geometry and the prompt order: compared as well.
GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
PPO_FIELDS = sorted({f.name for f in dataclasses.fields(PPOConfig)}
                    - {f.name for f in dataclasses.fields(TrainingArguments)})


class Changed:
    """A value no field holds; `settings` stores it as its str()."""

    def __str__(self):
        return "<changed on resume>"


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return PPOConfig(output_dir=str(tmp_path_factory.mktemp("resume_settings")), report_to=[])


def changed_names(args, name) -> set[str]:
    other = copy.copy(args)
    object.__setattr__(other, name, Changed())
    return set(compare_settings(settings(args), settings(other)))


def test_the_reviewed_list_names_only_real_fields():
    assert set(MAY_CHANGE_ON_RESUME) <= set(PPO_FIELDS), set(MAY_CHANGE_ON_RESUME) - set(PPO_FIELDS)
    assert all(reason.strip() for reason in MAY_CHANGE_ON_RESUME.values())


@pytest.mark.parametrize("name", [n for n in PPO_FIELDS if n not in MAY_CHANGE_ON_RESUME] + list(GEOMETRY))
def test_every_field_that_changes_the_run_is_compared_on_resume(args, name):
    assert changed_names(args, name) == {name}, (
        f"PPOConfig.{name} is not compared on resume: compare it (hf_ppo/trainer/checkpoint.py), or, if changing it on resume "
        "cannot change what training computes, add it with its reason to MAY_CHANGE_ON_RESUME")


@pytest.mark.parametrize("name", sorted(MAY_CHANGE_ON_RESUME))
def test_fields_that_may_change_are_not_compared(args, name):
    assert changed_names(args, name) == set(), f"{name} is compared on resume but listed as free to change"


@pytest.mark.parametrize("name", [n for n in PPO_FIELDS if n not in MAY_CHANGE_ON_RESUME])
def test_a_checkpoint_from_before_a_field_existed_resumes_at_its_default(args, name):
    """A checkpoint written by an hf_ppo without `name` ran as its default does: resuming with the default is no
    change (upgrading hf_ppo mid-run keeps the run); any other value is named."""
    older = {k: v for k, v in settings(args).items() if k != name}
    assert compare_settings(older, settings(args), default_settings(args)) == {}
    other = copy.copy(args)
    object.__setattr__(other, name, Changed())
    changed = compare_settings(older, settings(other), default_settings(args))
    assert set(changed) == {name} and "(not recorded)" in changed[name]


# ---- a full disk during a checkpoint --------------------------------------------------------------------------------
ENFORCE_FAIL = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.parametrize("failure", ["enospc", "torch_enforce_fail"])
def test_a_full_disk_during_a_checkpoint_names_the_disk_the_folder_and_what_is_intact(
        failure, reference_4_steps, tiny_models, tokenizer, lora_config, tmp_path, monkeypatch):
    """A checkpoint write that fails for lack of space (an OSError ENOSPC, or torch's zip writer's bare "enforce fail
    ... unexpected pos", which carries no errno: then the free space decides) ends in one error naming the cause, the
    folder, the free space and the last complete checkpoint, which stays intact; freeing space and resuming as the
    message says finishes the run exactly. Simulated: the writer raises, no disk is filled."""
    import errno
    from collections import namedtuple

    from hf_ppo.trainer import checkpoint as ckpt

    out = tmp_path / "out"
    kwargs = dict(max_steps=4, num_ppo_epochs=1, save_strategy="steps", save_steps=2)
    trainer = make_trainer(tiny_models, tokenizer, out, lora_config, **kwargs)
    real_save = torch.save

    def full_disk_save(obj, f, *args, **kw):
        if "checkpoint-4" in str(f):
            if failure == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            raise RuntimeError(ENFORCE_FAIL)
        return real_save(obj, f, *args, **kw)

    monkeypatch.setattr(torch, "save", full_disk_save)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 3 * 2**20, 3 * 2**20))
    with pytest.raises(ckpt.CheckpointWriteError) as info:
        trainer.train()
    monkeypatch.undo()
    message = str(info.value)
    assert isinstance(info.value, OSError)
    assert "no space left on device" in message and str(out / "checkpoint-4") in message
    assert "3.0 MiB free" in message
    assert f"{out / 'checkpoint-2'} is the last complete checkpoint" in message and "intact" in message
    assert "resume_from_checkpoint=True" in message and "--resume_from_checkpoint true" in message
    if failure == "torch_enforce_fail":
        assert "unexpected pos" in message  # torch's own words, kept beside the cause
    assert problems(str(out / "checkpoint-2")) == [] and problems(str(out / "checkpoint-4"))

    # Space freed: the message's fix resumes from checkpoint-2 and ends where an uninterrupted run ends.
    resumed = make_trainer(tiny_models, tokenizer, out, lora_config, **kwargs)
    with pytest.warns(UserWarning, match=r"Skipping incomplete checkpoint .*checkpoint-4"):
        resumed.train(resume_from_checkpoint=True)
    assert_same_weights(reference_4_steps, resumed)


def test_an_error_that_is_no_failed_write_passes_through_unchanged(tiny_models, tokenizer, lora_config, tmp_path,
                                                                   monkeypatch):
    from hf_ppo.trainer import checkpoint as ckpt

    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "out", lora_config, max_steps=2, num_ppo_epochs=1,
                           save_strategy="steps", save_steps=2)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        trainer.train()
    assert not isinstance(info.value, ckpt.CheckpointWriteError)


def test_safetensors_failed_write_is_named_with_its_errno(tmp_path):
    """safetensors (the weights Trainer writes) reports a full disk as a SafetensorError carrying "(os error 28)"."""
    from safetensors import SafetensorError

    from hf_ppo.trainer import checkpoint as ckpt

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    with pytest.raises(ckpt.CheckpointWriteError, match=rf"Could not write checkpoint {folder}: no space left on "
                                                        r"device .*SafetensorError.*nothing to resume from"):
        with ckpt.write_failures_named(str(folder), str(tmp_path)):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


# ---- a full disk during the final save_model() ----------------------------------------------------------------------
def folder_bytes(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and "checkpoint-" not in str(p.relative_to(folder))}


@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
def test_a_full_disk_during_the_final_save_keeps_the_earlier_save_and_names_the_checkpoint(
        peft, tiny_models, tokenizer, tmp_path, monkeypatch):
    """save_model() on a full disk: the policy is written aside (inside the folder, so on its disk) and moved in only
    once whole, so the earlier save in that folder stays byte for byte and loadable, what this save wrote is deleted,
    and one error names the cause, the folder, the free space, the size of the policy, the last complete checkpoint and
    the fix in Python and for hf-ppo train. Freed space, the same call saves the trained policy."""
    from collections import namedtuple

    from hf_ppo.trainer import checkpoint as ckpt

    out = tmp_path / "out"
    trainer = make_trainer(tiny_models, tokenizer, out, lora() if peft else None, max_steps=2, num_ppo_epochs=1,
                           save_strategy="steps", save_steps=2)
    trainer.train()
    trainer.save_model()
    earlier = folder_bytes(out)
    weights = "adapter_model.safetensors" if peft else "model.safetensors"
    assert weights in earlier
    with torch.no_grad():  # the policy trained on: the next save differs from the earlier one
        for p in trainer.model.policy_model.parameters():
            if p.requires_grad:
                p.add_(0.5)

    half_written_then_full(out, monkeypatch)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 3 * 2**20, 3 * 2**20))
    with pytest.raises(ckpt.SaveWriteError) as info:
        trainer.save_model()
    monkeypatch.undo()
    message = str(info.value)
    assert isinstance(info.value, OSError) and "os error 28" in str(info.value.__cause__)
    assert f"Could not save the policy to {out}: no space left on device (3.0 MiB free" in message
    assert "the policy takes about" in message and "any policy saved there before is intact" in message
    assert f"{out / 'checkpoint-2'} is the run's last complete checkpoint" in message
    assert "trainer.save_model() again" in message and "--resume_from_checkpoint true" in message
    assert folder_bytes(out) == earlier, "the earlier save was changed"
    assert not (out / ckpt.STAGING_DIR).exists()

    trainer.save_model()  # space freed: the same call saves the trained policy over the earlier one
    now = folder_bytes(out)
    assert now[weights] != earlier[weights] and not (out / ckpt.STAGING_DIR).exists()
    assert problems(str(out / "checkpoint-2")) == []

    import errno

    from hf_ppo.hub import cards

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "README.md"))

    monkeypatch.setattr(cards, "write_policy_card", full)  # the card, written after the policy moved in
    with pytest.raises(ckpt.SaveWriteError, match=rf"Could not save the policy's model card to {out}: no space left "
                                                  rf"on device .*The policy itself is saved in {out}\."):
        trainer.save_model()
    assert folder_bytes(out)[weights] == now[weights]


def test_a_full_disk_while_writing_the_training_log_is_named(tiny_models, tokenizer, tmp_path, monkeypatch):
    """save_state() (hf-ppo train's first write after training) on a full disk: the same named error, with its fix."""
    import errno

    from transformers import TrainerState

    from hf_ppo.trainer import checkpoint as ckpt

    trainer = make_trainer(tiny_models, tokenizer, tmp_path / "out", None, max_steps=1, num_ppo_epochs=1)

    def full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(TrainerState, "save_to_json", full)
    with pytest.raises(ckpt.SaveWriteError, match=r"Could not save the training log \(trainer_state.json\) to .*no "
                                                  r"space left on device.*call trainer.save_state\(\), then "
                                                  r"trainer.save_model\(\), again"):
        trainer.save_state()


def test_a_staged_save_that_fails_says_exactly_what_it_changed(tmp_path, monkeypatch):
    """A first save that fails leaves no folder behind; a move that fails part-way (no space is needed for a rename,
    so another cause: an I/O error) says which files already replaced the earlier save's, never "nothing replaced"."""
    import errno

    from hf_ppo.trainer import checkpoint as ckpt

    first = tmp_path / "first"
    with pytest.raises(ckpt.SaveWriteError, match="Nothing in .* was replaced"):
        with ckpt.staged_save(str(first), str(tmp_path)) as folder:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "model.safetensors"))
    assert not first.exists()

    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.json", "b.json"):
        (out / name).write_text("earlier")
    real, calls = os.replace, []

    def second_fails(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error", target)
        return real(source, target)

    with pytest.raises(ckpt.SaveWriteError, match=r"input/output error .*1 file\(s\) of this save were already moved "
                                                  r"into .*it mixes this save and the one before, so save again"):
        with ckpt.staged_save(str(out), str(tmp_path)) as folder:
            for name in ("a.json", "b.json"):
                with open(os.path.join(folder, name), "w") as f:
                    f.write("new")
            monkeypatch.setattr(ckpt.os, "replace", second_fails)
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.json"]


# ---- issue 63 kinds 3 and 5: the saved folder's exact files; the staged final save equals the checkpoint's -----------
POLICY_FILES = {"lora": ["adapter_config.json", "adapter_model.safetensors"],
                "full": ["config.json", "generation_config.json", "model.safetensors"]}
TOKENIZER_FILES = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
CHECKPOINT_FILES = ["hf_ppo_checkpoint.json", "optimizer.pt", "ppo_state.json", "rng_state.pth", "scheduler.pt",
                    "trainer_state.json", "value_head.safetensors"]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_saved_folder_holds_exactly_its_files_and_the_staged_save_equals_the_checkpoints(kind, tiny_models,
                                                                                          tokenizer, tmp_path):
    """The final save (written aside, then moved in: `staged_save`) leaves exactly the policy, the tokenizer, the run
    record, the card and its plot: no staging folder or marker in a folder that gets pushed. Its policy files are
    byte for byte those the checkpoint of the same step wrote straight into its folder (no staging)."""
    import contextlib
    import io

    trainer = make_trainer(tiny_models, tokenizer, tmp_path, lora() if kind == "lora" else None, max_steps=4,
                           save_strategy="steps", save_steps=4)
    trainer.train()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.save_model()
    saved = sorted([*POLICY_FILES[kind], *TOKENIZER_FILES, "hf_ppo_run.json"])
    assert sorted(os.listdir(tmp_path)) == sorted([*saved, "README.md", "checkpoint-4", "training_curves.png"])
    assert sorted(os.listdir(tmp_path / "checkpoint-4")) == sorted([*saved, *CHECKPOINT_FILES])
    for name in saved:
        assert (tmp_path / name).read_bytes() == (tmp_path / "checkpoint-4" / name).read_bytes(), name


# ---- issue 60: a finished run's resume, a half-made checkpoint, leftovers of a killed save ---------------------------
class _Steps:
    """A callback counting the optimizer steps a train() takes."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Count(TrainerCallback):
            steps = 0

            def on_step_end(self, args, state, control, **kwargs):
                Count.steps += 1

        return Count()


@pytest.mark.parametrize("resume", ["true", "path"])
def test_a_finished_runs_resume_trains_nothing_and_saves_the_last_checkpoint(tiny_models, tokenizer, tmp_path, resume):
    """Issue 60 item 2: a run that finished max_steps, then was killed (or failed) in its final save, is resumed as
    hf_ppo's messages advise; Trainer trained a step past max_steps (step 3 of 2) and saved that as the policy. Now
    nothing is trained: the checkpoint's policy and state are loaded, and the final save writes them."""
    out = tmp_path / "out"
    first = make_trainer(tiny_models, tokenizer, out, num_ppo_epochs=1, max_steps=2, save_strategy="steps",
                         save_steps=2)  # 2 of the epoch's 4 steps: Trainer's resume would go on inside the epoch
    first.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    resumed = make_trainer(tiny_models, tokenizer, out, num_ppo_epochs=1, max_steps=2, save_strategy="steps",
                           save_steps=2)
    counter = _Steps()
    resumed.add_callback(counter)
    with pytest.warns(UserWarning, match=r"checkpoint-2 finished this run already \(step 2, max_steps 2\): nothing is "
                                         r"trained; its policy and state are loaded"):
        output = resumed.train(resume_from_checkpoint=True if resume == "true" else str(out / "checkpoint-2"))
    assert counter.steps == 0 and output.global_step == 2 and resumed.state.global_step == 2
    assert resumed.iteration == first.iteration
    assert not (out / "checkpoint-3").exists()
    assert_same_weights(first, resumed)
    assert [e["loss"] for e in resumed.state.log_history if "loss" in e] == \
        [e["loss"] for e in first.state.log_history if "loss" in e]  # the checkpoint's log, for the card and the plot
    resumed.save_model()
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    policy = resumed.accelerator.unwrap_model(resumed.model).policy_model.state_dict()
    assert all(torch.equal(saved[k], policy[k]) for k in saved)
    # A longer run resumes from it and trains the steps that remain.
    longer = make_trainer(tiny_models, tokenizer, out, num_ppo_epochs=1, max_steps=3, save_strategy="steps",
                          save_steps=2)
    longer.train(resume_from_checkpoint=True)
    assert longer.state.global_step == 3


class _Killed(BaseException):
    """A kill -9 at that point: nothing of hf_ppo's own runs after it (only the OS releases the lock)."""


def test_a_kill_between_creating_a_checkpoint_folder_and_its_marker_never_blocks_a_resume(tiny_models, tokenizer,
                                                                                         tmp_path, monkeypatch):
    """Issue 60 item 6: a kill between creating checkpoint-N/ and writing its marker left a folder hf_ppo could not
    tell from another program's: every resume stopped with "hf_ppo did not write it". The folder is now made aside
    with its marker, then renamed into place; an empty checkpoint-N (left so by an earlier hf_ppo) is moved aside."""
    from hf_ppo.trainer import checkpoint as ckpt

    out = tmp_path / "out"
    real = ckpt._atomic_write

    def killed_at_the_marker(path, data):
        if "checkpoint-4" in path and path.endswith(ckpt.MARKER_FILE):
            raise _Killed()
        return real(path, data)

    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "_atomic_write", killed_at_the_marker)
        with pytest.raises(_Killed):
            make_trainer(tiny_models, tokenizer, out, num_ppo_epochs=1, max_steps=4, save_strategy="steps",
                         save_steps=2).train()
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    resumed = make_trainer(tiny_models, tokenizer, out, num_ppo_epochs=1, max_steps=4, save_strategy="steps",
                           save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4 and problems(str(out / "checkpoint-4")) == []
    assert not (out / "checkpoint-4.hf_ppo-new").exists()  # the leftover, replaced by the save of the same step

    (out / "checkpoint-6").mkdir()  # what an earlier hf_ppo left at that kill: an empty folder
    again = make_trainer(tiny_models, tokenizer, out, num_ppo_epochs=1, max_steps=6, save_strategy="steps",
                         save_steps=2)
    with pytest.warns(UserWarning, match=r"Skipping incomplete checkpoint .*checkpoint-6 .*Moved to "
                                         r".*incomplete-checkpoint-6"):
        again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6 and problems(str(out / "checkpoint-6")) == []


def test_a_leftover_under_the_name_a_checkpoint_is_made_under_is_never_deleted_unless_hf_ppos(tmp_path):
    """Issue 63 kind 2: `checkpoint-N.hf_ppo-new` holding only hf_ppo's marker (a killed creation) is replaced; one
    holding anything else is another program's: the save stops naming it, and it stays as it was."""
    from hf_ppo.trainer import checkpoint as ckpt

    folder = tmp_path / "checkpoint-2"
    leftover = tmp_path / "checkpoint-2.hf_ppo-new"
    leftover.mkdir()
    (leftover / ckpt.MARKER_FILE).write_text("{}")
    ckpt._created_with_marker(str(folder))
    assert sorted(os.listdir(folder)) == [ckpt.MARKER_FILE] and not leftover.exists()

    other = tmp_path / "checkpoint-3"
    theirs = tmp_path / "checkpoint-3.hf_ppo-new"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"checkpoint-3.hf_ppo-new exists and was not written by hf_ppo"):
        ckpt._created_with_marker(str(other))
    assert (theirs / "notes.txt").read_text() == "mine" and not other.exists()


def test_leftovers_of_a_killed_final_save(tmp_path):
    """Issue 63 kind 2: a killed save's staging folder (hf_ppo's marker inside) is cleared by the next save, which
    completes; a `.hf_ppo-saving` folder hf_ppo did not write stops the save naming it, and nothing in it or beside
    it is touched."""
    from hf_ppo.trainer import checkpoint as ckpt

    out = tmp_path / "out"
    staging = out / ckpt.STAGING_DIR
    staging.mkdir(parents=True)
    (staging / ckpt._STAGING_MARKER).write_text("")
    (staging / "model.safetensors").write_bytes(b"half")  # the killed save's partial write
    (out / "model.safetensors").write_bytes(b"earlier")
    (out / "notes.md").write_text("mine")
    with ckpt.staged_save(str(out), str(tmp_path)) as folder:
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"new")
    assert (out / "model.safetensors").read_bytes() == b"new" and not staging.exists()
    assert (out / "notes.md").read_text() == "mine"

    staging.mkdir()
    (staging / "draft.txt").write_text("a user's")
    with pytest.raises(FileExistsError, match=rf"{staging}, the folder hf_ppo writes a save into before moving it "
                                              r"in, exists and hf_ppo did not write it"):
        with ckpt.staged_save(str(out), str(tmp_path)):
            pytest.fail("no save starts")
    assert (staging / "draft.txt").read_text() == "a user's" and (out / "model.safetensors").read_bytes() == b"new"


def test_the_final_save_moves_the_run_record_in_after_the_weights(tmp_path, monkeypatch):
    """Issue 60 item 10: a kill between the final save's moves left this save's run record (step 4) over the earlier
    save's weights (step 2). The record moves last."""
    from hf_ppo.trainer import checkpoint as ckpt

    out = tmp_path / "out"
    out.mkdir()
    real, order = os.replace, []

    def recorded(source, target):
        order.append(os.path.basename(target))
        return real(source, target)

    monkeypatch.setattr(ckpt.os, "replace", recorded)
    names = ["hf_ppo_run.json", "adapter_model.safetensors", "adapter_config.json", "tokenizer.json"]
    with ckpt.staged_save(str(out), str(tmp_path), last=("hf_ppo_run.json",)) as folder:
        for name in names:
            with open(os.path.join(folder, name), "w") as f:
                f.write(name)
    assert sorted(order) == sorted(names) and order[-1] == "hf_ppo_run.json"


def test_a_save_of_the_other_kind_leaves_no_stale_weights_of_an_earlier_hf_ppo_save(tiny_models, tokenizer, tmp_path):
    """Issue 60 item 10: a LoRA run saved over a full-model run left the stale model.safetensors beside the adapter
    (a push uploaded it, from_pretrained loaded it as the model); the other way round, a stale adapter beside full
    weights. A save removes the earlier hf_ppo save's files of the other kind once it is in place; a folder hf_ppo
    never saved into (no run record) keeps every file."""
    out = tmp_path / "out"
    make_trainer(tiny_models, tokenizer, out).save_model()
    assert (out / "model.safetensors").is_file()
    make_trainer(tiny_models, tokenizer, out, lora()).save_model()
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    make_trainer(tiny_models, tokenizer, out).save_model()
    assert (out / "model.safetensors").is_file()
    assert not (out / "adapter_model.safetensors").exists() and not (out / "adapter_config.json").exists()

    users = tmp_path / "users"
    users.mkdir()
    (users / "model.safetensors").write_bytes(b"my own weights")
    make_trainer(tiny_models, tokenizer, users, lora()).save_model()
    assert (users / "model.safetensors").read_bytes() == b"my own weights"
