"""How reward functions are called (hf_ppo/rollout/reward_calls.py): the prompt dataset's columns reach reward
functions in TRL's calling convention (aligned with every completion: num_generations 1 and 4, the refill, a resume,
2-process DDP), None means "does not apply", errors name the function and the row, TRL's own reward functions run
unchanged, and each reward logs rewards/<name>/mean and /std."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from datasets import Dataset
from tqdm.auto import tqdm

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.rollout import RewardFunctionError, RewardSet, check_reward_function
from hf_ppo.trainer.data import PromptCollator, prepare_prompts
from tests.prompt_codes import CodeCheck, LastTokenEngine, batch_problems, coded_prompts, group_codes

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["movie", "food", "book", "show", "play", "song", "game", "town"]


def question(i: int) -> str:
    return f"the {WORDS[i % 8]} number {i} was"


def answer_of(prompt) -> str:
    """The answer each row carries: a function of its prompt, so any misalignment is caught."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return str(int(text.split()[3]) * 7)


def answers_dataset(n: int = 16, chat: bool = False) -> Dataset:
    prompts = [question(i) for i in range(n)]
    rows = {"prompt": [[{"role": "user", "content": p}] for p in prompts] if chat else prompts,
            "answer": [answer_of(p) for p in prompts], "row_id": list(range(n))}
    return Dataset.from_dict(rows)


CALLS: list[int] = []


def exact(prompts, completions, answer, **kwargs):
    """A TRL-style reward: checks, for EVERY row, that `answer` is the one of the row its prompt came from."""
    assert len(prompts) == len(completions) == len(answer) == len(kwargs["completion_ids"]) == len(kwargs["row_id"])
    for p, a, r in zip(prompts, answer, kwargs["row_id"]):
        if a != answer_of(p) or not (p if isinstance(p, str) else p[-1]["content"]).startswith(question(r)[:7]):
            raise AssertionError(f"misaligned: prompt {p!r} got answer {a!r} (row {r})")
    CALLS.append(len(completions))
    return [float(len(c) % 2) for c in completions]


def args_for(out, **overrides) -> PPOConfig:
    defaults = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    num_mini_batches=2, num_ppo_epochs=1, max_steps=4, response_length=4, logging_steps=1,
                    learning_rate=1e-3, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, seed=0, reward_quantization="none")
    defaults.update(overrides)
    return PPOConfig(**defaults)


def trainer_for(tiny_models, tokenizer, out, reward=exact, dataset=None, **overrides) -> PPOLMTrainer:
    return PPOLMTrainer(model=tiny_models["policy"], args=args_for(out, **overrides), processing_class=tokenizer,
                        reward_model=reward, train_dataset=dataset if dataset is not None else answers_dataset())


def logged(trainer, key) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


# ---- the columns travel ----------------------------------------------------------------------------------------------
def test_prepare_prompts_keeps_every_column_and_the_collator_returns_them(tokenizer):
    data = prepare_prompts(answers_dataset(4), tokenizer, "train_dataset", max_prompt_length=None,
                           response_length=4, context=None)
    assert set(data.column_names) == {"prompt", "input_ids", "answer", "row_id"}
    batch = PromptCollator(tokenizer.pad_token_id)([data[2], data[0], data[0]])
    assert batch["columns"] == {"answer": ["14", "0", "0"], "row_id": [2, 0, 0]}
    # Pre-tokenized rows: the prompt is their decoded text, the padding mask is dropped, the other columns stay.
    ids = tokenizer(["the movie was", "a"])
    pre = Dataset.from_dict({"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"],
                             "solution": ["x", "y"]})
    data = prepare_prompts(pre, tokenizer, "train_dataset", max_prompt_length=None, response_length=4, context=None)
    assert set(data.column_names) == {"prompt", "input_ids", "solution"}
    assert PromptCollator(tokenizer.pad_token_id)([data[1], data[0]])["columns"] == {"solution": ["y", "x"]}
    # Chat rows ('messages'): renamed to 'prompt', the other columns kept, none of them the prompt itself.
    chat = Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]], "answer": ["1"]})
    data = prepare_prompts(chat, tokenizer, "train_dataset", max_prompt_length=None, response_length=4, context=None)
    assert PromptCollator(tokenizer.pad_token_id)([data[0]])["columns"] == {"answer": ["1"]}


@pytest.mark.parametrize("settings", [
    {},
    {"advantage_estimator": "grpo", "num_generations": 4},
], ids=["k1", "grpo_k4"])
def test_every_completion_gets_its_own_rows_answer(tiny_models, tokenizer, tmp_path, settings):
    CALLS.clear()
    trainer = trainer_for(tiny_models, tokenizer, tmp_path, **settings)
    trainer.train()
    assert sum(CALLS) >= 16  # 2 iterations x 8 rows, every row checked (the probe's calls come on top)
    assert logged(trainer, "rewards/exact/mean") and logged(trainer, "rewards/exact/std")


def test_refill_prompts_carry_their_own_columns(tiny_models, tokenizer, tmp_path):
    CALLS.clear()

    def uniform(prompts, completions, answer, **kwargs):
        exact(prompts, completions, answer, **kwargs)
        return [float(int(a) % 2) for a in answer]  # the same for a whole group: every group dropped and refilled

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=uniform, advantage_estimator="grpo",
                          num_generations=4, drop_uniform_groups=True, max_refill_rounds=2, max_steps=2)
    trainer.train()
    assert max(logged(trainer, "rollout/refill_rounds")) == 2  # the refill ran, its rows checked by `exact`


@pytest.mark.parametrize("estimator,k", [("grpo", 4), ("rloo", 2)])
def test_the_k_rows_of_a_prompt_keep_its_tokens_text_and_columns(tiny_models, tokenizer, tmp_path, estimator, k):
    """With k responses per prompt, each row's TOKENS (the query the engine answers, the completion_ids the reward
    gets) must stay with its prompt's text and its dataset columns, and a prompt's k rows must be consecutive. The
    engine answers each query row with the row's last prompt token (tests/prompt_codes.py); the reward checks that
    against the row's `code` column and the prompt text, and scores the row with its `value` column. A reordering of
    the token rows against the texts or columns (a repeat for a repeat_interleave, one side shuffled) shows as a
    mismatch, and as a score on another prompt's tokens in the rollout batch."""
    length = 4
    reward = CodeCheck(tokenizer, length)
    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=reward, dataset=coded_prompts(tokenizer),
                          advantage_estimator=estimator, num_generations=k, response_length=length,
                          apply_chat_template_to_text=False)
    reward.reset()  # the construction probe's empty completions
    engine = trainer.rollout_engine = LastTokenEngine(length)
    real, batches = trainer._rollout, []

    def recorded(inputs):
        batches.append(real(inputs))
        return batches[-1]

    trainer._rollout = recorded
    trainer.train()
    assert len(batches) == 2 and reward.calls == 2 and reward.rows == 16  # 2 iterations x 8 rows, every one checked
    assert reward.mismatches == []
    for batch in batches:  # each row's score is the value of the prompt in its tokens; groups consecutive
        assert batch_problems(batch, tokenizer, length, k) == []
    codes, problems = group_codes(engine.calls, k)
    assert problems == [] and len(codes) == 16 // k == len(set(codes))  # one epoch's draw: every group its own prompt


def test_resumed_run_keeps_columns_aligned(tiny_models, tokenizer, tmp_path):
    first = trainer_for(tiny_models, tokenizer, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    CALLS.clear()
    second = trainer_for(tiny_models, tokenizer, tmp_path, max_steps=4, save_strategy="no")
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert second.state.global_step == 4 and sum(CALLS) >= 8  # one more iteration, its rows all checked


# ---- the calling convention ------------------------------------------------------------------------------------------
def test_positional_callables_keep_todays_call(tiny_models, tokenizer, tmp_path):
    seen = []

    def positional(p, c):
        seen.append((p, c))
        return [0.5] * len(c)

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=positional, max_steps=2)
    trainer.train()
    prompts, completions = seen[-1]
    assert all(isinstance(x, str) for x in prompts + completions)
    assert {p for p, _ in seen[1:] for p in p} <= {question(i) for i in range(16)}  # prompt texts, decoded


def test_chat_completions_in_trls_form_and_trls_reward_functions(tiny_models, tokenizer, tmp_path):
    from trl.rewards import think_format_reward

    seen = []

    def chat_exact(prompts, completions, answer, **kwargs):
        seen.append(completions)
        assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
        return exact(prompts, [c[0]["content"] for c in completions], answer, **kwargs)

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=[chat_exact, think_format_reward],
                          dataset=answers_dataset(chat=True), max_steps=2)
    trainer.train()
    assert all(isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant" for c in seen[-1])
    assert logged(trainer, "rewards/think_format_reward/mean") == [0.0]  # no <think> from a tiny model


def test_trl_accuracy_reward_runs_unchanged(tiny_models, tokenizer, tmp_path):
    pytest.importorskip("math_verify", reason="trl.rewards.accuracy_reward needs the math-verify package "
                                              "(pip install 'hf_ppo[math]')")
    from trl.rewards import accuracy_reward

    data = answers_dataset(chat=True).rename_column("answer", "solution").map(lambda r: {"solution": "$7$"})
    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=[accuracy_reward, exact_ignoring_answer],
                          dataset=data, max_steps=2)
    trainer.train()
    assert logged(trainer, "rewards/accuracy_reward/mean") == [0.0]  # a tiny model never writes 7


def exact_ignoring_answer(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def test_signature_errors_name_the_function_parameter_and_columns(tiny_models, tokenizer, tmp_path):
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match=r"'needs_solution' needs a parameter 'solution'.*\['answer', 'row_id'\]"):
        trainer_for(tiny_models, tokenizer, tmp_path, reward=needs_solution)
    check_reward_function(needs_solution, None, "needs_solution")  # columns unknown: not checked yet
    check_reward_function(lambda p, c: [0.0], ["answer"], "lambda")  # two positional parameters: today's call
    with pytest.raises(TypeError, match="not callable"):
        check_reward_function("exact", ["answer"], "exact")


# ---- None: does not apply --------------------------------------------------------------------------------------------
def rows_of(tokenizer, prompts, completions):
    q = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    r = tokenizer(completions, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return dict(queries=q["input_ids"], query_mask=q["attention_mask"].bool(), responses=r["input_ids"],
                response_mask=r["attention_mask"].bool(), tokenizer=tokenizer, prompts=prompts, batch_size=4)


def test_none_leaves_a_term_out_and_all_none_is_an_error(tokenizer):
    def first(prompts, completions, kind, **kwargs):
        return [1.0 if k == "a" else None for k in kind]

    def second(prompts, completions, kind, **kwargs):
        return [None if k == "a" else 3.0 if k == "b" else None for k in kind]

    rewards = RewardSet([first, second], [None, None], ["first", "second"], [0.5, 2.0])
    batch = rows_of(tokenizer, ["x", "y"], ["u", "v"])
    combined, raw = rewards.score(**batch, columns={"kind": ["a", "b"]})
    assert combined.tolist() == [0.5, 6.0]  # each row: only the reward that applies, with its weight
    assert raw["first"].tolist() == [1.0, 0.0] and raw["second"].tolist() == [0.0, 3.0]
    with pytest.raises(ValueError, match=r"Every reward returned None.*row 1 of the batch \(prompt 'y'\); rewards: "
                                         r"first, second.*return a number"):
        rewards.score(**batch, columns={"kind": ["a", "c"]})


def test_normalize_each_reward_skips_none_rows(tokenizer):
    def half(prompts, completions, kind, **kwargs):
        return [float(k) if k < 10 else None for k in kind]

    rewards = RewardSet([half], [None], ["half"], [1.0], normalize_each=True)
    batch = rows_of(tokenizer, ["x", "y", "z", "w"], ["u", "v", "s", "t"])
    with pytest.raises(ValueError, match="Every reward returned None"):
        rewards.score(**batch, columns={"kind": [1, 3, 100, 100]}, gather=lambda t: t)
    rewards = RewardSet([half, lambda p, c: [0.0] * len(c)], [None, None], ["half", "zero"], [1.0, 1.0],
                        normalize_each=True)
    rewards.score(**batch, columns={"kind": [1, 3, 100, 100]}, gather=lambda t: t)
    assert rewards.moments[0].mean == pytest.approx(2.0) and rewards.moments[0].count == 2  # not the None rows


def test_metrics_exclude_none_rows_and_the_bar_shows_the_first_reward(tiny_models, tokenizer, tmp_path):
    def sometimes(prompts, completions, row_id, **kwargs):
        return [1.0 if r % 2 else None for r in row_id]

    def always(prompts, completions):
        return [0.0] * len(completions)

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=[sometimes, always], max_steps=2)
    trainer.train()
    assert logged(trainer, "rewards/sometimes/mean") == [1.0]  # the None rows are no zeros
    assert logged(trainer, "rewards/sometimes/std") == [0.0]
    assert logged(trainer, "rewards/always/mean") == [0.0]
    from hf_ppo.trainer.progress import PPOProgressCallback

    bar = PPOProgressCallback(trainer.args)
    bar.training_bar = tqdm(total=1, file=io.StringIO())  # tqdm's own set_postfix: a fake would hide a clash
    bar.caption(trainer.state, trainer.state.log_history[0])
    assert "sometimes=1.000" in bar.training_bar.postfix
    # A reward named like the bar's own fields (the demo's reward model is "reward") gets "_mean", never a clash.
    bar.caption(trainer.state, {"objective/scores": 1.0, "objective/kl": 0.25, "rewards/reward/mean": 0.5})
    assert bar.training_bar.postfix == f"reward=1.000, reward_mean=0.500, {bar.kl_label}=0.250"


# ---- errors inside a reward function ---------------------------------------------------------------------------------
def test_an_exception_names_the_function_and_the_first_failing_row(tokenizer):
    def picky(prompts, completions, answer, **kwargs):
        return [1.0 / (a != "7") for a in answer]

    rewards = RewardSet.single(picky)
    batch = rows_of(tokenizer, ["x", "y", "z"], ["u", "v", "w"])
    with pytest.raises(RewardFunctionError, match=r"'picky' raised ZeroDivisionError.*row 1 alone \(prompt 'y', "
                                                  r"completion 'v'\)") as info:
        rewards.score(**batch, columns={"answer": ["1", "7", "7"]})
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_an_exception_at_the_probe_fails_construction(tiny_models, tokenizer, tmp_path):
    def broken(completions, answer, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match=r"'broken' raised KeyError.*row 0 alone \(prompt 'the movie"):
        trainer_for(tiny_models, tokenizer, tmp_path, reward=broken)


# ---- TRL's reward functions whole -----------------------------------------------------------------------------------
def test_async_reward_functions_are_awaited_together(tokenizer):
    """Two `async def` functions that each wait for the other: awaited one after the other, the first would wait for
    ever (a 60 s guard turns that into a failure, not a hang); awaited together, both finish."""
    import asyncio

    events = {}

    async def first(completions, **kwargs):
        events.setdefault("first", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("second", asyncio.Event()).wait(), 60)
        return [1.0] * len(completions)

    async def second(completions, **kwargs):
        events.setdefault("second", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("first", asyncio.Event()).wait(), 60)
        return [2.0] * len(completions)

    rewards = RewardSet([first, second], [None, None], ["first", "second"], [1.0, 1.0])
    combined, raw = rewards.score(**rows_of(tokenizer, ["x", "y"], ["u", "v"]))
    assert combined.tolist() == [3.0, 3.0] and raw["second"].tolist() == [2.0, 2.0]


def test_an_async_function_that_raises_names_itself_and_the_row(tokenizer):
    async def picky(completions, answer, **kwargs):
        if "7" in answer:
            raise ValueError("seven")
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'picky' raised ValueError: seven - first on row 1 alone"):
        RewardSet.single(picky).score(**rows_of(tokenizer, ["x", "y"], ["u", "v"]), columns={"answer": ["1", "7"]})


def _within(seconds: float, call):
    """`call()`'s outcome (its result, or the exception it raised), run in a thread: a hang is a failure after
    `seconds`, not a test that never ends."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"hung for {seconds} s"
    return outcome


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt])
def test_an_async_function_raising_systemexit_or_keyboardinterrupt_stops_naming_itself(tokenizer, kind):
    """Issue 60 item 5: raised inside the reward loop's thread, either one ended that thread and the call waited for
    ever; it stops the run, as it asked, naming the function."""
    async def quits(completions, **kwargs):
        raise kind(3)

    outcome = _within(30, lambda: RewardSet.single(quits).score(**rows_of(tokenizer, ["x"], ["u"])))
    assert isinstance(outcome.get("error"), kind)
    assert "The async reward function 'quits' raised" in str(outcome["error"])

    async def fine(completions, **kwargs):  # the loop serves the next call
        return [1.0] * len(completions)

    outcome = _within(30, lambda: RewardSet.single(fine).score(**rows_of(tokenizer, ["x"], ["u"])))
    assert outcome["value"][0].tolist() == [1.0]


def test_a_blocking_call_inside_an_async_function_is_named_and_later_calls_get_a_fresh_loop(tokenizer, monkeypatch):
    """Issue 60 item 5: a synchronous call that blocks inside an `async def` reward held the one loop every async
    reward of the process runs on: that call hung, and every later one with it. It stops after
    `LOOP_BLOCKED_AFTER` seconds naming the function, and the next call runs on a fresh loop."""
    import threading
    import time

    from hf_ppo.rollout import reward_calls

    monkeypatch.setattr(reward_calls, "LOOP_BLOCKED_AFTER", 0.5)
    monkeypatch.setattr(reward_calls, "_LOOK_EVERY", 0.2)
    release = threading.Event()

    async def slow_but_awaiting(completions, **kwargs):  # awaits: the loop answers, nothing is cut short
        import asyncio

        await asyncio.sleep(1.5)
        return [2.0] * len(completions)

    outcome = _within(30, lambda: RewardSet.single(slow_but_awaiting).score(**rows_of(tokenizer, ["x"], ["u"])))
    assert outcome["value"][0].tolist() == [2.0]

    async def stuck(completions, **kwargs):
        release.wait(60)  # a blocking call: the loop's thread waits here
        return [0.0] * len(completions)

    try:
        outcome = _within(30, lambda: RewardSet.single(stuck).score(**rows_of(tokenizer, ["x"], ["u"])))
        message = str(outcome.get("error"))
        assert isinstance(outcome.get("error"), RewardFunctionError), outcome
        assert "'stuck' has held hf_ppo's reward event loop for more than 0.5 s without awaiting" in message
        assert "asyncio.to_thread" in message and "plain def" in message

        async def fine(completions, **kwargs):
            return [1.0] * len(completions)

        started = time.monotonic()  # the old loop is held still: a fresh one serves this call at once
        outcome = _within(30, lambda: RewardSet.single(fine).score(**rows_of(tokenizer, ["x"], ["u"])))
        assert "value" in outcome, outcome
        assert outcome["value"][0].tolist() == [1.0] and time.monotonic() - started < 5
    finally:
        release.set()


def test_trls_keywords_reach_the_functions_that_accept_them(tiny_models, tokenizer, tmp_path, capsys):
    seen = {"steps": [], "kwargs": set()}

    def shaped(completions, trainer_state, log_metric, log_extra):  # no **kwargs: only what it names
        seen["steps"].append(trainer_state.global_step)
        log_metric("shaped/calls", 1.0)
        log_extra("shaped_note", ["n"] * len(completions))
        return [0.5] * len(completions)

    async def everything(completions, **kwargs):  # awaited, in training as at the construction probe
        seen["kwargs"] |= set(kwargs)
        return [0.0] * len(completions)

    def positional(prompts, completions):  # hf_ppo's own convention: nothing more than the two lists
        return [0.0] * len(completions)

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=[shaped, everything, positional], max_steps=2,
                          num_mini_batches=1, num_sample_generations=1)
    trainer.train()
    assert "shaped_note" in capsys.readouterr().out  # log_extra: a column of the sample table
    assert {"trainer_state", "log_metric", "log_extra", "completion_ids", "answer"} <= seen["kwargs"]
    assert seen["steps"] == [0, 0, 1]  # the probe, then the live state at each of the two rollouts
    assert logged(trainer, "shaped/calls") == [1.0, 1.0]  # logged under the name given, as TRL does
    # TRL's names for the combined reward beside each function's own
    assert logged(trainer, "reward") and logged(trainer, "reward_std") and logged(trainer, "rewards/shaped/mean")


def test_each_function_gets_its_own_copy_of_the_prompts_and_columns(tokenizer):
    seen = []

    def vandal(prompts, completions, meta, **kwargs):
        prompts[0][0]["content"] = "changed"
        meta[0]["tags"].append("changed")
        return [0.0] * len(completions)

    def reader(prompts, completions, meta, **kwargs):
        seen.append((prompts[0][0]["content"], list(meta[0]["tags"])))
        return [0.0] * len(completions)

    chat = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    meta = [{"tags": ["a"]}, {"tags": ["b"]}]
    batch = rows_of(tokenizer, ["hi", "yo"], ["u", "v"])
    batch["prompts"] = chat
    RewardSet([vandal, reader], [None, None], ["vandal", "reader"], [1.0, 1.0]).score(**batch,
                                                                                       columns={"meta": meta})
    assert seen == [("hi", ["a"])]
    assert chat[0][0]["content"] == "hi" and meta[0]["tags"] == ["a"]  # the batch itself is untouched


def test_a_wrong_return_names_the_function(tokenizer):
    import numpy as np

    def labels(completions, **kwargs):
        return np.array(["good"] * len(completions))

    def zero_d(completions, **kwargs):
        return [np.array("1.0") for _ in completions]

    batch = rows_of(tokenizer, ["x", "y"], ["u", "v"])
    with pytest.raises(TypeError, match=r"The reward function 'labels' returned a numpy array of strings \(dtype <U4"):
        RewardSet.single(labels).score(**batch)
    with pytest.raises(TypeError, match=r"The reward function 'zero_d' returned a non-number at position 0"):
        RewardSet.single(zero_d).score(**batch)


def test_a_function_named_reward_keeps_its_own_metric_beside_the_combined_one(tiny_models, tokenizer, tmp_path):
    def reward(completions, **kwargs):  # TRL's usual name
        return [2.0] * len(completions)

    def other(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=[reward, other], reward_weights=[1.0, 0.5],
                          max_steps=2, num_mini_batches=1)
    trainer.train()
    assert logged(trainer, "reward") == [2.5, 2.5] and logged(trainer, "rewards/reward/mean") == [2.0, 2.0]
    from hf_ppo.trainer.progress import PPOProgressCallback

    bar = PPOProgressCallback(trainer.args)
    bar.training_bar = tqdm(total=1, file=io.StringIO())
    bar.caption(trainer.state, trainer.state.log_history[0])
    assert bar.training_bar.postfix.startswith("reward=2.500, reward_mean=2.000")


def test_a_partial_is_named_after_its_function_as_trl_names_it(tokenizer):
    import functools

    def scaled(completions, scale, **kwargs):
        return [scale] * len(completions)

    rewards = RewardSet([functools.partial(scaled, scale=2.0)], [None], ["x"], [1.0])
    assert RewardSet.single(functools.partial(scaled, scale=2.0)).names == ["scaled"]
    assert rewards.identities() == [{"name": "x", "function": f"{__name__}.{scaled.__qualname__}"}]


def test_a_column_only_the_evaluation_split_lacks_fails_at_construction(tiny_models, tokenizer, tmp_path):
    evaluation = Dataset.from_dict({"prompt": ["the movie number 1 was"]})
    with pytest.raises(TypeError, match=r"'exact' needs a parameter 'answer'.*\['prompt'\]|"
                                        r"'exact' needs a parameter 'answer'.*on eval_dataset"):
        PPOLMTrainer(model=tiny_models["policy"], args=args_for(tmp_path), processing_class=tokenizer,
                     reward_model=exact, train_dataset=answers_dataset(), eval_dataset=evaluation)


# ---- 2-process DDP ---------------------------------------------------------------------------------------------------
DRIVER = textwrap.dedent("""
    import faulthandler; faulthandler.enable()  # a crash prints each thread's Python stack
    import json, os, sys
    sys.path.insert(0, sys.argv[2])
    import tests.rollout.test_reward_calls as t
    trainer = t.trainer_for({"policy": sys.argv[3]}, t.tokenizer_of(sys.argv[3]), sys.argv[1], use_cpu=True,
                            per_device_train_batch_size=2, num_mini_batches=1, advantage_estimator="grpo",
                            num_generations=2, max_steps=2)
    trainer.train()
    with open(os.path.join(sys.argv[1], f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump({"calls": sum(t.CALLS), "world_size": trainer.args.world_size}, f)
    trainer.accelerator.end_training()  # as `hf-ppo train` ends: the process group destroyed
    # Then out without interpreter finalization, where gloo's worker threads can abort a process whose work is
    # done (pytorch/pytorch#190489): the test reads what each rank wrote, and a teardown abort would fail it.
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
""")


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_two_ddp_processes_keep_columns_aligned(tiny_models, tmp_path):
    (tmp_path / "driver.py").write_text(DRIVER)
    # The children import what this process imports: the checkout first, then the PYTHONPATH this run was given
    # (where the packages may live). Two CPU (gloo) ranks, as the driver's use_cpu=True says: CUDA hidden from them,
    # so that a visible GPU changes nothing (no rank touches it, no bf16 default from it).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate/ddp.yaml"), "--num_processes", "2", "--main_process_port", "29537",
               str(tmp_path / "driver.py"), str(tmp_path), str(ROOT), tiny_models["policy"]]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert all(r["calls"] >= 4 for r in reports)  # each rank's rows checked by `exact`


def test_a_prefill_leads_the_completion_reward_functions_get_as_in_trl():
    """Issue 49 item 3: for a chat prompt ending with an assistant turn (a prefill the policy continues), TRL gives
    reward functions the prompt without that turn and the completion as prefill + generated text; exact_answer then
    reads "The answer is #### 4" whole. The dataset's own prompt is left as it is."""
    from hf_ppo.rewards import exact_answer
    from hf_ppo.rollout.reward_calls import call_reward

    user = {"role": "user", "content": "What is 2 + 2?"}
    prompts = [[user, {"role": "assistant", "content": "The answer is ####"}], [user]]
    seen = {}

    def reward(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return exact_answer(completions, answer)

    scores = call_reward(reward, "reward", prompts=prompts, prompt_texts=["q", "q"], texts=[" 4", "#### 4"],
                         completion_ids=[[1], [1]], columns={"answer": ["4", "4"]})
    assert scores == [1.0, 1.0]
    assert seen["prompts"] == [[user], [user]]
    assert seen["completions"] == [[{"role": "assistant", "content": "The answer is #### 4"}],
                                   [{"role": "assistant", "content": "#### 4"}]]
    assert prompts[0][-1] == {"role": "assistant", "content": "The answer is ####"}  # untouched


# ---- issue 51: the signatures users write, and the refusals ----------------------------------------------------------
KWARGS_ONLY_SCORES: list[list[float]] = []


def kwargs_only(completions, **kwargs):
    """TRL's most common form: the prompts and the dataset column read from kwargs. Each row scores 7 x its number
    (its `answer`), so a score from another row would move the logged mean."""
    prompts, answers = kwargs["prompts"], kwargs["answer"]
    assert len(prompts) == len(completions) == len(answers) == len(kwargs["completion_ids"])
    for p, a in zip(prompts, answers):
        if a != answer_of(p):
            raise AssertionError(f"misaligned: prompt {p!r} got answer {a!r}")
    scores = [float(a) for a in answers]
    KWARGS_ONLY_SCORES.append(scores)
    return scores


@pytest.mark.parametrize("form", ["alone", "in_a_list"])
def test_a_kwargs_only_function_reads_its_rows_column_and_its_scores_are_logged(tiny_models, tokenizer, tmp_path,
                                                                                form):
    """`def f(completions, **kwargs)` reading kwargs["answer"]: every row's own answer, and the scores it returns are
    the logged reward; given alone (reward_model=f) it works as the one-element list [f]."""
    KWARGS_ONLY_SCORES.clear()
    trainer = trainer_for(tiny_models, tokenizer, tmp_path, max_steps=2,
                          reward=kwargs_only if form == "alone" else [kwargs_only])
    trainer.train()
    probe, *rollouts = KWARGS_ONLY_SCORES
    assert len(probe) == 2 and [len(r) for r in rollouts] == [8]  # the probe's two rows, then one rollout of 8
    mean = sum(rollouts[0]) / 8
    assert logged(trainer, "rewards/kwargs_only/mean") == [pytest.approx(mean)]
    assert logged(trainer, "reward") == [pytest.approx(mean)]


def test_a_function_without_kwargs_gets_only_the_names_it_declares(tokenizer):
    """`def f(completions, answer)`: called with those two only (the batch has more columns, and prompts,
    completion_ids, trainer_state... exist), each completion with its own row's answer (docs: "A function without
    **kwargs gets only the names it declares")."""
    seen = []

    def strict(completions, answer):
        seen.append((completions, answer))
        return [float(a in c) for c, a in zip(completions, answer)]

    check_reward_function(strict, ["answer", "row_id"], "strict")  # accepted at construction
    batch = rows_of(tokenizer, ["the movie was", "the food was"], [" great fun", " bad"])
    scores, _ = RewardSet.single(strict).score(**batch, columns={"answer": ["great", "bad"], "row_id": [0, 1]})
    assert scores.tolist() == [1.0, 1.0]
    assert seen == [([" great fun", " bad"], ["great", "bad"])]


class ScaledReward:
    """A reward written as a class: its instance is the reward function."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, completions, **kwargs):
        return [self.scale] * len(completions)


def test_a_class_given_where_its_instance_was_meant_is_refused_naming_the_fix(tiny_models, tokenizer, tmp_path):
    for given in (ScaledReward, [exact, ScaledReward]):
        with pytest.raises(TypeError, match=r"'ScaledReward' is the class ScaledReward, not a reward function: pass "
                                            r"an instance of it \(ScaledReward\(\.\.\.\), whose __call__ scores"):
            trainer_for(tiny_models, tokenizer, tmp_path, reward=given)
    trainer_for(tiny_models, tokenizer, tmp_path, reward=ScaledReward(2.0))  # its instance: accepted


def test_a_column_not_aligned_with_the_completions_is_refused_before_the_call(tokenizer):
    seen = []

    def reads(completions, answer, **kwargs):
        seen.append(answer)
        return [0.0] * len(completions)

    batch = rows_of(tokenizer, ["x", "y"], ["u", "v"])
    for answers in (["1", "2", "3"], ["1"]):  # longer than the batch, and shorter
        with pytest.raises(ValueError, match=rf"The column 'answer' has {len(answers)} values for 2 completions: "
                                             r"each batch's columns must be aligned with its prompts"):
            RewardSet.single(reads).score(**batch, columns={"answer": answers})
    assert seen == []  # never called with a misaligned column


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids"])
def test_a_column_named_like_a_call_keyword_is_refused_naming_the_rename(tiny_models, tokenizer, tmp_path, column):
    data = answers_dataset().add_column(column, ["x"] * 16)
    with pytest.raises(TypeError, match=rf"column named '{column}', which the reward function "
                                        rf"'exact_ignoring_answer' is given as the call's own '{column}': rename the "
                                        rf"column, e\.g\. dataset\.rename_column\('{column}', '{column}_ref'\)"):
        trainer_for(tiny_models, tokenizer, tmp_path, reward=exact_ignoring_answer, dataset=data)


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids", "trainer_state"])
def test_a_clashing_column_given_straight_to_a_call_is_refused_too(column):
    """Outside a trainer (RewardSet.score, call_reward), where no construction check ran: the column would otherwise
    replace the call's own value, or be replaced by it, silently."""
    from hf_ppo.rollout.reward_calls import call_reward

    seen = []

    def reward(completions, **kwargs):
        seen.append(kwargs)
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match=rf"column named '{column}'.*rename_column\('{column}', '{column}_ref'\)"):
        call_reward(reward, "reward", prompts=["q", "q"], prompt_texts=["q", "q"], texts=["a", "b"],
                    completion_ids=[[1], [2]], columns={column: ["x", "y"]})
    assert not seen  # refused before the call


def test_a_reference_completion_column_never_reaches_the_functions_as_in_trl(tiny_models, tokenizer, tmp_path):
    """A prompt-completion dataset's "completion" column (its references) is left out of the call, as TRL leaves it
    out: a function naming a parameter `completion` (the samples are `completions`) would score the references, one
    with **kwargs never sees it. Refused at construction, naming both renames."""
    data = answers_dataset().add_column("completion", ["#### 42"] * 16)

    def scores_references(completion, **kwargs):  # meant the sampled completions
        return [float(c == "#### 42") for c in completion]

    with pytest.raises(TypeError, match=r"'scores_references' needs a parameter 'completion': the sampled completions "
                                        r"are 'completions' .*not passed, as TRL does not pass it.*rename_column\("
                                        r"'completion', 'solution'\)"):
        trainer_for(tiny_models, tokenizer, tmp_path, reward=scores_references, dataset=data)

    seen = []

    def reads_kwargs(completions, **kwargs):
        seen.append(sorted(kwargs))
        return [0.0] * len(completions)

    trainer_for(tiny_models, tokenizer, tmp_path, reward=reads_kwargs, dataset=data, max_steps=1).train()
    assert seen and all("completion" not in names and "answer" in names for names in seen)


def test_one_element_numpy_arrays_in_the_list_are_refused_naming_the_function(tokenizer):
    """i53s: a list of numpy arrays of shape (1,) passed the number check, then float() raised numpy's bare "only
    0-dimensional arrays can be converted to Python scalars", naming no function. TRL refuses such a list too
    (torch.tensor of it is (B, 1), which its (B,) reward column refuses); one-element torch tensors it reads, as
    here."""
    import numpy as np
    import torch

    from hf_ppo.rollout.reward_calls import reward_values

    def arrays(completions, **kwargs):
        return [np.array([1.0]) for _ in completions]

    def tensors(completions, **kwargs):
        return [torch.tensor([0.5]) for _ in completions]

    batch = rows_of(tokenizer, ["x", "y"], ["u", "v"])
    with pytest.raises(TypeError, match=r"The reward function 'arrays' returned a non-number at position 0: ndarray "
                                        r"array\(\[1\.\]\) \(2 such entries\).*shape \(1,\) is no number: return its "
                                        r"value, `x.item\(\)`"):
        RewardSet.single(arrays).score(**batch)
    scores, applies = reward_values([torch.tensor([0.5]), None], 2, "tensors")
    assert scores.tolist() == [0.5, 0.0] and applies.tolist() == [True, False]
    assert reward_values(tensors(["a", "b"]), 2)[0].tolist() == [0.5, 0.5]


# ---- issue 63 kind 4: a second call, a second column, TRL's own signature ------------------------------------------
def test_log_metric_twice_is_the_mean_and_log_extra_over_two_calls_is_extended():
    from hf_ppo.rollout.reward_calls import RewardLogs

    logs = RewardLogs()
    logs.log_metric("m", 1.0)
    logs.log_metric("m", 4.0)  # twice in one iteration: the mean, not the last value nor the sum
    logs.log_extra("note", ["a", "b"])
    logs.log_extra("note", ["c"])  # a second micro-batch's rows: appended, not replacing the first's
    assert logs.take_metrics() == {"m": 2.5} and logs.take_extra() == {"note": ["a", "b", "c"]}
    assert logs.take_metrics() == {} and logs.take_extra() == {}  # taken once per iteration


def test_log_metric_called_twice_per_rollout_logs_the_mean(tiny_models, tokenizer, tmp_path):
    def twice(completions, log_metric, **kwargs):
        log_metric("twice/value", 1.0)
        log_metric("twice/value", 3.0)
        return [0.0] * len(completions)

    trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=twice, max_steps=2, num_mini_batches=1)
    trainer.train()
    assert logged(trainer, "twice/value") == [2.0, 2.0]


def test_trls_own_signature_is_called_by_keyword_with_every_column(tokenizer):
    seen = {}

    def trl_style(prompts, completions, **kwargs):  # TRL's documented reward signature
        seen.update(prompts=prompts, completions=completions, kwargs=set(kwargs))
        return [float(a == "7") for a in kwargs["answer"]]

    scores, _ = RewardSet.single(trl_style).score(**rows_of(tokenizer, ["x", "y"], ["u", "v"]),
                                                  columns={"answer": ["7", "8"]})
    assert scores.tolist() == [1.0, 0.0] and {"answer", "completion_ids"} <= seen["kwargs"]
    assert seen["prompts"] == ["x", "y"]


def test_a_messages_column_never_reaches_the_reward_functions_as_data(tiny_models, tokenizer, tmp_path):
    seen = set()

    def everything(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    # the prompts in a "messages" column (read as chat prompts), and beside a "prompt" column (the prompts read)
    chat = answers_dataset(chat=True).rename_column("prompt", "messages")
    both = answers_dataset().add_column("messages", chat["messages"])
    for rows in (chat, both):
        seen.clear()
        trainer = trainer_for(tiny_models, tokenizer, tmp_path, reward=everything, dataset=rows, max_steps=1,
                              num_mini_batches=1)
        trainer.train()
        assert {"answer", "row_id"} <= seen and "messages" not in seen and "prompt" not in seen


def test_log_metric_under_a_trainer_metrics_name_warns_once():
    """Issue 60 item 10: a reward function's log_metric('reward', ...) was averaged into the trainer's own 'reward'
    in silence (TRL does the same). A name the trainer logs under (or its namespace) warns, once per name; a name
    of one's own is quiet."""
    import warnings

    from hf_ppo.rollout.reward_calls import RewardLogs

    logs = RewardLogs()
    with pytest.warns(UserWarning, match=r"log_metric\('reward', \.\.\.\): the trainer logs its own metric under that "
                                         r"name .*e\.g\. 'custom/reward'") as said:
        logs.log_metric("reward", 1.0)
        logs.log_metric("reward", 3.0)
        logs.log_metric("objective/kl", 0.5)
    assert len(said) == 2 and "'objective/kl'" in str(said[1].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        logs.log_metric("accuracy", 1.0)
        logs.log_metric("format/ok", 0.0)
    assert logs.take_metrics() == {"reward": 2.0, "objective/kl": 0.5, "accuracy": 1.0, "format/ok": 0.0}
