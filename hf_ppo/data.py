"""Prompt datasets: checked and tokenized once at construction, then left-padded into batches."""

from __future__ import annotations

import warnings

import torch


class PromptCollator:
    """Left-pads tokenized prompts: {"queries": (B, Q) long, "query_mask": (B, Q) bool, "prompts": raw prompts}."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        queries = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.bool)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            queries[row, width - n:] = torch.tensor(f["input_ids"], dtype=torch.long)
            mask[row, width - n:] = True
        return {"queries": queries, "query_mask": mask, "prompts": [f["prompt"] for f in features]}


def prepare_prompts(dataset, tokenizer, name: str, *, max_prompt_length: int | None, response_length: int,
                    context: int | None):
    """Check the prompt column and tokenize it; truncate over-long prompts from the left with one warning.

    Returns a dataset with columns "prompt" (the raw text or messages) and "input_ids".
    """
    if dataset is None:
        return None
    columns = dataset.column_names
    if "prompt" in columns:
        key = "prompt"
    elif "messages" in columns:
        key = "messages"
    else:
        raise ValueError(f"{name} needs a 'prompt' column (text) or a 'messages' column (chat); it has {columns}. "
                         f"Rename yours, e.g. {name}.rename_column('{columns[0] if columns else 'text'}', 'prompt').")
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs prompts.")
    first = dataset[0][key]
    chat = isinstance(first, list)
    _check_rows(dataset[key], name, key, chat)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name} holds chat messages but the tokenizer has no chat template: set "
                         "tokenizer.chat_template, or give plain-text prompts in a 'prompt' column.")
    budget = max_prompt_length
    if context is not None:
        room = context - response_length
        if room < 1:
            raise ValueError(f"response_length={response_length} leaves no room for a prompt in the policy's "
                             f"context of {context} tokens: lower response_length.")
        budget = room if budget is None else min(budget, room)

    def tokenize(batch):
        prompts = batch[key]
        if chat:
            ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for p in prompts]
        else:
            ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        empty = [not (p if chat else p.strip()) for p in prompts]
        return {"input_ids": ids, "_empty": empty, "_length": [len(i) for i in ids]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=[c for c in columns if c != key],
                            desc=f"Tokenizing {name}")
    empty = [i for i, e in enumerate(tokenized["_empty"]) if e]
    if empty:
        raise ValueError(f"{name} has {len(empty)} empty prompt(s) (rows {empty[:10]}): remove them, e.g. "
                         f"{name}.filter(lambda x: x['{key}'].strip()).")
    too_long = sum(length > budget for length in tokenized["_length"]) if budget else 0
    if too_long:
        warnings.warn(f"{too_long} prompt(s) of {name} are longer than {budget} tokens (max_prompt_length, capped so "
                      f"prompt + response_length fits the model's context); they are truncated from the left.")
        tokenized = tokenized.map(lambda x: {"input_ids": x["input_ids"][-budget:]})
    tokenized = tokenized.remove_columns(["_empty", "_length"])
    if key != "prompt":
        tokenized = tokenized.rename_column(key, "prompt")
    return tokenized


def _check_rows(values: list, name: str, key: str, chat: bool) -> None:
    """Every row a non-empty string (text) or a list of {"role": str, "content": ...} turns (chat); errors name rows."""
    problems = []
    for row, value in enumerate(values):
        if value is None:
            problems.append(f"row {row} is None")
        elif not chat and not isinstance(value, str):
            problems.append(f"row {row} is a {type(value).__name__}, not a string")
        elif chat and not isinstance(value, list):
            problems.append(f"row {row} is a {type(value).__name__}, not a list of turns (row 0 is a chat)")
        elif chat:
            for turn_index, turn in enumerate(value):
                if not isinstance(turn, dict):
                    problems.append(f"row {row}, turn {turn_index} is a {type(turn).__name__} ({turn!r:.40}), not "
                                    "a {'role': ..., 'content': ...} dict")
                elif not isinstance(turn.get("role"), str) or turn.get("content") is None:
                    problems.append(f"row {row}, turn {turn_index} needs a 'role' (string) and a 'content'; it has "
                                    f"{ {k: v for k, v in turn.items() if v is not None} !r:.80}")
        if len(problems) >= 5:
            break
    if problems:
        raise ValueError(f"{name}[{key!r}] has malformed rows: " + "; ".join(problems) + ". Fix or drop them, e.g. "
                         f"{name}.filter(lambda x: isinstance(x['{key}'], {'list' if chat else 'str'})).")
