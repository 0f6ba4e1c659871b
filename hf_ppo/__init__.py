"""hf_ppo: clipped-PPO RLHF with a value head on transformers.Trainer.

The public names; everything else lives in the sub-packages, on floors (docs/project/architecture.md).
"""

from .runtime.versions import warn_if_out_of_range

warn_if_out_of_range()

from .models import AutoModelForCausalLMWithValueHead  # noqa: E402
from .rollout import EnvSample, Environment, RolloutEngine  # noqa: E402
from .trainer import PPOConfig, PPOLMTrainer  # noqa: E402

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLMWithValueHead", "EnvSample", "Environment", "PPOConfig", "PPOLMTrainer",
           "RolloutEngine"]
