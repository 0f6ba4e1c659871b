"""A checkable final answer: GSM8K's "#### 42" convention, and `exact_answer`, a reward function in TRL's calling
convention that compares a completion's final number with the dataset's `answer` column.

What counts as a completion's final answer (`extract_answer`): the LAST of its marked answers, where a marked answer
is a "#### 42" line (GSM8K's own format, and what the recipe's system prompt asks for), a `\\boxed{42}`, or
"the answer is 42" / "answer: 42". The number is the first token after the marker with `$`, `\\$`, `**`, thousands
separators, a trailing period / comma / `%` removed; `1,200.00`, `$1200` and `1200.` are equal; `3/4` and
`\\frac{3}{4}` are fractions. A comma counts only as a thousands separator (`1,234`, `12,345,678`): `#### 1,5` is no
number, never 15. A marked answer that is not a number (`#### forty-two`, `\\boxed{x+1}`) is skipped.

Deliberately no "last number in the text" fallback by default (`strict=False` turns it on): it would pay a
completion that ends on any number (a restated quantity, a step of the working) and so teach the policy to drop the
format the check relies on; verl's GSM8K reward makes the same choice (its "strict" method, the default). Symbolic
answers (LaTeX expressions, sets, intervals) are out of scope: use `trl.rewards.accuracy_reward` (math-verify).

Floor 1 (rewards/): the standard library only; exported to YAML as `hf_ppo.rewards.exact_answer`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from numbers import Rational, Real

# The markers of a final answer; each match's end is where the answer starts.
_MARKERS = re.compile(r"####|\\boxed\s*\{|\b(?:final\s+)?answer\s*(?:is|:)\s*:?", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:/\d+)?")
# Commas only as thousands separators: 1,234 and 12,345,678.5; "1,5" or "1234,567" is no number (a decimal comma, a
# list or a typo: reading it as 15 would pay an answer the model never gave).
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"^\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
# Units and spacing inside \\boxed{}: "\\boxed{42\\text{ apples}}", "\\boxed{1\\,000}".
_LATEX_NOISE = re.compile(r"\\(?:text|mathrm|mbox)\{[^}]*\}|\\[,!; ]")
_LEADING = ("\\$", "$", "**", "*", "(", "`", "\\(")
_TRAILING = ("\\%", "%", "\\$", "$", "**", "*", ".", ",", ";", ":", "!", "?", ")", "`", "\\)")


def parse_number(token: str) -> Fraction | None:
    """`token` as an exact number, or None when it is not one: "1,200.00", "$1200", "-3.", "3/4", "\\frac{3}{4}",
    "50%" (as 50) all parse; "x+1", "forty-two", "" do not."""
    token = token.strip().replace("\u2212", "-")  # the typographic minus sign
    changed = True
    while changed and token:
        changed = False
        for prefix in _LEADING:
            if token.startswith(prefix):
                token, changed = token[len(prefix):].lstrip(), True
        for suffix in _TRAILING:
            if token.endswith(suffix):
                token, changed = token[: -len(suffix)].rstrip(), True
    fraction = _FRAC.match(token)
    if fraction:
        token = f"{fraction.group(1)}/{fraction.group(2)}"
    if not _NUMBER.fullmatch(token):
        return None
    numerator, _, denominator = token.partition("/")
    if "," in numerator and not _GROUPED.fullmatch(numerator):
        return None
    numerator = numerator.replace(",", "")
    try:
        value = Fraction(Decimal(numerator))
        if denominator:
            if Decimal(denominator) == 0:
                return None
            value /= Fraction(Decimal(denominator))
    except (InvalidOperation, ValueError):
        return None
    return value


def _braced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace that closes the one opened just before it (nested braces counted)."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _marked_answers(text: str) -> list[Fraction | None]:
    """The number after each marker of `text`, in order (None where the marked answer is not a number)."""
    found = []
    for match in _MARKERS.finditer(text):
        if match.group(0).startswith("\\boxed"):
            inner = _braced(text, match.end())
            inner = None if inner is None else _LATEX_NOISE.sub("", inner.replace("{,}", ","))
            found.append(None if inner is None else parse_number(inner))
        else:
            token = text[match.end():].split(maxsplit=1)
            found.append(parse_number(token[0]) if token else None)
    return found


def extract_answer(text: str, strict: bool = True) -> Fraction | None:
    """The final answer of `text` as an exact number: the last marked answer that is a number ("#### 42",
    `\\boxed{42}`, "the answer is 42"), or None when there is none. With `strict=False`, a text with no marked
    number falls back to its last number (see the module's docstring for why that is off by default)."""
    if not isinstance(text, str):
        raise TypeError(f"extract_answer takes a str, got {type(text).__name__}.")
    numbers = [n for n in _marked_answers(text) if n is not None]
    if numbers:
        return numbers[-1]
    if not strict:
        for token in reversed(_NUMBER.findall(text)):
            value = parse_number(token)
            if value is not None:
                return value
    return None


def reference_answer(answer, row: int | None = None) -> Fraction:
    """The reference number of a dataset's `answer` cell: GSM8K's worked solution ending "#### 42", a bare number
    ("42", "1,200"), or an int / float. A float counts as the decimal it was written as (0.1 is 1/10, not its binary
    fraction; numpy floats too). A cell with no number, or a NaN/inf, is an error naming the row: a reward that
    silently scores 0 against an unreadable reference would train on nothing."""
    where = f" (row {row} of the batch)" if row is not None else ""
    if isinstance(answer, bool) or not isinstance(answer, (str, Real)):
        raise TypeError(f"The reference answer{where} is {type(answer).__name__} {answer!r}; exact_answer needs the "
                        "dataset's `answer` column to hold text ending '#### <number>', a number as text, or a number.")
    if isinstance(answer, Rational):  # int, numpy integers, Fraction: exact already
        return Fraction(answer)
    if isinstance(answer, Real):
        # A float is the decimal it was written as (its shortest round-trip text: 0.1, not the binary fraction
        # 3602879701896397/36028797018963968 it holds), which is what a model writes; numpy's float32 prints its own.
        if not math.isfinite(answer):
            raise ValueError(f"The reference answer{where} is {answer!r}, not a finite number: fix the dataset's "
                             "`answer` column (or drop the row), e.g. dataset.filter(lambda x: "
                             "math.isfinite(x['answer'])).")
        return Fraction(Decimal(str(answer)))
    value = parse_number(answer)
    if value is None:
        value = extract_answer(answer)
    if value is None:
        raise ValueError(f"The reference answer{where} {answer[-80:]!r} holds no final number: exact_answer reads "
                         "'#### <number>' (GSM8K's format), a \\boxed{<number>} or a bare number. Fix the dataset's "
                         "`answer` column, or pass a reward function that reads your format.")
    return value


def completion_text(completion) -> str:
    """The text of one completion: a str, or TRL's conversational form (a list of messages, the last one the
    assistant's, whose "content" is read)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict) \
            and isinstance(completion[-1].get("content"), str):
        return completion[-1]["content"]
    raise TypeError(f"A completion is {type(completion).__name__} {str(completion)[:80]!r}: exact_answer takes text or "
                    "TRL's conversational form, a list holding one {'role': 'assistant', 'content': text} message.")


def exact_answer(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 for each completion whose final answer (`extract_answer`) equals its row's reference (`reference_answer`
    of the `answer` column), else 0.0 (also when the completion has no marked answer). TRL's calling convention:
    `completions` are texts or one-message lists, `answer` is the dataset column aligned with them; other columns
    arrive in `kwargs` and are ignored. Numbers compare exactly: "1,200.00" equals "1200", and "0.3" equals an
    `answer` of 0.3 (a float is the decimal it was written as)."""
    if len(completions) != len(answer):
        raise ValueError(f"exact_answer got {len(completions)} completions and {len(answer)} answers: they must be "
                         "aligned one to one (each completion with the `answer` of the row its prompt came from).")
    scores = []
    for row, (completion, reference) in enumerate(zip(completions, answer)):
        expected = reference_answer(reference, row)
        got = extract_answer(completion_text(completion))
        scores.append(1.0 if got is not None and got == expected else 0.0)
    return scores


__all__ = ["completion_text", "exact_answer", "extract_answer", "parse_number", "reference_answer"]
