"""Prompt datasets: checked and tokenized once at construction, then left-padded into batches."""

from __future__ import annotations

import hashlib
import math

import torch
from torch.utils.data import Dataset, Sampler

from ..models.tokenizers import render_chat_prompt
from ..rollout.reward_calls import data_columns
from ..runtime.warn import warn_user


class PromptCollator:
    """Left-pads tokenized prompts: {"queries": (B, Q) long, "query_mask": (B, Q) bool, "prompts": raw prompts,
    "columns": {column: one raw value per row}} ("columns": the dataset's other columns, `data_columns`; {} when
    there are none). The sampler repeats a row once per sample (`RolloutRepeatSampler`), so the columns are aligned
    with the completions as they are."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
        self._last: tuple[list | None, tuple, dict | None] = (None, (), None)  # rows last collated, their ids, batch

    def __call__(self, features: list[dict]) -> dict:
        # The very rows of the last call (`RolloutPrompts` hands the same list again for each micro-batch of an
        # iteration): the batch already made. Only the identical list holding the identical rows counts, never equal
        # rows read anew, nor a list whose rows were replaced in place.
        ids = tuple(map(id, features))
        if features is self._last[0] and ids == self._last[1]:
            return self._last[2]
        batch = self._collate(features)
        self._last = (features, ids, batch)
        return batch

    def _collate(self, features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        queries = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.bool)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            queries[row, width - n:] = torch.tensor(f["input_ids"], dtype=torch.long)
            mask[row, width - n:] = True
        columns = {c: [f[c] for f in features] for c in data_columns(features[0])}
        return {"queries": queries, "query_mask": mask, "prompts": [f["prompt"] for f in features], "columns": columns}


def _pretokenized_rows(batch: dict, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids of a pre-tokenized batch (padding dropped where an attention_mask says so) and their decoded text."""
    masks = batch.get("attention_mask") or [None] * len(batch["input_ids"])
    ids = [[int(t) for t, keep in zip(row, mask or [1] * len(row)) if keep] for row, mask in zip(batch["input_ids"], masks)]
    # The text reward callables and the reward model's chat formatting see (as rollouts decode prompts).
    return ids, tokenizer.batch_decode(ids, skip_special_tokens=True)


def select_prompt_column(dataset, column: str, name: str, how: str = "set prompt_column to it"):
    """`dataset` with `column` as its prompts: renamed "prompt" (text or chat messages), or "input_ids" when it holds
    token ids (with the dataset's "attention_mask"), and the dataset's other prompt-named columns (`PROMPT_COLUMNS`,
    which would compete with it) left out; every other column stays (the reward functions' keyword arguments). A
    missing column is an error listing the columns there are; `how` says how to choose another."""
    if column not in dataset.column_names:
        raise ValueError(f"{name} has no column {column!r}; its columns are {dataset.column_names}. Name the column "
                         f"of the prompts: {how}.")
    first = dataset[0][column] if len(dataset) else ""
    ids = isinstance(first, list) and bool(first) and all(isinstance(t, int) for t in first)
    others = [c for c in data_columns(dataset.column_names) if c != column]
    mask = ["attention_mask"] if ids and "attention_mask" in dataset.column_names and column != "attention_mask" else []
    dataset = dataset.select_columns([column, *mask, *others])
    target = "input_ids" if ids else "prompt"
    return dataset.rename_column(column, target) if column != target else dataset


def with_system_prompt(dataset, system_prompt: str | None, tokenizer, name: str, key: str = "prompt"):
    """`dataset` with `system_prompt` as the first message of every prompt (column `key`): a text prompt becomes
    [system, user], a chat prompt gets the system message in front. Refused for token-id prompts, a tokenizer without
    a chat template, and chats that already open with a system message (which of the two was meant is not ours to
    guess)."""
    if system_prompt is None:
        return dataset
    if key == "input_ids" or key not in dataset.column_names:
        raise ValueError(f"system_prompt needs text or chat prompts, but {name} has token ids (input_ids): put the "
                         "system message into the ids yourself, or drop system_prompt.")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("system_prompt makes every prompt a chat, but the policy's tokenizer has no chat template: "
                         "use a chat/instruct model, or drop system_prompt and write the instruction into the prompts.")
    for i, prompt in enumerate(dataset[key]):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and prompt[0].get("role") == "system":
            raise ValueError(f"Row {i} of {name} already opens with a system message, and system_prompt gives "
                             "another: drop system_prompt, or remove the dataset's own system messages.")

    def add(row):
        turns = row[key] if isinstance(row[key], list) else [{"role": "user", "content": row[key]}]
        return {key: [{"role": "system", "content": system_prompt}, *turns]}

    return dataset.map(add, desc="system_prompt")


def prompt_key(columns: list[str], name: str) -> str:
    """The column a prompt dataset's prompts are read from: "prompt" (text), else "messages" (chat), else "input_ids"
    (token ids); an error naming the columns there are and the rename (or `prompt_column`) when it has none."""
    key = next((c for c in ("prompt", "messages", "input_ids") if c in columns), None)
    if key is None:
        raise ValueError(f"{name} needs a 'prompt' column (text), a 'messages' column (chat) or an 'input_ids' column "
                         f"(token ids from the policy's tokenizer); it has {columns}. Rename yours, e.g. "
                         f"{name}.rename_column('{columns[0] if columns else 'text'}', 'prompt'), or name it with "
                         "prompt_column.")
    return key


def check_prompt_columns(args, **datasets) -> None:
    """Before any model loads: every prompt dataset given has the column its prompts are read from (`prompt_column`,
    else `prompt_key`'s), or the construction stops here, naming the columns it has (`prepare_prompts` checks the rest
    once the tokenizer is loaded)."""
    for name, dataset in datasets.items():
        columns = getattr(dataset, "column_names", None)
        if columns is None:
            continue
        if args.prompt_column is None:
            prompt_key(columns, name)
        elif args.prompt_column not in columns:
            raise ValueError(f"{name} has no column {args.prompt_column!r}; its columns are {columns}. Name the column "
                             "of the prompts: set prompt_column to it.")


def prepare_prompts(dataset, tokenizer, name: str, *, max_prompt_length: int | None, response_length: int,
                    context: int | None, num_proc: int | None = None, apply_chat_template_to_text: bool | None = None,
                    prompt_column: str | None = None, system_prompt: str | None = None):
    """Check the prompt column and tokenize it; truncate over-long prompts from the left with one warning.

    Accepts a "prompt" column (text), a "messages" column (chat), or pre-tokenized "input_ids" (TRL 1.12's format;
    an "attention_mask" column, when present, marks padding to drop); `prompt_column` names another
    (`select_prompt_column`). Returns a dataset with columns "prompt" (the raw text or messages; for pre-tokenized
    rows their decoded text) and "input_ids", and every other column of `dataset` as it is (the reward functions'
    keyword arguments; a pre-tokenized dataset's "attention_mask" is dropped once its padding is). With
    `apply_chat_template_to_text` and a tokenizer that has a chat template, text prompts become one user turn each
    ("prompt" then holds those messages), exactly as a "messages" column would be read; `system_prompt` puts a
    system message first in every prompt (`with_system_prompt`), which makes text prompts chats too.
    """
    if dataset is None:
        return None
    if prompt_column is not None:
        dataset = select_prompt_column(dataset, prompt_column, name)
    columns = dataset.column_names
    key = prompt_key(columns, name)
    pretokenized = key == "input_ids"
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs prompts.")
    first = dataset[0][key]
    if pretokenized and not (isinstance(first, list) and all(isinstance(t, int) for t in first)):
        raise ValueError(f"{name}'s 'input_ids' must hold one list of token ids per row, got {first!r:.80}. Tokenize "
                         "without padding or tensors, e.g. dataset.map(lambda x: tokenizer(x['prompt']), "
                         "batched=True), or give the text in a 'prompt' column.")
    if not pretokenized and isinstance(first, list) and first and all(isinstance(t, int) for t in first):
        raise ValueError(f"{name}'s {key!r} column holds token ids, not text: name it 'input_ids' "
                         f"({name}.rename_column({key!r}, 'input_ids')), which is read as pre-tokenized prompts.")
    chat = isinstance(first, list) and not pretokenized
    if not pretokenized:
        _check_rows(dataset[key], name, key, chat)
    if system_prompt is not None:
        dataset = with_system_prompt(dataset, system_prompt, tokenizer, name, key)
        chat = True
    # Text rows are checked as text (above, and for empty rows below); they are wrapped when tokenized.
    wrap = bool(apply_chat_template_to_text and not chat and not pretokenized
                and getattr(tokenizer, "chat_template", None))
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
        if pretokenized:
            ids, texts = _pretokenized_rows(batch, tokenizer)
            vocab = len(tokenizer)
            return {"input_ids": ids, "prompt": texts, "_empty": [not i for i in ids],
                    "_length": [len(i) for i in ids], "_out_of_vocab": [any(not 0 <= t < vocab for t in i) for i in ids]}
        prompts = batch[key]
        turns = [[{"role": "user", "content": p}] for p in prompts] if wrap else prompts
        if chat or wrap:
            # A final assistant turn (a prefill) is continued, as TRL does; otherwise a new assistant turn opens.
            ids = [render_chat_prompt(tokenizer, p) for p in turns]
        else:
            ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        empty = [_empty_chat(p) if chat else not p.strip() for p in prompts]
        return {"input_ids": ids, "_empty": empty, "_length": [len(i) for i in ids], **({key: turns} if wrap else {})}

    dropped = [c for c in ("attention_mask",) if c in columns] + ([key] if wrap else [])  # `key` comes back as turns
    tokenized = dataset.map(tokenize, batched=True, remove_columns=dropped, desc=f"Tokenizing {name}",
                            num_proc=num_proc)
    if pretokenized:
        bad = [i for i, b in enumerate(tokenized["_out_of_vocab"]) if b]
        if bad:
            raise ValueError(f"{name} has token ids outside the policy tokenizer's {len(tokenizer)} tokens (rows "
                             f"{bad[:10]}): they were made with another tokenizer. Tokenize the prompts with the "
                             "policy's tokenizer, or give the text in a 'prompt' column.")
        tokenized = tokenized.remove_columns(["_out_of_vocab"])
    empty = [i for i, e in enumerate(tokenized["_empty"]) if e]
    if empty:
        text = "str(t['content'] or '').strip()"
        if chat:
            keep = f"any({text} for t in x['{key}']) and all({text} for t in x['{key}'] if t['role'] == 'user')"
        elif pretokenized:
            keep = "any(x['attention_mask']) if 'attention_mask' in x else len(x['input_ids']) > 0"
        else:
            keep = f"x['{key}'].strip()"
        what = " (no text, or a user turn with none: the policy would answer the bare chat template)" if chat else ""
        raise ValueError(f"{name} has {len(empty)} empty prompt(s){what} (rows {empty[:10]}): remove them, e.g. "
                         f"{name}.filter(lambda x: {keep}).")
    too_long = sum(length > budget for length in tokenized["_length"]) if budget else 0
    if too_long:
        warn_user(f"{too_long} prompt(s) of {name} are longer than {budget} tokens (max_prompt_length, capped so "
                  f"prompt + response_length fits the model's context); they are truncated from the left.")
        tokenized = tokenized.map(lambda x: {"input_ids": x["input_ids"][-budget:]}, num_proc=num_proc)
    tokenized = tokenized.remove_columns(["_empty", "_length"])
    if key != "prompt" and not pretokenized:
        tokenized = tokenized.rename_column(key, "prompt")
    return tokenized


def _blank(content) -> bool:
    """A turn's content with no text: an empty or whitespace-only string, or an empty list of parts."""
    return not content or (isinstance(content, str) and not content.strip())


def _empty_chat(messages: list) -> bool:
    """A chat prompt with nothing to answer: no turns, every turn blank, or a user turn blank (the prompt is then the
    chat template's markup around nothing)."""
    return (not messages or all(_blank(turn["content"]) for turn in messages)
            or any(turn["role"] == "user" and _blank(turn["content"]) for turn in messages))


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


class RolloutRepeatSampler(Sampler):
    """Shuffled prompt indices, each prompt `num_generations` (k) times in a row, each global rollout batch
    repeated `repeat` times in a row.

    `global_batch_size` counts responses (rollout_batch_size x world_size): a global batch holds
    global_batch_size / k prompts. The DataLoader's batch is one device's rollout batch, a multiple of k, so
    accelerate (which gives process r the r-th batch of every `world_size` consecutive ones) hands each process
    whole groups, the same slice of the same global batch `repeat` times: once per micro-batch of the PPO iteration.
    One epoch visits every prompt once (k responses each); prompts that do not fill a last batch are dropped.
    """

    def __init__(self, num_prompts: int, global_batch_size: int, repeat: int, seed: int, num_generations: int = 1):
        if global_batch_size % num_generations:
            raise ValueError(f"A global batch of {global_batch_size} responses is not whole groups of "
                             f"num_generations={num_generations}.")
        self.num_prompts, self.global_batch_size, self.repeat, self.seed = num_prompts, global_batch_size, repeat, seed
        self.num_generations = num_generations
        self.prompts_per_batch = global_batch_size // num_generations
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_prompts, generator=generator).tolist()
        for start in range(0, self.num_batches * self.prompts_per_batch, self.prompts_per_batch):
            chunk = [i for i in order[start:start + self.prompts_per_batch] for _ in range(self.num_generations)]
            for _ in range(self.repeat):
                yield from chunk

    @property
    def num_batches(self) -> int:
        """Global rollout batches (PPO iterations) per epoch."""
        return self.num_prompts // self.prompts_per_batch

    def __len__(self) -> int:
        return self.num_batches * self.global_batch_size * self.repeat


class RolloutPrompts(Dataset):
    """The training prompts as Trainer's DataLoader reads them. `RolloutRepeatSampler` asks for the same rollout batch
    once per micro-batch of a PPO iteration (so that Trainer counts its steps right), but only the iteration's first
    micro-batch samples from it; the others train on the rollout (`MinibatchSchedule`). So a batch asked for right
    after itself is handed back as the rows already read, the same list (which `PromptCollator` then recognises),
    instead of being read from `dataset` and collated once per micro-batch. Any other batch is read as usual."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._last: tuple[list[int] | None, list | None] = (None, None)  # the indices last read, and their rows

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list:
        indices = list(indices)
        if self._last[0] == indices:
            return self._last[1]
        many = getattr(self.dataset, "__getitems__", None)
        rows = many(indices) if many is not None else [self.dataset[i] for i in indices]
        self._last = (indices, rows)
        return rows


class RefillPrompts:
    """The extra prompt groups of DAPO's refill (`rollout.rollout_with_refill`): `extra(round)` is one process's
    rollout batch, rollout_batch_size / num_generations distinct prompts of `dataset`, each num_generations times in a
    row, collated by `collator`.

    The prompts are a pure function of (seed, the optimizer step the rollout starts at, the round, the process), drawn
    with a generator of their own: the global RNG (the sampling noise, which checkpoints restore) is not touched, so
    a resumed run draws the same refill prompts as the run it continues. They may repeat the main batch's prompts.
    """

    def __init__(self, dataset, collator, args, step: int):
        self.dataset, self.collator, self.step = dataset, collator, step
        self.seed, self.process, self.k = args.seed, args.process_index, args.num_generations
        self.num_prompts = args.rollout_batch_size // args.num_generations

    def __call__(self, round_: int) -> dict:
        key = [self.seed, self.step, round_, self.process]
        seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(seed))
        rows = [self.dataset[i] for i in order[:self.num_prompts].tolist()]
        return self.collator([row for row in rows for _ in range(self.k)])


def check_rollout_batch(args, train_dataset) -> None:
    """Fail at construction when one iteration needs more prompts than `train_dataset` has; warn when `max_steps`
    ends part-way through an iteration."""
    if train_dataset is None:
        return
    global_batch = args.rollout_batch_size * args.world_size
    prompts = global_batch // args.num_generations
    if len(train_dataset) < prompts:
        per_prompt = f" / num_generations {args.num_generations}" if args.num_generations > 1 else ""
        raise ValueError(
            f"One PPO iteration samples {prompts} prompts (per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps {args.gradient_accumulation_steps} x "
            f"num_mini_batches {args.num_mini_batches} x {args.world_size} processes{per_prompt}), but train_dataset "
            f"has {len(train_dataset)}. Add prompts or lower one of those factors."
        )
    if args.max_steps > 0 and args.max_steps % args.optimizer_steps_per_iteration:
        warn_user(f"max_steps={args.max_steps} is not a multiple of num_ppo_epochs x critic_updates_per_step x "
                  f"num_mini_batches = "
                  f"{args.optimizer_steps_per_iteration}: the last PPO iteration will stop part-way.")
    check_run_length(args, len(train_dataset) // prompts)


def check_run_length(args, iterations_per_epoch: int) -> None:
    """With the run's length set by `num_train_epochs` (max_steps unset), the optimizer steps it will make are known
    once the dataset is: a critic warm-up covering all of them leaves the policy where it started (a warning, as
    PPOConfig gives for max_steps)."""
    warmup = args.critic_warmup_steps
    if args.max_steps > 0 or not warmup:
        return
    steps = math.ceil(args.num_train_epochs * iterations_per_epoch * args.optimizer_steps_per_iteration)
    if warmup >= steps:
        warn_user(f"critic_warmup_steps={warmup} covers the whole run ({args.num_train_epochs:g} epoch(s) of "
                  f"{iterations_per_epoch} iteration(s) x {args.optimizer_steps_per_iteration} optimizer steps = "
                  f"{steps} steps): only the critic trains and the policy ends where it started. Lower "
                  "critic_warmup_steps, or raise num_train_epochs / set max_steps, if the policy should train.")


def _text_prompts(dataset, column: str | None = None) -> bool:
    """The dataset's prompts are plain text: a `column` ("prompt" by default) of strings (not chat messages, not
    token ids)."""
    column = column or "prompt"
    return (dataset is not None and column in dataset.column_names and len(dataset) > 0
            and isinstance(dataset[0][column], str))


def check_text_prompts(tokenizer, apply_chat_template_to_text: bool | None, prompt_column: str | None = None,
                       **datasets) -> None:
    """One warning, for all the datasets together, when plain-text prompts (in `prompt_column`, default "prompt") go
    to a policy whose tokenizer has a chat template and `apply_chat_template_to_text` was left unset (None): a chat
    model given raw text, without its template, often answers with empty or broken turns, and PPO then optimises on
    those."""
    if apply_chat_template_to_text is not None or not getattr(tokenizer, "chat_template", None):
        return
    plain = [name for name, dataset in datasets.items() if _text_prompts(dataset, prompt_column)]
    if plain:
        warn_user(f"{' and '.join(plain)} {'hold' if len(plain) > 1 else 'holds'} plain-text prompts, but the policy's tokenizer has a chat template: the "
                  "prompts reach the model without it, and a chat model given raw text often answers with empty or "
                  "broken turns, which PPO then optimises. Give the prompts as chat messages (a 'messages' column of "
                  "[{'role': 'user', 'content': ...}] turns), or set apply_chat_template_to_text=True to wrap each "
                  "prompt as one user turn; for a base model (or prompts already formatted) set "
                  "apply_chat_template_to_text=False to feed the text as it is without this warning. (In a YAML "
                  "config `apply_chat_template_to_text: true`; on the `hf-ppo train` or `hf-ppo evaluate` command "
                  "line `--apply_chat_template_to_text true`.)")


def prepare_datasets(train_dataset, eval_dataset, tokenizer, args, context: int | None):
    """Both prompt datasets checked and tokenized (`prepare_prompts`), and the rollout batch checked against the
    training set; returns (train, eval, chat) where chat is the set of "is a chat dataset" values seen."""
    kwargs = dict(context=context, max_prompt_length=args.max_prompt_length, response_length=args.response_length,
                  num_proc=args.dataset_num_proc, apply_chat_template_to_text=args.apply_chat_template_to_text,
                  prompt_column=args.prompt_column, system_prompt=args.system_prompt)
    if args.system_prompt is None:  # a system prompt makes every prompt a chat
        check_text_prompts(tokenizer, args.apply_chat_template_to_text, args.prompt_column,
                           train_dataset=train_dataset, eval_dataset=eval_dataset)
    if train_dataset is None and args.max_refill_rounds:
        raise ValueError(f"max_refill_rounds={args.max_refill_rounds} refills with prompts sampled from train_dataset, "
                         "and there is none: pass train_dataset, or set max_refill_rounds=0.")
    train_dataset = prepare_prompts(train_dataset, tokenizer, "train_dataset", **kwargs)
    eval_dataset = prepare_prompts(eval_dataset, tokenizer, "eval_dataset", **kwargs)
    check_rollout_batch(args, train_dataset)
    chat = {isinstance(d[0]["prompt"], list) for d in (train_dataset, eval_dataset) if d is not None}
    return train_dataset, eval_dataset, chat or {False}
