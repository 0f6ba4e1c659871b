"""Loading the policy, the frozen reference and reward models, and tokenizers: by Hub id, local path or object.

Everything goes through `from_pretrained`, so the HF cache, `revision`, `token` and offline mode work as usual.
This is the only module that touches bitsandbytes (lazily, through `BitsAndBytesConfig`). Frozen models are put in
`eval()` mode with `requires_grad=False`, are never handed to the optimizer, and are never `.to()`-moved once
quantized (they are loaded straight onto their device with `device_map`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
import re

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from . import gguf
from .adapters import adapter_config, prepare_adapters
from .estimators import ESTIMATORS
from .critic_store import saved_critic
from .modeling import (AutoModelForCausalLMWithValueHead, PolicyAndCritic, ValueModel, mark_scoring_context,
                       reject_seq2seq_checkpoint)
from .reporting import warn_user
from .rewards import (RewardSet, naming_reward, pools_itself, probe_reward_callable, reward_input_format, reward_name,
                      unique_names)
from .sharding import sharded_by_accelerate


def compute_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The dtype matmuls run in under the run's mixed-precision setting."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def quantization_config(kind: str, dtype: torch.dtype):
    """A `BitsAndBytesConfig` for '4bit' (NF4, double quantization) or '8bit'; None for 'none'."""
    if kind == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(f"Loading a model in {kind} needs bitsandbytes: `pip install bitsandbytes`, or set the "
                          "quantization to 'none'.") from err
    from transformers import BitsAndBytesConfig

    if kind == "4bit":
        # Under FSDP the 4-bit weights are stored in the compute dtype, so `fully_shard` can shard them (it shards
        # floating-point tensors only); the packed 4-bit values are the same.
        storage = dtype if sharded_by_accelerate() else torch.uint8
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=storage)
    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"Unknown quantization {kind!r}: choose '4bit', '8bit' or 'none'.")


def from_pretrained(auto_cls, name_or_path: str, role: str, *, missing_fix: str | None = None, **kwargs):
    """`auto_cls.from_pretrained` with one clear error naming the model's role, its id and the remedies.

    `missing_fix` (for a frozen model, which nothing will train): weights the checkpoint lacks, which transformers
    initialises at random and only logs, are an error instead, naming them and this fix.
    """
    if auto_cls is AutoModelForCausalLM:
        reject_seq2seq_checkpoint(name_or_path, kwargs, f"{role} {name_or_path!r}")
    try:
        loaded = auto_cls.from_pretrained(name_or_path, **kwargs, **({"output_loading_info": True} if missing_fix
                                                                     else {}))
    except OSError as err:
        raise OSError(
            f"Could not load the {role} {name_or_path!r}: {err}\n"
            f"Check the id or path (and `revision`), that you have access (log in with `hf auth login` or pass "
            f"`token`), and, offline (HF_HUB_OFFLINE=1), that the model is in the HF cache (download it once online)."
        ) from err
    if not missing_fix:
        return loaded
    model, info = loaded
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"The {role} {name_or_path!r} ({type(model).__name__}) lacks weights its class needs: "
                         f"{shown}. transformers initialised them at random, and a frozen model is never trained, "
                         f"so training would follow noise. {missing_fix}")
    return model


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


def check_vocab(model, tokenizer: PreTrainedTokenizerBase, role: str, fix: str) -> None:
    """Fail now, not with an IndexError mid-rollout, when `model` has fewer embedding rows than the token ids of
    `tokenizer`; `fix` says what to do for this model's role and the way it was given."""
    rows = model.get_input_embeddings().weight.shape[0]
    needed = tokenizer_size(tokenizer)
    if needed > rows:
        raise ValueError(f"The tokenizer produces token ids up to {needed - 1} ({len(tokenizer)} tokens) but the "
                         f"{role}'s embedding has only {rows} rows. {_added_pad_fix(tokenizer, rows, role)}{fix}")


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
# Ordinary text (ASCII, accents, CJK, emoji): a pad candidate must never come out of encoding it.
_PROBE_TEXT = (" ".join(chr(c) for c in range(33, 127)) + " Hello world, the quick brown fox. Héllo wörld ça "
               "日本語 中文 한국어 🙂\n\tend")


def choose_pad_token(
    tokenizer: PreTrainedTokenizerBase, model, stop_token_ids: list[int], model_given_as: str
) -> PreTrainedTokenizerBase:
    """The tokenizer the trainer uses: padding on the left, with a pad token that is not a stop token.

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
    tokenizer.padding_side = "left"  # generation appends on the right
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


def freeze(model: nn.Module) -> nn.Module:
    """eval() mode and no gradients: a frozen model is never trained and never reaches the optimizer."""
    model.eval()
    model.requires_grad_(False)
    return model


def keep_4bit_differentiable(model: nn.Module) -> None:
    """Keep every bitsandbytes 4-bit layer of `model` in its standard layout on the CPU.

    bitsandbytes (0.50) repacks a 4-bit weight for a faster CPU kernel the first time the layer runs in eval mode
    without gradients (a reward model scoring, an evaluation pass), and from then on computes the layer with that
    kernel in training too; the kernel has no backward, so torch drops the gradient flowing through the layer with
    only a warning. A QLoRA policy evaluated once, or a `reward_lora` critic on the scoring reward model's base,
    would then train only its last layers. No effect on a GPU, where the repacking never happens.
    """
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


# Attribute and config-field names that hold a dropout probability (`dropout`, `attention_dropout`, GPT-2's
# `resid_pdrop`, `summary_first_dropout`, OPT's `layerdrop`...).
_DROPOUT_FIELD = re.compile(r"dropout|pdrop|layerdrop", re.IGNORECASE)


def disable_dropout(model: nn.Module) -> None:
    """Turn off every kind of dropout in `model`: RL needs deterministic forwards (N+ paper), so that step-0 KL is
    exactly 0 and the first PPO ratio exactly 1.

    Dropout comes in three forms, all handled by name and type rather than per architecture: `nn.Dropout` modules
    (LoRA dropout included) get p=0; float attributes that modules pass to `F.dropout` (OPT's `self.dropout`,
    attention modules' `attention_dropout`) are set to 0; and the same fields of every config the modules hold
    (text, vision and audio sub-configs included) are set to 0, for code that reads the config at forward time.
    """
    configs = {}
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        _zero_dropout_fields(module)
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs[id(config)] = config
    stack = list(configs.values())
    while stack:
        config = stack.pop()
        _zero_dropout_fields(config)
        stack.extend(v for v in vars(config).values() if isinstance(v, PretrainedConfig))


def _zero_dropout_fields(obj) -> None:
    for name, value in vars(obj).items():
        if (_DROPOUT_FIELD.search(name) and isinstance(value, (int, float)) and not isinstance(value, bool)
                and value != 0):
            setattr(obj, name, 0.0)


def _is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def _quantization_of(model: nn.Module) -> str:
    model = getattr(model, "pretrained_model", model)
    return ("4bit" if getattr(model, "is_loaded_in_4bit", False) else "8bit" if getattr(model, "is_loaded_in_8bit", False)
            else "none")


def language_model_lora_config(model: nn.Module, peft_config):
    """`peft_config` with `target_modules="all-linear"` limited to the language model of a multimodal model.

    peft's "all-linear" takes every linear layer but the output head, vision and audio towers included, where LoRA
    only costs memory (the policy never sees an image here). For a model whose config has sub-models (e.g.
    Gemma3ForConditionalGeneration), it is resolved to a pattern matching the linear layers inside the language model
    (`get_decoder()`). Explicit `target_modules` are left as given, so naming tower layers still adapts them.
    A copy is returned; the user's config is not modified.
    """
    target = getattr(peft_config, "target_modules", None)
    if not (isinstance(target, str) and target.lower() == "all-linear"):
        return peft_config
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if text_config is config or decoder is None:
        return peft_config
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in decoder.named_modules()
                     if isinstance(module, nn.Linear)})
    peft_config = copy.deepcopy(peft_config)
    peft_config.target_modules = rf"{re.escape(prefix)}\..*\.({'|'.join(map(re.escape, leaves))})"
    return peft_config


def _init_kwargs(init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device) -> dict:
    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("trust_remote_code", False)
    qconfig = quantization_config(quantization, dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        kwargs.setdefault("dtype", dtype)
        kwargs["device_map"] = {"": device}
    return kwargs


def load_policy(
    model, init_kwargs: dict | None, quantization: str, peft_config, dtype: torch.dtype, device,
    gradient_checkpointing: bool = False,
) -> AutoModelForCausalLMWithValueHead:
    """The trainable policy with its value head.

    `model`: id/path, a `PreTrainedModel`, a `PeftModel` or an `AutoModelForCausalLMWithValueHead`. With
    `peft_config`, LoRA adapters are added; a quantized base is prepared with `prepare_model_for_kbit_training`
    (QLoRA: adapters trainable, base frozen).
    """
    wrapper = None
    if isinstance(model, AutoModelForCausalLMWithValueHead):
        wrapper, model = model, model.pretrained_model
    if not isinstance(model, str) and quantization != "none" and _quantization_of(model) != quantization:
        raise ValueError(
            f"policy_quantization={quantization!r} applies only when `model` is a Hub id or path (the trainer loads "
            "it); the policy was passed as a model object. Pass the id/path instead, or quantize it yourself "
            "(`AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`) "
            "and set policy_quantization='none'.")
    if isinstance(model, str) and (adapter := adapter_config(model, init_kwargs)) is not None:
        return AutoModelForCausalLMWithValueHead(_load_adapter_policy(
            model, adapter, init_kwargs, quantization, peft_config, dtype, device, gradient_checkpointing))
    if isinstance(model, str):
        if quantization != "none" and peft_config is None:
            raise ValueError(f"policy_quantization={quantization!r} needs `peft_config` (a quantized base can only "
                             "train adapters: QLoRA). Pass peft_config=LoraConfig(...) or set policy_quantization='none'.")
        model = from_pretrained(AutoModelForCausalLM, model, "policy", **_init_kwargs(init_kwargs, quantization, dtype, device))
    if peft_config is not None:
        from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

        if isinstance(model, PeftModel):
            raise ValueError("The policy is already a PeftModel: pass peft_config=None to train its adapter, or pass "
                             "the base model with peft_config.")
        if _is_quantized(model):
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
        model = get_peft_model(model, language_model_lora_config(model, peft_config))
    if wrapper is None:
        wrapper = AutoModelForCausalLMWithValueHead(model)
    else:
        wrapper.pretrained_model = model
    return wrapper


def _load_adapter_policy(name_or_path: str, adapter: dict, init_kwargs: dict | None, quantization: str, peft_config,
                         dtype: torch.dtype, device, gradient_checkpointing: bool):
    """An adapter folder or Hub adapter repo as the policy: its base loaded once (quantized under QLoRA, prepared for
    k-bit training), the adapter loaded trainable as "default" (the trainer adds its frozen reference copy)."""
    from peft import PeftModel, prepare_model_for_kbit_training

    if peft_config is not None:
        raise ValueError(
            f"model={name_or_path!r} is a LoRA adapter: PPO continues training it (a frozen copy is the reference), "
            "with its own LoRA config. Pass peft_config=None, or to train a fresh adapter on top of it, merge it "
            "first (PeftModel.from_pretrained(base, adapter).merge_and_unload(), save it) and pass the merged model "
            "with peft_config.")
    base_name = adapter.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(f"The adapter {name_or_path!r} does not name its base model (base_model_name_or_path in "
                         "adapter_config.json): set it, or load the PeftModel yourself and pass it as `model`.")
    base_kwargs = {k: v for k, v in (init_kwargs or {}).items() if k != "revision"}  # the revision is the adapter's
    if adapter.get("revision"):
        base_kwargs["revision"] = adapter["revision"]
    base = from_pretrained(AutoModelForCausalLM, base_name, "policy's base model (named by the adapter)",
                           **_init_kwargs(base_kwargs, quantization, dtype, device))
    if _is_quantized(base):
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=gradient_checkpointing)
    adapter_kwargs = {k: v for k, v in (init_kwargs or {}).items() if k in ("revision", "token", "cache_dir")}
    return PeftModel.from_pretrained(base, name_or_path, is_trainable=True, **adapter_kwargs)


def without_critic(policy: AutoModelForCausalLMWithValueHead, estimator: str,
                   given_with_head: bool = False) -> PolicyAndCritic:
    """The policy alone, for a critic-free advantage estimator: `PolicyAndCritic(causal LM, None)`, so no value
    head is in memory, in the optimizer or in a checkpoint. A model the user passed with a value head
    (`given_with_head`) keeps its causal LM (and adapter); its head is dropped with a warning."""
    if given_with_head:
        warn_user(f"advantage_estimator={estimator!r} uses no critic: the value head of the "
                  "AutoModelForCausalLMWithValueHead you passed is not used or trained (its causal LM is the "
                  "policy). Pass the causal LM itself to silence this, or use advantage_estimator='gae'.")
    return PolicyAndCritic(policy.policy_model, None)


def load_reference(
    ref_model, policy_source, init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device, uses_peft: bool
) -> nn.Module | None:
    """The frozen reference policy. None means "inside the policy" (only with LoRA): its adapter disabled, or a
    reference adapter beside the trained one (see `adapters.prepare_adapters`).

    Without LoRA and without `ref_model`, the reference is a second copy of the starting policy, in the policy's
    own precision (so step-0 KL is exactly 0): loaded again from the same id/path or deep-copied from the model
    object. `quantization` applies to a reference given by id/path.
    """
    if ref_model is None and uses_peft:
        return None
    if ref_model is None:
        ref_model, quantization = policy_source, "none"
    if isinstance(ref_model, AutoModelForCausalLMWithValueHead):
        ref_model = ref_model.pretrained_model
    if isinstance(ref_model, str):
        ref_model = from_pretrained(AutoModelForCausalLM, ref_model, "reference model",
                                    missing_fix="Pass the checkpoint the policy starts from as ref_model (or "
                                    "ref_model=None for a frozen copy of the policy).",
                                    **_init_kwargs(init_kwargs, quantization, dtype, device))
    elif _shares_parameters(ref_model, policy_source):
        # The policy object or a part of it (e.g. the body of a value-head wrapper): freezing it would freeze the
        # policy and training would move the reference. A frozen copy of the starting policy instead.
        ref_model = copy.deepcopy(ref_model)
    if not _is_quantized(ref_model):
        ref_model = ref_model.to(device)
    return freeze(ref_model)


def _shares_parameters(model: nn.Module, other) -> bool:
    """True when `model` and the module `other` hold a parameter in common (one is, or contains, the other)."""
    if not isinstance(other, nn.Module):
        return False
    ids = {id(p) for p in other.parameters()}
    return any(id(p) in ids for p in model.parameters())



# A checkpoint without a trained score head (a causal LM, a base encoder) is not a reward model.
REWARD_HEAD_FIX = ("If a score head (`score` / `classifier`) is missing, this checkpoint is no reward model (a causal LM "
                   "or a base encoder, say): train one first (e.g. trl's RewardTrainer with num_labels=1 on preference "
                   "pairs) and pass that, or pass a reward function (prompts, completions) -> list[float].")


def load_reward_model(
    reward_model, init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device
):
    """The frozen reward model (a sequence classifier with one label), or a reward callable passed through."""
    if callable(reward_model) and not isinstance(reward_model, nn.Module):
        return reward_model
    if isinstance(reward_model, str):
        reward_model = from_pretrained(AutoModelForSequenceClassification, reward_model, "reward model",
                                       missing_fix=REWARD_HEAD_FIX, **_init_kwargs(init_kwargs, quantization, dtype,
                                                                                   device))
    if not isinstance(reward_model, PreTrainedModel):
        raise TypeError("reward_model must be a Hub id or path, an AutoModelForSequenceClassification, or a callable "
                        f"(prompts, completions) -> list[float]; got {type(reward_model).__name__}.")
    num_labels = getattr(reward_model.config, "num_labels", None)
    if num_labels != 1:
        raise ValueError(f"The reward model has num_labels={num_labels}; PPO needs one scalar score per response. "
                         "Use a reward model trained with num_labels=1 (e.g. trl's RewardTrainer).")
    if not _is_quantized(reward_model):
        reward_model = reward_model.to(device)
    return freeze(reward_model)


def load_rewards(reward_model, reward_processing_class, args, dtype: torch.dtype, device):
    """(reward(s), reward tokenizer(s)): `load_reward_model` on one reward or on each of a list, with the tokenizer
    of each one given by id/path loaded beside it. For a list, `reward_processing_class` is None or a list with one
    entry (a tokenizer or None) per reward, and an error names the reward it concerns."""
    if not isinstance(reward_model, (list, tuple)):
        reward = load_reward_model(reward_model, args.reward_model_init_kwargs, args.reward_quantization, dtype, device)
        if isinstance(reward_model, str) and reward_processing_class is None:
            reward_processing_class = load_tokenizer(reward_model, "reward model", args.reward_model_init_kwargs)
        return reward, reward_processing_class
    if not reward_model:
        raise ValueError("reward_model is an empty list: give at least one reward model, id or callable.")
    classes = reward_processing_class if reward_processing_class is not None else [None] * len(reward_model)
    if not isinstance(classes, (list, tuple)) or len(classes) != len(reward_model):
        raise ValueError(f"reward_model is a list of {len(reward_model)} rewards: reward_processing_class must be None "
                         "or a list with one entry per reward (its tokenizer, or None), in the same order.")
    rewards, tokenizers = [], []
    for i, (given, tokenizer) in enumerate(zip(reward_model, classes)):
        with naming_reward(reward_name(given), i):
            if isinstance(given, (list, tuple)):
                raise TypeError("a list inside the reward_model list: give one flat list of rewards.")
            reward, tokenizer = load_rewards(given, tokenizer, args, dtype, device)
        rewards.append(reward)
        tokenizers.append(tokenizer)
    return rewards, tokenizers


def reward_set(loaded: "LoadedModels", given, tokenizer, args, chat: set[bool], train_dataset) -> RewardSet:
    """The run's `RewardSet`: each reward's tokenizer and input format resolved and checked as for a single reward
    (`reward_tokenizer`), each callable probed (`probe_reward_callable`), names for the logs, and `reward_weights`
    checked against the number of rewards. `given`: the trainer's `reward_model` argument (a list or one reward)."""
    is_list = isinstance(given, (list, tuple))
    rewards = loaded.reward_model if is_list else [loaded.reward_model]
    classes = loaded.reward_processing_class if is_list else [loaded.reward_processing_class]
    names = unique_names([reward_name(r) for r in (given if is_list else [given])])
    return _reward_set(rewards, classes, names, is_list, tokenizer, args, chat, train_dataset, args.reward_weights,
                       args.normalize_each_reward)


def judge_set(given, tokenizer, args, chat: set[bool], train_dataset) -> RewardSet | None:
    """The evaluation-only rewards (the trainer's `eval_reward_model`: one or a list, in the forms of
    `reward_model`), loaded and checked as the training rewards are, scored each on its own (weights 1.0, never
    normalised); None when none is given."""
    if given is None:
        return None
    given = list(given) if isinstance(given, (list, tuple)) else [given]
    if not given:
        raise ValueError("eval_reward_model is an empty list: give a judge (id, path, model or callable) or None.")
    judges, classes = load_rewards(given, None, args, compute_dtype(args.bf16, args.fp16), args.device)
    names = unique_names([reward_name(r) for r in given])
    return _reward_set(judges, classes, names, True, tokenizer, args, chat, train_dataset, None, False)


def _reward_set(rewards, classes, names, is_list, tokenizer, args, chat, train_dataset, weights,
                normalize_each) -> RewardSet:
    weights = weights if weights is not None else [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise ValueError(f"reward_weights has {len(weights)} weights but there {'are' if len(rewards) > 1 else 'is'} "
                         f"{len(rewards)} reward{'s' if len(rewards) > 1 else ''} ({', '.join(names)}): give one weight "
                         "per reward, in the order of reward_model, or reward_weights=None for all 1.0.")
    # A forced format is meant for the list's models: its callables always read text.
    any_model = any(isinstance(r, PreTrainedModel) for r in rewards)
    tokenizers = []
    for i, (reward, processing_class, name) in enumerate(zip(rewards, classes, names)):
        callable_in_list = is_list and any_model and not isinstance(reward, PreTrainedModel)
        input_format = "auto" if callable_in_list else args.reward_input_format
        with naming_reward(name if is_list else None, i):
            tokenizers.append(reward_tokenizer(reward, tokenizer, processing_class, input_format, chat))
            probe_reward_callable(reward, train_dataset, tokenizer)
    return RewardSet(rewards, tokenizers, names, [float(w) for w in weights], input_format=args.reward_input_format,
                     normalize_each=normalize_each, is_list=is_list)


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


def reward_tokenizer(reward_model, tokenizer, reward_processing_class, input_format: str, chat: set[bool]):
    """None when the reward model reads the policy's token ids as they are (the 'concat' fast path); else the
    tokenizer the reward model reads decoded text with (its own; a pad chosen for scoring when it has none).

    A reward model object without `reward_processing_class` gets its tokenizer from its own name or path (a local
    folder or the HF cache); when that fails, only a model that comes from the policy tokenizer's own checkpoint may
    read the policy's ids: anything else is an error asking for `reward_processing_class`. `chat`: whether the
    prompts are chat messages (one value per dataset); forced formats that cannot apply fail here.
    """
    if not isinstance(reward_model, PreTrainedModel):
        if input_format != "auto":
            raise ValueError(f"reward_input_format={input_format!r} applies to reward models; a reward callable always "
                             "receives (prompts, completions) as text. Leave reward_input_format='auto'.")
        return None
    if reward_processing_class is None:
        reward_processing_class, why = load_reward_tokenizer(reward_model)
        if reward_processing_class is None:
            vocab = reward_model.get_input_embeddings().num_embeddings
            if not same_checkpoint(reward_model, tokenizer) or len(tokenizer) > vocab:
                raise ValueError(
                    f"The reward model was given as an object without its tokenizer, and its tokenizer could not be "
                    f"loaded from its name or path ({why}); nothing shows that it reads the policy tokenizer's ids "
                    f"(embedding of {vocab} tokens, policy tokenizer of {len(tokenizer)}). Pass "
                    "reward_processing_class=<the reward model's tokenizer>, or pass reward_model as its Hub id or path.")
            reward_processing_class = tokenizer
    chosen = with_scoring_pad(reward_processing_class)
    vocab = reward_model.get_input_embeddings().num_embeddings
    if len(chosen) > vocab:  # ids past the embedding would fail mid-rollout with a bare IndexError
        raise ValueError(f"The reward tokenizer has {len(chosen)} tokens but the reward model's embedding has {vocab}: "
                         "pass the tokenizer the reward model was trained with as reward_processing_class.")
    formats = {reward_input_format(input_format, reward_model, chosen, c) for c in chat}
    if formats == {"concat"} and same_tokenizer(tokenizer, chosen):
        return None
    return chosen


# ---- the critic (PPOConfig.critic; see README "Choosing a critic") ----------------------------------------------
# LoRA of a 'reward_lora' critic when the policy is fully fine-tuned (no peft_config).
DEFAULT_CRITIC_LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


def critic_lora_config(peft_config):
    """The critic's LoRA config: the policy's LoRA settings (a copy) on a base model, with no task head; without a
    policy peft_config, `DEFAULT_CRITIC_LORA`."""
    from peft import LoraConfig

    if peft_config is None:
        return LoraConfig(**DEFAULT_CRITIC_LORA)
    config = copy.deepcopy(peft_config)
    config.task_type = None  # the critic's body is a base model: no causal-LM head, no generation
    config.base_model_name_or_path = None  # set by peft to the critic's own base
    config.modules_to_save = None  # the value head is the critic's only trained non-LoRA part
    if isinstance(config.target_modules, (set, list, tuple)):
        # Names peft resolved on the policy ('model.layers.0.self_attn.q_proj') as layer names, for any backbone.
        config.target_modules = {name.rsplit(".", 1)[-1] for name in config.target_modules}
    return config


def dequantized_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight in full precision (fp32), dequantized when bitsandbytes quantized it."""
    weight = linear.weight
    if getattr(weight, "quant_state", None) is not None:  # bitsandbytes 4-bit
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if getattr(weight, "SCB", None) is not None:  # bitsandbytes 8-bit: int8 rows with one scale each
        return weight.data.float() * weight.SCB.float().unsqueeze(1) / 127
    return weight.detach().float()


def _backbone_and_score(model: nn.Module, role: str, fix: str) -> tuple[nn.Module, torch.Tensor | None, int]:
    """The causal backbone of a decoder sequence classifier or causal LM, for a one-label reward model its score
    weight (1, width) to start the value head from (None: the head starts at zero), and the width of the backbone's
    last hidden state: what the score head (or the LM head) reads, not always hidden_size (OPT-350m projects)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"The {role} must be a transformers model (or a Hub id / path); got {type(model).__name__}. "
                        f"{fix}")
    backbone = getattr(model, model.base_model_prefix, None)
    score = getattr(model, "score", None)
    decoder_classifier = isinstance(score, nn.Module) and not pools_itself(model)
    causal_lm = model.get_output_embeddings() is not None and not model.config.is_encoder_decoder
    if not isinstance(backbone, PreTrainedModel) or not (decoder_classifier or causal_lm):
        raise ValueError(f"The {role} ({type(model).__name__}) is not a decoder sequence classifier or causal LM: a "
                         "critic needs a causal backbone (an encoder's value at a token would see the tokens after "
                         f"it). {fix}")
    head = dequantized_weight(score) if decoder_classifier and score.weight.shape[0] == 1 else None
    reader = score if decoder_classifier else model.get_output_embeddings()
    return backbone, head, reader.in_features


CRITIC_VOCAB_FIX = ("The critic reads the policy's token ids, so it needs the policy's vocabulary: pass critic_model=<a "
                    "checkpoint with the policy's tokenizer, e.g. the policy's own id or path>, or use "
                    "critic='shared'.")


def _critic_tokenizer(source, given: PreTrainedTokenizerBase | None, init_kwargs: dict | None):
    """The tokenizer that belongs to the critic's source: `given`, else loaded from the id/path or from a model
    object's name_or_path; None when none can be found."""
    if given is not None:
        return given
    if isinstance(source, str):
        try:
            return load_tokenizer(source, "critic", init_kwargs)
        except (OSError, ValueError):
            return None
    return load_reward_tokenizer(source)[0]


def _reads_policy_ids(tokenizer, critic_tokenizer) -> bool:
    """Every token of the critic's tokenizer has the policy's id, and the policy's only other tokens are special tokens
    added to it (a [PAD] the user added in a spare row): then every id means the same to both."""
    policy, critic = tokenizer.get_vocab(), critic_tokenizer.get_vocab()
    if any(policy.get(token) != i for token, i in critic.items()):
        return False
    return set(policy) - set(critic) <= set(tokenizer.all_special_tokens)


def _check_critic_vocab(tokenizer, critic_tokenizer, source, role: str, fix: str) -> None:
    """The critic must read the policy's ids as they are: its tokenizer must give them the policy's meaning (or, when
    it has no findable tokenizer, it must come from the policy tokenizer's own checkpoint). (`check_vocab` then checks
    that its embedding has a row for each id.)"""
    if critic_tokenizer is not None:
        if _reads_policy_ids(tokenizer, critic_tokenizer):
            return
        why = "its tokenizer's vocabulary differs from the policy's"
    elif isinstance(source, PreTrainedModel) and same_checkpoint(source, tokenizer):
        return
    elif isinstance(source, str) and source == getattr(tokenizer, "name_or_path", None):
        return
    else:
        why = "its tokenizer could not be found, so nothing shows it reads the policy's token ids"
    raise ValueError(f"The critic would start from the {role}, but {why}. {fix}")


def trl_inputs(model, reward_model, value_model, critic_model, args) -> tuple:
    """(model, reward_model, critic_model) from the trainer's arguments and TRL 1.12's names for them:
    `args.sft_model_path` / `args.reward_model_path` stand in for a model or reward model not given (an argument
    given too must name the same checkpoint), and `value_model=` is a 'separate' critic (`trl_value_model`)."""
    model = _config_path(model, args.sft_model_path, "model", "sft_model_path")
    reward_model = _config_path(reward_model, args.reward_model_path, "reward_model", "reward_model_path")
    if model is None:
        raise ValueError("PPOLMTrainer needs a policy: pass model=<Hub id / path / model object>, or set "
                         "PPOConfig(sft_model_path=<Hub id / path>) (TRL's name).")
    return model, reward_model, trl_value_model(value_model, critic_model, args)


def _config_path(given, path: str | None, argument: str, field_name: str):
    """`given`, or `path` when nothing is given; an error when both are given and name different checkpoints (an
    object is compared by the id/path it was loaded from, its config's `name_or_path`)."""
    if path is None or given is None:
        return path if given is None else given
    name = given if isinstance(given, str) else getattr(getattr(given, "config", None), "name_or_path", None)
    if isinstance(name, str) and _same_checkpoint_name(name, path):
        return given
    what = repr(given) if isinstance(given, str) else (f"a {type(given).__name__} loaded from {name!r}" if name
                                                       else f"a {type(given).__name__}")
    raise ValueError(f"{argument}= is {what}, but PPOConfig.{field_name}={path!r} names another checkpoint: give the "
                     f"model in one place (drop {field_name}, or drop the {argument} argument).")


def _same_checkpoint_name(a: str, b: str) -> bool:
    """True when two ids/paths name one checkpoint: equal ids, or local paths to the same folder."""
    def norm(p):
        expanded = os.path.expanduser(p)
        return os.path.realpath(expanded) if os.path.exists(expanded) else p.rstrip("/")
    return norm(a) == norm(b)


def trl_value_model(value_model, critic_model, args):
    """TRL 1.12's `PPOTrainer(value_model=...)`, a critic model of its own: hf_ppo's `critic="separate"` started from
    `critic_model`. Returns the critic model to use; with `critic="shared"` (the default) `args.critic` becomes
    "separate", which is what TRL's argument meant."""
    if value_model is None:
        return critic_model
    if critic_model is not None:
        raise ValueError("Both value_model (TRL's name) and critic_model give the critic model: pass one of them.")
    if not ESTIMATORS[args.advantage_estimator].needs_critic:
        raise ValueError(f"value_model is given, but advantage_estimator={args.advantage_estimator!r} uses no critic: "
                         "drop value_model, or use advantage_estimator='gae'.")
    if args.critic == "reward_lora":
        raise ValueError("value_model (TRL's separate critic) is given with critic='reward_lora', which puts the "
                         "critic's adapter on the reward model: drop value_model, or set critic='separate'.")
    args.critic = "separate"
    return value_model


def critic_reward(kind: str, reward_model, reward, reward_processing_class, critic_model) -> tuple:
    """(source, loaded model, tokenizer) of the reward model a critic starts from or sits on. With mixed rewards
    (a list) that is the list's one reward model; several (or none) leave the choice to the user, by error."""
    if not isinstance(reward, list) or kind == "shared" or (kind == "separate" and critic_model is not None):
        return reward_model, reward, reward_processing_class
    models = [i for i, r in enumerate(reward) if isinstance(r, nn.Module)]
    if len(models) != 1:
        raise ValueError(f"critic={kind!r} starts from the reward model, but the reward_model list holds "
                         f"{len(models)} models. Use critic='separate' with critic_model=<id / path / model>, or "
                         "critic='shared'.")
    i = models[0]
    return reward_model[i], reward[i], reward_processing_class[i]


def load_critic(kind: str, critic_model, reward_source, reward, reward_processing_class, tokenizer, policy,
                peft_config, args, dtype: torch.dtype, device) -> ValueModel | None:
    """The critic `PPOConfig.critic` asks for: None for 'shared' (the value head on the policy), else a `ValueModel`.

    'separate': its own copy of a causal backbone + value head. Started from `critic_model` (id / path / model
    object) when given, else from the reward model (the N+ paper's initialisation; its score head becomes the value
    head): loaded again by id/path, or deep-copied when given as an unquantized object. A reward function has no
    model to start from: then `critic_model` is required. LoRA (the policy's LoRA settings, its own adapter) when
    the trainer got a peft_config, else full fine-tuning; `critic_quantization` ('4bit'/'8bit' need LoRA) and
    `critic_model_init_kwargs` (default: the reward model's) apply to an id/path.
    'reward_lora': a LoRA adapter + value head on the reward model's already-loaded frozen base (no second base in
    memory); the head starts as the reward's score head, and the reward scores with the adapter disabled.
    The critic reads the policy's token ids, so a critic source with another vocabulary is an error here.
    """
    if kind == "shared":
        if critic_model is not None:
            raise ValueError("critic_model is given but PPOConfig.critic='shared' (the value head on the policy): set "
                             "critic='separate' to train a critic started from critic_model, or drop critic_model.")
        return None
    from peft import get_peft_model, prepare_model_for_kbit_training

    if kind == "reward_lora":
        fix = "Use critic='separate' (with critic_model=<id/path>) or critic='shared'."
        if critic_model is not None:
            raise ValueError("critic_model applies to critic='separate'; critic='reward_lora' puts its adapter on the "
                             "reward model itself. Drop critic_model, or set critic='separate'.")
        if not isinstance(reward, PreTrainedModel):
            raise ValueError("critic='reward_lora' puts the critic on the reward model's base, but the reward is a "
                             f"function. {fix}")
        backbone, head, width = _backbone_and_score(reward, "reward model", fix)
        _check_critic_vocab(tokenizer, _critic_tokenizer(reward, reward_processing_class, None), reward,
                            "reward model", "critic='reward_lora' needs a reward model with the policy's tokenizer. "
                            + fix)
        check_vocab(reward, tokenizer, "reward model (the critic's base)", fix)
        # No prepare_model_for_kbit_training: it would recast the reward model's norms and change its scores.
        backbone = get_peft_model(backbone, critic_lora_config(peft_config), adapter_name="critic")
        mark_scoring_context(reward, backbone.disable_adapter)
        return ValueModel(backbone, head, quantization_method=getattr(reward, "quantization_method", None),
                          width=width, kind="reward_lora", source=_source_name(reward_source))

    # critic == "separate"
    init_kwargs = args.critic_model_init_kwargs
    source, given_tokenizer = critic_model, None
    if critic_model is None:
        if not isinstance(reward, nn.Module):
            raise ValueError(
                "critic='separate' starts the critic from the reward model, but the reward is a function. Pass "
                "critic_model=<id / path / model to start the critic from; the policy's own checkpoint works>, or "
                "use critic='shared'.")
        source, given_tokenizer = (reward_source if isinstance(reward_source, str) else reward), reward_processing_class
        if isinstance(source, str) and init_kwargs is None:
            init_kwargs = args.reward_model_init_kwargs
    if args.critic_quantization != "none" and peft_config is None:
        raise ValueError(f"critic_quantization={args.critic_quantization!r} needs LoRA (a quantized base trains only "
                         "adapters): pass peft_config=LoraConfig(...), or set critic_quantization='none'.")
    if isinstance(source, str):
        model = from_pretrained(AutoModelForSequenceClassification, source, "critic model",
                                **_init_kwargs(init_kwargs, args.critic_quantization, dtype, device))
        if not _is_quantized(model):  # a quantized one is loaded onto `device`; Trainer may not move the critic
            model = model.to(device)
    else:
        where = "critic_model" if critic_model is not None else "the reward model"
        if args.critic_quantization != "none" or _is_quantized(source):
            raise ValueError(f"{where} is a model object: a critic can be quantized only when loaded by id/path (a "
                             "quantized object cannot be copied). Pass critic_model=<its Hub id or path> with "
                             "critic_quantization, or an unquantized object with critic_quantization='none'.")
        shared = critic_model is None or _shares_parameters(source, policy) or _shares_parameters(source, reward)
        model = (copy.deepcopy(source) if shared else source).to(device)
    _check_critic_vocab(tokenizer, _critic_tokenizer(source, given_tokenizer, init_kwargs), source,
                        "critic model" if critic_model is not None else "reward model", CRITIC_VOCAB_FIX)
    check_vocab(model, tokenizer, "critic model", CRITIC_VOCAB_FIX)
    backbone, head, width = _backbone_and_score(model, "critic model", CRITIC_VOCAB_FIX)
    if peft_config is not None:
        if _is_quantized(model):
            backbone = prepare_model_for_kbit_training(backbone,
                                                       use_gradient_checkpointing=args.gradient_checkpointing)
        backbone = get_peft_model(backbone, critic_lora_config(peft_config), adapter_name="critic")
    else:
        backbone.requires_grad_(True)  # full fine-tuning (a copy of the frozen reward model starts frozen)
    return ValueModel(backbone, head, quantization_method=getattr(model, "quantization_method", None), width=width,
                      source=_source_name(source))


def _source_name(source) -> str | None:
    """The id or path a critic's base came from (what `save_critic` records), None for a model object."""
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else None


POLICY_VOCAB_FIX = ("If you added tokens to the tokenizer (a [PAD], chat tokens), the policy needs rows for them: "
                     "`model.resize_token_embeddings(len(tokenizer))` and pass the model object; a pad token needs "
                     "none (the trainer picks an existing unused special token when the tokenizer has no pad). "
                     "Otherwise pass the tokenizer that belongs to the policy.")
REFERENCE_VOCAB_FIX = ("The reference scores the policy's token ids, so it must have the policy's vocabulary: pass "
                        "the policy's starting checkpoint as ref_model (or ref_model=None), resized like the policy "
                        "if you added tokens.")


def max_positions(config) -> int | None:
    """The model's context length (`max_position_embeddings` of its text config), or None when it has none."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "max_position_embeddings", None)


@dataclass
class LoadedModels:
    """Everything `load_models` builds: the policy + value head (or the policy alone for a critic-free
    estimator), the frozen models and the tokenizers."""

    policy: AutoModelForCausalLMWithValueHead | PolicyAndCritic  # the latter for critic='separate' / 'reward_lora'
    tokenizer: PreTrainedTokenizerBase  # the policy's, with a pad token that is no stop token
    ref_model: nn.Module | None  # None: the policy's reference adapter, or its adapter disabled
    reward_model: nn.Module  # or a reward callable; a list of them for mixed rewards
    reward_processing_class: PreTrainedTokenizerBase | None  # a list (one per reward) for mixed rewards
    stop_token_ids: list[int]
    trained_adapter: str | None
    ref_adapter: str | None


def load_models(model, processing_class, reward_model, ref_model, reward_processing_class, peft_config,
                args, device, critic_model=None) -> LoadedModels:
    """Load and check the policy, the reference, the reward model and the critic (`load_critic`) as `PPOLMTrainer`
    is given them.

    Each model that reads the policy's token ids is checked against the tokenizer here, not by an IndexError
    mid-rollout; the stop tokens are resolved, then a pad token that is none of them is chosen; dropout is turned off.
    """
    if reward_model is None:
        raise ValueError("PPOLMTrainer needs a reward_model: a Hub id or path, an AutoModelForSequenceClassification "
                         "(num_labels=1), a callable (prompts, completions) -> list[float], or a list of them.")
    dtype = compute_dtype(args.bf16, args.fp16)
    init_kwargs, ref_init_kwargs = args.model_init_kwargs, args.ref_model_init_kwargs
    if isinstance(model, str):  # a GGUF checkpoint loads from its converted folder (gguf.py)
        model, init_kwargs = gguf.converted(model, init_kwargs, "policy")
    if isinstance(ref_model, str):
        ref_model, ref_init_kwargs = gguf.converted(ref_model, ref_init_kwargs, "reference model")
    elif ref_init_kwargs and ref_init_kwargs.get("gguf_file"):  # the reference is a copy of the starting policy
        ref_init_kwargs = {k: v for k, v in ref_init_kwargs.items() if k != "gguf_file"}
    if processing_class is None:
        if not isinstance(model, str):
            raise ValueError("Pass processing_class=tokenizer when model is not a Hub id or path.")
        processing_class = load_policy_tokenizer(model, init_kwargs)
    policy = load_policy(model, init_kwargs, args.policy_quantization, peft_config, dtype, device,
                         args.gradient_checkpointing)
    if not ESTIMATORS[args.advantage_estimator].needs_critic:
        policy = without_critic(policy, args.advantage_estimator, given_with_head=isinstance(
            model, AutoModelForCausalLMWithValueHead))
    body = policy.policy_model
    check_vocab(body, processing_class, "policy", POLICY_VOCAB_FIX)
    stop_token_ids = resolve_stop_token_ids(args.stop_token_ids, args.stop_token_id, args.stop_token,
                                            processing_class, body)
    check_stop_token_ids(stop_token_ids, body, needs_stop=args.missing_eos_penalty is not None)
    tokenizer = choose_pad_token(processing_class, body, stop_token_ids, "id" if isinstance(model, str) else "object")
    for config in (body.config, getattr(body, "generation_config", None)):  # said once, by hf_ppo: Trainer need not
        if config is not None:                                               # align (and announce) it again
            config.pad_token_id = tokenizer.pad_token_id
    # The trained adapter and, with ref_model=None, the reference adapter beside it (continuing from an adapter).
    trained_adapter, ref_adapter = prepare_adapters(
        body, fresh=peft_config is not None, ref_model_given=ref_model is not None,
        model_adapter_name=args.model_adapter_name, ref_adapter_name=args.ref_adapter_name)
    ref = load_reference(ref_model, model, ref_init_kwargs, args.ref_quantization, dtype, device,
                         uses_peft=policy.is_peft_model)
    if ref is not None:
        check_vocab(ref, tokenizer, "reference model", REFERENCE_VOCAB_FIX)
    reward, reward_processing_class = load_rewards(reward_model, reward_processing_class, args, dtype, device)
    saved = saved_critic(critic_model, args.critic, args.critic_model_init_kwargs)  # rebuilt, then its state loaded
    critic_model = saved.build_from if saved is not None else critic_model
    critic = load_critic(args.critic, critic_model, *critic_reward(args.critic, reward_model, reward,
                                                                   reward_processing_class, critic_model),
                         tokenizer, body, peft_config, args, dtype, device)
    if critic is not None:  # the critic has a body of its own: the shared value head is not used
        if isinstance(model, AutoModelForCausalLMWithValueHead):
            warn_user(f"critic={args.critic!r}: the value head of the model passed is not used (the critic has "
                      "its own). Pass the causal LM alone, or use critic='shared' to train that head.")
        policy = PolicyAndCritic(body, critic)
    if saved is not None:
        policy.load_critic_state_dict(saved.state)
    models = [m for m in (policy, ref, *(reward if isinstance(reward, list) else [reward])) if isinstance(m, nn.Module)]
    for m in models:
        keep_4bit_differentiable(m)
        if args.disable_dropout:
            disable_dropout(m)
    return LoadedModels(policy, tokenizer, ref, reward, reward_processing_class, stop_token_ids, trained_adapter,
                        ref_adapter)
