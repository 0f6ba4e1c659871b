"""A watch for collapse and reward hacking, from the metrics the trainer already logs.

`CollapseWatch` is a `TrainerCallback` that reads every logged dict (`on_log`) and looks for five signatures. Each
warns once (a `CollapseWarning`) naming the numbers, the likely cause and the settings that usually fix it; with
`stop_on_collapse` the first one stops training (`control.should_training_stop`) and names the last complete
checkpoint. Trends compare the mean of the first `WINDOW` logged values of a metric (its start) with the mean of the
last `WINDOW` (now), so one noisy log never fires a signature, and nothing is judged before `2 * WINDOW` logs:

| signature | fires when (the thresholds) |
|---|---|
| length up, entropy down | `rollout/response_length` now >= 1.3 x its start, and `policy/entropy_avg` now <= 0.7 x its start |
| KL beyond its target | `objective/kl` now > `collapse_kl_threshold` (None: 3 x `kl_target` with `adaptive_kl`; off otherwise) |
| clip fraction out of range | `policy/clipfrac_avg` now > 0.3 (healthy PPO clips a few percent to about 20% of tokens) |
| value loss exploding | `loss/value_avg` now > 100 x its start |
| reward hacking | at one evaluation, a training reward's win rate over the reference has its 95% interval above 0.5 while a judge's has it below 0.5 (`evaluation/`) |
"""

from __future__ import annotations

from typing import Callable

from transformers import TrainerCallback

from ..runtime.warn import warn_user

WINDOW = 3  # logs averaged for "start" and "now"
LENGTH_RISE, ENTROPY_FALL = 1.3, 0.7
KL_TARGET_MULTIPLE = 3.0
CLIPFRAC_MAX = 0.3
VALUE_LOSS_RISE = 100.0  # a critic with a fresh head swings 10x between batches of a healthy run


class CollapseWarning(UserWarning):
    """A collapse or reward-hacking signature in the logged metrics (see `trainer/watch.py`)."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class CollapseWatch(TrainerCallback):
    """Warns once per signature (see the module docstring); `stop_on_collapse` stops training at the first.

    `kl_threshold`: per-response KL that counts as too far (None: no KL check); `last_checkpoint`: returns the last
    complete checkpoint folder (or None), named when training stops.
    """

    def __init__(self, *, kl_threshold: float | None, stop: bool, last_checkpoint: Callable[[], str | None],
                 kl_reason: str = ""):
        self.kl_threshold, self.kl_reason = kl_threshold, kl_reason
        self.stop, self.last_checkpoint = stop, last_checkpoint
        self.history: dict[str, list[float]] = {}
        self.fired: list[str] = []  # the signatures seen, in order

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        for key, value in logs.items():
            if isinstance(value, (int, float)):
                self.history.setdefault(key, []).append(float(value))
        found = [(name, text) for name, text in self._signatures(logs) if name not in self.fired]
        for name, text in found:
            self.fired.append(name)
            if state.is_world_process_zero:
                warn_user(f"Collapse watch, step {state.global_step}: {text}" + self._stop_text(), CollapseWarning)
        if found and self.stop:
            control.should_training_stop = True

    def _stop_text(self) -> str:
        if not self.stop:
            return " (stop_on_collapse=True stops training at such a signature.)"
        folder = self.last_checkpoint()
        where = (f"the last complete checkpoint is {folder} (the signature may have begun before it: compare its "
                 "metrics)" if folder else "no checkpoint was saved (save_strategy='steps' keeps some)")
        return f" stop_on_collapse=True: training stops now; {where}."

    def _trend(self, key: str) -> tuple[float, float] | None:
        """(start, now) of a metric, or None before 2 * WINDOW logs of it."""
        values = self.history.get(key, [])
        if len(values) < 2 * WINDOW:
            return None
        return _mean(values[:WINDOW]), _mean(values[-WINDOW:])

    def _signatures(self, logs: dict):
        length, entropy = self._trend("rollout/response_length"), self._trend("policy/entropy_avg")
        if (length and entropy and length[0] > 0 and length[1] >= LENGTH_RISE * length[0]
                and entropy[1] <= ENTROPY_FALL * entropy[0]):
            yield "length_entropy", (
                f"responses grew from {length[0]:.1f} to {length[1]:.1f} tokens while the policy's entropy fell from "
                f"{entropy[0]:.3f} to {entropy[1]:.3f}: the policy is likely exploiting a reward that pays for length "
                "(or repeating itself). Usually fixed by missing_eos_penalty (pay for stopping), "
                "overlong_buffer_length (penalise running long), a larger kl_coef, or a lower learning_rate.")
        kl = self._trend("objective/kl")
        if self.kl_threshold is not None and kl and kl[1] > self.kl_threshold:
            yield "kl", (
                f"KL to the reference (objective/kl) averages {kl[1]:.2f} nats per response over the last {WINDOW} "
                f"logs, beyond {self.kl_threshold:g} ({self.kl_reason}): the policy has moved far from the reference, "
                "typically gaming the reward or taking unstable updates. Usually fixed by a larger kl_coef (or "
                "adaptive_kl), a lower learning_rate, fewer num_ppo_epochs, or whiten_rewards=True.")
        clip = self.history.get("policy/clipfrac_avg", [])
        if len(clip) >= 2 * WINDOW and _mean(clip[-WINDOW:]) > CLIPFRAC_MAX:
            yield "clipfrac", (
                f"the policy's clip fraction (policy/clipfrac_avg) averages {_mean(clip[-WINDOW:]):.2f} over the last "
                f"{WINDOW} logs (healthy PPO: a few percent to about 20%): each update moves the "
                "policy too far from the one that sampled. Usually fixed by a lower learning_rate, fewer "
                "num_ppo_epochs, or a larger batch (per_device_train_batch_size, gradient_accumulation_steps).")
        value = self._trend("loss/value_avg")
        if value and value[0] > 0 and value[1] > VALUE_LOSS_RISE * value[0]:
            yield "value_loss", (
                f"the value loss (loss/value_avg) rose from {value[0]:.3g} to {value[1]:.3g}, over "
                f"{VALUE_LOSS_RISE:g}x its start: the critic cannot follow the returns (the reward scale grew or "
                "exploded). Usually fixed by whiten_rewards=True or normalize_rewards=True, reward_clip, a lower "
                "critic_learning_rate (or learning_rate), or a smaller cliprange_value.")
        hacked = [(k[len("eval_reward/"):-len("/win_rate_low")], logs[k]) for k in logs
                  if k.startswith("eval_reward/") and k.endswith("/win_rate_low") and logs[k] > 0.5]
        judged = [(k[len("eval_judge/"):-len("/win_rate_high")], logs[k]) for k in logs
                  if k.startswith("eval_judge/") and k.endswith("/win_rate_high") and logs[k] < 0.5]
        if hacked and judged:
            (reward, low), (judge, high) = hacked[0], judged[0]
            yield "reward_hacking", (
                f"the policy beats the reference on the training reward {reward!r} (win rate interval above 0.5, "
                f"from {low:.2f}) but loses on the judge {judge!r} (interval below 0.5, up to {high:.2f}): it is "
                "likely gaming the training reward. Usually fixed by a larger kl_coef, an earlier checkpoint, "
                "missing_eos_penalty when the gain is length, or a reward that also checks what the judge does "
                "(a list in reward_model with reward_weights); read eval_report.md to see how.")


def add_watch(callbacks: list | None, args, last_checkpoint: Callable[[], str | None]) -> list:
    """The trainer's `callbacks` plus the `CollapseWatch` that `args` ask for (none with `watch_collapse=False`);
    `last_checkpoint` returns the last complete checkpoint folder (or None)."""
    callbacks = list(callbacks or [])
    if not args.watch_collapse:
        return callbacks
    threshold, reason = args.collapse_kl_threshold, "collapse_kl_threshold"
    if threshold is None and args.adaptive_kl:
        threshold, reason = KL_TARGET_MULTIPLE * args.kl_target, f"{KL_TARGET_MULTIPLE:g} x kl_target"
    return [*callbacks, CollapseWatch(kl_threshold=threshold, stop=args.stop_on_collapse,
                                      last_checkpoint=last_checkpoint, kl_reason=reason)]
