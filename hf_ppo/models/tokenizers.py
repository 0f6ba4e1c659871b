"""Tokenizers: loading them with clear errors, the stop tokens that end a response, the pad token (an existing unused
special token when the tokenizer has none; never a stop token), and the checks that a model has a row for every id
the tokenizer can produce."""

from __future__ import annotations

import copy
import os

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.tokenization_utils_base import LARGE_INTEGER

from ..runtime.warn import warn_user
from .adapters import adapter_config
from .pretrained import _PROBE_TEXT, from_pretrained


def load_tokenizer(name_or_path: str, role: str, init_kwargs: dict | None = None) -> PreTrainedTokenizerBase:
    kwargs = {k: v for k, v in (init_kwargs or {}).items()
              if k in ("revision", "token", "trust_remote_code", "cache_dir", "gguf_file", "subfolder")}
    return from_pretrained(AutoTokenizer, name_or_path, f"{role} tokenizer", **kwargs)


def resolve_stop_token_ids(stop_token_ids, stop_token_id, stop_token, tokenizer, model) -> list[int]:
    """The ids that end a response, from the config fields in order of precedence.

    `stop_token_ids` (a list) as given; else `stop_token_id` alone; else with `stop_token="eos"` the tokenizer's EOS
    plus every id of the model's `generation_config.eos_token_id` (an int or a list: instruct models end a turn with
    `<|eot_id|>`, `<end_of_turn>`, `<|im_end|>`...); else (`stop_token=None`) none: responses never stop.
    """
    if stop_token_ids is not None:
        ids = list(stop_token_ids)
    elif stop_token_id is not None:
        ids = [stop_token_id]
    elif stop_token == "eos":
        generation_config = getattr(model, "generation_config", None)
        configured = getattr(generation_config, "eos_token_id", None)
        configured = configured if isinstance(configured, (list, tuple)) else [configured]
        ids = [tokenizer.eos_token_id, *configured]
    else:
        ids = []
    return list(dict.fromkeys(int(i) for i in ids if i is not None))  # unique, in order


def check_stop_token_ids(stop_token_ids: list[int], model, needs_stop: bool = False) -> None:
    """Every stop id must be a token the policy can sample (a row of its output embedding); `needs_stop` (the EOS
    trick is on) requires at least one."""
    if needs_stop and not stop_token_ids:
        raise ValueError("missing_eos_penalty is set but there is no stop token: the tokenizer has no EOS and the "
                         "model's generation_config names none. Set PPOConfig.stop_token_ids.")
    rows = model.get_output_embeddings().weight.shape[0]
    bad = [i for i in stop_token_ids if not 0 <= i < rows]
    if bad:
        raise ValueError(f"stop token ids {bad} are outside the policy's vocabulary (0..{rows - 1}): the policy can "
                         "never sample them. Set PPOConfig.stop_token_ids to ids of this tokenizer.")


def tokenizer_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """Rows an embedding needs for every id the tokenizer can produce: len(tokenizer), or max id + 1 if larger."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


# The largest multiple real vocabularies are padded to (DeepSeek LLM: 4096).
_LARGEST_PADDING_MULTIPLE = 4096


def spare_rows_expected(rows: int) -> int:
    """How many embedding rows beyond the tokenizer's ids a model may have without looking like another model's.

    Vocabularies are padded for speed: to a multiple of a power of two (Phi-2's 50,295 tokens to 51,200, a multiple
    of 1024; DeepSeek LLM's 100,015 to 102,400, of 4096), or with some slack besides (Qwen2.5 by up to 399 rows). So:
    a tenth of the rows, or fewer rows than the largest power of two (up to 4096) that divides `rows`, whichever is
    more. A fixed floor (1024, before) exceeds a small embedding whole: 417 rows would have accepted any tokenizer."""
    return max(rows // 10, min(rows & -rows, _LARGEST_PADDING_MULTIPLE) - 1)


def check_vocab(model, tokenizer: PreTrainedTokenizerBase, role: str, fix: str, warn_unused: bool = False) -> bool:
    """Fail now, not with an IndexError mid-rollout, when `model` has fewer embedding rows than the token ids of
    `tokenizer`; `fix` says what to do for this model's role and the way it was given.

    Fewer token ids than rows is normal (vocabularies padded for speed); with `warn_unused`, far fewer
    (`spare_rows_expected`) from a tokenizer not saved with the model is probably another model's tokenizer: a
    warning, and True is returned (so a model checked next against the same tokenizer need not say it again)."""
    rows = model.get_input_embeddings().weight.shape[0]
    needed = tokenizer_size(tokenizer)
    if needed > rows:
        raise ValueError(f"The tokenizer produces token ids up to {needed - 1} ({len(tokenizer)} tokens) but the "
                         f"{role}'s embedding has only {rows} rows. {_added_pad_fix(tokenizer, rows, role)}{fix}")
    # A tokenizer from the model's own checkpoint is its own, however many rows it leaves unused.
    if not warn_unused or rows - needed <= spare_rows_expected(rows) or same_checkpoint(model, tokenizer):
        return False
    source = getattr(model, "name_or_path", "") or ""
    own = f"AutoTokenizer.from_pretrained({source!r})" if source else "the tokenizer saved with it"
    what = f"Pass the policy's own tokenizer as processing_class ({own})" if role == "policy" else fix.rstrip(".")
    warn_user(f"The tokenizer has {needed} token ids but the {role}'s embedding has {rows} rows: {rows - needed} rows "
              f"no id reaches, more than the padding of a vocabulary (up to {spare_rows_expected(rows)} here). It is "
              f"probably another model's tokenizer, whose ids mean other tokens to the {role}. {what}; if this one "
              "is right (a vocabulary trimmed on purpose), ignore this warning.")
    return True


def _added_pad_fix(tokenizer: PreTrainedTokenizerBase, rows: int, role: str) -> str:
    """For a pad token added to the tokenizer without resizing the model (TRL's scripts' `[PAD]`): both fixes, hf_ppo's
    (add no pad token) and the one that keeps the habit (resize every model that reads the policy's ids)."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None or pad_id < rows:
        return ""
    return (f"The pad token {tokenizer.pad_token!r} (id {pad_id}) has no row in the {role}'s embedding: it was added "
            "to the tokenizer (`add_special_tokens({'pad_token': ...})`, as TRL's scripts did) without resizing the "
            "model. Either add no pad token (hf_ppo's way: with none, the trainer pads with an existing unused "
            "special token, and no new embedding row must be trained), or keep the habit and resize: "
            "`model.resize_token_embeddings(len(tokenizer))` on the policy and on the reference model alike (load "
            "them yourself and pass the objects; ref_model=None copies the resized policy). ")


# Name fragments of special tokens that exist to be unused, best first (see `choose_pad_token`).
_PAD_NAMES = ("pad",)
_UNUSED_NAMES = ("reserved", "unused", "placeholder", "control")
_MODALITY_NAMES = ("image", "video", "vision", "audio")


def choose_pad_token(
    tokenizer: PreTrainedTokenizerBase, model, stop_token_ids: list[int], model_given_as: str
) -> PreTrainedTokenizerBase:
    """The tokenizer the trainer uses (and saves): padding on the left, with a pad token that is not a stop token,
    and a `model_max_length` that is the model's context (`max_position_embeddings`) when the tokenizer had only
    transformers' "no limit" sentinel (1e30, e.g. a tokenizer converted from a GGUF file).

    When the tokenizer has no pad token, or its pad is EOS or another stop token (padding with EOS makes it
    undetectable after truncation, N+ paper), an existing special token is chosen instead: one with an embedding row
    in `model` that never comes out of encoding text (not BOS/EOS/UNK, not a token of the chat template, not a token
    the model's config refers to, such as an image placeholder). Names with "pad" are preferred (Llama 3's
    `<|finetune_right_pad_id|>`, Pythia's `<|padding|>`, Qwen's `<|fim_pad|>`), then reserved/unused ones, then any
    other unused special token, then UNK if no text encodes to it (byte-level tokenizers). The choice is announced
    once. No token is ever added and no embedding resized: when no such token exists this fails with the fix for
    `model_given_as` ("id" or "object").

    The user's tokenizer is never modified: the trainer works on (and saves) a copy.
    """
    tokenizer = copy.deepcopy(tokenizer)
    # Generation appends on the right. `save_pretrained` writes only the keys of `init_kwargs` (a tokenizer built
    # without `padding_side` would be saved right-padded), so the saved copy is told too.
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"
    context = max_positions(model.config)
    if tokenizer.model_max_length > LARGE_INTEGER and isinstance(context, int) and context > 0:
        tokenizer.model_max_length = tokenizer.init_kwargs["model_max_length"] = context
    pad = tokenizer.pad_token_id
    if pad is not None and pad not in stop_token_ids:
        return tokenizer
    rows = model.get_input_embeddings().weight.shape[0]
    choice = _unused_special_token(tokenizer, model, rows, set(stop_token_ids))
    why = ("has no pad token" if pad is None
           else f"pads with {tokenizer.pad_token!r}, which is a stop token (padding with a stop token hides it)")
    if choice is None:
        raise ValueError(f"The tokenizer {why}, and it has no unused special token with an embedding row to pad with. "
                         + _pad_fix(tokenizer, rows, model_given_as))
    token_id, token = choice
    tokenizer.pad_token = token
    warn_user(f"The tokenizer {why}: padding with {token!r} (id {token_id}), an existing special token with an "
              "embedding row that ordinary text never encodes to (no token added, no resize). Pass a "
              "processing_class with pad_token set to choose another.")
    return tokenizer


def max_positions(config) -> int | None:
    """The model's context length (`max_position_embeddings` of its text config), or None when it has none."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "max_position_embeddings", None)


def _unused_special_token(tokenizer, model, rows: int, stop_ids: set[int]) -> tuple[int, str] | None:
    """(id, token) of the best pad candidate, or None; see `choose_pad_token` for the rules."""
    taken = set(stop_ids) | set(tokenizer(_PROBE_TEXT, verbose=False)["input_ids"])
    taken |= {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "sep", "cls", "mask")}
    taken |= _config_token_ids(model.config)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template or "")
    ranked = []
    for token_id, added in tokenizer.added_tokens_decoder.items():
        name = str(added).lower()
        if (not added.special or token_id in taken or token_id >= rows or token_id == tokenizer.unk_token_id
                or str(added) in template):
            continue
        if any(w in name for w in _PAD_NAMES) and not any(w in name for w in _MODALITY_NAMES):
            rank = 0
        elif any(w in name for w in _PAD_NAMES + _UNUSED_NAMES):
            rank = 1
        else:
            rank = 2
        ranked.append((rank, token_id, str(added)))
    unk = tokenizer.unk_token_id
    if unk is not None and unk not in taken and unk < rows:
        ranked.append((3, unk, tokenizer.unk_token))
    return min(ranked)[1:] if ranked else None


def _config_token_ids(config) -> set[int]:
    """Every token id the model's config (and its sub-configs) names, pad excepted (image placeholders, BOI...)."""
    ids, stack, seen = set(), [config], set()
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for name, value in vars(cfg).items():
            if isinstance(value, PretrainedConfig):
                stack.append(value)
            elif (name.endswith(("token_id", "token_ids", "token_index")) and name != "pad_token_id"
                  and not isinstance(value, bool)):
                ids.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return ids


def _pad_fix(tokenizer, rows: int, model_given_as: str) -> str:
    """How to give the trainer a pad token, for a model given by id/path or as an object."""
    if rows > len(tokenizer):  # the embedding has spare rows (vocabularies padded to a multiple of 64...)
        return (f"The policy's embedding has {rows} rows, more than the tokenizer's {len(tokenizer)} tokens, so a new "
                "special token fits without resizing: `tokenizer.add_special_tokens({'pad_token': '<pad>'})`, then "
                "pass processing_class=tokenizer.")
    if model_given_as == "id":
        return ("Pass processing_class=<a tokenizer whose pad_token is an existing token with an embedding row that "
                "is not a stop token>, or load the model yourself, add a pad token and resize it, and pass the model "
                "object: " + _resize_fix())
    return _resize_fix()


def _resize_fix() -> str:
    return ("`tokenizer.add_special_tokens({'pad_token': '<pad>'})`, "
            "`model.resize_token_embeddings(len(tokenizer))`, then pass both. With LoRA/QLoRA the resized embedding "
            "rows are new weights: train and save them (e.g. LoraConfig(trainable_token_indices=...) or "
            "modules_to_save=['embed_tokens', 'lm_head'], which stores the full embeddings in every adapter).")


def ends_with_prefill(messages) -> bool:
    """Whether a chat prompt ends with an assistant turn: a prefill ("The answer is") or an empty one, which the
    model continues (TRL's `continue_final_message`) instead of answering in a new turn."""
    return (isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant")


def render_chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list, tokenize: bool = True):
    """A chat prompt through the tokenizer's chat template, as TRL renders one: a final assistant turn (a prefill,
    `ends_with_prefill`) is left open for the model to continue (`continue_final_message=True`, no generation prompt);
    any other prompt ends with the generation prompt that opens the assistant's turn. Token ids, or the text with
    `tokenize=False`."""
    prefill = ends_with_prefill(messages)
    return tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=not prefill,
                                         continue_final_message=prefill, return_dict=False)


def with_completion(messages: list, completion: str) -> tuple[list, dict]:
    """(the prompt's turns before the answer, the answer as one assistant message) for a chat prompt and the text
    the model generated after it: a prefill's text leads the answer, which continues it (TRL's convention for the
    completions reward functions get); otherwise the answer is the generated text alone."""
    if ends_with_prefill(messages):
        prefill = messages[-1].get("content")
        return messages[:-1], {"role": "assistant", "content": (prefill if isinstance(prefill, str) else "") + completion}
    return messages, {"role": "assistant", "content": completion}


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when token ids mean the same thing in both tokenizers (then no decode/re-encode is needed)."""
    if a is b:
        return True
    # The pad id is not compared: pad positions are masked everywhere, so a pad chosen differently (see
    # `choose_pad_token`) does not change what any real token id means.
    return a.get_vocab() == b.get_vocab()


def load_policy_tokenizer(name_or_path: str, init_kwargs: dict | None) -> PreTrainedTokenizerBase:
    """The policy's tokenizer from its id/path; for an adapter saved without one, its base model's."""
    try:
        return load_tokenizer(name_or_path, "policy", init_kwargs)
    except (OSError, ValueError):  # an adapter folder without tokenizer files fails with either
        adapter = adapter_config(name_or_path, init_kwargs)
        if adapter is None or not adapter.get("base_model_name_or_path"):
            raise
        return load_tokenizer(adapter["base_model_name_or_path"], "policy (the adapter's base)", init_kwargs)


def load_reward_tokenizer(reward_model: PreTrainedModel) -> tuple[PreTrainedTokenizerBase | None, str]:
    """The tokenizer saved with a reward model object, found by its `name_or_path`: (tokenizer, "") or (None, why).

    A local folder or the HF cache first (offline-safe: no request); a Hub id not in the cache is downloaded unless
    HF_HUB_OFFLINE is set. Pinned to the commit the model was loaded from when the config recorded it.
    """
    from huggingface_hub import constants

    source = getattr(reward_model, "name_or_path", "") or ""
    if not source:
        return None, "the model has no name_or_path: it was built in memory"
    kwargs = {}
    if getattr(reward_model.config, "_commit_hash", None) and not os.path.isdir(source):
        kwargs["revision"] = reward_model.config._commit_hash
    attempts = [True] if os.path.isdir(source) or constants.HF_HUB_OFFLINE else [True, False]
    why = ""
    for local_only in attempts:
        try:
            return AutoTokenizer.from_pretrained(source, local_files_only=local_only, **kwargs), ""
        except Exception as err:  # noqa: BLE001 - any failure means "no tokenizer found there"; reported to the user
            why = f"{source!r}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    return None, why


def same_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the model and the tokenizer were loaded from the same id or folder (so they share a vocabulary)."""
    a, b = getattr(model, "name_or_path", "") or "", getattr(tokenizer, "name_or_path", "") or ""
    if not a or not b:
        return False
    return os.path.realpath(a) == os.path.realpath(b) if os.path.isdir(a) and os.path.isdir(b) else a == b


def with_scoring_pad(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer, or a copy with a pad token when it has none (EOS, SEP, UNK, BOS or CLS: any will do for
    scoring, since pad slots are masked and the score is read at the last real token or at [CLS])."""
    if tokenizer.pad_token_id is not None:
        return tokenizer
    for token in (tokenizer.eos_token, tokenizer.sep_token, tokenizer.unk_token, tokenizer.bos_token,
                  tokenizer.cls_token):
        if token is not None:
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.pad_token = token
            return tokenizer
    raise ValueError("The reward model's tokenizer has no pad token and no special token to pad with: set one of its "
                     "existing tokens as pad (reward_tokenizer.pad_token = <a token in its vocabulary>; pad slots are "
                     "masked when scoring) and pass it as reward_processing_class.")
