"""hf_ppo: clipped-PPO RLHF with a value head on transformers.Trainer."""

from .versions import warn_if_out_of_range

warn_if_out_of_range()

from .config import PPOConfig  # noqa: E402
from .environment import EnvSample, Environment  # noqa: E402
from .modeling import AutoModelForCausalLMWithValueHead  # noqa: E402
from .trainer import PPOLMTrainer  # noqa: E402

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLMWithValueHead", "EnvSample", "Environment", "PPOConfig", "PPOLMTrainer"]
