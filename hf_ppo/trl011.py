"""`from hf_ppo.trl011 import PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead`: TRL 0.11's names, kept at
this path for the scripts that import them; they live in `hf_ppo.compat.trl011`."""

from .compat.trl011 import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

__all__ = ["AutoModelForCausalLMWithValueHead", "PPOConfig", "PPOTrainer"]
