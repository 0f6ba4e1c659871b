"""Loading the policy, the frozen reference and reward models, and tokenizers: by Hub id, local path or object.

Everything goes through `from_pretrained`, so the HF cache, `revision`, `token` and offline mode work as usual.
This is the only module that touches bitsandbytes (lazily, through `BitsAndBytesConfig`). Frozen models are put in
`eval()` mode with `requires_grad=False`, are never handed to the optimizer, and are never `.to()`-moved once
quantized (they are loaded straight onto their device with `device_map`).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .adapters import adapter_config
from .modeling import AutoModelForCausalLMWithValueHead
from .rollout import reward_input_format


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
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8)
    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"Unknown quantization {kind!r}: choose '4bit', '8bit' or 'none'.")


def from_pretrained(auto_cls, name_or_path: str, role: str, **kwargs):
    """`auto_cls.from_pretrained` with one clear error naming the model's role, its id and the remedies."""
    try:
        return auto_cls.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise OSError(
            f"Could not load the {role} {name_or_path!r}: {err}\n"
            f"Check the id or path (and `revision`), that you have access (log in with `hf auth login` or pass "
            f"`token`), and, offline (HF_HUB_OFFLINE=1), that the model is in the HF cache (download it once online)."
        ) from err


def load_tokenizer(name_or_path: str, role: str, init_kwargs: dict | None = None) -> PreTrainedTokenizerBase:
    kwargs = {k: v for k, v in (init_kwargs or {}).items() if k in ("revision", "token", "trust_remote_code", "cache_dir")}
    return from_pretrained(AutoTokenizer, name_or_path, f"{role} tokenizer", **kwargs)


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Require a dedicated pad token and pad prompts on the left (generation appends on the right)."""
    fix = ("Add one: `tokenizer.add_special_tokens({'pad_token': '<pad>'})` and "
           "`model.resize_token_embeddings(len(tokenizer))`, or pick an unused special token as pad.")
    if tokenizer.pad_token_id is None:
        raise ValueError(f"The tokenizer has no pad token. {fix}")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            "The tokenizer's pad token is its EOS token: padding with EOS makes EOS unlearnable and undetectable in "
            f"responses (N+ paper). {fix}"
        )
    tokenizer.padding_side = "left"
    return tokenizer


def freeze(model: nn.Module) -> nn.Module:
    """eval() mode and no gradients: a frozen model is never trained and never reaches the optimizer."""
    model.eval()
    model.requires_grad_(False)
    return model


def disable_dropout(model: nn.Module) -> None:
    """Set p=0 on every dropout module (LoRA dropout included): RL needs deterministic forwards (N+ paper)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


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
    elif isinstance(model, str) and (adapter := adapter_config(model, init_kwargs)) is not None:
        return AutoModelForCausalLMWithValueHead(_load_adapter_policy(
            model, adapter, init_kwargs, quantization, peft_config, dtype, device, gradient_checkpointing))
    elif isinstance(model, str):
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
        model = get_peft_model(model, peft_config)
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
                                    **_init_kwargs(init_kwargs, quantization, dtype, device))
    elif ref_model is policy_source:
        ref_model = copy.deepcopy(ref_model)
    if not _is_quantized(ref_model):
        ref_model = ref_model.to(device)
    return freeze(ref_model)


def load_reward_model(
    reward_model, init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device
):
    """The frozen reward model (a sequence classifier with one label), or a reward callable passed through."""
    if callable(reward_model) and not isinstance(reward_model, nn.Module):
        return reward_model
    if isinstance(reward_model, str):
        reward_model = from_pretrained(AutoModelForSequenceClassification, reward_model, "reward model",
                                       **_init_kwargs(init_kwargs, quantization, dtype, device))
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


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when token ids mean the same thing in both tokenizers (then no decode/re-encode is needed)."""
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab() and a.pad_token_id == b.pad_token_id



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
