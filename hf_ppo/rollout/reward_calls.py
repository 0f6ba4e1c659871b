"""How a reward function is called: TRL's keyword convention or hf_ppo's positional `(prompts, completions)`.

- `keyword_style`: which of the two a function takes, from its signature (`check_reward_function` checks, before any
  model loads or at trainer construction, that it can take the call);
- `call_reward`: the call itself, with the dataset's other columns aligned with the completions, and an exception
  inside the function re-raised naming the function and the first row it fails on (`RewardFunctionError`). Each
  function gets its own copy of the prompts and columns (an edit it makes in place never reaches the next one), and
  what TRL passes besides them (`RewardHooks`: `trainer_state`, `log_metric`, `log_extra`) when it accepts them;
- `async def` functions (TRL awaits them) are awaited, several of them concurrently (`start_reward_call`,
  `finish_reward_calls`), on an event loop of their own in a daemon thread, so a notebook's running loop is no
  obstacle;
- a returned None means "this reward does not apply to this row" (TRL's meaning): `reward_values` turns the returned
  values into scores and a mask of the rows that apply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerState

from ..models.tokenizers import with_completion
from ..runtime.warn import warn_user

# Columns that are the prompt itself; every other column of a prompt dataset reaches the reward functions.
PROMPT_COLUMNS = ("prompt", "messages", "input_ids", "attention_mask")
# A prompt-completion dataset's reference completions: never passed, as TRL leaves them out, so that a function whose
# `completion` parameter meant the sampled completions (`completions`) cannot score the references in silence.
REFERENCE_COLUMNS = ("completion",)
# What TRL passes besides the dataset's columns; a column of one of these names would be shadowed.
CALL_NAMES = ("prompts", "completions", "completion_ids")
# ... and what it passes from the trainer (`RewardHooks`): given to a function that accepts them.
HOOK_NAMES = ("trainer_state", "log_extra", "log_metric")
KEYWORD_FIX = ("add **kwargs to its signature (def f(prompts, completions, **kwargs)), or name each parameter after "
               "a dataset column or one of prompts, completions, completion_ids, trainer_state, log_metric, log_extra")


def _ignore(*args, **kwargs) -> None:
    """A `log_metric` / `log_extra` that keeps nothing (a call outside training: the construction probe)."""


@dataclass(frozen=True)
class RewardHooks:
    """What TRL's GRPO trainer passes every reward function besides the batch: `trainer_state` (Trainer's
    `TrainerState`: `global_step`, `max_steps`, ... for shaping by progress), `log_metric(name, value)` (a scalar,
    averaged over the iteration and logged under `name`) and `log_extra(column, values)` (one value per completion, a
    column of the sample tables). The trainer hands its own over at each rollout (`RolloutParts.hooks`); the default
    (a fresh state, loggers that keep nothing) serves calls outside training."""

    trainer_state: Any = field(default_factory=TrainerState)
    log_metric: Callable[[str, float], None] = _ignore
    log_extra: Callable[[str, list], None] = _ignore

    def kwargs(self) -> dict:
        return {"trainer_state": self.trainer_state, "log_extra": self.log_extra, "log_metric": self.log_metric}


# The names the trainer logs its own metrics under: Trainer's, hf_ppo's, and hf_ppo's namespaces. A reward function's
# `log_metric` under one of them is averaged into the trainer's own value of that name (TRL mixes them in silence).
TRAINER_METRICS = frozenset({"loss", "grad_norm", "learning_rate", "lr", "epoch", "episode", "iteration", "reward",
                             "reward_std", "frac_reward_zero_std"})
TRAINER_NAMESPACES = ("objective/", "loss/", "policy/", "val/", "rollout/", "time/", "nonfinite/", "rewards/", "eval_",
                      "train_")


def trainer_metric(name: str) -> bool:
    """Whether the trainer logs a metric of its own under `name` (or in its namespace)."""
    return name in TRAINER_METRICS or name.startswith(TRAINER_NAMESPACES)


class RewardLogs:
    """What reward functions log through TRL's `log_metric` and `log_extra`, kept until the trainer takes it: the
    metrics' means (`take_metrics`: {name: mean of the values logged since}) and the extra columns (`take_extra`:
    {column: values, one per completion}). `hooks(state)` gives the `RewardHooks` that log here."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}
        self.said: set[str] = set()  # the trainer's metric names a reward function was warned about

    def log_metric(self, name: str, value: float) -> None:
        name = str(name)
        if trainer_metric(name) and name not in self.said:
            self.said.add(name)
            warn_user(f"A reward function called log_metric({name!r}, ...): the trainer logs its own metric under "
                      "that name (or in that namespace), so the two are averaged into one logged value. Log it under "
                      f"a name of your own, e.g. 'custom/{name.replace('/', '_')}'.")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(str(column), []).extend(list(values))

    def hooks(self, trainer_state) -> RewardHooks:
        return RewardHooks(trainer_state, self.log_metric, self.log_extra)

    def take_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return {name: sum(values) / len(values) for name, values in metrics.items() if values}

    def take_extra(self) -> dict[str, list]:
        extra, self.extra = self.extra, {}
        return extra


def data_columns(column_names) -> list[str]:
    """The columns of a prompt dataset (or the keys of one of its rows) that reward functions receive as keyword
    arguments: all but the prompt's own (`PROMPT_COLUMNS`) and a reference "completion" (`REFERENCE_COLUMNS`), as in
    TRL."""
    return [c for c in column_names if c not in PROMPT_COLUMNS and c not in REFERENCE_COLUMNS]


class RewardFunctionError(RuntimeError):
    """An exception raised inside a reward function, re-raised naming the function and the first failing row; the
    original is chained as `__cause__`."""


def _signature(func) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):  # builtins and C callables without a signature: called as they always were
        return None


def keyword_style(func, columns=None) -> bool:
    """True when `func` takes TRL's keyword call: its signature has **kwargs, cannot take two positional arguments,
    or names a parameter after a dataset column or after prompts/completions/completion_ids anywhere but hf_ppo's
    positional spots (prompts first, completions second). Else (`(prompts, completions)`, or two positional
    parameters of any other names, as `lambda p, c: ...`) it keeps the positional call f(prompt_texts, texts)."""
    sig = _signature(func)
    if sig is None:
        return False
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    try:
        sig.bind(None, None)
    except TypeError:
        return True
    known = set(CALL_NAMES) | set(HOOK_NAMES) | set(columns or ())
    positional = {0: "prompts", 1: "completions"}
    return any(p.name in known and positional.get(i) != p.name for i, p in enumerate(params)
               if p.kind is not p.VAR_POSITIONAL)


def check_reward_function(func, columns: list[str] | None, name: str) -> None:
    """Raise TypeError when `func` cannot take the call hf_ppo will make: a keyword-style function (see
    `keyword_style`) with a required parameter that is neither a dataset column (`columns`; None: not known yet, that
    check is skipped) nor prompts/completions/completion_ids, or one that can only be given by position. A column
    named like one of those three is refused too (the call's own value would hide it), and so is a class (passed where
    its instance was meant: calling it would build an instance, not score)."""
    if not callable(func):
        raise TypeError(f"The reward function {name!r} is a {type(func).__name__}, not callable: give a function "
                        "(prompts, completions, **kwargs) -> list[float].")
    if inspect.isclass(func):  # callable, but calling it builds an instance: never one score per completion
        raise TypeError(f"The reward function {name!r} is the class {func.__qualname__}, not a reward function: pass "
                        f"an instance of it ({func.__qualname__}(...), whose __call__ scores the completions), or a "
                        "function (completions, **kwargs) -> list[float].")
    _refuse_clashing_columns(columns, name)
    if not keyword_style(func, columns):
        return
    params = _signature(func).parameters.values()
    available = set(CALL_NAMES) | set(HOOK_NAMES) | set(columns or ())
    shown = f"the dataset's columns are {sorted(columns)}" if columns is not None else "the columns are not known yet"
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise TypeError(f"The reward function {name!r} takes {p.name!r} by position only, but reward functions "
                            f"with keyword parameters are called with keyword arguments (TRL's convention): make it "
                            f"a normal parameter (drop the '/'), or {KEYWORD_FIX}.")
        if p.default is p.empty and p.name in REFERENCE_COLUMNS:
            raise TypeError(f"The reward function {name!r} needs a parameter {p.name!r}: the sampled completions are "
                            "'completions' (TRL's name), and a dataset's 'completion' column (a prompt-completion "
                            "dataset's reference) is not passed, as TRL does not pass it. Rename the parameter "
                            "'completions' to score the samples; to read the reference, rename the column (e.g. "
                            "dataset.rename_column('completion', 'solution')) and the parameter after it.")
        if p.default is p.empty and p.name not in available and columns is not None:
            raise TypeError(f"The reward function {name!r} needs a parameter {p.name!r}, which hf_ppo cannot give it: "
                            f"it is called with prompts, completions, completion_ids, trainer_state, log_metric, "
                            f"log_extra and one keyword per dataset column, and {shown}. Rename the parameter after "
                            f"the column it means, add a {p.name!r} column to the prompt dataset, or give the "
                            "parameter a default.")


def trl_completions(prompts: list, texts: list[str]) -> list:
    """Completions in TRL's form: for a chat prompt (a list of messages) a list holding one assistant message, for
    a text prompt the text. A chat prompt's final assistant turn (a prefill the policy continued) leads the message,
    as in TRL (`with_completion`)."""
    return [[with_completion(p, t)[1]] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def trl_prompts(prompts: list) -> list:
    """The prompts in TRL's form: a chat prompt without its final assistant turn, which the completion carries
    (`trl_completions`); new lists, so the dataset's own prompts are left as they are."""
    return [with_completion(p, "")[0] if isinstance(p, list) else p for p in prompts]


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
# The reward loop serves every async reward function of the process, one step at a time: a synchronous call that
# blocks inside one (time.sleep, requests.get, a lock) stops them all. When the loop has not answered for this long
# while a call waits on it, that call stops naming the function, and later calls get a fresh loop. Async work that
# awaits (an API call taking minutes) keeps the loop answering and is never cut short.
LOOP_BLOCKED_AFTER = 120.0  # seconds
_LOOK_EVERY = 5.0  # seconds between looks at a loop while a call waits on it


def _event_loop() -> asyncio.AbstractEventLoop:
    """The event loop async reward functions run on, in a daemon thread of its own (started at the first use): the
    caller may itself be inside a running loop (a notebook), where `asyncio.run` is refused. One loop serves the
    whole run, so a client a function keeps between calls stays on the loop it was made on."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="hf_ppo-async-rewards", daemon=True).start()
        return _loop


def _abandon(loop: asyncio.AbstractEventLoop) -> None:
    """Leave a blocked loop to its thread (a daemon: it cannot be stopped from outside, and it stops once unblocked):
    later calls get a fresh loop."""
    global _loop
    with _loop_lock:
        if _loop is loop:
            _loop = None
    loop.call_soon_threadsafe(loop.stop)


def _answers(loop: asyncio.AbstractEventLoop, within: float, also: concurrent.futures.Future) -> bool:
    """Whether `loop` runs a callback within `within` seconds (or `also` finishes meanwhile): False when a
    synchronous call inside a coroutine holds it."""
    ping: concurrent.futures.Future = concurrent.futures.Future()
    loop.call_soon_threadsafe(ping.set_result, None)
    done, _ = concurrent.futures.wait([ping, also], timeout=within, return_when=concurrent.futures.FIRST_COMPLETED)
    return bool(done)


class Raised:
    """A KeyboardInterrupt or SystemExit an async function raised, handed back as its result: raised inside the
    loop's thread it would end that thread (and every call waiting on it would wait for ever)."""

    def __init__(self, error: BaseException):
        self.error = error


async def _guarded(awaitable):
    try:
        return await awaitable
    except (KeyboardInterrupt, SystemExit) as err:
        return Raised(err)


def _await_all(awaitables: list, names: list[str] | None = None) -> list:
    """The results of `awaitables` (the coroutines of the functions `names`), run concurrently; an exception is
    returned in place of its result, a KeyboardInterrupt or SystemExit as `Raised`. A loop held by a synchronous
    call for `LOOP_BLOCKED_AFTER` seconds is a `RewardFunctionError` naming the function that holds it."""
    names = names or [getattr(a, "__qualname__", "an async reward function") for a in awaitables]

    async def together():
        tasks = [asyncio.ensure_future(_guarded(a)) for a in awaitables]
        for task, name in zip(tasks, names):
            task.set_name(name)
        return await asyncio.gather(*tasks, return_exceptions=True)

    loop = _event_loop()
    future = asyncio.run_coroutine_threadsafe(together(), loop)
    try:
        while True:
            try:
                return future.result(timeout=_LOOK_EVERY)
            except concurrent.futures.TimeoutError:
                if _answers(loop, LOOP_BLOCKED_AFTER, future):
                    continue
                task = asyncio.current_task(loop)
                holder = task.get_name() if task is not None and task.get_name() in names else " or ".join(names)
                raise RewardFunctionError(
                    f"The async reward function {holder!r} has held hf_ppo's reward event loop for more than "
                    f"{LOOP_BLOCKED_AFTER:g} s without awaiting: a synchronous call inside it (time.sleep, "
                    "requests.get, a blocking read or lock) stops every async reward function, in this trainer and "
                    "any later one. Await asynchronous calls (await asyncio.sleep, an async HTTP client), run a "
                    "blocking one with `await asyncio.to_thread(f, ...)`, or make the function a plain def. "
                    "Checkpoints already saved are kept.") from None
    except BaseException:  # (the error above, or a Ctrl-C while the loop is held: later calls get a fresh loop)
        if not future.done() and not _answers(loop, 1.0, future):
            _abandon(loop)
        future.cancel()
        raise


def _own_copy(value):
    """A value a function may edit in place without the next function seeing it: lists and dicts (chat prompts,
    nested columns) deep-copied; strings, numbers and other immutables as they are."""
    return copy.deepcopy(value) if isinstance(value, (list, dict, set)) else value


class RewardCall:
    """One reward function's call on a batch (`start_reward_call`): done when the function is synchronous, else its
    awaitable waits for `finish_reward_calls`, which awaits every pending call together."""

    def __init__(self, func, name: str, arguments: Callable[[slice], tuple[tuple, dict]], rows: int,
                 prompt_texts: list[str], texts: list[str]):
        self.func, self.name, self.arguments, self.rows = func, name, arguments, rows
        self.prompt_texts, self.texts = prompt_texts, texts
        self.value, self.error, self.pending = None, None, None
        try:
            self.value = self._invoke(slice(None))
        except Exception as err:  # noqa: BLE001 - any exception of user code, re-raised naming the row
            self.error = err
            return
        if inspect.isawaitable(self.value):
            self.pending, self.value = self.value, None

    def _invoke(self, rows: slice):
        args, kwargs = self.arguments(rows)
        return self.func(*args, **kwargs)

    def _alone(self, i: int) -> None:
        """Call the function on row `i` alone (awaited when it is async); raises what it raises."""
        value = self._invoke(slice(i, i + 1))
        if inspect.isawaitable(value):
            (value,) = _await_all([value], [self.name])
            if isinstance(value, Raised):
                raise value.error
            if isinstance(value, BaseException):
                raise value

    def result(self):
        """What the function returned; its exception re-raised as `RewardFunctionError` naming the function and the
        first row that fails alone (the original chained)."""
        if self.error is None:
            return self.value
        failing = None
        for i in range(self.rows):
            try:
                self._alone(i)
            except Exception:  # noqa: BLE001
                failing = i
                break
        err = self.error
        where = (f"first on row {failing} alone (prompt {self.prompt_texts[failing]!r:.200}, completion "
                 f"{self.texts[failing]!r:.200})" if failing is not None else
                 f"on the batch of {self.rows} rows, though each row alone passes")
        raise RewardFunctionError(f"The reward function {self.name!r} raised {type(err).__name__}: {err} - {where}. "
                                  "Fix the function (or return None for rows it does not apply to); checkpoints "
                                  "already saved are kept.") from err


def _refuse_clashing_columns(columns, name: str) -> None:
    """A column named like one of the call's own keywords (prompts, completions, completion_ids, the hooks) would
    replace the call's value, or be replaced by it: refused, naming the rename."""
    clash = sorted(set(columns or ()) & (set(CALL_NAMES) | set(HOOK_NAMES)))
    if clash:
        raise TypeError(f"The prompt dataset has a column named {clash[0]!r}, which the reward function {name!r} is "
                        f"given as the call's own {clash[0]!r}: rename the column, e.g. "
                        f"dataset.rename_column({clash[0]!r}, '{clash[0]}_ref').")


def start_reward_call(func, name: str, *, prompts: list, prompt_texts: list[str], texts: list[str],
                      completion_ids: list[list[int]], columns: dict[str, list] | None,
                      hooks: RewardHooks | None = None) -> RewardCall:
    """Call `func` on the batch in its style (`keyword_style`): positional f(prompt_texts, texts); keyword with
    prompts (as the dataset gives them), completions (`trl_completions`), completion_ids, each column and the
    `hooks` (`RewardHooks`; default: outside training), a function without **kwargs getting only the names it
    declares. Every call gets its own copy of the prompts, completions and columns. An `async def` function's
    coroutine is left pending for `finish_reward_calls`."""
    columns = columns or {}
    _refuse_clashing_columns(columns, name)  # also where the columns come straight to a call (RewardSet.score)
    for column, values in columns.items():
        if len(values) != len(texts):  # a misaligned column would score completions against other rows' data
            raise ValueError(f"The column {column!r} has {len(values)} values for {len(texts)} completions: each "
                             "batch's columns must be aligned with its prompts.")
    if keyword_style(func, columns):
        params = _signature(func).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        given = {"prompts": trl_prompts(prompts), "completions": None, "completion_ids": completion_ids, **columns}
        hook_values = (hooks or RewardHooks()).kwargs()
        names = [k for k in [*given, *hook_values] if takes_all or k in params]

        def arguments(rows: slice) -> tuple[tuple, dict]:
            kwargs = {}
            for k in names:
                if k == "completions":
                    kwargs[k] = trl_completions(prompts[rows], texts[rows])
                elif k in hook_values:
                    kwargs[k] = hook_values[k]  # the trainer's own objects, never copied
                else:
                    kwargs[k] = [_own_copy(v) for v in given[k][rows]]
            return (), kwargs
    else:
        def arguments(rows: slice) -> tuple[tuple, dict]:
            return (list(prompt_texts[rows]), list(texts[rows])), {}
    return RewardCall(func, name, arguments, len(texts), prompt_texts, texts)


def finish_reward_calls(calls: list[RewardCall]) -> list:
    """What each call's function returned, in order: the pending (async) ones awaited together, concurrently; the
    first call that raised re-raised as `RewardFunctionError` (`RewardCall.result`)."""
    pending = [call for call in calls if call.pending is not None]
    if pending:
        outcomes = _await_all([call.pending for call in pending], [call.name for call in pending])
        for call, outcome in zip(pending, outcomes):
            call.pending = None
            if isinstance(outcome, Exception):
                call.error = outcome
            elif isinstance(outcome, Raised):  # KeyboardInterrupt, SystemExit: stop, as they would have, naming it
                err = outcome.error
                raise type(err)(f"The async reward function {call.name!r} raised {type(err).__name__}"
                                f"{f' ({err})' if str(err) else ''}: training stops, as it asked. Checkpoints already "
                                "saved are kept.") from err
            elif isinstance(outcome, BaseException):  # a CancelledError: not the function's error
                raise outcome
            else:
                call.value = outcome
    return [call.result() for call in calls]


def call_reward(func, name: str, *, prompts: list, prompt_texts: list[str], texts: list[str],
                completion_ids: list[list[int]], columns: dict[str, list] | None,
                hooks: RewardHooks | None = None) -> list:
    """What `func` returns for the batch (`start_reward_call`, awaited when async: `finish_reward_calls`). An
    exception inside it is re-raised as `RewardFunctionError` naming the function and the first row that fails
    alone (the original chained)."""
    call = start_reward_call(func, name, prompts=prompts, prompt_texts=prompt_texts, texts=texts,
                             completion_ids=completion_ids, columns=columns, hooks=hooks)
    return finish_reward_calls([call])[0]


def reward_values(values, expected: int, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,) float32, applies (B,) bool) from what the reward function `name` returned: a sequence, 1-D tensor
    or 1-D array of `expected` numbers, None entries meaning "does not apply to this row" (score 0.0, applies False).

    Anything else (a dict, a 2-D tensor, strings, a single number) is an error that names the function and says what
    came back. NaN/inf pass through: scoring leaves such a row out of the update (`RewardSet.combine`).
    """
    name = "The reward function" if name is None else f"The reward function {name!r}"
    fix = (f"return one number (or None: does not apply) per (prompt, completion) pair: a list of {expected} floats "
           "or a 1-D tensor/array")
    if getattr(values, "dtype", None) is not None and getattr(values.dtype, "kind", None) == "O" \
            and getattr(values, "ndim", None) == 1:
        values = values.tolist()  # a numpy array of Python objects (numbers and None): read as the list it holds
    if getattr(values, "dtype", None) is not None and getattr(values.dtype, "kind", None) in ("U", "S"):
        first = values.flat[0] if values.size else ""
        raise TypeError(f"{name} returned a numpy array of strings (dtype {values.dtype}, shape "
                        f"{tuple(values.shape)}, first {str(first)!r:.60}): {fix}; convert the strings with "
                        "float(...) if they hold numbers.")
    if hasattr(values, "ndim") and hasattr(values, "shape"):  # torch tensor or numpy array
        if values.ndim != 1:
            raise TypeError(f"{name} returned a {type(values).__name__} of shape {tuple(values.shape)}: "
                            f"{fix} (e.g. .squeeze(-1) on (B, 1) logits).")
        try:
            scores = torch.as_tensor(values).detach().to(device="cpu", dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} returned a {type(values).__name__} of dtype {values.dtype}: {fix}.") from err
        applies = torch.ones(scores.shape, dtype=torch.bool)
    elif isinstance(values, (str, bytes, dict)) or not isinstance(values, (list, tuple)):
        shown = f"a dict with keys {list(values)[:5]}" if isinstance(values, dict) else f"{values!r:.100}"
        raise TypeError(f"{name} returned {type(values).__name__} {shown}: {fix}.")
    else:
        bad = [(i, v) for i, v in enumerate(values) if v is not None and not _is_number(v)]
        if bad:
            i, v = bad[0]
            shape = tuple(getattr(v, "shape", ()))  # e.g. a numpy array of shape (1,), which TRL refuses too
            if shape and all(n == 1 for n in shape):
                fix = f"{fix}; an array of shape {shape} is no number: return its value, `x.item()`"
            raise TypeError(f"{name} returned a non-number at position {i}: {type(v).__name__} {v!r:.60} "
                            f"({len(bad)} such entries): {fix}.")
        applies = torch.tensor([v is not None for v in values], dtype=torch.bool)
        scores = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32)
    if scores.numel() != expected:
        raise ValueError(f"{name} returned {scores.numel()} scores for {expected} completions: it must return one "
                         "float (or None) per (prompt, completion) pair, in order.")
    return scores, applies


def _is_number(value) -> bool:
    """A real number: int/float/bool, a numpy scalar or 0-d array, or a torch tensor of one element (not a string,
    not None). A numpy array of shape (1,) is none: `float()` refuses it, and TRL's `torch.tensor(...)` of such a list
    is (B, 1), which its (B,) reward column refuses."""
    if isinstance(value, (str, bytes)) or value is None:
        return False
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, torch.dtype):
        numeric = not dtype.is_complex
    else:
        numeric = getattr(dtype, "kind", None) in ("b", "i", "u", "f")
    one_element = isinstance(dtype, torch.dtype) and getattr(value, "shape", None) == (1,)
    return numeric and (getattr(value, "ndim", None) == 0 or one_element)
