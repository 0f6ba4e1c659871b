"""Loading the policy, the frozen reference and reward models, and tokenizers: by Hub id, local path or object.

Everything goes through `from_pretrained`, so the HF cache, `revision`, `token` and offline mode work as usual.
This is the only module that touches bitsandbytes (lazily, through `BitsAndBytesConfig`). Frozen models are put in
`eval()` mode with `requires_grad=False`, are never handed to the optimizer, and are never `.to()`-moved once
quantized (they are loaded straight onto their device with `device_map`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .modeling import AutoModelForCausalLMWithValueHead


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


_FLOAT_DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout")


def disable_dropout(model: nn.Module) -> None:
    """Set p=0 on every dropout module (LoRA dropout included): RL needs deterministic forwards (N+ paper)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # Llama-family attention (Llama, Qwen2, Mistral, ...) applies a float `attention_dropout` in training mode,
        # not an nn.Dropout module.
        for name in _FLOAT_DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


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


def load_reference(
    ref_model, policy_source, init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device, uses_peft: bool
) -> nn.Module | None:
    """The frozen reference policy. None means "the policy with its adapter disabled" (only with LoRA).

    Without LoRA and without `ref_model`, the reference is a second copy of the starting policy, in the policy's
    own precision (so step-0 KL is exactly 0): loaded again from the same id/path or deep-copied from the model
    object. `quantization` applies to a reference given by id/path.
    """
    if ref_model is None and uses_peft:
        if _has_trained_adapter(policy_source):
            raise ValueError(
                "The policy is a PeftModel whose adapter is already trained, so the base with the adapter disabled is "
                "not the starting policy and cannot be the reference. Pass ref_model=<the starting policy> (e.g. the "
                "merged SFT model's id), or merge the adapter into the base and train a fresh one with peft_config.")
        return None
    if ref_model is None:
        ref_model, quantization = policy_source, "none"
    if isinstance(ref_model, AutoModelForCausalLMWithValueHead):
        ref_model = ref_model.pretrained_model
    if isinstance(ref_model, str):
        ref_model = from_pretrained(AutoModelForCausalLM, ref_model, "reference model",
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


def _has_trained_adapter(model) -> bool:
    """True for a PeftModel (or a value-head wrapper of one) whose LoRA B matrices are not all zero."""
    model = getattr(model, "pretrained_model", model)
    if not hasattr(model, "peft_config"):
        return False
    return any(p.count_nonzero() > 0 for n, p in model.named_parameters() if "lora_B" in n)


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

