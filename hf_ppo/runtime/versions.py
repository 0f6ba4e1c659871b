"""The dependency versions hf_ppo is tested with, and the one API difference inside that range.

The tested range is declared once, in pyproject.toml (a floor that CI installs from `deps/floors.txt`, a
ceiling at the first release nobody has tested); this module reads it back from the installed package's metadata,
so an environment built around pip's resolver (`--no-deps`, conda) is told once, on import, when it holds a version
outside it.

transformers 5.24 renamed the KV cache from `past_key_values` to `cache` (model forwards still accept the old keyword
with a FutureWarning, until 5.40). `CACHE` is the name the installed version uses, for forwards and outputs alike.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from dataclasses import fields

from transformers import TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast


class GradientCheckpointingNames:
    """`gradient_checkpointing_enable` / `_disable`: the names of `activation_checkpointing_enable` / `_disable`
    before transformers 5.23 (its Trainer calls them, with `every_n_layers` and `offload`), and callers' older names."""

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs):
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self):
        self.activation_checkpointing_disable()


CACHE = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"

# The packages whose internals hf_ppo leans on: their range in pyproject.toml is a tested one.
CHECKED = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "datasets", "huggingface_hub")


def out_of_range() -> list[str]:
    """`name version (tested: range)` for every checked package installed outside the range hf_ppo declares."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("hf_ppo") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return []
    found = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None or _normal(req.name) not in {_normal(n) for n in CHECKED}:
            continue  # extras (`[test]`) and packages whose version does not matter
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # its import fails with its own message
        if req.specifier and not req.specifier.contains(have.split("+")[0], prereleases=True):
            found.append(f"{req.name} {have} (tested: {req.specifier})")
    return found


def warn_if_out_of_range() -> None:
    """One warning naming every checked package outside the tested range, and the range."""
    found = out_of_range()
    if found:
        warnings.warn(
            "hf_ppo is tested with versions this environment does not have: " + "; ".join(found)
            + ". It may work, or fail in ways the tests would have caught. Install the tested range with "
            "`pip install hf_ppo` (without --no-deps), or see the tested versions (docs/getting-started/installation.md).",
            UserWarning, stacklevel=3)


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


# transformers 5.23 renamed `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` to
# `activation_checkpointing_enable(activation_checkpointing_kwargs=...)` (the old name stays as an alias there).
# hf_ppo's wrappers answer to both names and call a wrapped model by whichever it has. `CHECKPOINTING_ARG` is the
# TrainingArguments field (from 5.23 `gradient_checkpointing` is its deprecated alias, which it keeps mirrored).
CHECKPOINTING_ARG = ("activation_checkpointing" if "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}
                     else "gradient_checkpointing")


def checkpointing_enable(module, kwargs: dict | None = None, **extra) -> None:
    """Turn on activation (gradient) checkpointing in a transformers model under the installed version's name;
    `extra` (`every_n_layers`, `offload`) is what Trainer passes."""
    if hasattr(module, "activation_checkpointing_enable"):
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)


def checkpointing_disable(module) -> None:
    if hasattr(module, "activation_checkpointing_disable"):
        module.activation_checkpointing_disable()
    else:
        module.gradient_checkpointing_disable()


def supports_checkpointing(module) -> bool:
    return hasattr(module, "activation_checkpointing_enable") or hasattr(module, "gradient_checkpointing_enable")
