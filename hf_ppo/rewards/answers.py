"""A checkable final answer: GSM8K's "#### 42" convention, and `exact_answer`, a reward function in TRL's calling
convention that compares a completion's final number with the dataset's `answer` column.

What counts as a completion's final answer (`extract_answer`): the LAST of its marked answers, where a marked answer
is a "#### 42" line (GSM8K's own format, and what the recipe's system prompt asks for), a `\\boxed{42}`, or
"the answer is 42" / "answer: 42" (markdown emphasis around the marker included: "**Answer:** 42"). The number is
the first token after the marker with `$`, `\\$`, `**`, thousands separators, a trailing period / comma / `%` removed;
`1,200.00`, `$1200` and `1200.` are equal; `3/4` and `\\frac{3}{4}` are fractions; a sign before a `$` or a `\\frac`
negates it (`-$5`, `-\\frac{3}{4}`, `\\frac{7}{-2}`), `+5` is 5, and math delimiters are read through
(`\\( 42 \\)`). When an arithmetic expression starts there, its result is the answer ("the answer is 48 - 12 = 36"
is 36, never 48; "3 / 4" is 3/4). A comma counts only as a thousands separator (`1,234`, `12,345,678`): `#### 1,5` is
no number, never 15; a space (also a thin or no-break space, or `\\,`) likewise: `#### 12 345` is 12345, never 12,
and numbers side by side that are no such grouping (`#### 3 5`, `#### 5 3/4`) are no number. A marked answer that is
not a number (`#### forty-two`, `\\boxed{x+1}`, `#### 2 + 3`) is skipped. In a `\\boxed{}`, wrappers of the whole
number (`\\text{42}`, `\\mathbf{42}`, `{42}`) are read through and units (`\\text{ cm}`, `^\\circ`) dropped.

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
# Markdown emphasis around the marker ("**Answer:** 42", "**Final Answer**: 42", "*The answer is* 42") is part of
# it: read as the token after it, "**" would be the answer, no number, and a right answer would score 0.
_MARKERS = re.compile(r"####|\\boxed\s*\{|\b(?:final\s+)?answer\**\s*(?:is|:)\s*:?(?:\s*\*+)?", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:/\d+)?")
# Commas only as thousands separators: 1,234 and 12,345,678.5; "1,5" or "1234,567" is no number (a decimal comma, a
# list or a typo: reading it as 15 would pay an answer the model never gave).
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"^\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
# Units and spacing inside \\boxed{}: "\\boxed{42\\text{ apples}}", "\\boxed{1\\,000}", "\\boxed{90^\\circ}".
_LATEX_NOISE = re.compile(r"\\(?:text|mathrm|mbox)\{[^}]*\}|\\[,!; ]|\^\s*\{?\\circ\}?")
# What may wrap a \\boxed{}'s whole content without being a unit: "\\boxed{\\text{42}}", "\\boxed{\\mathbf{42}}",
# "\\boxed{{42}}".
_WRAPPER = re.compile(r"\\(?:text|textbf|mathbf|mathrm|mbox|bm|boldsymbol)\s*\{|\{")
_LEADING = ("\\$", "$", "**", "*", "(", "`", "\\(", "\\[")
# "\\)" before ")": stripping ")" first left "42\\" of "\\(42\\)", no number.
_TRAILING = ("\\%", "%", "\\$", "$", "**", "*", ".", ",", ";", ":", "!", "?", "\\)", "\\]", ")", "`")
# Thousands grouped by a space (SI style: "1 000", "12 345 678"; a no-break, thin or narrow no-break space, or LaTeX's
# "\\,", too), as commas are: a first group of 1-3 digits, then groups of exactly 3. Read token by token, "1 000" was 1.
_SPACE_GROUPED = re.compile(r"(?<![\d.,/])\d{1,3}(?:(?:[ \u00a0\u2009\u202f]|\\,)\d{3})+(?!\d|,\d)")
_GROUP_SPACE = re.compile(r"[ \u00a0\u2009\u202f]|\\,")
# A math opening before the answer ("the answer is \\( 42 \\)", "$$ 42 $$"): read as the number, it was no answer.
_MATH_OPENING = re.compile(r"^(?:\\[(\[]|\$\$?)\s*")


def _space_groups_joined(text: str) -> str:
    """`text` with the spaces inside space-grouped thousands (`_SPACE_GROUPED`) removed: "1 000" is "1000"; "3 5" and
    "12 3456" keep their spaces (no grouping: `_expression_result` reads them as no number)."""
    return _SPACE_GROUPED.sub(lambda m: _GROUP_SPACE.sub("", m.group(0)), text)


def parse_number(token: str) -> Fraction | None:
    """`token` as an exact number, or None when it is not one: "1,200.00", "$1200", "-3.", "3/4", "\\frac{3}{4}",
    "50%" (as 50), "-$5", "-\\frac{3}{4}" all parse; "x+1", "forty-two", "--5", "" do not."""
    token = _unwrapped(_space_groups_joined(token.strip()).replace("\u2212", "-"))  # the typographic minus sign
    if token.startswith("+") and token[1:2] not in ("+", "-"):  # an explicit plus sign: "+5", "+$5" ("+-5" is none)
        token = _unwrapped(token[1:])
    negative = token.startswith("-") and not _NUMBER.fullmatch(token)
    if negative:  # a sign before what it negates: "-$5", "-\\frac{3}{4}" (never read as no number: a right answer's 0)
        token = _unwrapped(token[1:])
        if token.startswith("-"):
            return None
    fraction = _FRAC.match(token)
    if fraction:
        numerator, denominator = fraction.groups()
        if denominator.startswith("-"):  # "\\frac{7}{-2}": the denominator's sign negates the fraction
            negative, denominator = not negative, denominator[1:]
        token = f"{numerator}/{denominator}"
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
    return -value if negative else value


def _unwrapped(token: str) -> str:
    """`token` without the currency signs, emphasis, brackets and punctuation around a number (`_LEADING`,
    `_TRAILING`)."""
    token = token.strip()
    changed = True
    while changed and token:
        changed = False
        for prefix in _LEADING:
            if token.startswith(prefix):
                token, changed = token[len(prefix):].lstrip(), True
        for suffix in _TRAILING:
            if token.endswith(suffix):
                token, changed = token[: -len(suffix)].rstrip(), True
    return token


def _braced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace that closes the one opened just before it (nested braces counted)."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _unbraced(inner: str) -> str:
    """A \\boxed{}'s content without the wrappers that hold all of it (`_WRAPPER`): "\\text{42}", "\\mathbf{42}" and
    "{42}" are 42, where removing `\\text{...}` as a unit would leave no number and a right answer would score 0."""
    inner = inner.strip()
    while (wrapper := _WRAPPER.match(inner)) is not None:
        body = _braced(inner, wrapper.end())
        if body is None or wrapper.end() + len(body) + 1 != len(inner):
            break
        inner = body.strip()
    return inner


def _marked_answers(text: str) -> list[Fraction | None]:
    """The number after each marker of `text`, in order (None where the marked answer is not a number)."""
    found = []
    for match in _MARKERS.finditer(text):
        if match.group(0).startswith("\\boxed"):
            inner = _braced(text, match.end())
            inner = None if inner is None else _LATEX_NOISE.sub("", _unbraced(inner).replace("{,}", ","))
            found.append(None if inner is None else parse_number(inner))
        else:
            rest = _MATH_OPENING.sub("", text[match.end():].lstrip())
            line = rest.split("\n", 1)[0]  # the answer's line: "The answer is:\n42" too
            found.append(_expression_result(line.split(maxsplit=_MOST_TOKENS)[:_MOST_TOKENS]))
    return found


# An arithmetic expression after a marker ("the answer is 48 - 12 = 36"): its operators, and how many tokens are read.
_OPERATORS = {"+", "-", "\u2212", "*", "x", "\u00d7", "/", "\u00f7", "^", "\u00b7", "\\times", "\\cdot", "\\div"}
_MOST_TOKENS = 24
_ENDS = (".", ",", ";", ":", "!", "?")  # a token ending a sentence or clause ends the expression


def _expression_result(tokens: list[str]) -> Fraction | None:
    """The number a marker's following `tokens` give: the first, unless an arithmetic expression starts there. Of
    "48 - 12 = 36" and "36 = 48 - 12" it is 36 (the last side of the `=` chain that is one number: reading the
    first token, 48, would pay an answer the model never gave); "3 / 4" is 3/4; an expression with no such side
    ("2 + 3") is no number."""
    first = parse_number(tokens[0]) if tokens else None
    if first is None:
        return None
    sides, i = [[first]], 1
    while i + 1 < len(tokens) and (tokens[i] in _OPERATORS or tokens[i] == "=") and not tokens[i - 1].endswith(_ENDS):
        term = parse_number(tokens[i + 1])
        if term is None:
            break
        if tokens[i] == "=":
            sides.append([term])
        else:
            sides[-1] += [tokens[i], term]
        i += 2
    if i < len(tokens) and tokens[i][:1].isdigit() and not tokens[i - 1].endswith(_ENDS):
        return None  # "#### 3 5", "#### 5 3/4", "#### 12 3456": a list or a misgrouped number, as "3,5" is none
    numbers = [side[0] for side in sides if len(side) == 1]
    if numbers:
        return numbers[-1]
    if len(sides) == 1 and len(sides[0]) == 3 and sides[0][1] == "/" and sides[0][2] != 0:
        return sides[0][0] / sides[0][2]
    return None


def extract_answer(text: str, strict: bool = True) -> Fraction | None:
    """The final answer of `text` as an exact number: the last marked answer that is a number ("#### 42",
    `\\boxed{42}`, "the answer is 42"), or None when there is none. With `strict=False`, a text with no marked
    number falls back to its last number (see the module's docstring for why that is off by default)."""
    if not isinstance(text, str):
        raise TypeError(f"extract_answer takes a str, got {type(text).__name__}.")
    text = _space_groups_joined(text)
    numbers = [n for n in _marked_answers(text) if n is not None]
    if numbers:
        return numbers[-1]
    if not strict:
        for token in reversed(_NUMBER.findall(text)):
            value = parse_number(token)
            if value is not None:
                return value
    return None


def _written(value: float) -> str:
    """The decimal a float cell was written as: its shortest round-trip text, at float32's precision when the value is
    a float32 (a float32 column, from parquet, pandas or datasets' Value("float32"), reads 0.1 back as the Python
    float 0.10000000149011612, whose float32 text is 0.1); at float64's otherwise."""
    import numpy as np

    if isinstance(value, np.floating) and value.dtype.itemsize < 8:
        return str(value)  # a numpy float16 / float32 prints its own shortest text
    with np.errstate(over="ignore"):  # a float64 beyond float32's range is no float32 (inf here)
        single = np.float32(value)
    return str(single) if float(single) == float(value) else repr(float(value))


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
        # 3602879701896397/36028797018963968 it holds), which is what a model writes; a float32 cell at its own
        # precision (`_written`).
        if not math.isfinite(answer):
            raise ValueError(f"The reference answer{where} is {answer!r}, not a finite number: fix the dataset's "
                             "`answer` column (or drop the row), e.g. dataset.filter(lambda x: "
                             "math.isfinite(x['answer'])).")
        return Fraction(Decimal(_written(answer)))
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
