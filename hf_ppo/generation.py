"""`from hf_ppo.generation import RolloutEngine`: kept at this path for the scripts that import it; the rollout
engines live in `hf_ppo.rollout.engines` (also `from hf_ppo import RolloutEngine`)."""

from .rollout.engines import KVCacheSampler, RolloutEngine, StaticCacheSampler, generate, make_rollout_engine

__all__ = ["KVCacheSampler", "RolloutEngine", "StaticCacheSampler", "generate", "make_rollout_engine"]
