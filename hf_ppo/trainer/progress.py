"""What the user sees while PPO runs: a progress bar with iteration, reward and KL, sample-completion tables (to the
console and to the report_to integrations), and a closing summary (reward first -> last, KL last and peak, seconds
per iteration) that the demo prints too."""

from __future__ import annotations

import contextlib
import functools
import math
import time

from tqdm.auto import tqdm
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import has_length

from ..evaluation.report import prompt_cell
from ..rollout.engines import sampling_progress
from ..rollout.scoring import decode_masked

# The sampling status on a bar is redrawn at most this often (seconds): a 1024-token rollout reports 1024 times.
STATUS_SECONDS = 0.5


@contextlib.contextmanager
def showing_sampling(callbacks: list, state, phase: str):
    """Inside, the engines' per-token progress (`rollout.engines.sampling_progress`) shows on the progress bar of the
    main process (`StageProgressCallback.sampling`): `phase` 'rollout' or 'evaluation'. Nothing without a bar
    (`disable_tqdm`, another process)."""
    bar = next((c for c in callbacks if isinstance(c, StageProgressCallback)), None)
    if bar is None or not state.is_world_process_zero:
        yield
        return
    with sampling_progress(functools.partial(bar.sampling, phase)):
        try:
            yield
        finally:
            bar.sampling_done(phase)


# A console table: few rows, short cells (the tracker tables keep TRACKER_ROWS rows of the whole text).
CONSOLE_ROWS, TRACKER_ROWS = 4, 8
PROMPT_CHARS, COMPLETION_CHARS = 100, 160


def iterations_in(max_steps: int, steps_per_iteration: int) -> int:
    """PPO iterations in a run of `max_steps` optimizer steps (a last one cut short counts)."""
    return max(1, math.ceil(max_steps / steps_per_iteration))


class StageProgressCallback(ProgressCallback):
    """Trainer's progress bar, named after its stage and captioned with the loss; the metric dicts stay off the console.

    Trainer's own `ProgressCallback` prints every logged dict under the bar (dozens of lines per run). Here they
    only go to the trackers (`report_to`) and `trainer_state.json`; `print_metrics=True` prints them as Trainer does.
    """

    def __init__(self, description: str | None = None, print_metrics: bool = False):
        super().__init__()
        self.description, self.print_metrics = description, print_metrics
        self._status_time = -math.inf  # when the sampling status was last drawn
        self._state = None  # Trainer's state, for the iteration the bar names

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.unit = "step"  # it counts optimizer steps: the rate reads s/step, not "it/s"
            if self.description:
                self.training_bar.set_description(self.description)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        new = self.prediction_bar is None
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)
        bar = self.prediction_bar
        if bar is not None and bar.total is None and has_length(eval_dataloader):  # opened by `sampling`
            bar.total = len(eval_dataloader)
            bar.set_postfix_str("", refresh=True)
        if new and bar is not None:  # Trainer's evaluation bar has no label
            self._label_prediction_bar()

    def _label_prediction_bar(self) -> None:
        self.prediction_bar.unit = "batch"
        self.prediction_bar.set_description(f"{self.description} evaluation" if self.description else "evaluation")

    def sampling(self, phase: str, first_row: int, end_row: int, rows: int, token: int, length: int) -> None:
        """Say on the bar what is being sampled (`rollout.engines.sampling_progress` calls it after each decoded
        token): how many responses, which rows of them when they come in several passes, and how many of the
        `length` tokens so far; redrawn at most every `STATUS_SECONDS`. `phase`: 'rollout' (on the training bar) or
        'evaluation' (on the evaluation bar, opened here when the first batch is still sampling)."""
        now = time.monotonic()
        if now - self._status_time < STATUS_SECONDS and token not in (1, length):
            return
        self._status_time = now
        passes = f" (rows {first_row + 1}-{end_row})" if end_row - first_row < rows else ""
        status = f"sampling {rows} responses{passes}: token {token}/{length}"
        if phase == "rollout":  # on the training bar (none: a rollout outside train(), e.g. `step()`)
            if self.training_bar is not None:
                self.training_bar.set_description(self.stage_text(sampling=True) + f": {status}")
            return
        if self.prediction_bar is None:
            self.prediction_bar = tqdm(total=None, leave=self.training_bar is None, dynamic_ncols=True)
            self._label_prediction_bar()
        self.prediction_bar.set_postfix_str(status)

    def sampling_done(self, phase: str) -> None:
        """The rollout's sampling is over: the training bar says the stage again."""
        if phase == "rollout" and self.training_bar is not None:
            self.training_bar.set_description(self.stage_text())

    def stage_text(self, sampling: bool = False) -> str:
        """What the training bar is labelled with (`sampling`: while a rollout samples)."""
        return self.description or ""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.caption(state, logs)
        if self.print_metrics:
            super().on_log(args, state, control, logs=logs, **kwargs)

    def caption(self, state, logs: dict) -> None:
        """Show the latest training loss beside the bar."""
        if "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)


class PPOProgressCallback(StageProgressCallback):
    """Trainer's progress bar (it counts optimizer steps, and its rate is per step), captioned with the PPO iteration,
    the combined reward, the first reward's own mean (`rewards/<name>/mean`) and KL; when training ends, one summary
    line (`run_summary`)."""

    def __init__(self, args):
        super().__init__("PPO", args.print_metrics)
        self.steps_per_iteration = args.optimizer_steps_per_iteration
        # k1's batch mean can be negative (an unbiased estimate of a non-negative KL): the bar says which it shows.
        self.kl_label = "kl" if args.kl_estimator != "k1" else "kl_k1"
        self.started = None  # (time, global step) when train() began

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.started = (time.perf_counter(), state.global_step)
        self._state = state

    def on_step_end(self, args, state, control, **kwargs):
        # The iteration the last optimizer step belongs to, as the sample tables number it: a log every
        # `logging_steps` optimizer steps may skip iterations, the bar's number does not.
        self._state = state
        if self.training_bar is not None:
            self.training_bar.set_description(self.stage_text(), refresh=False)
        super().on_step_end(args, state, control, **kwargs)

    def stage_text(self, sampling: bool = False) -> str:
        """'PPO iteration i/n': the iteration of the last optimizer step (`sampling`: the one whose rollout is being
        sampled), numbered as the sample tables and the logs' `iteration` number it."""
        if self._state is None:
            return self.description
        total = iterations_in(self._state.max_steps, self.steps_per_iteration)
        done = self._state.global_step / self.steps_per_iteration
        return f"PPO iteration {min(total, int(done) + 1 if sampling else max(1, math.ceil(done)))}/{total}"

    def on_train_end(self, args, state, control, **kwargs):
        shown = self.training_bar is not None  # a bar on this process: the summary goes where the bar was
        super().on_train_end(args, state, control, **kwargs)
        if shown and self.started is not None:
            start, first_step = self.started
            iterations = math.ceil((state.global_step - first_step) / self.steps_per_iteration)
            summary = run_summary(state.log_history, time.perf_counter() - start, iterations)
            if summary:
                print(summary_text(summary, self.kl_label))

    def caption(self, state, logs: dict) -> None:
        if "objective/scores" in logs:
            total = iterations_in(state.max_steps, self.steps_per_iteration)
            # The log's own iteration (the rollouts done): the iteration of its last step, as `stage_text` names it.
            self.training_bar.set_description(f"PPO iteration {logs.get('iteration', 0)}/{total}")
            postfix = {"reward": f"{logs['objective/scores']:.3f}"}
            first = next((k for k in logs if k.startswith("rewards/") and k.endswith("/mean")), None)
            if first:  # the first reward's own mean (over the rows it applies to), beside the combined score
                name = first[len("rewards/"):-len("/mean")]
                postfix[f"{name}_mean" if name in ("reward", self.kl_label) else name] = f"{logs[first]:.3f}"
            if "objective/kl" in logs:  # absent from a log of rollouts that skipped the reference (stats_pass_every)
                postfix[self.kl_label] = f"{logs['objective/kl']:.3f}"
            self.training_bar.set_postfix(postfix, refresh=False)


def kl_figures(history: list[dict]) -> dict:
    """First, last and peak logged `objective/kl` (nats per response), with the PPO iteration of the peak; {} when
    none was logged."""
    logged = [(e["objective/kl"], e.get("iteration")) for e in history if "objective/kl" in e]
    if not logged:
        return {}
    peak, at = max(logged, key=lambda pair: pair[0])
    return {"first": logged[0][0], "last": logged[-1][0], "peak": peak, "iteration_of_peak": at}


def run_summary(history: list[dict], seconds: float, iterations: int) -> dict:
    """The figures a run ends on, from Trainer's `log_history`: the combined reward (`objective/scores`) at the first
    and the last logged iteration, `kl_figures`, `seconds` (the run's wall time) per iteration, and whether every
    logged KL was exactly 0 (`policy_unmoved`: no update moved the policy). {} when no iteration was logged."""
    scores = [e["objective/scores"] for e in history if "objective/scores" in e]
    if not scores:
        return {}
    kls = [e["objective/kl"] for e in history if "objective/kl" in e]
    return {"reward": {"first": scores[0], "last": scores[-1]}, "kl": kl_figures(history), "iterations": iterations,
            "seconds": seconds, "seconds_per_iteration": seconds / max(1, iterations),
            "policy_unmoved": bool(kls) and all(kl == 0 for kl in kls)}


def summary_text(summary: dict, kl_label: str = "kl") -> str:
    """`run_summary` in one line: reward first -> last, KL last and peak (nats per response), seconds per iteration."""
    kl, reward = summary["kl"], summary["reward"]
    text = (f"PPO: {summary['iterations']} iterations in {summary['seconds']:.0f}s "
            f"({summary['seconds_per_iteration']:.1f} s/iteration); reward {reward['first']:+.3f} -> "
            f"{reward['last']:+.3f}; {kl_label} to the reference {kl['last']:.2f} at the end, peak {kl['peak']:.2f} "
            f"(iteration {kl['iteration_of_peak']})")
    if summary.get("policy_unmoved"):  # every logged KL exactly 0: the policy is still the reference
        text += ("; no update moved the policy (its KL to the reference stayed 0: the rollouts gave no learning "
                 "signal, or every update was skipped; the warnings above say which)")
    return text


def sample_iterations(total: int, n: int) -> set[int]:
    """The PPO iterations (1-based, of `total`) that log a sample table: `n` of them (all when n >= total), spread
    evenly, the first and the last included."""
    if n <= 0:
        return set()
    if n >= total:
        return set(range(1, total + 1))
    if n == 1:
        return {1}
    return {1 + j * (total - 1) // (n - 1) for j in range(n)}


def _one_line(text: str) -> str:
    return " ".join(text.replace("\n", " \u23ce ").split())  # a newline shows as ⏎: the cell stays compact


def short_cells(prompt: str, completion: str) -> tuple[str, str]:
    """A console row: each cell on one line, the prompt's last PROMPT_CHARS (its end is what the policy answers) and
    the completion's first COMPLETION_CHARS; an empty completion says so (a chat model given raw text often answers
    with nothing)."""
    prompt, completion = _one_line(prompt), _one_line(completion)
    if len(prompt) > PROMPT_CHARS:
        prompt = "\u2026" + prompt[-(PROMPT_CHARS - 1):]
    if len(completion) > COMPLETION_CHARS:
        completion = completion[:COMPLETION_CHARS - 1] + "\u2026"
    return prompt, completion or "(empty)"


def log_samples_table(rows: list[tuple[str, str, float]], iteration: int, step: int, report_to: list[str],
                      extra_columns: tuple[str, ...] = ()) -> None:
    """Show (prompt, completion, score, *extra) rows: a wandb/trackio table when one is active, else a rich table
    printed. `extra_columns`: the names of the values after the score (the reward functions' `log_extra`)."""
    report_to = report_to or []
    columns = ["prompt", "completion", "score", *extra_columns]
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(columns=columns, data=[list(r) for r in rows])}, step=step)
            return
    if "trackio" in report_to:
        import trackio

        trackio.log({"completions": trackio.Table(columns=columns, data=[list(r) for r in rows])}, step=step)
        return
    if [r for r in report_to if r not in ("none",)]:
        return  # other trackers (tensorboard, ...) have no table type: the scalars are logged as usual
    import io
    import shutil

    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    table = Table(title=f"Samples at PPO iteration {iteration} (step {step})", show_lines=True)
    table.add_column("prompt (last user turn)", overflow="fold", ratio=2)
    table.add_column("completion", overflow="fold", ratio=3)
    table.add_column("score", justify="right")
    for name in extra_columns:
        table.add_column(name, overflow="fold")
    for prompt, completion, score, *extra in rows[:CONSOLE_ROWS]:
        table.add_row(*short_cells(prompt, completion), f"{score:.3f}", *(_one_line(str(v))[:COMPLETION_CHARS]
                                                                         for v in extra))
    text = io.StringIO()
    Console(file=text, width=min(120, shutil.get_terminal_size().columns), force_terminal=False).print(table)
    tqdm.write(text.getvalue().rstrip("\n"))  # above the progress bar, which is drawn again below it


def maybe_log_samples(tokenizer, batch, iteration: int, step: int, max_steps: int, args, prompts: list | None = None,
                      extra: dict[str, list] | None = None) -> None:
    """At `num_sample_generations` iterations spread over the run (`sample_iterations`), a table of (prompt,
    completion, score) rows of the rollout `batch`; `prompts`, the dataset's prompts of the batch (text or messages),
    give each row's prompt cell (`prompt_cell`); `extra`, {column: one value per row of the batch} that reward
    functions logged (TRL's `log_extra`), more columns (one whose values do not match the rows is left out)."""
    total = iterations_in(max_steps, args.optimizer_steps_per_iteration)
    if iteration not in sample_iterations(total, args.num_sample_generations):
        return
    decoded = decode_masked(tokenizer, batch.queries[:TRACKER_ROWS], batch.query_mask[:TRACKER_ROWS])
    aligned = prompts is not None and len(prompts) == len(batch.queries)
    raw = list(prompts)[:TRACKER_ROWS] if aligned else [None] * TRACKER_ROWS
    rows = list(zip([prompt_cell(r, d) for r, d in zip(raw, decoded)],
                    decode_masked(tokenizer, batch.responses[:TRACKER_ROWS], batch.response_mask[:TRACKER_ROWS]),
                    batch.scores[:TRACKER_ROWS].tolist()))
    extra = {k: v for k, v in (extra or {}).items() if len(v) == len(batch.queries)}
    rows = [(*row, *(values[i] for values in extra.values())) for i, row in enumerate(rows)]
    log_samples_table(rows, iteration, step, args.report_to, tuple(extra))
