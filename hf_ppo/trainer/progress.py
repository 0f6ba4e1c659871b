"""What the user sees while PPO runs: a progress bar with iteration, reward and KL, and sample-completion
tables (to the console and to the report_to integrations)."""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback

from ..rollout.rewards import decode_masked


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
        if self.training_bar is not None and self.description:
            self.training_bar.set_description(self.description)

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
    """Trainer's progress bar (it counts optimizer steps), captioned with the PPO iteration, the combined reward, the
    first reward's own mean (`rewards/<name>/mean`) and KL."""

    def __init__(self, args):
        super().__init__("PPO", args.print_metrics)
        self.steps_per_iteration = args.optimizer_steps_per_iteration
        # k1's batch mean can be negative (an unbiased estimate of a non-negative KL): the bar says which it shows.
        self.kl_label = "kl" if args.kl_estimator in ("k2", "k3") else "kl_k1"

    def caption(self, state, logs: dict) -> None:
        if "objective/scores" in logs:
            total = max(1, state.max_steps // self.steps_per_iteration)
            self.training_bar.set_description(f"PPO iteration {logs.get('iteration', 0)}/{total}")
            postfix = {"reward": f"{logs['objective/scores']:.3f}"}
            first = next((k for k in logs if k.startswith("rewards/") and k.endswith("/mean")), None)
            if first:  # the first reward's own mean (over the rows it applies to), beside the combined score
                name = first[len("rewards/"):-len("/mean")]
                postfix[f"{name}_mean" if name in ("reward", self.kl_label) else name] = f"{logs[first]:.3f}"
            postfix[self.kl_label] = f"{logs['objective/kl']:.3f}"
            self.training_bar.set_postfix(postfix, refresh=False)


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
    table.add_column("prompt", overflow="fold")
    table.add_column("completion", overflow="fold")
    table.add_column("score", justify="right")
    for prompt, completion, score in rows:
        table.add_row(prompt, completion, f"{score:.3f}")
    text = io.StringIO()
    Console(file=text, width=min(120, shutil.get_terminal_size().columns), force_terminal=False).print(table)
    tqdm.write(text.getvalue().rstrip("\n"))  # above the progress bar, which is drawn again below it


def maybe_log_samples(tokenizer, batch, iteration: int, step: int, max_steps: int, args) -> None:
    """Every so many iterations (`num_sample_generations` tables over the run), a table of up to 8 (prompt,
    completion, score) rows of the rollout `batch`."""
    n = args.num_sample_generations
    if n <= 0:
        return
    total = max(1, max_steps // args.optimizer_steps_per_iteration)
    every = max(1, total // n)
    if (iteration - 1) % every:
        return
    rows = list(zip(decode_masked(tokenizer, batch.queries, batch.query_mask),
                    decode_masked(tokenizer, batch.responses, batch.response_mask), batch.scores.tolist()))[:8]
    log_samples_table(rows, iteration, step, args.report_to)
