"""`RolloutBatch`: one PPO iteration's experience, the record every step of the rollout fills and the update reads.
Each field carries its shape and meaning in the class docstring."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class RolloutBatch:
    """One PPO iteration's experience. B = prompts, Q = prompt length (left-padded), R = response_length.

    queries (B, Q) long; query_mask (B, Q) bool; responses (B, R) long, pad after the stop token;
    response_mask (B, R) bool, True = a real response token (the stop token included); logprobs, ref_logprobs,
    values (B, R) float32 from the rollout-time policy / reference / critic (zeros without a critic); scores (B,)
    reward after penalties;
    contains_stop (B,) bool; rewards, non_score_rewards, advantages, returns (B, R), 0 at masked positions;
    policy_mask (B, R) bool, True = a token the policy sampled (an action): `response_mask` without an environment's
    tokens (`rollout/environments.py`), which are context only. Log-probs, KL, values, advantages and every loss term and mean
    use `policy_mask`; `response_mask` is what the model attends to.
    Every field is set at construction (`rollout` builds it once everything is computed).
    """

    queries: torch.Tensor
    query_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    contains_stop: torch.Tensor
    rewards: torch.Tensor
    non_score_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    policy_mask: torch.Tensor | None = None  # None: every response token is the policy's (a checkpoint without it)

    def __post_init__(self):
        if self.policy_mask is None:  # a copy: checkpoints (safetensors) refuse tensors that share memory
            self.policy_mask = self.response_mask.clone()

    def __len__(self) -> int:
        return self.queries.shape[0]

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """The rows `index` of every tensor (a minibatch or micro-batch)."""
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})
