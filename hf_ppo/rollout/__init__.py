"""Floor 3, the rollout: one iteration's experience. The `RolloutBatch` record, the engines that sample responses
(`RolloutEngine`), scoring (reward models and functions, mixing, shaping), environments (multi-turn, tools), the
numbered steps 1-9 (`steps.rollout`) and dynamic sampling's refill."""

from .batch import RolloutBatch
from .engine_choice import make_rollout_engine
from .engines import KVCacheSampler, RolloutEngine, StaticCacheSampler, generate
from .environments import Environment, EnvSample, GivenSamples
from .refill import rollout_with_refill
from .reward_calls import RewardFunctionError, check_reward_function
from .scoring import RewardSet, RewardSettings, score_responses
from .steps import Rollout, policy_forward, reference_logprobs, rollout, sample_and_score, without_uniform_groups
from .vllm_engine import VLLMEngine, VLLMSettings

__all__ = ["EnvSample", "Environment", "GivenSamples", "KVCacheSampler", "RewardFunctionError", "RewardSet",
           "RewardSettings", "Rollout", "RolloutBatch", "RolloutEngine", "StaticCacheSampler", "VLLMEngine",
           "VLLMSettings", "check_reward_function", "generate", "make_rollout_engine", "policy_forward",
           "reference_logprobs", "rollout", "rollout_with_refill", "sample_and_score", "score_responses",
           "without_uniform_groups"]
