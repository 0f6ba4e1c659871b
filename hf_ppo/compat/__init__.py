"""Floor 7, TRL-shaped entry points: `trl011` runs TRL 0.11's `PPOTrainer.step()` code unchanged (also importable as
`hf_ppo.trl011`). TRL 1.12's `PPOConfig` names are mapped by `PPOConfig` itself."""

from . import trl011

__all__ = ["trl011"]
