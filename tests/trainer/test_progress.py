"""What a run prints: the plain-text-prompts warning and `apply_chat_template_to_text`, the
sample tables (how many, what their cells show), the progress bars' units and labels, the closing summary and the
KL note, the time/ metrics that keep the forwards out of `time/score`, and the import noise and `hf-ppo --help`
that must not load torch."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tqdm.auto import tqdm

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.trainer import progress
from hf_ppo.trainer.progress import PPOProgressCallback, log_samples_table

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["the movie was", "the food was", "the book was", "the show was"] * 4


def make_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    num_mini_batches=1, num_ppo_epochs=1, max_steps=2, response_length=6, logging_steps=1,
                    learning_rate=1e-2, report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True,
                    seed=0, apply_chat_template_to_text=False)
    defaults.update(overrides)
    return PPOConfig(**defaults)


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


# ---- 8. import noise and --help --------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["entry point", "python -m"])
def test_help_prints_without_loading_torch_or_transformers(how):
    """`hf-ppo --help` imported torch and transformers (6 CPU seconds) before printing a docstring: the package's
    __init__ imported every floor. Both the console script's `hf_ppo.cli:main` and `python -m hf_ppo.cli` must print
    the usage with neither loaded."""
    call = ("from hf_ppo.cli import main; main(['--help'])" if how == "entry point" else
            "import runpy; sys.argv = ['hf-ppo', '--help']; runpy.run_module('hf_ppo.cli', run_name='__main__')")
    loaded = "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = _python(f"import sys\n{call}\n{loaded}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: hf-ppo {train,evaluate,demo}" in done.stdout
    assert "LOADED []" in done.stdout, done.stdout[-500:]


def test_the_public_names_still_load_on_first_use():
    """The lazy top level hands on the same objects as their homes, and an unknown name is an AttributeError."""
    import hf_ppo
    from hf_ppo.models import AutoModelForCausalLMWithValueHead
    from hf_ppo.trainer import PPOLMTrainer as Home

    assert hf_ppo.PPOLMTrainer is Home and hf_ppo.AutoModelForCausalLMWithValueHead is AutoModelForCausalLMWithValueHead
    assert set(hf_ppo.__all__) <= set(dir(hf_ppo))
    with pytest.raises(AttributeError, match="no attribute 'PPOTrainer'"):
        hf_ppo.PPOTrainer  # noqa: B018


def test_bitsandbytes_kernels_note_is_dropped_and_nothing_else():
    """bitsandbytes logs "Failed to load CPU gemm_4bit_forward ... pip install kernels" on import (on CPUs with
    AVX512-BF16), which read like a broken install on every `import hf_ppo`. After `import hf_ppo` that one record of
    that one logger is dropped, whether bitsandbytes logs it (this machine) or not; its other records still show."""
    done = _python(
        "import logging, hf_ppo\n"
        "import bitsandbytes  # on this kind of CPU, logs the note while it imports\n"
        "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
        "`pip install kernels`', 'no module')\n"
        "log.warning('another bitsandbytes message')\n")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gemm_4bit_forward" not in done.stderr + done.stdout, done.stderr[-2000:]
    assert "another bitsandbytes message" in done.stderr


def test_lora_construction_is_quiet_about_is_gradient_checkpointing_and_the_filter_stays_inside(tiny_models, tmp_path,
                                                                                              lora_config):
    """peft reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model, so every LoRA
    construction printed a FutureWarning about a name hf_ppo never uses. It is silenced inside hf_ppo's loading
    only: the user's own read of the property still warns (no process-wide filter). transformers deprecated the name
    after 5.19 (CI's floor leg), where no read warns and only the first half applies."""
    from transformers import AutoModelForCausalLM

    from hf_ppo import AutoModelForCausalLMWithValueHead

    def read_warns(model) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.is_gradient_checkpointing  # noqa: B018
        return any("is_gradient_checkpointing" in str(w.message) for w in caught)

    deprecated = read_warns(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]))
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), reward_model=count_e,
                               train_dataset=dataset, peft_config=lora_config)
        AutoModelForCausalLMWithValueHead.from_pretrained(tiny_models["policy"], peft_config=lora_config)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert read_warns(trainer.model.policy_model.get_base_model()) == deprecated


# ---- 5. plain-text prompts to a chat tokenizer -----------------------------------------------------------------------
def test_text_prompts_to_a_chat_tokenizer_warn_once_naming_the_fix(tiny_models, tmp_path):
    """A chat model given raw text answers mostly with empty turns, and PPO optimised on that without a word: text
    prompts with a tokenizer that has a chat template warn once (for train and eval together), naming the
    'messages' column and apply_chat_template_to_text; False (a base model) is silent, as are chat prompts."""
    text = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.warns(UserWarning, match="plain-text prompts") as caught:
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, apply_chat_template_to_text=None),
                     reward_model=count_e, train_dataset=text, eval_dataset=text)
    notes = [w for w in caught if "plain-text prompts" in str(w.message)]
    assert len(notes) == 1 and "train_dataset and eval_dataset" in str(notes[0].message)
    assert "'messages' column" in str(notes[0].message) and "apply_chat_template_to_text=True" in str(notes[0].message)
    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    for args, data in ((make_args(tmp_path, apply_chat_template_to_text=False), text),
                       (make_args(tmp_path, apply_chat_template_to_text=None), chat)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=count_e, train_dataset=data)
        assert not [w for w in caught if "plain-text prompts" in str(w.message)]


def test_apply_chat_template_to_text_reads_text_prompts_as_user_turns(tiny_models, tokenizer, tmp_path):
    """apply_chat_template_to_text=True: each text prompt is one user turn through the chat template, token for token
    what a 'messages' column gives, and the rewards see it as a chat; a bad value is refused at construction."""
    text = Dataset.from_dict({"prompt": PROMPTS})
    messages = Dataset.from_dict({"messages": [[{"role": "user", "content": p}] for p in PROMPTS]})
    wrapped = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, apply_chat_template_to_text=True),
                           reward_model=count_e, train_dataset=text)
    chat = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), reward_model=count_e,
                        train_dataset=messages)
    assert wrapped.train_dataset["input_ids"] == chat.train_dataset["input_ids"]
    assert wrapped.train_dataset[0]["input_ids"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "the movie was"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert wrapped.train_dataset[0]["prompt"] == [{"role": "user", "content": "the movie was"}]
    with pytest.raises(ValueError, match="apply_chat_template_to_text='yes'"):
        make_args(tmp_path, apply_chat_template_to_text="yes")


# ---- 6. the sample tables --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total, n, expected", [(12, 10, 10), (3, 10, 3), (40, 4, 4), (5, 1, 1), (7, 0, 0)])
def test_tables_are_the_documented_number_first_and_last_included(total, n, expected):
    """num_sample_generations=10 printed 12 tables in 12 iterations (every max(1, 12 // 10) = 1 iteration): exactly
    min(n, total) iterations, spread over the run, the first and the last among them."""
    chosen = progress.sample_iterations(total, n)
    assert len(chosen) == expected and chosen <= set(range(1, total + 1))
    if n > 1:
        assert {1, total} <= chosen


def _batch(tok, prompts: list[str], completions: list[str]):
    queries = tok(prompts, return_tensors="pt", padding=True)
    responses = tok(completions, return_tensors="pt", padding=True, padding_side="right")
    return SimpleNamespace(queries=queries["input_ids"], query_mask=queries["attention_mask"].bool(),
                           responses=responses["input_ids"], response_mask=responses["attention_mask"].bool(),
                           scores=torch.arange(len(prompts), dtype=torch.float))


@pytest.fixture
def tables(monkeypatch):
    """The text of every console table written."""
    import tqdm.auto

    written = []
    monkeypatch.setattr(tqdm.auto.tqdm, "write", classmethod(lambda cls, text, *a, **k: written.append(text)))
    return written


def test_a_run_of_12_iterations_prints_10_tables(tok, tables, tmp_path):
    args = make_args(tmp_path, num_sample_generations=10, max_steps=12)  # one optimizer step per iteration
    batch = _batch(tok, ["the movie was"], [" great"])
    for iteration in range(1, 13):
        progress.maybe_log_samples(tok, batch, iteration, iteration, 12, args)
    assert len(tables) == 10 and "Samples at PPO iteration 12" in tables[-1]


def test_cells_show_the_last_user_turn_and_are_short(tok, tables, tmp_path):
    """A chat prompt's cell was the whole template (mostly its system prompt), and long completions folded over
    dozens of lines: the prompt cell is the last user turn, every cell one short line, an empty completion says so,
    at most CONSOLE_ROWS rows. A row whose dataset prompt is not in its tokens (a refilled row) shows its tokens."""
    system = "You are a helpful AI assistant named Tiny, trained to be very polite and thorough " * 3
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i} here"}]
             for i in range(6)]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    texts[1] = texts[1].replace("question 1 here", "another prompt")  # the refill replaced this row
    long = "the plot was fun " * 40
    batch = _batch(tok, texts, [long, "", "good", "bad", "ok", "fine"])
    args = make_args(tmp_path, num_sample_generations=1, max_steps=1)
    progress.maybe_log_samples(tok, batch, 1, 1, 1, args, chats)
    (table,) = tables
    assert "question 0 here" in table and "helpful AI assistant" not in table.split("another prompt")[0]
    assert "another prompt" in table  # not the dataset's "question 1 here": the row's own tokens
    assert "question 1 here" not in table
    assert "(empty)" in table and "\u2026" in table and long.strip() not in table
    assert "question 4 here" not in table  # rows beyond CONSOLE_ROWS
    assert len(table.splitlines()) < 30


def test_the_bar_counts_steps_and_the_evaluation_bar_is_labelled(tmp_path):
    """The bar said "PPO iteration i/N" while its rate was per optimizer step under tqdm's "it": the unit is "step";
    Trainer's evaluation bar had no label at all."""
    from transformers import TrainerControl, TrainerState

    args = make_args(tmp_path, num_ppo_epochs=2)
    callback = progress.PPOProgressCallback(args)
    state = TrainerState(max_steps=8, is_world_process_zero=True, is_local_process_zero=True)
    callback.on_train_begin(args, state, TrainerControl())
    callback.training_bar.fp = io.StringIO()
    callback.caption(state, {"objective/scores": 0.5, "objective/kl": 0.1, "iteration": 1})
    assert callback.training_bar.unit == "step" and callback.training_bar.desc.startswith("PPO iteration 1/4")
    assert "step/s" in str(callback.training_bar) or "s/step" in str(callback.training_bar)
    callback.on_prediction_step(args, state, TrainerControl(), eval_dataloader=[1, 2, 3])
    assert callback.prediction_bar.desc.startswith("PPO evaluation")
    callback.on_evaluate(args, state, TrainerControl())
    callback.training_bar.close()


def test_run_summary_reads_the_history():
    """Reward first -> last, KL last and peak with its iteration, seconds per iteration, from `log_history`."""
    history = [{"objective/scores": 0.1, "objective/kl": 0.0, "iteration": 1}, {"loss": 1.0},
               {"objective/scores": 0.4, "objective/kl": 7.5, "iteration": 2},
               {"objective/scores": 0.9, "objective/kl": 3.0, "iteration": 3}]
    summary = progress.run_summary(history, seconds=30.0, iterations=3)
    assert summary["reward"] == {"first": 0.1, "last": 0.9} and summary["seconds_per_iteration"] == 10.0
    assert summary["kl"] == {"first": 0.0, "last": 3.0, "peak": 7.5, "iteration_of_peak": 2}
    text = progress.summary_text(summary)
    assert "+0.100 -> +0.900" in text and "3.00 at the end, peak 7.50 (iteration 2)" in text
    assert "10.0 s/iteration" in text
    assert progress.run_summary([{"loss": 1.0}], 1.0, 1) == {}
    assert "no update moved the policy" not in text and not summary["policy_unmoved"]


def test_the_closing_line_says_when_no_update_moved_the_policy():
    """Issue 61: a run whose KL stayed exactly 0 (every sample scored 0, the adapter never moved) ended on a summary
    that read like any other; it now says so. A KL that dips below 0 and comes back is no such run."""
    still = [{"objective/scores": 0.0, "objective/kl": 0.0, "iteration": i} for i in (1, 2, 3)]
    assert "; no update moved the policy (its KL to the reference stayed 0" in progress.summary_text(
        progress.run_summary(still, seconds=3.0, iterations=3))
    dipped = [{"objective/scores": 0.0, "objective/kl": kl, "iteration": i} for i, kl in ((1, -0.1), (2, 0.0))]
    assert "no update moved" not in progress.summary_text(progress.run_summary(dipped, seconds=2.0, iterations=2))


# ---- 6-7. one short run, as the console shows it --------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """Two PPO iterations with the bar on, the policy and reference passes slowed by known amounts; returns (trainer,
    printed, warnings)."""
    from hf_ppo.rollout import steps

    slow = pytest.MonkeyPatch()
    forward, reference = steps.policy_forward, steps.reference_logprobs
    slow.setattr(steps, "policy_forward", lambda *a, **k: (time.sleep(0.3), forward(*a, **k))[1])
    slow.setattr(steps, "reference_logprobs", lambda *a, **k: (time.sleep(0.2), reference(*a, **k))[1])
    args = make_args(tmp_path_factory.mktemp("console"), disable_tqdm=False, kl_target=1e-6, max_steps=4,
                     num_ppo_epochs=2, kl_estimator="k3")  # k3 is never negative: the second iteration's KL is > 0
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=count_e,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    out = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            real = sys.stdout
            sys.stdout = out
            try:
                trainer.train()
            finally:
                sys.stdout = real
    finally:
        slow.undo()
    return trainer, out.getvalue(), [str(w.message) for w in caught]


def test_time_score_leaves_out_the_forwards(run):
    """`time/score` included the old-log-prob, value and reference forwards (a regex reward looked slow at 12 s):
    they are `time/policy_forward` and `time/reference` now, and the score's time is the reward's alone."""
    trainer, _, _ = run
    logs = [e for e in trainer.state.log_history if "time/score" in e]
    assert len(logs) == 2
    for log in logs:
        assert log["time/policy_forward"] >= 0.3 and log["time/reference"] >= 0.2
        assert log["time/score"] < 0.2, log


def test_train_ends_with_the_summary(run):
    """`hf-ppo train` (any run with the bar) ended without the summary the demo prints: one line, reward first ->
    last, KL last and peak, seconds per iteration, from the run's own history."""
    trainer, printed, _ = run
    scores = [e["objective/scores"] for e in trainer.state.log_history if "objective/scores" in e]
    kl = [e["objective/kl"] for e in trainer.state.log_history if "objective/kl" in e]
    line = next(line for line in printed.splitlines() if line.startswith("PPO: 2 iterations in"))
    assert f"reward {scores[0]:+.3f} -> {scores[-1]:+.3f}" in line
    assert f"kl to the reference {kl[-1]:.2f} at the end, peak {max(kl):.2f}" in line and "s/iteration" in line


def test_kl_past_kl_target_is_noted_once(run):
    """KL passed 6, then 10 nats per response with a fixed kl_coef and nothing said so (the watch speaks at 30):
    once it passes kl_target a note names it and the fixes."""
    trainer, _, caught = run
    notes = [m for m in caught if "past kl_target" in m]
    assert max(e["objective/kl"] for e in trainer.state.log_history if "objective/kl" in e) > 1e-6
    assert len(notes) == 1 and "adaptive_kl=True" in notes[0] and "at 30" in notes[0]


def test_logging_filter_is_scoped_to_one_logger():
    """The bitsandbytes filter sits on its one logger: the same words from another logger still go through."""
    from hf_ppo.runtime.warn import BITSANDBYTES_CPU_LOGGER, BITSANDBYTES_KERNELS_NOTE

    assert any(not f.filter(logging.LogRecord("x", logging.WARNING, "", 0, BITSANDBYTES_KERNELS_NOTE, None, None))
               for f in logging.getLogger(BITSANDBYTES_CPU_LOGGER).filters)
    assert not logging.getLogger("bitsandbytes").filters and not logging.getLogger().filters


def test_the_kl_note_comes_from_the_watch_with_or_without_a_bar(tmp_path):
    """The note lived in the progress bar's callback, so a run with disable_tqdm=True (a script's log, a notebook
    without widgets) never got it. It is the collapse watch's now: once, on the main process, not with adaptive_kl
    (the controller holds KL), and not when kl_target is at or past the watch's own KL threshold."""
    import warnings

    from transformers import TrainerControl, TrainerState

    from hf_ppo import PPOConfig
    from hf_ppo.trainer.watch import CollapseWatch, add_watch

    def notes(**settings) -> list[str]:
        args = PPOConfig(output_dir=str(tmp_path), disable_tqdm=True, report_to=[], **settings)
        watch = next((c for c in add_watch(None, args, lambda: None) if isinstance(c, CollapseWatch)), None)
        if watch is None:
            return []
        state, control = TrainerState(), TrainerControl()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watch.on_train_begin(args, state, control)
            for kl in (2.0, 7.0, 9.0):
                watch.on_log(args, state, control, logs={"objective/kl": kl, "iteration": 1})
        return [str(w.message) for w in caught if "past kl_target" in str(w.message)]

    found = notes()
    assert len(found) == 1 and "7.00 nats" in found[0] and "past kl_target=6" in found[0] and "at 30" in found[0]
    assert notes(adaptive_kl=True) == []
    assert notes(kl_target=40.0) == []  # past the watch's 30 nats: the KL signature itself speaks
    assert notes(watch_collapse=False) == []


# ---- the progress bar's caption and the sample tables ----------------------------------------------------------------
# What the user reads while PPO runs (hf_ppo/trainer/progress.py): the progress bar's caption and the sample tables.

@pytest.mark.parametrize("estimator,label", [("k1", "kl_k1"), ("k2", "kl"), ("k3", "kl")])
def test_the_bar_names_the_kl_estimate_it_shows(tmp_path, estimator, label):
    """k1's batch mean can be negative: the bar does not call it `kl`; k2 and k3 are never negative."""
    args = PPOConfig(output_dir=str(tmp_path), kl_estimator=estimator, num_mini_batches=2, num_ppo_epochs=2)
    callback = PPOProgressCallback(args)
    assert callback.kl_label == label and callback.steps_per_iteration == 4

    class State:
        max_steps = 8

    callback.training_bar = tqdm(total=8, file=io.StringIO())  # tqdm's own set_postfix, whatever the reward names
    callback.caption(State(), {"objective/scores": 0.5, "objective/kl": -0.0123, "iteration": 1})
    assert callback.training_bar.postfix == f"reward=0.500, {label}=-0.012"
    assert callback.training_bar.desc.startswith("PPO iteration 1/2")  # tqdm adds ": "
    # Reward names are the caller's: one named like a tqdm argument ("refresh") is just a caption field.
    callback.caption(State(), {"objective/scores": 0.5, "objective/kl": 0.1, "iteration": 1,
                               "rewards/refresh/mean": 0.25})
    assert callback.training_bar.postfix == f"reward=0.500, refresh=0.250, {label}=0.100"


def test_sample_tables_are_written_above_the_progress_bar(monkeypatch):
    """With no tracker, the table goes through tqdm.write (which clears the bar, prints, and draws it again below),
    never straight into the middle of the bar's line."""
    import tqdm.auto

    written = []
    monkeypatch.setattr(tqdm.auto.tqdm, "write", classmethod(lambda cls, text, *a, **k: written.append(text)))
    log_samples_table([("the movie was", " great fun", 1.25)], iteration=3, step=12, report_to=["none"])
    assert len(written) == 1 and "Samples at PPO iteration 3 (step 12)" in written[0]
    assert "great fun" in written[0] and "1.250" in written[0]
    log_samples_table([("p", "c", 0.0)], iteration=4, step=16, report_to=["tensorboard"])  # no table type there
    assert len(written) == 1


# ---- the bar tells what is being sampled, and numbers iterations as the sample tables ------------------------------
def test_the_bar_names_the_iteration_of_every_step_not_of_the_last_log(tmp_path):
    """With logging_steps counting optimizer steps, the bar kept the iteration of the last log (2, while the sample
    table said 3): it names the iteration of each step."""
    from transformers import TrainerControl, TrainerState

    args = make_args(tmp_path, logging_steps=2, max_steps=4)  # one optimizer step per iteration
    callback = progress.PPOProgressCallback(args)
    state = TrainerState(max_steps=4, is_world_process_zero=True, is_local_process_zero=True)
    callback.on_train_begin(args, state, TrainerControl())
    callback.training_bar.fp = io.StringIO()
    state.global_step = 2
    callback.on_step_end(args, state, TrainerControl())
    callback.caption(state, {"objective/scores": 0.5, "objective/kl": 0.1, "iteration": 2})
    state.global_step = 3
    callback.on_step_end(args, state, TrainerControl())  # no log at step 3
    assert callback.training_bar.desc.startswith("PPO iteration 3/4")
    callback.sampling("rollout", 0, 4, 4, 7, 1024)  # iteration 4's rollout
    assert callback.training_bar.desc.startswith("PPO iteration 4/4: sampling 4 responses: token 7/1024")
    callback.sampling_done("rollout")
    assert callback.training_bar.desc.startswith("PPO iteration 3/4")
    callback.training_bar.close()


def seen_by_reward(seen: list, trainer_box: list):
    """A reward that records, when it is called (right after the sampling), what the progress bars say."""
    def reward(prompts, completions, **kwargs):
        if not trainer_box:  # the probe at construction
            return [0.0] * len(completions)
        bar = next(c for c in trainer_box[0].callback_handler.callbacks if isinstance(c, PPOProgressCallback))
        seen.append((getattr(bar.training_bar, "desc", None), getattr(bar.prediction_bar, "postfix", None)))
        return [float(len(c)) for c in completions]
    return reward


def test_a_rollout_and_an_evaluation_say_how_many_responses_and_tokens_they_sample(tiny_models, tmp_path):
    seen, box = [], []
    args = make_args(tmp_path, disable_tqdm=False, max_steps=1, response_length=5, per_device_eval_batch_size=2)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, reward_model=seen_by_reward(seen, box),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    box.append(trainer)
    trainer.train()
    assert seen[0][0].startswith("PPO iteration 1/1: sampling 4 responses: token ")  # the training rollout
    trainer.evaluate()
    assert any(postfix and "sampling 2 responses: token" in postfix for _, postfix in seen[1:]), seen


def test_disable_tqdm_shows_no_sampling_status(tiny_models, tmp_path):
    from hf_ppo.rollout.engines import progress_reporter

    reporters = []

    def reward(prompts, completions, **kwargs):
        reporters.append(progress_reporter())
        return [0.0] * len(completions)

    trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, max_steps=1), reward_model=reward,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    assert reporters and all(r is None for r in reporters)


def test_the_bar_takes_a_log_without_kl(tmp_path):
    """A log of rollouts that skipped the reference pass (kl_coef=0, `stats_pass_every`) holds no objective/kl: the
    bar shows the reward without it, and does not fail."""
    from transformers import TrainerControl, TrainerState

    args = make_args(tmp_path, num_ppo_epochs=1)
    callback = progress.PPOProgressCallback(args)
    state = TrainerState(max_steps=8, is_world_process_zero=True, is_local_process_zero=True)
    callback.on_train_begin(args, state, TrainerControl())
    callback.training_bar.fp = io.StringIO()
    callback.caption(state, {"objective/scores": 0.5, "iteration": 2})
    assert "reward=0.500" in str(callback.training_bar) and "kl" not in str(callback.training_bar).split("reward")[1]
    callback.training_bar.close()
