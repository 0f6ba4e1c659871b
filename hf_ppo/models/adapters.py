"""Named adapters on one base: the trained adapter, and a frozen reference adapter beside it.

Continuing from an SFT adapter (the usual path: SFT with LoRA, then PPO) loads the base once and holds the SFT
adapter twice: a frozen copy named `reference` gives the reference log-probs, and the trained adapter starts as an
exact copy of it, so step-0 KL is exactly 0 and no second base is in memory. TRL's `model_adapter_name` /
`ref_adapter_name` are the general case: any two adapters of one `PeftModel`. Saving writes the trained adapter
alone, as a plain adapter folder (`PeftModel.from_pretrained(base, folder)` loads it as "default").
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

from torch import nn

from ..runtime.warn import warn_user

REFERENCE_ADAPTER = "reference"


def adapter_config(name_or_path: str, init_kwargs: dict | None = None) -> dict | None:
    """The `adapter_config.json` of an adapter folder or Hub adapter repo; None when `name_or_path` is not one."""
    from transformers.utils import find_adapter_config_file

    kwargs = {k: v for k, v in (init_kwargs or {}).items() if k in ("revision", "token", "cache_dir")}
    try:
        path = find_adapter_config_file(name_or_path, **kwargs)
    except (OSError, ValueError):  # not a repo, no access, or offline without it: not an adapter we can load
        return None
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_parameters(peft_model: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters that belong to adapter `name` (PEFT names them `...<module>.<name>.weight`)."""
    return [p for n, p in peft_model.named_parameters() if f".{name}." in n]


def add_reference_copy(peft_model: nn.Module, source: str) -> str:
    """Add a frozen exact copy of adapter `source` under a new name (`reference` unless taken); return the name."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    name = REFERENCE_ADAPTER
    while name in peft_model.peft_config:
        name = f"{name}_"
    config = copy.deepcopy(peft_model.peft_config[source])
    config.inference_mode = True
    peft_model.add_adapter(name, config)
    result = set_peft_model_state_dict(peft_model, get_peft_model_state_dict(peft_model, adapter_name=source),
                                       adapter_name=name)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"Copying adapter {source!r} as the reference left keys unused: {result.unexpected_keys[:5]}")
    for param in adapter_parameters(peft_model, name):
        param.requires_grad_(False)
    return name


def prepare_adapters(policy: nn.Module, *, fresh: bool, ref_model_given: bool, model_adapter_name: str | None,
                     ref_adapter_name: str | None) -> tuple[str | None, str | None]:
    """Choose the trained adapter and the reference adapter of the policy; return (trained, reference) names.

    `policy`: the wrapped model (a `PeftModel` or not). `fresh`: the adapter was just created from `peft_config`
    (then the reference is the adapter disabled: None). A `PeftModel` passed in with `ref_model=None` and no
    `ref_adapter_name` continues from its adapter: a frozen copy becomes the reference. The trained adapter is made
    active and trainable (with a warning if it came frozen and the user did not ask to continue from it); every other
    adapter is frozen.
    """
    if not is_peft_model(policy) and getattr(policy, "peft_config", None):
        raise ValueError("The policy carries adapters loaded through transformers (from_pretrained of an adapter, or "
                         "model.load_adapter), which cannot serve as trained and reference adapters: pass the adapter "
                         "folder or id as `model`, or a PeftModel (PeftModel.from_pretrained(base, adapter)).")
    if not is_peft_model(policy):
        if model_adapter_name is not None or ref_adapter_name is not None:
            raise ValueError("model_adapter_name / ref_adapter_name select adapters of a PeftModel policy, but the "
                             "policy has no adapters: pass a PeftModel holding them, or leave both unset.")
        return None, None
    adapters = list(policy.peft_config)
    if fresh:
        if model_adapter_name not in (None, "default") or ref_adapter_name is not None:
            raise ValueError("With peft_config a fresh adapter named 'default' is trained and the reference is the "
                             "base (adapter disabled): leave model_adapter_name / ref_adapter_name unset, or pass a "
                             "PeftModel that holds the named adapters and peft_config=None.")
        return "default", None
    trained = model_adapter_name if model_adapter_name is not None else policy.active_adapter
    for role, name in (("model_adapter_name", trained), ("ref_adapter_name", ref_adapter_name)):
        if name is not None and name not in adapters:
            raise ValueError(f"{role}={name!r} is not an adapter of the policy; it has {adapters}.")
    if ref_adapter_name is not None and ref_model_given:
        raise ValueError("Both ref_model and ref_adapter_name give a reference: pass one of them.")
    was_frozen = not any(p.requires_grad for p in adapter_parameters(policy, trained))
    policy.set_adapter(trained)  # active and trainable; PEFT freezes the other adapters
    reference = ref_adapter_name
    if reference is None and not ref_model_given:
        reference = add_reference_copy(policy, trained)
    elif was_frozen:
        warn_user(f"The policy's adapter {trained!r} was frozen (loaded for inference, e.g. PeftModel."
                  "from_pretrained without is_trainable=True); it is made trainable, so PPO trains it and not only "
                  "the value head.")
    if reference is not None:
        for param in adapter_parameters(policy, reference):
            param.requires_grad_(False)
    for param in adapter_parameters(policy, trained):  # set_adapter alone leaves them frozen before peft 0.21
        param.requires_grad_(True)
    return trained, reference


@contextlib.contextmanager
def adapter_active(peft_model: nn.Module, name: str):
    """Run `peft_model` with adapter `name` active; on exit the previous adapter and every requires_grad flag return.

    (`set_adapter` also flips requires_grad, so the flags are restored exactly rather than re-derived.)
    """
    previous = peft_model.active_adapter
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    peft_model.set_adapter(name, inference_mode=True)
    try:
        yield peft_model
    finally:
        peft_model.set_adapter(previous)
        for param, flag in flags:
            param.requires_grad_(flag)


def save_policy(policy: nn.Module, folder: str, trained_adapter: str | None, state_dict: dict | None = None) -> None:
    """Save the policy: full weights, or only the trained adapter as a plain adapter folder (loads as "default").

    `state_dict`: the policy's weights when they are not its parameters' own (gathered from shards)."""
    if trained_adapter is None:
        policy.save_pretrained(folder, state_dict=state_dict)
        return
    policy.save_pretrained(folder, selected_adapters=[trained_adapter], state_dict=state_dict)
    if trained_adapter != "default":  # PEFT writes a non-default adapter into a subfolder named after it
        nested = os.path.join(folder, trained_adapter)
        for entry in os.listdir(nested):
            os.replace(os.path.join(nested, entry), os.path.join(folder, entry))
        shutil.rmtree(nested)


def adapters_enabled(peft_model: nn.Module) -> bool:
    """False inside `peft_model.disable_adapter()` (every tuner layer bypassed: the bare base model runs)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            return not module.disable_adapters
    return True
