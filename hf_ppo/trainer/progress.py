"""What the user sees while PPO runs: a progress bar with iteration, reward and KL, sample-completion tables (to the
console and to the report_to integrations), and a closing summary (reward first -> last, KL last and peak, seconds
per iteration) that the demo prints too."""

from __future__ import annotations

import math
import time

from transformers.trainer_callback import ProgressCallback

from ..rollout.scoring import decode_masked

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

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.unit = "step"  # it counts optimizer steps: the rate reads s/step, not "it/s"
            if self.description:
                self.training_bar.set_description(self.description)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        new = self.prediction_bar is None
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)
        if new and self.prediction_bar is not None:  # Trainer's evaluation bar has no label
            self.prediction_bar.unit = "batch"
            self.prediction_bar.set_description(f"{self.description} evaluation" if self.description else "evaluation")

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
        self.kl_label = "kl" if args.kl_estimator in ("k2", "k3") else "kl_k1"
        self.started = None  # (time, global step) when train() began

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.started = (time.perf_counter(), state.global_step)

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
            self.training_bar.set_description(f"PPO iteration {logs.get('iteration', 0)}/{total}")
            postfix = {"reward": f"{logs['objective/scores']:.3f}"}
            first = next((k for k in logs if k.startswith("rewards/") and k.endswith("/mean")), None)
            if first:  # the first reward's own mean (over the rows it applies to), beside the combined score
                name = first[len("rewards/"):-len("/mean")]
                postfix[f"{name}_mean" if name in ("reward", self.kl_label) else name] = f"{logs[first]:.3f}"
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
    and the last logged iteration, `kl_figures`, and `seconds` (the run's wall time) per iteration. {} when no
    iteration was logged."""
    scores = [e["objective/scores"] for e in history if "objective/scores" in e]
    if not scores:
        return {}
    return {"reward": {"first": scores[0], "last": scores[-1]}, "kl": kl_figures(history), "iterations": iterations,
            "seconds": seconds, "seconds_per_iteration": seconds / max(1, iterations)}


def summary_text(summary: dict, kl_label: str = "kl") -> str:
    """`run_summary` in one line: reward first -> last, KL last and peak (nats per response), seconds per iteration."""
    kl, reward = summary["kl"], summary["reward"]
    return (f"PPO: {summary['iterations']} iterations in {summary['seconds']:.0f}s "
            f"({summary['seconds_per_iteration']:.1f} s/iteration); reward {reward['first']:+.3f} -> "
            f"{reward['last']:+.3f}; {kl_label} to the reference {kl['last']:.2f} at the end, peak {kl['peak']:.2f} "
            f"(iteration {kl['iteration_of_peak']})")


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


def prompt_cell(raw, decoded: str) -> str:
    """What a table shows of a prompt: of a chat prompt its last user turn (the template's markup and system prompt
    are the same on every row), of a text prompt the text. `raw` is the dataset's prompt (text or messages) and
    `decoded` the prompt's tokens as text; `raw` is shown only when that text holds it (so a row the refill replaced,
    or a prompt truncated through its last turn, shows its tokens instead)."""
    if isinstance(raw, list):
        turns = [t for t in raw if isinstance(t, dict) and t.get("role") == "user"]
        content = turns[-1].get("content") if turns else None
        if isinstance(content, list):  # content parts: their text
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        raw = content
    return raw if isinstance(raw, str) and raw.strip() and raw.strip() in decoded else decoded


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


def log_samples_table(rows: list[tuple[str, str, float]], iteration: int, step: int, report_to: list[str]) -> None:
    """Show (prompt, completion, score) rows: a wandb/trackio table when one is active, else a rich table printed."""
    report_to = report_to or []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(columns=["prompt", "completion", "score"], data=[list(r) for r in rows])},
                      step=step)
            return
    if "trackio" in report_to:
        import trackio

        trackio.log({"completions": trackio.Table(columns=["prompt", "completion", "score"], data=[list(r) for r in rows])},
                    step=step)
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
    for prompt, completion, score in rows[:CONSOLE_ROWS]:
        table.add_row(*short_cells(prompt, completion), f"{score:.3f}")
    text = io.StringIO()
    Console(file=text, width=min(120, shutil.get_terminal_size().columns), force_terminal=False).print(table)
    tqdm.write(text.getvalue().rstrip("\n"))  # above the progress bar, which is drawn again below it


def maybe_log_samples(tokenizer, batch, iteration: int, step: int, max_steps: int, args, prompts: list | None = None
                      ) -> None:
    """At `num_sample_generations` iterations spread over the run (`sample_iterations`), a table of (prompt,
    completion, score) rows of the rollout `batch`; `prompts`, the dataset's prompts of the batch (text or messages),
    give each row's prompt cell (`prompt_cell`)."""
    total = iterations_in(max_steps, args.optimizer_steps_per_iteration)
    if iteration not in sample_iterations(total, args.num_sample_generations):
        return
    decoded = decode_masked(tokenizer, batch.queries[:TRACKER_ROWS], batch.query_mask[:TRACKER_ROWS])
    aligned = prompts is not None and len(prompts) == len(batch.queries)
    raw = list(prompts)[:TRACKER_ROWS] if aligned else [None] * TRACKER_ROWS
    rows = list(zip([prompt_cell(r, d) for r, d in zip(raw, decoded)],
                    decode_masked(tokenizer, batch.responses[:TRACKER_ROWS], batch.response_mask[:TRACKER_ROWS]),
                    batch.scores[:TRACKER_ROWS].tolist()))
    log_samples_table(rows, iteration, step, args.report_to)
