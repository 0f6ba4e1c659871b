"""Non-finite numbers never reach the weights.

- A row a reward scored NaN/inf leaves the update, not the rollout (`rollout.steps.unscored_rows`: its masks are
  cleared; with reinforce_pp's groups, its prompt's whole group; rloo and grpo group by index and keep the rest),
  with a one-time warning per reward naming the row;
  the rows left out are counted (`nonfinite/unscored_rows`).
- A rollout whose scores, log-probs, values, rewards, advantages or returns hold NaN/inf (every row unscored, or a
  model's numbers) is dropped and sampled again from the same prompts (Trainer's step count is untouched: every
  optimizer step trains on a finite rollout).
- An optimizer step whose loss (any of its micro-batches) or gradient norm is non-finite is skipped: its gradients
  are dropped, so `optimizer.step()` leaves the weights and the optimizer state as they were. The step still counts
  for `max_steps` and the learning-rate schedule, as a skipped fp16 step does.
- Each drop or skip warns and is counted (`nonfinite/dropped_rollouts`, `nonfinite/skipped_steps` in the logs);
  `max_consecutive_nonfinite` of them without a good optimizer step in between stop training with
  `NonFiniteError`, naming the cause and the last complete checkpoint.
- Weights are checked before every save: non-finite ones are never written.
"""

from __future__ import annotations

import math

import torch

from ..runtime.warn import warn_user

# Scores beyond this magnitude overflow float32 in the squared value loss long before they mean anything.
SCORE_WARN_MAGNITUDE = 1e4
ROLLOUT_FIELDS = ("scores", "logprobs", "ref_logprobs", "values", "rewards", "advantages", "returns")


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers too many times in a row."""


def nonfinite_counts(batch) -> torch.Tensor:
    """Per field of `ROLLOUT_FIELDS`, the number of non-finite entries at real tokens (scores: per response). (F,)"""
    mask = batch.response_mask
    counts = [(~torch.isfinite(batch.scores)).sum()]
    counts += [(~torch.isfinite(getattr(batch, name)) & mask).sum() for name in ROLLOUT_FIELDS[1:]]
    return torch.stack(counts).float()


def describe_counts(counts: list[float], total_responses: int) -> str | None:
    """'scores: 2 NaN/inf of 8 responses; ...' for the non-zero counts, or None when everything is finite."""
    parts = [f"{name}: {int(n)} NaN/inf" + (f" of {total_responses} responses" if name == "scores" else " tokens")
             for name, n in zip(ROLLOUT_FIELDS, counts) if n]
    return "; ".join(parts) or None


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters (and value head) holding NaN/inf."""
    return [name for name, p in model.named_parameters()
            if (p.requires_grad or "v_head" in name) and not torch.isfinite(p).all()]


class NonFiniteGuard:
    """Counts dropped rollouts and skipped steps; stops after `max_consecutive` without a good step in between."""

    def __init__(self, max_consecutive: int, score_hint: str):
        self.max_consecutive = max_consecutive
        self.score_hint = score_hint  # how to tame huge scores, given the run's reward settings ("" if tamed)
        self.consecutive = 0
        self.dropped_rollouts = 0
        self.skipped_steps = 0
        self.unscored = 0  # rows left out of an update for a NaN/inf score (`unscored_rows`)
        self.max_abs_score = 0.0
        self._warned_scale = False
        self._warned_rewards: set[str] = set()  # the rewards of a list already warned about (see `check_scale`)

    def check_scale(self, scores: torch.Tensor, reward_scores: dict[str, torch.Tensor] | None = None) -> None:
        """Warn once when finite scores exceed `SCORE_WARN_MAGNITUDE` and nothing normalises or clips them; with a
        list of rewards (`reward_scores`: {name: raw scores (B,)}), once for each reward whose own scores do."""
        self.max_abs_score = max(self.max_abs_score, _max_abs(scores))
        if self.score_hint and not self._warned_scale and self.max_abs_score > SCORE_WARN_MAGNITUDE:
            self._warned_scale = True
            warn_user(f"Reward scores reach {self.max_abs_score:.3g}: at this scale the value loss overflows "
                      f"and advantages lose precision. {self.score_hint}")
        for name, raw in (reward_scores or {}).items():
            top = _max_abs(raw)
            if self.score_hint and name not in self._warned_rewards and top > SCORE_WARN_MAGNITUDE:
                self._warned_rewards.add(name)
                warn_user(f"Reward {name!r} scores reach {top:.3g}: at this scale the value loss overflows and "
                          f"advantages lose precision. {self.score_hint}")

    def dropped_rollout(self, cause: str, last_checkpoint) -> None:
        self.dropped_rollouts += 1
        self._record(f"rollout dropped and sampled again ({cause})", last_checkpoint)

    def unscored_rows(self, rows: torch.Tensor | None, accelerator, world_size: int) -> None:
        """Count the rows (B,) bool a rollout left out of its update for a NaN/inf score, over all processes."""
        count = torch.zeros((), device=accelerator.device) if rows is None else rows.sum().float()
        if world_size > 1:
            count = accelerator.reduce(count.to(accelerator.device), reduction="sum")
        self.unscored += int(count.item())

    def skipped_step(self, cause: str, last_checkpoint) -> None:
        self.skipped_steps += 1
        self._record(f"optimizer step skipped ({cause})", last_checkpoint)

    def good_step(self) -> None:
        self.consecutive = 0

    def check_step(self, loss_finite, grad_norm, under_grad_scaler: bool, step: int, last_checkpoint) -> bool:
        """After the backward passes of optimizer step `step`: True when it may go ahead; False (counted, and an
        error after too many in a row) for a non-finite loss or gradient norm. Under fp16's GradScaler, which skips
        overflowed steps itself, only a non-finite loss counts."""
        cause = ("the loss is NaN/inf" if loss_finite is not None and not loss_finite.item()
                 else None if under_grad_scaler or is_finite_number(grad_norm)
                 else f"the gradient norm is {float(grad_norm)}")
        if cause is None:
            self.good_step()
            return True
        self.skipped_step(f"{cause} at step {step}", last_checkpoint)
        return False

    def _record(self, what: str, last_checkpoint) -> None:
        self.consecutive += 1
        if self.consecutive < self.max_consecutive:
            warn_user(f"Non-finite numbers: {what}. {self.consecutive} in a row; training stops at "
                      f"max_consecutive_nonfinite={self.max_consecutive}.")
            return
        hint = (f" Scores reached {self.max_abs_score:.3g}: {self.score_hint}"
                if self.score_hint and self.max_abs_score > SCORE_WARN_MAGNITUDE else "")
        raise NonFiniteError(
            f"Training stopped: {self.consecutive} non-finite events in a row (max_consecutive_nonfinite="
            f"{self.max_consecutive}); the last: {what}.{hint} The weights hold no NaN/inf; the last complete "
            f"checkpoint is {last_checkpoint() or 'none (none was saved yet)'}. Fix the cause (reward model/function, "
            "learning rate, reward scale) and resume from it.")

    def log_values(self) -> dict[str, float]:
        return {"nonfinite/dropped_rollouts": float(self.dropped_rollouts),
                "nonfinite/skipped_steps": float(self.skipped_steps),
                "nonfinite/unscored_rows": float(self.unscored)}

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "dropped_rollouts": self.dropped_rollouts,
                "skipped_steps": self.skipped_steps, "max_abs_score": self.max_abs_score,
                "warned_scale": self._warned_scale, "unscored_rows": self.unscored}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.dropped_rollouts = state["consecutive"], state["dropped_rollouts"]
        self.skipped_steps, self.max_abs_score = state["skipped_steps"], state["max_abs_score"]
        self._warned_scale = state["warned_scale"]
        self.unscored = state.get("unscored_rows", 0)  # absent from checkpoints written before it was counted


def _max_abs(scores: torch.Tensor) -> float:
    """The largest finite |score|, 0.0 when none is finite."""
    finite = scores[torch.isfinite(scores)]
    return finite.abs().max().item() if finite.numel() else 0.0


def is_finite_number(value) -> bool:
    """True for a finite float / 0-d tensor; None counts as finite (nothing was computed)."""
    return value is None or math.isfinite(float(value))


def score_hint(args) -> str:
    """How to tame huge reward scores, or "" when the run already normalises or clips them."""
    if args.normalize_rewards or args.reward_clip is not None or args.normalize_each_reward:
        return ""
    return ("Set normalize_rewards=True (running mean/std) or reward_clip (with several rewards: "
            "normalize_each_reward=True), or rescale the reward.")


def check_finite_weights(model: torch.nn.Module, output_dir: str, last_checkpoint: str | None) -> None:
    """Refuse to save NaN/inf weights: the error names the parameters and the last complete checkpoint."""
    bad = nonfinite_parameters(model)
    if bad:
        raise RuntimeError(f"Not saving to {output_dir}: parameters {bad[:5]} hold NaN/inf. The last complete "
                           f"checkpoint is {last_checkpoint or 'none'}.")


def nonfinite_problem(batch, accelerator, world_size: int,
                      reward_scores: dict[str, torch.Tensor] | None = None) -> str | None:
    """What is NaN/inf in a rollout batch, counted over all processes (so they all drop it together); None if
    nothing is. With a list of rewards (`reward_scores`: {name: raw scores (B,)}), it names the rewards that gave
    NaN/inf."""
    names = list(reward_scores or {})
    counts = nonfinite_counts(batch)
    if names:
        each = torch.stack([(~torch.isfinite(reward_scores[n])).sum() for n in names]).float().to(counts.device)
        counts = torch.cat([counts, each])
    if world_size > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    counts = counts.tolist()
    problem = describe_counts(counts[:len(ROLLOUT_FIELDS)], len(batch) * world_size)
    culprits = [f"reward {n!r}: {int(c)} NaN/inf" for n, c in zip(names, counts[len(ROLLOUT_FIELDS):]) if c]
    return f"{problem}; from {', '.join(culprits)}" if problem and culprits else problem
