"""`hf_ppo.rewards`: reward functions ready for `reward_funcs` (YAML `reward_funcs: [hf_ppo.rewards.exact_answer]`)
and for `PPOLMTrainer(reward_model=...)`, in TRL's calling convention; they live in `hf_ppo.rollout.verifiable`."""

from .rollout.verifiable import exact_answer, extract_answer

__all__ = ["exact_answer", "extract_answer"]
