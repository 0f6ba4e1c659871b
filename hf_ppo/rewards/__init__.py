"""Floor 1, the rewards: ready-made reward functions in TRL's calling convention (`completions`, the dataset's
columns as keywords, one float per completion), for `reward_funcs` (YAML `reward_funcs:
[hf_ppo.rewards.exact_answer]`) and for `PPOLMTrainer(reward_model=...)`. Plain Python: no model, no config, no
import from another hf_ppo package."""

from .answers import completion_text, exact_answer, extract_answer, parse_number, reference_answer

__all__ = ["completion_text", "exact_answer", "extract_answer", "parse_number", "reference_answer"]
