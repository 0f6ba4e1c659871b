"""Rows whose answer is written in the prompt's TOKENS: a probe that the token rows (queries, responses) stay aligned
with the prompt texts and the dataset columns the reward functions get, when every prompt is sampled k times
(`num_generations`, `num_eval_samples`). Used by tests/rollout/test_reward_calls.py and
tests/evaluation/test_evaluator.py.

- `coded_prompts`: distinct prompts (in their tokens: every one ends in another word, its last token), in an order no
  sort gives, each row's `code` column the token id its prompt ends in and its `value` column a score of its own;
- `LastTokenEngine`: answers each query row with that row's last real prompt token, repeated: what it answers is read
  off the row's tokens, never its text or its position;
- `CodeCheck`: a TRL-style reward that, for every row, compares the completion's ids and text with the row's `code`
  column and the prompt text with the code, records every mismatch, and scores the row with its `value` column;
- `batch_problems`, `group_codes`: what a rollout batch or the engine's calls show of the alignment.

A reordering of the token rows against the texts and columns (a `repeat` for a `repeat_interleave`, a shuffle of one
side) makes completions meet the columns of another prompt: a mismatch, and a score that is not the tokens' row's.
"""

from __future__ import annotations

import torch
from datasets import Dataset

from hf_ppo.rollout.engines import RolloutEngine

# Distinct prompts, each ending in a word that is one token of the tiny tokenizer; not sorted by text, code or value.
PROMPTS = ["the game was dull", "the movie was great", "the hotel was awful", "the book was lovely",
           "the song was poor", "the food was nice", "the show was boring", "the film was happy"]
VALUES = [6.0, 2.0, 7.0, 1.0, 8.0, 3.0, 5.0, 4.0]  # each prompt's score (the `value` column)


def code_of(tokenizer, prompt: str) -> int:
    """The token id `prompt` ends in: what `LastTokenEngine` answers it with."""
    return tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]


def coded_prompts(tokenizer, n: int = len(PROMPTS)) -> Dataset:
    """The first `n` of `PROMPTS` with their `code` and `value` columns; the codes are checked distinct."""
    codes = [code_of(tokenizer, p) for p in PROMPTS[:n]]
    assert len(set(codes)) == n, "the probe needs prompts that end in distinct tokens"
    return Dataset.from_dict({"prompt": PROMPTS[:n], "code": codes, "value": VALUES[:n]})


class LastTokenEngine(RolloutEngine):
    """Row i's response: the last real token of row i's prompt (by its `query_mask`), `length` times. Records the
    (queries, query_mask) of every call (`calls`, on the CPU)."""

    def __init__(self, length: int):
        self.length = length
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def generate(self, model, queries, query_mask):
        self.calls.append((queries.cpu().clone(), query_mask.cpu().clone()))
        return last_tokens(queries, query_mask)[:, None].repeat(1, self.length)


def last_tokens(queries: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the last real token of each row, wherever its padding is."""
    positions = torch.arange(queries.shape[1], device=queries.device).expand_as(queries)
    last = torch.where(query_mask.bool(), positions, torch.full_like(positions, -1)).max(1).values
    return queries.gather(1, last[:, None]).squeeze(1)


class CodeCheck:
    """A keyword-style reward reading the `code` and `value` columns. For every row: the completion's ids must be
    the row's `code` `length` times, its text their decoding, and the prompt text the one that ends in that code;
    each row that is not is recorded in `mismatches` (never raised: a test reads them all). Scores each row with its
    `value` column, so a score placed on another row's tokens shows in the rollout batch (`batch_problems`).
    `reset()` after the trainer's construction: its probe calls with empty completions."""

    def __init__(self, tokenizer, length: int, name: str = "code_check"):
        self.__name__, self.tokenizer, self.length = name, tokenizer, length
        self.code_of_prompt = {p: code_of(tokenizer, p) for p in PROMPTS}
        self.reset()

    def reset(self) -> None:
        self.rows, self.calls, self.mismatches = 0, 0, []

    def __call__(self, prompts, completions, completion_ids, code, value, **kwargs):
        assert len(prompts) == len(completions) == len(completion_ids) == len(code) == len(value)
        for prompt, completion, ids, want in zip(prompts, completions, completion_ids, code):
            expected = [want] * self.length
            text = completion if isinstance(completion, str) else completion[0]["content"]
            if (list(ids) != expected or text != self.tokenizer.decode(expected)
                    or self.code_of_prompt.get(prompt) != want):
                self.mismatches.append({"prompt": prompt, "completion": text, "ids": list(ids), "code": want})
        self.rows, self.calls = self.rows + len(prompts), self.calls + 1
        return [float(v) for v in value]


def value_of_code(tokenizer) -> dict[int, float]:
    return {code_of(tokenizer, p): v for p, v in zip(PROMPTS, VALUES)}


def batch_problems(batch, tokenizer, length: int, k: int) -> list[str]:
    """What is wrong in a rollout batch (`RolloutBatch`) of groups of `k`: a group whose rows are not one prompt
    (its k rows consecutive), a response that is not its own prompt's code, or a score that is not the `value` of the
    prompt in the row's tokens."""
    problems, values = [], value_of_code(tokenizer)
    codes = last_tokens(batch.queries.cpu(), batch.query_mask.cpu()).tolist()
    rows = [tuple(q[m].tolist()) for q, m in zip(batch.queries.cpu(), batch.query_mask.cpu().bool())]
    for g in range(0, len(rows), k):
        if len(set(rows[g:g + k])) != 1:
            problems.append(f"rows {g}..{g + k - 1} are not one prompt's group: {rows[g:g + k]}")
    for i, (code, response, mask, score) in enumerate(zip(codes, batch.responses.cpu(), batch.response_mask.cpu(),
                                                           batch.scores.cpu().tolist())):
        if response[mask.bool()].tolist() != [code] * length:
            problems.append(f"row {i}: response {response.tolist()} for a prompt ending in {code}")
        if score != values.get(code):
            problems.append(f"row {i}: score {score} for the prompt ending in {code} (its value: {values.get(code)})")
    return problems


def group_codes(calls: list[tuple[torch.Tensor, torch.Tensor]], k: int) -> tuple[list[int], list[str]]:
    """The code of each group of `k` consecutive rows over the engine's `calls`, in order, and the groups whose rows
    are not all one prompt."""
    codes, problems = [], []
    for c, (queries, mask) in enumerate(calls):
        rows = [tuple(q[m].tolist()) for q, m in zip(queries, mask.bool())]
        last = last_tokens(queries, mask).tolist()
        assert len(rows) % k == 0, f"call {c}: {len(rows)} rows are not groups of {k}"
        for g in range(0, len(rows), k):
            if len(set(rows[g:g + k])) != 1:
                problems.append(f"call {c}, rows {g}..{g + k - 1}: {rows[g:g + k]}")
            codes.append(last[g])
    return codes, problems
