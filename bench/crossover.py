"""The crossover table (issue 50): where a fresh value head catches up with grpo k=4 on a verifiable reward.

    python bench/crossover.py --dry-run          # the runs, without running them
    python bench/crossover.py                    # words1 and words2, three configurations, seeds 0-2, one at a time
    python bench/crossover.py --tasks words2 --configs "grpo k=4" --seeds 0   # a subset (results are reused)
    python bench/crossover.py --tasks words1 arithmetic --seeds 0 1 2 3 4 --iterations 12   # 192 samples (issue 61)

PPO with a critic starts with a zero-initialised value head, so its first iterations' baseline is whatever the head
has learned (with whitened advantages: roughly the batch mean); grpo's group mean is a per-prompt baseline from the
first rollout. This table measures, at a small budget, which wins and how it depends on where the policy starts:
SmolLM2-135M-Instruct on the word-problem tasks of bench/learning.py (`TASKS["words1"]`, one-step problems, and
`TASKS["words2"]`, two-step ones: two start accuracies from one pipeline and one lenient final-number reward), with
`learning.CROSSOVER_CONFIGS`: hf_ppo's default (the shared value head, GAE), grpo k=4, and the shared head with the
existing options that might close the gap (`critic_learning_rate` 10x the policy's and a one-iteration
`critic_warmup_steps`), and `auto k=4` (issue 61: EVPO's per-batch switch between GAE and grpo's group baseline on
the explained variance, `advantage_estimator="auto"`). `--tasks arithmetic` adds bench/learning.py's arithmetic task
(SmolLM2, "a + b ="), and `--iterations` sets the budget (16 responses an iteration: 6 is 96 samples, 12 is 192).
Every run goes through bench/learning.py's machinery (`learning.launch`: a process of its own,
one torch thread; the one evaluator, `learning.evaluate`; results under bench/out/learning/<task>/<config>/, reused).

Per run: the held-out accuracy after the budget (32 problems, one sample each at temperature 0.7, for the policy and the
SFT start alike), and the training curve (the mean score of every iteration's 16 sampled responses), from which the
table reads the sampled accuracy at half the budget and at the end. Cells are mean +/- SE over seeds; a difference is
+/- 2 SE (Welch), beyond the seed noise when the interval excludes 0. Left out on purpose: greedy accuracy, budgets
beyond 128 samples and more than 3 seeds (2 CPU cores), and the peer (the second learning table has it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import learning  # noqa: E402

TASKS = ("words1", "words2")
MORE_TASKS = ("arithmetic",)  # run when named (`--tasks`): the second learning table's task, at this table's budgets
GRPO = "grpo k=4"


def mean_se(values: list[float], percent: bool = True) -> str:
    """`values`' mean +/- its standard error over seeds (in percent points by default)."""
    scale = 100 if percent else 1
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.1f} +/- {scale * se:.1f}" if percent else \
        f"{statistics.mean(values):.2f} +/- {se:.2f}"


def versus(a: list[float], b: list[float]) -> str:
    """mean(a) - mean(b) in percent points, +/- twice the Welch standard error."""
    if len(a) < 2 or len(b) < 2:
        return ""
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return f"{100 * (statistics.mean(a) - statistics.mean(b)):+.1f} +/- {200 * se:.1f}"


def window(scores: list[float], end: int, width: int = 2) -> float:
    """The mean training score of the `width` iterations ending at iteration `end` (1-based; at least the first: a
    one-iteration dry run's half budget is its one iteration)."""
    end = max(1, end)
    return statistics.mean(scores[max(0, end - width):end])


def table(runs: list[dict]) -> str:
    """One row per task and configuration: the start, held-out accuracy after the budget, its difference from grpo
    k=4, the training accuracy at half the budget and at the end, the mean training curve, KL and CPU seconds."""
    lines = ["| task (start) | configuration | held-out accuracy after the budget | vs grpo k=4 (+/- 2 SE) | "
             "training accuracy, first 2 iterations | at half the budget | at the end | mean training curve | "
             "held-out KL | CPU s (train) | seeds |", "|---" * 11 + "|"]
    for task in dict.fromkeys(r["task"] for r in runs):
        grpo = [r["held_out_reward"] for r in runs if r["task"] == task and r["config"] == GRPO]
        # The start: the SFT policy's held-out accuracy in the same evaluations, one per seed (the reference's
        # samples are the same for every configuration at a seed).
        reference = {r["seed"]: r["reference_reward"] for r in runs if r["task"] == task}
        start = statistics.mean(reference.values()) if reference else 0.0
        for config in learning.CROSSOVER_CONFIGS:
            rows = sorted((r for r in runs if r["task"] == task and r["config"] == config), key=lambda r: r["seed"])
            if not rows:
                continue
            n = rows[0]["iterations"]
            curves = [r["train_scores"] for r in rows]
            curve = " ".join(f"{100 * statistics.mean(c[i] for c in curves):.0f}" for i in range(n))
            held = [r["held_out_reward"] for r in rows]
            lines.append(
                f"| {task} (SFT {100 * start:.1f}%) | {config} | {mean_se(held)} | "
                f"{versus(held, grpo) if config != GRPO else ''} | {mean_se([window(c, 2) for c in curves])} | "
                f"{mean_se([window(c, n // 2) for c in curves])} | {mean_se([window(c, n) for c in curves])} | "
                f"{curve} | {mean_se([r['held_out_kl'] for r in rows], percent=False)} | "
                f"{statistics.mean(r['cpu_seconds'] for r in rows):.0f} | {len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the runs, run none")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS + MORE_TASKS)
    parser.add_argument("--configs", nargs="+", default=list(learning.CROSSOVER_CONFIGS),
                        choices=list(learning.CROSSOVER_CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the tasks' (0-2)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results are saved")
    parser.add_argument("--iterations", type=int, default=None,
                        help="the budget per run in iterations of 16 responses (default: the task's, 6 = 96 samples)")
    args = parser.parse_args(argv)
    # Task by task, seed-major within a task: a table cut short by the clock has every configuration of the tasks
    # it reached at the seeds it reached.
    plan = [(task, config, seed) for task in args.tasks for seed in (args.seeds or learning.TASKS[task].seeds)
            for config in args.configs]
    print(f"[crossover] {len(plan)} runs, one at a time:")
    for task, config, seed in plan:
        print(f"  {task} {config:40s} seed {seed}: {learning.config_overrides(task, config)}")
    if args.dry_run:
        return []
    learning.smollm2()  # converted once, before the runs share it
    runs = []
    for task, config, seed in plan:
        r = learning.launch(task, config, seed, False, args.fresh, args.iterations)
        runs.append(r)
        print(f"[crossover] {task} / {config} / seed {seed}: held-out {r['held_out_reward']:.3f} (SFT "
              f"{r['reference_reward']:.3f}), training {' '.join(f'{s:.2f}' for s in r['train_scores'])}, KL "
              f"{r['held_out_kl']:.2f}, {r['cpu_seconds']} CPU s", flush=True)
    md = table(runs)
    out = learning.OUT / ("crossover.md" if args.iterations is None else f"crossover-it{args.iterations}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md + "\n")
    print("\n" + md)
    return runs


if __name__ == "__main__":
    main()
