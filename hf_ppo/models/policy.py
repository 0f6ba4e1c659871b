"""Loading the trainable policy and the frozen reference: by Hub id, local path, model object, LoRA adapter or
value-head wrapper; QLoRA (a quantized base prepared for k-bit training, adapters trained); LoRA limited to the
language model of a multimodal model; the reference as the policy's disabled adapter, a reference adapter, or a frozen
copy."""

from __future__ import annotations

import copy
import re

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..runtime.warn import warn_user
from .actor_critic import PolicyAndCritic
from .adapters import adapter_config
from .pretrained import _init_kwargs, _is_quantized, _quantization_of, _shares_parameters, freeze, from_pretrained
from .value_head import AutoModelForCausalLMWithValueHead


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


def _starting_checkpoint(policy) -> str | None:
    """The id/path the policy was loaded from (the base of an adapter), or None when that is unknown."""
    if isinstance(policy, str):
        return policy
    body = getattr(policy, "pretrained_model", policy)
    peft_config = getattr(body, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        return next(iter(peft_config.values())).base_model_name_or_path
    return getattr(getattr(body, "config", None), "_name_or_path", None) or None


def _warn_if_precision_differs(ref_model: str, policy_source, policy: nn.Module | None, quantization: str) -> None:
    """Say so when `ref_model` is the very checkpoint the policy starts from but loads at another precision
    (`quantization`, the ref_quantization, against the policy's): the two then differ from the first step by the
    quantization alone, so the KL penalty starts at that gap instead of 0 and the penalty trains the policy towards
    the quantized model."""
    if policy is None:
        return
    starts = {str(c).rstrip("/") for c in (policy_source if isinstance(policy_source, str) else None,
                                           _starting_checkpoint(policy)) if c}
    if ref_model.rstrip("/") not in starts:
        return
    ours = _quantization_of(policy)
    if ours == quantization:
        return
    warn_user(f"ref_model={ref_model!r} is the checkpoint the policy starts from, but it loads in "
              f"{quantization!r} (ref_quantization) while the policy is {ours!r}: the two differ from the first step "
              "by the quantization alone, so the KL penalty starts at that gap instead of 0 and pulls the policy "
              f"towards the quantized copy. Set ref_quantization={ours!r}, or pass ref_model=None (a frozen copy of "
              "the starting policy in its own precision; with LoRA, the policy with its adapter disabled).")


def load_reference(
    ref_model, policy_source, init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device, uses_peft: bool,
    policy: nn.Module | None = None,
) -> nn.Module | None:
    """The frozen reference policy. None means "inside the policy" (only with LoRA): its adapter disabled, or a
    reference adapter beside the trained one (see `adapters.prepare_adapters`).

    Without LoRA and without `ref_model`, the reference is a second copy of the starting policy, in the policy's
    own precision (so step-0 KL is exactly 0): loaded again from the same id/path or deep-copied from the model
    object. `quantization` applies to a reference given by id/path; `policy` (the loaded policy) lets a reference of
    the policy's own checkpoint at another precision be said (`_warn_if_precision_differs`).
    """
    if ref_model is None and uses_peft:
        return None
    if ref_model is None:
        ref_model, quantization = policy_source, "none"
    if isinstance(ref_model, AutoModelForCausalLMWithValueHead):
        ref_model = ref_model.pretrained_model
    if isinstance(ref_model, str):
        _warn_if_precision_differs(ref_model, policy_source, policy, quantization)
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
