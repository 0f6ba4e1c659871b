"""The offline arithmetic task (issue 37's twin of the GSM8K recipe): accuracy before -> after for PPO with the
value head and for GRPO k=4 at equal samples, over seeds, with pass@k from the same evaluation.

    OMP_NUM_THREADS=1 python bench/arithmetic.py                 # 3 seeds x 2 methods, the table for RESULTS.md
    OMP_NUM_THREADS=1 python bench/arithmetic.py --seeds 0 --k 4  # one seed, pass@4

The task, the SFT policy and the recipe are `hf_ppo.cli.arithmetic` and hf_ppo/cli/configs/arithmetic.yaml: 400 sums
a + b (0 <= a, b <= 19), 320 to train on and 80 held out; the tiny Llama after 300 SFT steps; the reward
`hf_ppo.rewards.exact_answer` on the `answer` column, given by `reward_funcs`. Each run is `hf-ppo train` (the recipe's
`main`) with the YAML, then `trainer.evaluate()` on the 80 held-out questions with `num_eval_samples` = k: k responses
per question from the policy (after) and from its reference, the SFT policy (before), sampled at the training
temperature (1.0); `eval_reward/exact_answer/{policy,reference}` is the sampled accuracy (= pass@1) and `.../pass@k`
the chance that one of k samples is right. Greedy accuracy (the policy's argmax answer) is measured beside it.

Equal samples: both methods generate 64 completions per iteration for the same 20 iterations (1,280 completions):
PPO (gae, the shared value head) on 64 questions x 1 sample, GRPO on 16 questions x 4 samples (no critic).
Writes bench/out/arithmetic.json and prints a Markdown table (pasted into bench/RESULTS.md by hand).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from hf_ppo.cli import arithmetic  # noqa: E402
from hf_ppo.cli.train import main as hf_ppo_train  # noqa: E402

METHODS = {
    "PPO, value head (gae, k=1)": [],
    "GRPO k=4": ["--advantage_estimator", "grpo", "--num_generations", "4"],
}
REWARD = "eval_reward/exact_answer"


def run(method: str, seed: int, k: int, out: Path, sft: Path, train: Path, test: Path, tokenizer) -> dict:
    """One `hf-ppo train` run of `method` at `seed`, then the held-out evaluation; the numbers of the table."""
    start = time.perf_counter()
    trainer = hf_ppo_train(["--config", str(arithmetic.arithmetic_config()), "--model_name_or_path", str(sft),
                            "--dataset_name", str(train), "--dataset_test_split", str(test),
                            "--output_dir", str(out / f"{method.split()[0].strip(',').lower()}-seed{seed}"),
                            "--seed", str(seed),
                            "--num_eval_samples", str(k), *METHODS[method]], command="hf-ppo train")
    train_s = time.perf_counter() - start
    metrics = trainer.evaluate()
    held_out = arithmetic.rows(arithmetic.split_pairs()[1])
    greedy_after = arithmetic.accuracy(arithmetic.load_policy(trainer.args.output_dir), tokenizer, held_out)
    return {"method": method, "seed": seed, "k": k, "train_seconds": round(train_s, 1),
            "completions": trainer.state.global_step // trainer.args.optimizer_steps_per_iteration
            * trainer.args.rollout_batch_size,
            "greedy_after": greedy_after,
            **{f"{side}/{what}": metrics[f"{REWARD}/{what}/{side}" if what != "mean" else f"{REWARD}/{side}"]
               for side in ("reference", "policy") for what in ("mean", f"pass@{k}")}}


def fmt(values: list[float]) -> str:
    """mean +/- sd (sd over seeds; none for one seed), as percentages."""
    mean = statistics.mean(values)
    return f"{mean:.1%}" + (f" ± {statistics.stdev(values):.1%}" if len(values) > 1 else "")


def table(results: list[dict], greedy_before: float, k: int, n: int) -> str:
    """The Markdown table: one row per method, mean +/- sd over seeds, before -> after."""
    lines = [f"| method | greedy accuracy | sampled accuracy (pass@1) | pass@{k} | completions | train s |",
             "|---|---|---|---|---|---|"]
    for method in METHODS:
        rows = [r for r in results if r["method"] == method]
        if not rows:
            continue
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        lines.append(
            f"| {method} | {greedy_before:.1%} -> {fmt(col('greedy_after'))} "
            f"| {fmt(col('reference/mean'))} -> {fmt(col('policy/mean'))} "
            f"| {fmt(col(f'reference/pass@{k}'))} -> {fmt(col(f'policy/pass@{k}'))} "
            f"| {rows[0]['completions']} | {statistics.mean(col('train_seconds')):.0f} |")
    seeds = sorted({r["seed"] for r in results})
    lines.append("")
    lines.append(f"{n} held-out questions; before = the SFT policy (the reference), after = the trained policy; "
                 f"mean ± sd over seeds {seeds}; sampled at temperature 1.0, {k} samples per question.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Build the SFT policy (cached), run every method at every seed, print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--k", type=int, default=8, help="Samples per held-out question (pass@k).")
    parser.add_argument("--out", default=str(HERE / "out" / "arithmetic"))
    args = parser.parse_args(argv)

    arithmetic.quiet_console()
    from transformers import AutoTokenizer

    start = time.perf_counter()
    out = Path(args.out)
    sft = out / "cache" / arithmetic.CACHE_VERSION / "sft"
    arithmetic.cached(lambda d: arithmetic.build_sft_policy(d), sft, False, "SFT policy")
    train_pairs, held_out_pairs = arithmetic.split_pairs()
    train = arithmetic.write_jsonl(out / "train.jsonl", arithmetic.rows(train_pairs))
    test = arithmetic.write_jsonl(out / "test.jsonl", arithmetic.rows(held_out_pairs))
    tokenizer = AutoTokenizer.from_pretrained(sft)
    greedy_before = arithmetic.accuracy(arithmetic.load_policy(sft), tokenizer, arithmetic.rows(held_out_pairs))
    results = [run(method, seed, args.k, out, sft, train, test, tokenizer)
               for seed in args.seeds for method in METHODS]
    markdown = table(results, greedy_before, args.k, len(held_out_pairs))
    (out / "arithmetic.json").write_text(json.dumps({"greedy_before": greedy_before, "runs": results}, indent=2))
    print(markdown)
    print(f"[bench/arithmetic] {len(results)} runs in {time.perf_counter() - start:.0f}s; "
          f"results in {out / 'arithmetic.json'}")
    return results


if __name__ == "__main__":
    main()
