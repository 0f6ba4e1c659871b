"""The learning table: which critic / estimator configuration learns best at equal samples.

    python bench/learning.py --dry-run              # the runs the full table makes, without running them
    python bench/learning.py --quick                # a smoke run: every configuration, 2 iterations, seed 0
    python bench/learning.py                        # the full table: 30 iterations, seeds 0-4, both tasks

Every configuration trains the same LoRA (r 16) adapter on the demo's SFT policy (recipes/demo.py's cached models,
built if missing; `--quick` uses the demo's quick cache) with the demo recipe's settings (recipes/configs/demo.yaml:
12-token responses, temperature 0.7, `missing_eos_penalty` 1.0, lr 2e-4 constant, kl_coef 0.2, 4 PPO epochs x 2
minibatches) and **64 responses per iteration**, so 30 iterations are the 1,920 samples of the demo comparison
(gae: 64 prompts x k=1; grpo / rloo: 16 prompts x k=4). Tasks: "demo" (the demo's trained 4-bit reward model) and
"rule" (`common.rule_score`, +1 per " great": harder, it does not saturate in 30 iterations; no reward model, so
the separate critic starts from the SFT checkpoint). Configurations (`CONFIGS`): today's default (shared value
head); the separate critic from the reward model; the critic recipe (shared head with `critic_learning_rate` 10x
the policy's, a one-iteration warm-up, `critic_updates_per_step=2`, `lam_critic=1.0`); grpo and rloo with k=4.

Per run: the held-out reward (mean score of fresh samples on 64 held-out prompts after training, `evaluate()`),
the final KL (`objective/kl` of the last iteration) and the wall seconds of `train()`. The table gives mean +/- sd
over seeds. Results go to bench/out/learning.json (quick: learning-quick.json).

What it leaves out: the peer (trl 1.12's PPOTrainer) is not run by this script (bench/run_trl.py times the peer on
the timing matrix; it has no demo-task learning mode yet). `--quick` numbers mean nothing: it proves the pipeline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from common import rule_score  # noqa: E402

# name: PPOConfig overrides on top of the demo recipe's settings.
CONFIGS = {
    "default (shared head)": {},
    "separate critic": {"critic": "separate"},
    "critic recipe": {"critic_learning_rate": 2e-3, "critic_warmup_steps": 16, "critic_updates_per_step": 2,
                      "lam_critic": 1.0},
    "grpo k=4": {"advantage_estimator": "grpo", "num_generations": 4},
    "rloo k=4": {"advantage_estimator": "rloo", "num_generations": 4},
}
TASKS = ("demo", "rule")
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


def demo_models(quick: bool) -> tuple[str, str]:
    """The demo's SFT policy and reward model (recipes/demo.py's cache under outputs/demo; built if missing)."""
    import demo

    cache = ROOT / "outputs" / "demo" / "cache" / (demo.CACHE_VERSION + ("-quick" if quick else ""))
    steps = {"max_steps": 30} if quick else {}
    demo.cached(lambda d: demo.build_sft_policy(d, **steps), cache / "sft", False, "SFT policy")
    demo.cached(lambda d: demo.build_reward(d, **steps), cache / "reward", False, "reward model")
    return str(cache / "sft"), str(cache / "reward")


def rule_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [rule_score(c) for c in completions]


def prompts(n: int, seed: int) -> list[str]:
    import demo

    path = demo.write_prompts(Path(tempfile.mkdtemp()) / "p.jsonl", n=n, seed=seed)
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def run(task: str, config: str, seed: int, iterations: int, responses: int, held_out: int, sft: str,
        reward: str) -> dict:
    """One training run; its held-out reward, final KL and wall seconds."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_ppo import PPOConfig, PPOLMTrainer

    torch.set_num_threads(1)
    overrides = CONFIGS[config]
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=responses // 2, num_mini_batches=2,
        num_ppo_epochs=4, num_total_batches=iterations, response_length=12, temperature=0.7, missing_eos_penalty=1.0,
        learning_rate=2e-4, lr_scheduler_type="constant", kl_coef=0.2, vf_coef=0.1, policy_quantization="4bit",
        reward_quantization="4bit", per_device_eval_batch_size=held_out, report_to=[], save_strategy="no",
        disable_tqdm=True, num_sample_generations=0, seed=seed, **overrides)
    args.logging_steps = args.optimizer_steps_per_iteration  # one log entry per iteration
    rule = task == "rule"
    trainer = PPOLMTrainer(
        model=sft, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
        reward_model=rule_reward if rule else reward,
        train_dataset=Dataset.from_dict({"prompt": prompts(2000, seed=1000)}),
        eval_dataset=Dataset.from_dict({"prompt": prompts(held_out, seed=2000)}),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
        critic_model=sft if rule and overrides.get("critic") == "separate" else None)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    held_out_reward = -trainer.evaluate()["eval_loss"]
    logs = [e for e in trainer.state.log_history if "objective/kl" in e]
    return {"task": task, "config": config, "seed": seed, "iterations": iterations, "responses": responses,
            "samples": iterations * responses, "held_out_reward": held_out_reward,
            "final_kl": logs[-1]["objective/kl"], "seconds": round(seconds, 1)}


def mean_sd(values: list[float], digits: int = 2) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.{digits}f} +/- {sd:.{digits}f}"


def table(runs: list[dict]) -> str:
    lines = ["| task | configuration | held-out reward | final KL | wall s | seeds |", "|---|---|---|---|---|---|"]
    for task in TASKS:
        for config in CONFIGS:
            rows = [r for r in runs if r["task"] == task and r["config"] == config]
            if rows:
                lines.append(f"| {task} | {config} | {mean_sd([r['held_out_reward'] for r in rows])} | "
                             f"{mean_sd([r['final_kl'] for r in rows])} | "
                             f"{statistics.mean(r['seconds'] for r in rows):.0f} | {len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the runs, run none")
    parser.add_argument("--quick", action="store_true",
                        help="2 iterations of 16 responses, seed 0, 16 held-out prompts, the demo's quick models")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0-4 (quick: 0)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2, 3, 4])
    iterations, responses, held_out = (2, 16, 16) if args.quick else (30, 64, 64)
    plan = [(task, config, seed) for task in args.tasks for config in args.configs for seed in seeds]
    print(f"[learning] {len(plan)} runs of {iterations} iterations x {responses} responses "
          f"({iterations * responses} samples each); {held_out} held-out prompts")
    if args.dry_run:
        for task, config, seed in plan:
            print(f"  {task:5s} {config:22s} seed {seed}: {json.dumps(CONFIGS[config])}")
        return []
    sft, reward = demo_models(args.quick)
    runs = []
    for task, config, seed in plan:
        runs.append(run(task, config, seed, iterations, responses, held_out, sft, reward))
        r = runs[-1]
        print(f"[learning] {task} {config} seed {seed}: held-out reward {r['held_out_reward']:+.3f}, final KL "
              f"{r['final_kl']:.3f}, {r['seconds']} s", flush=True)
    out = HERE / "out" / ("learning-quick.json" if args.quick else "learning.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=1))
    print("\n" + table(runs))
    return runs


if __name__ == "__main__":
    main()
