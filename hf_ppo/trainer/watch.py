"""A watch for collapse and reward hacking, from the metrics the trainer already logs.

`CollapseWatch` is a `TrainerCallback` that reads every logged dict (`on_log`) and looks for six signatures. Each
warns once (a `CollapseWarning`) naming the numbers, the likely cause and the settings that usually fix it; with
`stop_on_collapse` the first one stops training (`control.should_training_stop`), names the last complete checkpoint
and keeps Trainer from saving the collapsed state after it (`control.should_save`), so that checkpoint stays the
newest and `resume_from_checkpoint=True` resumes from it.

Trends compare a metric's start with now: with n values logged so far, the means of its first and its last
w = min(`WINDOW`, n // 2) values, judged from the second log on. A learning rate far too high blows the critic up
within the first iteration's updates, so a start of `WINDOW` logs can already hold the blow-up (a tiny run logged
value loss 0.18, 109, 4921 at steps 1-3), and the default `logging_steps=10` logs a run of a few dozen steps only a
few times: a watch that waits for `2 * WINDOW` logs stays silent through the whole collapse. The signatures judged
that early have thresholds far outside a healthy run's swings (entropy at a tenth, value loss at 100x, KL in
absolute nats); the two with narrow ones (length with entropy, the clip fraction) wait for `2 * WINDOW` logs.
Non-finite values (a NaN loss the guard skipped, an evaluation with no finite score) are left out of every mean and
never fire a signature.

The rollout's own metrics (`ROLLOUT_KEYS`: KL, entropy, response length) are read from every rollout, not from the
logs (the trainer hands each rollout's statistics over: `observe_rollout`), and judged at the end of the optimizer
step that trains on it (`on_step_end`): a run logged every `logging_steps` optimizer steps is watched at every
iteration all the same. A short run logs too rarely for a log-based watch: 8 iterations of one optimizer step each
log once with the default `logging_steps=10`, at the very end, and a far too high learning rate with `kl_coef=0` and
a reward paid per word had taken KL from 0 to 195 nats by then (32 nats at the 3rd iteration, where the watch now
speaks). The update's metrics (clip fraction, value loss) exist only in the logs and are judged there.

| signature | fires when (the thresholds) |
|---|---|
| length up, entropy down | `rollout/response_length` now >= 1.3 x start, `policy/entropy_avg` now <= 0.7 x start |
| entropy collapse | `policy/entropy_avg` now <= 0.1 x its start (one token picked where many were chosen from) |
| KL too high | `objective/kl` now > `collapse_kl_threshold` (None: 3 x `kl_target` if `adaptive_kl`, or 30) |
| clip fraction out of range | `policy/clipfrac_avg` now > 0.3 (healthy PPO clips a few percent to 20% of tokens) |
| value loss exploding | `loss/value_avg` now > 100 x its start, and > 1 |
| reward hacking | at one evaluation, a training reward's win rate over the reference has its 95% interval above 0.5 while a judge's has it below 0.5 (`evaluation/`) |
"""

from __future__ import annotations

import math
from typing import Callable

from transformers import TrainerCallback

from ..runtime.warn import warn_user

WINDOW = 3  # logs (for the rollout's metrics: rollouts) averaged for "start" and "now"
# The metrics every rollout gives (`rollout.steps.rollout_stats`): read per rollout when the trainer hands them over.
ROLLOUT_KEYS = ("objective/kl", "policy/entropy_avg", "rollout/response_length")
LENGTH_RISE, ENTROPY_FALL = 1.3, 0.7
# Entropy at a tenth of its start: a policy that sampled among many tokens now picks one almost every time. Healthy
# RLHF lowers entropy gradually (by tens of percent); a learning rate far too high takes it to ~0 within iterations.
ENTROPY_COLLAPSE = 0.1
KL_TARGET_MULTIPLE = 3.0
# Per-response KL (nats) with a fixed kl_coef: 5 x the kl_target default (6, Ziegler et al.'s). At 30 nats the
# policy gives its own responses e^30 times the reference's probability: it no longer samples what the reference would.
KL_FIXED_DEFAULT = 30.0
CLIPFRAC_MAX = 0.3
VALUE_LOSS_RISE = 100.0  # a critic with a fresh head swings 10x between batches of a healthy run
# ... and the loss must also reach 1 (squared reward units): a 0/1 reward that nothing earns at first starts the value
# loss near 0, and its first successes raise it 100x in a healthy run; a blow-up reaches hundreds or thousands.
VALUE_LOSS_FLOOR = 1.0


class CollapseWarning(UserWarning):
    """A collapse or reward-hacking signature in the logged metrics (see `trainer/watch.py`)."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class CollapseWatch(TrainerCallback):
    """Warns once per signature (see the module docstring); `stop_on_collapse` stops training at the first.

    `kl_threshold`: per-response KL that counts as too far (None: no KL check); `last_checkpoint`: returns the last
    complete checkpoint folder (or None), named when training stops. `stopped` is True once it stopped training.
    """

    def __init__(self, *, kl_threshold: float | None, stop: bool, last_checkpoint: Callable[[], str | None],
                 kl_reason: str = "", kl_note_at: float | None = None):
        self.kl_threshold, self.kl_reason = kl_threshold, kl_reason
        # With a fixed kl_coef nothing holds KL near kl_target, and the KL signature speaks only at its threshold (30
        # nats by default): one note, not a collapse, when KL first passes kl_target says where the run is heading.
        self.kl_note_at = kl_note_at
        self.noted = False
        self.stop, self.last_checkpoint = stop, last_checkpoint
        self.history: dict[str, list[float]] = {}
        self.fired: list[str] = []  # the signatures seen, in order
        self.stopped = False
        self.per_rollout: set[str] = set()  # the metrics read from each rollout (`observe_rollout`), not the logs
        self.rollout_seen: dict | None = None  # the last rollout's statistics, judged at the step's end

    def on_train_begin(self, args, state, control, **kwargs):
        """A new `train()` (a resume on the same trainer, say) is watched afresh, and saves again."""
        self.history, self.fired, self.stopped, self.noted = {}, [], False, False
        self.per_rollout, self.rollout_seen = set(), None

    def observe_rollout(self, stats: dict) -> None:
        """Record one rollout's statistics (its `ROLLOUT_KEYS`; `stats` as `rollout.steps.rollout_stats` gives them,
        with the PPO `iteration`): from now on these metrics are read from every rollout and not from the logs.
        They are judged at the end of the optimizer step that trains on the rollout (`on_step_end`), or at the next
        log, whichever comes first."""
        for key in ROLLOUT_KEYS:
            if key in stats:
                self.per_rollout.add(key)
                if _finite(stats[key]):
                    self.history.setdefault(key, []).append(float(stats[key]))
        self.rollout_seen = stats

    def on_step_end(self, args, state, control, **kwargs):
        """Judge the rollout observed since the last judgement (`observe_rollout`): warn on each new signature, stop
        at the first with `stop` (Trainer saves after this event: the stop's own step saves nothing)."""
        if self.rollout_seen is not None:
            self._judge(state, control, {})

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Record the finite metrics of `logs` (but those read per rollout), warn on each new signature, stop at the
        first with `stop`."""
        if self.stopped:
            control.should_save = False
        if not logs:
            return
        for key, value in logs.items():
            if _finite(value) and key not in self.per_rollout:
                self.history.setdefault(key, []).append(float(value))
        self._judge(state, control, logs)

    def _judge(self, state, control, logs: dict) -> None:
        """The one-time KL note, then each new signature warned; with `stop`, training stopped at the first."""
        seen, self.rollout_seen = self.rollout_seen, None
        self._note_kl(state, (seen or {}) if "objective/kl" in self.per_rollout else logs)
        found = [(name, text) for name, text in self._signatures(logs) if name not in self.fired]
        for name, text in found:
            self.fired.append(name)
            if state.is_world_process_zero:
                warn_user(f"Collapse watch, step {state.global_step}: {text}" + self._stop_text(), CollapseWarning)
        if found and self.stop:
            # on_step_end and on_log run before Trainer saves on a save step (and on the last step): no checkpoint
            # of the collapsed state may become newer than the one the warning names.
            control.should_training_stop, control.should_save, self.stopped = True, False, True

    def _note_kl(self, state, logs: dict) -> None:
        """The one-time note when KL first passes `kl_note_at` (kl_target, with a fixed kl_coef)."""
        kl = logs.get("objective/kl")
        if self.noted or self.kl_note_at is None or not _finite(kl) or kl <= self.kl_note_at:
            return
        self.noted = True
        if state.is_world_process_zero:
            warn_user(f"KL to the reference (objective/kl) is {kl:.2f} nats per response at PPO iteration "
                      f"{logs.get('iteration', '?')}, past kl_target={self.kl_note_at:g} (what adaptive_kl would hold "
                      f"it to); with a fixed kl_coef nothing pulls it back, and the collapse watch warns only at "
                      f"{self.kl_threshold:g}. Read the sample tables: if the responses drift from what the reference "
                      "writes, raise kl_coef, set adaptive_kl=True, or lower learning_rate (docs/reference/metrics.md).")

    def on_epoch_end(self, args, state, control, **kwargs):
        """After a stop, Trainer's later events (the epoch end, an evaluation) save nothing either."""
        if self.stopped:
            control.should_save = False

    on_evaluate = on_epoch_end

    def _stop_text(self) -> str:
        if not self.stop:
            return " (stop_on_collapse=True stops training at such a signature.)"
        folder = self.last_checkpoint()
        if not folder:
            return (" stop_on_collapse=True: training stops now; no checkpoint was saved (save_strategy='steps' keeps "
                    "some), and the model in memory is the collapsed one: do not save_model() it as the result.")
        return (f" stop_on_collapse=True: training stops now; the last complete checkpoint is {folder}, and none is "
                "saved after it (the signature may have begun before it: compare its metrics). The model in memory "
                "is the collapsed one: do not save_model() it as the result; load the policy from that folder "
                "(from_pretrained), or fix the settings and train(resume_from_checkpoint=True) to resume from it.")

    def _span(self, key: str, least: int = 2) -> tuple[float, float, int] | None:
        """(start, now, w) of a metric: the means of its first and last w values, w = min(WINDOW, n // 2) of the n
        logged so far; None before `least` logs of it (2 for the wide thresholds, 2 * WINDOW for the narrow ones)."""
        values = self.history.get(key, [])
        width = min(WINDOW, len(values) // 2)
        return (_mean(values[:width]), _mean(values[-width:]), width) if len(values) >= least else None

    def _signatures(self, logs: dict):
        length, entropy = (self._span(key, 2 * WINDOW) for key in ("rollout/response_length", "policy/entropy_avg"))
        if (length and entropy and length[0] > 0 and length[1] >= LENGTH_RISE * length[0]
                and entropy[1] <= ENTROPY_FALL * entropy[0]):
            yield "length_entropy", (
                f"responses grew from {length[0]:.1f} to {length[1]:.1f} tokens while the policy's entropy fell from "
                f"{entropy[0]:.3f} to {entropy[1]:.3f}: the policy is likely exploiting a reward that pays for length "
                "(or repeating itself). Usually fixed by missing_eos_penalty (pay for stopping), "
                "overlong_buffer_length (penalise running long), a larger kl_coef, or a lower learning_rate.")
        entropy = self._span("policy/entropy_avg")
        if entropy and entropy[0] > 0 and entropy[1] <= ENTROPY_COLLAPSE * entropy[0]:
            yield "entropy", (
                f"the policy's entropy (policy/entropy_avg) fell from {entropy[0]:.3g} to {entropy[1]:.3g}, below "
                f"{ENTROPY_COLLAPSE:g}x its start: the policy has collapsed onto a few responses (mode collapse), "
                "usually from updates far too large. Usually fixed by a lower learning_rate, a larger kl_coef (or "
                "adaptive_kl), fewer num_ppo_epochs, or, to keep it exploring, a small entropy_coef > 0 or "
                "cliprange_high above cliprange (clip-higher).")
        kl = self._span("objective/kl")
        if self.kl_threshold is not None and kl and kl[1] > self.kl_threshold:
            width = kl[2]  # fewer than WINDOW logs so far: the message says how many it averaged
            unit = "rollout" if "objective/kl" in self.per_rollout else "log"
            yield "kl", (
                f"KL to the reference (objective/kl) averages {kl[1]:.2f} nats per response over the "
                f"{f'last {unit}' if width == 1 else f'last {width} {unit}s'}, beyond {self.kl_threshold:g} "
                f"({self.kl_reason}): the policy has moved far from the reference, typically gaming the reward or "
                "taking unstable updates. Usually fixed by a larger kl_coef (or adaptive_kl), a lower learning_rate, "
                "fewer num_ppo_epochs, or whiten_rewards=True.")
        clip = self._span("policy/clipfrac_avg", 2 * WINDOW)
        if clip and clip[1] > CLIPFRAC_MAX:
            yield "clipfrac", (
                f"the policy's clip fraction (policy/clipfrac_avg) averages {clip[1]:.2f} over the last "
                f"{WINDOW} logs (healthy PPO: a few percent to about 20%): each update moves the "
                "policy too far from the one that sampled. Usually fixed by a lower learning_rate, fewer "
                "num_ppo_epochs, or a larger batch (per_device_train_batch_size, gradient_accumulation_steps).")
        value = self._span("loss/value_avg")
        if value and value[0] > 0 and value[1] > max(VALUE_LOSS_RISE * value[0], VALUE_LOSS_FLOOR):
            yield "value_loss", (
                f"the value loss (loss/value_avg) rose from {value[0]:.3g} to {value[1]:.3g}, over "
                f"{VALUE_LOSS_RISE:g}x its start: the critic cannot follow the returns (the reward scale grew or "
                "exploded, or the updates are far too large). Usually fixed by whiten_rewards=True or "
                "normalize_rewards=True, reward_clip, a lower critic_learning_rate (or learning_rate), or a smaller "
                "cliprange_value.")
        # NaN (an evaluation with no finite score) compares False both ways, but say so rather than rely on it.
        hacked = [(k[len("eval_reward/"):-len("/win_rate_low")], logs[k]) for k in logs
                  if k.startswith("eval_reward/") and k.endswith("/win_rate_low") and _finite(logs[k])
                  and logs[k] > 0.5]
        judged = [(k[len("eval_judge/"):-len("/win_rate_high")], logs[k]) for k in logs
                  if k.startswith("eval_judge/") and k.endswith("/win_rate_high") and _finite(logs[k])
                  and logs[k] < 0.5]
        if hacked and judged:
            (reward, low), (judge, high) = hacked[0], judged[0]
            yield "reward_hacking", (
                f"the policy beats the reference on the training reward {reward!r} (win rate interval above 0.5, "
                f"from {low:.2f}) but loses on the judge {judge!r} (interval below 0.5, up to {high:.2f}): it is "
                "likely gaming the training reward. Usually fixed by a larger kl_coef, an earlier checkpoint, "
                "missing_eos_penalty when the gain is length, or a reward that also checks what the judge does "
                "(a list in reward_model with reward_weights); read eval_report.md to see how.")


class NoSignalWarning(UserWarning):
    """Every sample of an iteration got the same reward: nothing to learn from (see `NoSignal`)."""


# The no-signal warning says again, with the count, after this many iterations in a row without signal.
REPEAT_AFTER = 4
# A temperature this high or higher, on a policy of fewer parameters than SMALL_MODEL, samples near-random text: at 1.0
# SmolLM2-135M wrote "11 is a multiple of 2 (2In 2)" to a word problem; at 0.7 it starts at a few percent right.
HIGH_TEMPERATURE, SMALL_MODEL = 0.9, 1_000_000_000
# Fewer than this share of the responses stopping within response_length: the answers are cut off.
CUT_OFF = 0.5
FORMAT_NAMES = ("format", "fmt")  # a reward whose name holds one of these pays for the format


class NoSignal:
    """Warns once per reward, and once for the combined score, in the first PPO iteration where every sample got the
    same value of it (`rollout.steps.uniform_rewards`): no response then scores better than another, so the update
    learns nothing from it (a group baseline gives every response advantage 0; a critic learns a constant). A
    verifiable reward that a model does not hit yet (an answer check whose format an instruct model does not write)
    is the usual cause; the warning names what to try, and first what the run itself shows (`seen`): responses cut
    off at `response_length` (the count that stopped), a format reward already in the run, a temperature high for the
    policy's size. After `REPEAT_AFTER` iterations in a row without signal it says so again, with the count.

    `reward_names`: the run's rewards; `parameters`: the policy's parameter count (None: unknown); `can_stop`: the
    run has a stop token (without one no response ever stops, and the count says nothing)."""

    def __init__(self, args, reward_names=(), parameters: int | None = None, can_stop: bool = True):
        self.estimator, self.k = args.advantage_estimator, args.num_generations
        self.temperature = getattr(args, "temperature", None)
        self.response_length = getattr(args, "response_length", None)
        self.format_rewards = [n for n in reward_names if any(f in str(n).lower() for f in FORMAT_NAMES)]
        self.parameters, self.can_stop = parameters, can_stop
        self.warned: set = set()
        self.since: dict = {}  # reward (None: the combined score) -> the first iteration of its run without signal

    def check(self, uniform: dict, iteration: int, samples: int, stats: dict | None = None) -> None:
        """`uniform`: {reward name (None: the combined score): the one value every sample got} of this iteration;
        `stats`: its rollout statistics (`rollout/eos_rate`, reduced over processes), for what the run shows."""
        self.since = {name: self.since.get(name, iteration) for name in uniform}
        new = {name: value for name, value in uniform.items() if name not in self.warned}
        again = {name: value for name, value in uniform.items() if name in self.warned
                 and (iteration - self.since[name] + 1) % REPEAT_AFTER == 0}
        if not new and not again:
            return
        seen = self.seen(uniform, samples, (stats or {}).get("rollout/eos_rate"))
        shown = (" What this run shows: " + "; ".join(seen) + ".") if seen else ""
        if again:
            count = iteration - self.since[next(iter(again))] + 1
            warn_user(f"Still no learning signal at PPO iteration {iteration}: {' and '.join(_what(again))} got one "
                      f"value for every sampled response in each of the last {count} iterations (iterations "
                      f"{iteration - count + 1}-{iteration}, {samples} responses each), so no update has learned "
                      f"from it.{shown} See docs/guides/verifiable-rewards.md.", NoSignalWarning)
        if not new:
            return
        self.warned |= set(new)
        group = "" if self.k > 1 and self.estimator != "gae" else (
            " Sample several responses per prompt (num_generations=4 with advantage_estimator='grpo', 'rloo' or "
            "'auto'), so that the responses to one prompt are compared and one right answer among them is signal.")
        fmt = ("add a format reward beside it that pays for the format alone, once (exactly one final answer line, "
               "not one point per marker), or put a few-shot example of the format in the prompts (or "
               "system_prompt)." if not self.format_rewards else
               f"the run already has a format reward ({', '.join(map(repr, self.format_rewards))}): put a few-shot "
               "example of the whole answer in the prompts (or system_prompt), and check that the answers fit "
               "response_length.")
        warn_user(f"No learning signal in PPO iteration {iteration}: all {samples} sampled responses got the same "
                  f"value of {' and '.join(_what(new))}, so no response scores better than another and this update "
                  f"learns nothing from it.{shown} A verifiable reward (an answer check such as exact_answer) usually "
                  "starts at 0 because the model does not yet write the answer in the format it checks: "
                  f"{fmt}{group} And check the reward function on a few completions by hand: does it ever give "
                  "another value? frac_reward_zero_std in the logs is the fraction of prompt groups without spread. "
                  "See docs/guides/verifiable-rewards.md.", NoSignalWarning)

    def seen(self, uniform: dict, samples: int, eos_rate: float | None) -> list[str]:
        """What the run shows that explains an iteration without signal, each with its fix."""
        found = []
        if self.can_stop and eos_rate is not None and eos_rate < CUT_OFF:
            stopped = round(eos_rate * samples)
            found.append(f"{stopped} of {samples} responses ended within response_length={self.response_length}: "
                         "answers are cut off before they are finished; raise response_length")
        if self.format_rewards:
            varies = [n for n in self.format_rewards if n not in uniform]
            found.append(f"the format reward {', '.join(map(repr, self.format_rewards))} is already in the run"
                         + (" and varies, so answers reach the format but none is right yet" if varies else
                            " and pays every response the same too"))
        if (self.parameters is not None and self.parameters < SMALL_MODEL and self.temperature is not None
                and self.temperature >= HIGH_TEMPERATURE):
            found.append(f"temperature={self.temperature:g} is high for a policy of {self.parameters / 1e6:.0f}M "
                         "parameters: small models sample near-random text there; try temperature=0.7")
        return found


def parameter_count(model) -> int | None:
    """The model's parameter count as transformers counts it (`num_parameters`: a 4-bit weight counts whole), or
    None for a model without it."""
    count = getattr(model, "num_parameters", None)
    return count() if callable(count) else None


def _what(values: dict) -> list[str]:
    """The rewards of `values` ({name (None: the combined score): value}) as the no-signal warnings name them."""
    what = [f"the reward {name!r} ({value:g} each)" for name, value in values.items() if name is not None]
    if None in values:
        what.append(f"the combined score ({values[None]:g} each)")
    return what


def add_watch(callbacks: list | None, args, last_checkpoint: Callable[[], str | None]) -> list:
    """The trainer's `callbacks` plus the `CollapseWatch` that `args` ask for (none with `watch_collapse=False`);
    `last_checkpoint` returns the last complete checkpoint folder (or None)."""
    callbacks = list(callbacks or [])
    if not args.watch_collapse:
        return callbacks
    threshold, reason = args.collapse_kl_threshold, "collapse_kl_threshold"
    if threshold is None and args.adaptive_kl:
        threshold, reason = KL_TARGET_MULTIPLE * args.kl_target, f"{KL_TARGET_MULTIPLE:g} x kl_target"
    elif threshold is None:
        threshold, reason = KL_FIXED_DEFAULT, "the default with a fixed kl_coef; collapse_kl_threshold sets another"
    note = None if args.adaptive_kl or args.kl_target >= threshold else args.kl_target
    return [*callbacks, CollapseWatch(kl_threshold=threshold, stop=args.stop_on_collapse,
                                      last_checkpoint=last_checkpoint, kl_reason=reason, kl_note_at=note)]


def observe_rollout(callbacks: list, stats: dict) -> None:
    """Hand one rollout's statistics (`rollout.steps.rollout_stats`, reduced over processes, and its `iteration`) to
    each `CollapseWatch` among `callbacks` (`CollapseWatch.observe_rollout`)."""
    for callback in callbacks:
        if isinstance(callback, CollapseWatch):
            callback.observe_rollout(stats)


def stopped_by_collapse(callbacks: list) -> bool:
    """Whether a `CollapseWatch` among `callbacks` stopped training (no checkpoint of the collapsed state is saved)."""
    return any(isinstance(c, CollapseWatch) and c.stopped for c in callbacks)
