"""`MinibatchSchedule`: the order in which one rollout's sequences go through the PPO epochs, minibatches and
micro-batches (step 11), kept with the iteration so that a resumed run replays exactly the same updates."""

from __future__ import annotations

from dataclasses import fields

import torch

from ..algorithms.ppo_math import loss_normalizer
from ..rollout.batch import RolloutBatch


class MinibatchSchedule:
    """The PPO update over one rollout: `num_ppo_epochs` shuffled passes, each split into `num_mini_batches`
    minibatches of gradient-accumulation micro-batches, handed out one micro-batch at a time. With `critic_passes`
    c > 1 each policy pass is followed by c - 1 critic-only passes (shuffled anew): pass p updates the policy only
    when p % c == 0 (`critic_updates_per_step`).

    The rollout, the shuffles (`orders`, (passes, B) long) and the `position` (micro-batches handed out) are
    the whole state, so a checkpoint taken part-way through an iteration resumes with exactly the rest of it.
    """

    def __init__(self, batch: RolloutBatch, orders: torch.Tensor, *, num_mini_batches: int,
                 gradient_accumulation_steps: int, position: int = 0, loss_aggregation: str = "token_mean",
                 critic_passes: int = 1):
        self.batch, self.orders, self.position = batch, orders, position
        self.loss_aggregation, self.critic_passes = loss_aggregation, critic_passes
        self.num_mini_batches, self.gradient_accumulation_steps = num_mini_batches, gradient_accumulation_steps
        self.minibatch_size = len(batch) // num_mini_batches
        self.micro_batch_size = self.minibatch_size // gradient_accumulation_steps

    @classmethod
    def shuffled(cls, batch: RolloutBatch, *, num_ppo_epochs: int, num_mini_batches: int,
                 gradient_accumulation_steps: int, loss_aggregation: str = "token_mean",
                 critic_passes: int = 1) -> "MinibatchSchedule":
        """A new schedule over `batch`: one permutation per pass from the global torch RNG."""
        orders = torch.stack([torch.randperm(len(batch), device=batch.queries.device)
                              for _ in range(num_ppo_epochs * critic_passes)])
        return cls(batch, orders, num_mini_batches=num_mini_batches, critic_passes=critic_passes,
                   gradient_accumulation_steps=gradient_accumulation_steps, loss_aggregation=loss_aggregation)

    def __len__(self) -> int:
        return self.orders.shape[0] * self.num_mini_batches * self.gradient_accumulation_steps

    @property
    def done(self) -> bool:
        return self.position >= len(self)

    def next(self) -> dict:
        """The next micro-batch: {"batch": RolloutBatch, "normalizer": what its whole minibatch's loss divides by
        (real tokens, or sequences for the seq-mean aggregations: `loss_normalizer`), "critic_only": whether it
        belongs to a critic-only pass}."""
        epoch, rest = divmod(self.position, self.num_mini_batches * self.gradient_accumulation_steps)
        m, k = divmod(rest, self.gradient_accumulation_steps)
        minibatch = self.orders[epoch, m * self.minibatch_size:(m + 1) * self.minibatch_size]
        self.position += 1
        return {"batch": self.batch.select(minibatch[k * self.micro_batch_size:(k + 1) * self.micro_batch_size]),
                "normalizer": loss_normalizer(self.batch.policy_mask[minibatch], self.loss_aggregation),
                "critic_only": epoch % self.critic_passes != 0}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the rollout, the orders and the position (as a 0-d tensor): what a checkpoint stores."""
        tensors = {f.name: getattr(self.batch, f.name) for f in fields(self.batch)}
        return {**tensors, "orders": self.orders, "position": torch.tensor(self.position)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], *, num_mini_batches: int,
                        gradient_accumulation_steps: int, loss_aggregation: str = "token_mean",
                        critic_passes: int = 1, num_ppo_epochs: int | None = None) -> "MinibatchSchedule":
        """The schedule `state_dict` stored; `num_ppo_epochs` (the `schedule_settings` key) is in the orders."""
        state = dict(state)
        orders, position = state.pop("orders"), int(state.pop("position"))
        return cls(RolloutBatch(**state), orders, num_mini_batches=num_mini_batches, critic_passes=critic_passes,
                   gradient_accumulation_steps=gradient_accumulation_steps, position=position,
                   loss_aggregation=loss_aggregation)
