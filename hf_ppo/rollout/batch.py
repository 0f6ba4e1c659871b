"""`RolloutBatch`: one PPO iteration's experience, the record every step of the rollout fills and the update reads.
One field a line, each with its shape and meaning beside it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class RolloutBatch:
    """One PPO iteration's experience. Shapes: B rows (one per response: prompts x `num_generations`), Q the prompt
    length (left-padded), R the response length. Every (B, R) float is 0 at masked positions.

    Two masks: `response_mask` is what the model attends to; `policy_mask` marks the tokens the policy sampled (its
    actions). They differ only where an environment inserted tokens (`rollout/environments.py`: context, never
    trained on). Log-probs, KL, values, advantages and every loss term and mean use `policy_mask`.
    Every field is set at construction: `rollout` builds the record once everything is computed.
    """

    queries: torch.Tensor  # (B, Q) long: prompt ids, left-padded
    query_mask: torch.Tensor  # (B, Q) bool: True = a real prompt token
    responses: torch.Tensor  # (B, R) long: sampled ids, pad after the stop token
    response_mask: torch.Tensor  # (B, R) bool: True = a real response token (the stop token included)
    logprobs: torch.Tensor  # (B, R) float32: log pi_old(token), the rollout-time policy's
    ref_logprobs: torch.Tensor  # (B, R) float32: the reference's log-prob of each token
    values: torch.Tensor  # (B, R) float32: the rollout-time critic's V(s_t); zeros without a critic
    scores: torch.Tensor  # (B,) float32: each response's reward after step 4's penalties, before step 7's shaping
    contains_stop: torch.Tensor  # (B,) bool: the policy sampled a stop token (the response was not cut at R)
    rewards: torch.Tensor  # (B, R) float32: per-token rewards the advantages came from (shaped score at the last)
    non_score_rewards: torch.Tensor  # (B, R) float32: the KL penalty part of them, -kl_coef * KL_t
    advantages: torch.Tensor  # (B, R) float32: the estimator's advantages (whitened where it whitens)
    returns: torch.Tensor  # (B, R) float32: the critic's targets (gae); logged only for critic-free estimators
    policy_mask: torch.Tensor | None = None  # (B, R) bool: True = a token the policy sampled; None (a checkpoint
    #                                          written before environments): every response token is the policy's
    sampling_logprobs: torch.Tensor | None = None  # (B, R) float32: the log-prob the engine drew each token with
    #                                                (vLLM's); None (an engine that samples the policy): `logprobs`

    def __post_init__(self):
        if self.policy_mask is None:  # a copy: checkpoints (safetensors) refuse tensors that share memory
            self.policy_mask = self.response_mask.clone()
        if self.sampling_logprobs is None:
            self.sampling_logprobs = self.logprobs.clone()

    def __len__(self) -> int:
        return self.queries.shape[0]

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """The rows `index` of every tensor (a minibatch or micro-batch)."""
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})
