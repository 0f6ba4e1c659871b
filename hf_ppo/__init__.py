"""hf_ppo: clipped-PPO RLHF with a value head on transformers.Trainer."""

from .config import PPOConfig
from .modeling import AutoModelForCausalLMWithValueHead
from .trainer import PPOLMTrainer

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLMWithValueHead", "PPOConfig", "PPOLMTrainer"]
