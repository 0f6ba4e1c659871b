"""hf_ppo: clipped-PPO RLHF with a value head on transformers.Trainer.

The public names; everything else lives in the sub-packages, on floors (docs/project/architecture.md). They are
imported on first use (`hf_ppo.PPOConfig`, `from hf_ppo import PPOLMTrainer`), so that `import hf_ppo.cli` and
`hf-ppo --help` load neither torch nor transformers; importing the package checks the installed versions against
the tested range and quiets bitsandbytes' note about an optional CPU kernel (`runtime/warn.py`).
"""

import importlib

from .runtime.ranges import warn_if_out_of_range
from .runtime.warn import quiet_bitsandbytes_kernels_note

warn_if_out_of_range()
quiet_bitsandbytes_kernels_note()

__version__ = "0.1.0"
_HOMES = {"AutoModelForCausalLMWithValueHead": "models", "EnvSample": "rollout", "Environment": "rollout",
          "PPOConfig": "trainer", "PPOLMTrainer": "trainer", "RolloutEngine": "rollout"}
__all__ = ["AutoModelForCausalLMWithValueHead", "EnvSample", "Environment", "PPOConfig", "PPOLMTrainer",
           "RolloutEngine"]


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
