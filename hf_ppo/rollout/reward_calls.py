"""How a reward function is called: TRL's keyword convention or hf_ppo's positional `(prompts, completions)`.

- `keyword_style`: which of the two a function takes, from its signature (`check_reward_function` checks, before any
  model loads or at trainer construction, that it can take the call);
- `call_reward`: the call itself, with the dataset's other columns aligned with the completions, and an exception
  inside the function re-raised naming the function and the first row it fails on (`RewardFunctionError`);
- a returned None means "this reward does not apply to this row" (TRL's meaning): `reward_values` turns the returned
  values into scores and a mask of the rows that apply.
"""

from __future__ import annotations

import inspect
import numbers

import torch

# Columns that are the prompt itself; every other column of a prompt dataset reaches the reward functions.
PROMPT_COLUMNS = ("prompt", "messages", "input_ids", "attention_mask")
# What TRL passes besides the dataset's columns; a column of one of these names would be shadowed.
CALL_NAMES = ("prompts", "completions", "completion_ids")
KEYWORD_FIX = ("add **kwargs to its signature (def f(prompts, completions, **kwargs)), or name each parameter after "
               "a dataset column or one of prompts, completions, completion_ids")


def data_columns(column_names) -> list[str]:
    """The columns of a prompt dataset (or the keys of one of its rows) that reward functions receive as keyword
    arguments: all but the prompt's own (`PROMPT_COLUMNS`)."""
    return [c for c in column_names if c not in PROMPT_COLUMNS]


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
    known = set(CALL_NAMES) | set(columns or ())
    positional = {0: "prompts", 1: "completions"}
    return any(p.name in known and positional.get(i) != p.name for i, p in enumerate(params)
               if p.kind is not p.VAR_POSITIONAL)


def check_reward_function(func, columns: list[str] | None, name: str) -> None:
    """Raise TypeError when `func` cannot take the call hf_ppo will make: a keyword-style function (see
    `keyword_style`) with a required parameter that is neither a dataset column (`columns`; None: not known yet, that
    check is skipped) nor prompts/completions/completion_ids, or one that can only be given by position. A column
    named like one of those three is refused too (the call's own value would hide it)."""
    if not callable(func):
        raise TypeError(f"The reward function {name!r} is a {type(func).__name__}, not callable: give a function "
                        "(prompts, completions, **kwargs) -> list[float].")
    clash = sorted(set(columns or ()) & set(CALL_NAMES))
    if clash:
        raise TypeError(f"The prompt dataset has a column named {clash[0]!r}, which the reward function {name!r} is "
                        f"given as the call's own {clash[0]!r}: rename the column, e.g. "
                        f"dataset.rename_column({clash[0]!r}, '{clash[0]}_ref').")
    if not keyword_style(func, columns):
        return
    params = _signature(func).parameters.values()
    available = set(CALL_NAMES) | set(columns or ())
    shown = f"the dataset's columns are {sorted(columns)}" if columns is not None else "the columns are not known yet"
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise TypeError(f"The reward function {name!r} takes {p.name!r} by position only, but reward functions "
                            f"with keyword parameters are called with keyword arguments (TRL's convention): make it "
                            f"a normal parameter (drop the '/'), or {KEYWORD_FIX}.")
        if p.default is p.empty and p.name not in available and columns is not None:
            raise TypeError(f"The reward function {name!r} needs a parameter {p.name!r}, which hf_ppo cannot give it: "
                            f"it is called with prompts, completions, completion_ids and one keyword per dataset "
                            f"column, and {shown}. Rename the parameter after the column it means, add a {p.name!r} "
                            "column to the prompt dataset, or give the parameter a default.")


def trl_completions(prompts: list, texts: list[str]) -> list:
    """Completions in TRL's form: for a chat prompt (a list of messages) a list holding one assistant message, for
    a text prompt the text."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def call_reward(func, name: str, *, prompts: list, prompt_texts: list[str], texts: list[str],
                completion_ids: list[list[int]], columns: dict[str, list] | None) -> list:
    """What `func` returns for the batch, called in its style (`keyword_style`): positional f(prompt_texts, texts);
    keyword with prompts (as the dataset gives them), completions (`trl_completions`), completion_ids and each
    column, a function without **kwargs getting only the names it declares. An exception inside it is re-raised as
    `RewardFunctionError` naming the function and the first row that fails alone (the original chained)."""
    columns = columns or {}
    for column, values in columns.items():
        if len(values) != len(texts):  # a misaligned column would score completions against other rows' data
            raise ValueError(f"The column {column!r} has {len(values)} values for {len(texts)} completions: each "
                             "batch's columns must be aligned with its prompts.")
    if keyword_style(func, columns):
        kwargs = {"prompts": list(prompts), "completions": trl_completions(prompts, texts),
                  "completion_ids": completion_ids, **{c: list(v) for c, v in columns.items()}}
        params = _signature(func).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        row = lambda i: {k: v[i:i + 1] for k, v in kwargs.items()}  # noqa: E731
        call = lambda args: func(**args)  # noqa: E731
        everything = kwargs
    else:
        everything = (prompt_texts, texts)
        row = lambda i: (prompt_texts[i:i + 1], texts[i:i + 1])  # noqa: E731
        call = lambda args: func(*args)  # noqa: E731
    try:
        return call(everything)
    except Exception as err:  # noqa: BLE001 - any exception of user code, re-raised with the row it fails on
        failing = None
        for i in range(len(texts)):
            try:
                call(row(i))
            except Exception:  # noqa: BLE001
                failing = i
                break
        where = (f"first on row {failing} alone (prompt {prompt_texts[failing]!r:.200}, completion "
                 f"{texts[failing]!r:.200})" if failing is not None else
                 f"on the batch of {len(texts)} rows, though each row alone passes")
        raise RewardFunctionError(f"The reward function {name!r} raised {type(err).__name__}: {err} - {where}. Fix "
                                  "the function (or return None for rows it does not apply to); checkpoints already "
                                  "saved are kept.") from err


def reward_values(values, expected: int, name: str = "The reward function") -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,) float32, applies (B,) bool) from what a reward function returned: a sequence, 1-D tensor or 1-D
    array of `expected` numbers, None entries meaning "does not apply to this row" (score 0.0, applies False).

    Anything else (a dict, a 2-D tensor, strings, a single number) is an error that says what came back. NaN/inf
    pass through: the trainer drops such a rollout (see trainer/guard.py).
    """
    fix = (f"return one number (or None: does not apply) per (prompt, completion) pair: a list of {expected} floats "
           "or a 1-D tensor/array")
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
            raise TypeError(f"{name} returned a non-number at position {i}: {type(v).__name__} {v!r:.60} "
                            f"({len(bad)} such entries): {fix}.")
        applies = torch.tensor([v is not None for v in values], dtype=torch.bool)
        scores = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32)
    if scores.numel() != expected:
        raise ValueError(f"{name} returned {scores.numel()} scores for {expected} completions: it must return one "
                         "float (or None) per (prompt, completion) pair, in order.")
    return scores, applies


def _is_number(value) -> bool:
    """A real number: int/float/bool, a numpy scalar, or a one-element tensor/array (not a string, not None)."""
    if isinstance(value, (str, bytes)) or value is None:
        return False
    if isinstance(value, numbers.Real):
        return True
    return getattr(value, "ndim", None) == 0 or getattr(value, "shape", None) in ((), (1,))
