"""The dependency versions hf_ppo is tested with, and the one API difference inside that range.

The tested range is declared once, in pyproject.toml (a floor that CI installs from `deps/floors.txt`, a
ceiling at the first release nobody has tested); `ranges` reads it back from the installed package's metadata (no
heavy import), so an environment built around pip's resolver (`--no-deps`, conda) is told once, on import, when it
holds a version outside it.

transformers 5.24 renamed the KV cache from `past_key_values` to `cache` (model forwards still accept the old keyword
with a FutureWarning, until 5.40). `CACHE` is the name the installed version uses, for forwards and outputs alike.
"""

from __future__ import annotations

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
