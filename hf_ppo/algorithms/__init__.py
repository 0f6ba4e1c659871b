"""Floor 1, the algorithms: PPO's math as pure tensor functions (`ppo_math`, with the masked statistics in `masked`,
the group advantages in `advantages` and the policy losses beside PPO's in `policy_losses`) and the advantage
estimators of step 8 (`estimators`: GAE, RLOO, GRPO, REINFORCE++). Torch only: no config objects, no models, nothing
of hf_ppo."""

from .estimators import ESTIMATORS, Estimator, EstimatorSettings, estimate, kl_loss_coef
from .ppo_math import (
                       Experience,
                       LossSettings,
                       AdaptiveKLController,
                       FixedKLController,
                       RunningMoments,
                       compute_gae,
                       compute_rewards,
                       entropy_from_logits,
                       explained_variance,
                       grpo_advantages,
                       kl_estimate,
                       logprobs_from_logits,
                       masked_mean,
                       masked_var,
                       masked_whiten,
                       policy_loss,
                       ppo_loss,
                       reinforce_pp_advantages,
                       rloo_advantages,
                       value_loss,
)

__all__ = ["ESTIMATORS", "AdaptiveKLController", "Estimator", "EstimatorSettings", "Experience", "FixedKLController",
           "LossSettings",
           "RunningMoments", "compute_gae", "compute_rewards", "entropy_from_logits", "estimate", "explained_variance",
           "grpo_advantages", "kl_estimate", "kl_loss_coef", "logprobs_from_logits", "masked_mean", "masked_var",
           "masked_whiten", "policy_loss", "ppo_loss", "reinforce_pp_advantages", "rloo_advantages", "value_loss"]
