"""Advantage estimators side by side: learning on two tasks, seconds per iteration and memory.

    python bench/estimators.py                       # 5 estimators x 2 tasks x 3 seeds, prints the README table
    python bench/estimators.py --iters 6 --seeds 0   # a quick look

Every run is the same PPO loop, changed by `advantage_estimator` (and `num_generations`, `scale_rewards`) only:
the demo's SFT policy (`recipes/demo.py`, built into its cache `outputs/demo/cache/` when missing) with a fresh LoRA
adapter (r 16, reference = adapter disabled), 12-token responses at temperature 0.7, missing_eos_penalty 1.0,
kl_coef 0.2 (as the demo), learning rate 1e-3, 2 PPO epochs x 2 minibatches per iteration. Every iteration
generates the SAME 16 responses: gae samples 16 prompts once each (k = 1), the group estimators 4 prompts 4 times
each (k = 4). Tasks: "demo" scores with the demo's trained reward model; "rule" with `common.rule_score` (+1 per
" great"). Reported: the mean score (after the EOS penalty) of the first and of the last 3 iterations' rollouts,
mean and spread (min-max) over the seeds; median wall and CPU seconds per iteration (one torch thread, first
iteration excluded); peak RSS of the process that ran the 3 seeds; trainable parameters and optimizer-state bytes.

Each (task, estimator) runs in its own process, so peak RSS is that configuration's. What it leaves out: a GPU,
the 'separate' critic (where a critic-free estimator saves a whole model), any tuning per estimator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from common import IterationClock, iteration_callback, peak_rss_mb, rule_score  # noqa: E402

# (label, PPOConfig overrides): the same 16 responses per iteration for every row.
ESTIMATORS = {
    "gae (k=1)": dict(advantage_estimator="gae", num_generations=1),
    "rloo (k=4)": dict(advantage_estimator="rloo", num_generations=4),
    "grpo (k=4)": dict(advantage_estimator="grpo", num_generations=4),
    "grpo, scale_rewards=False (k=4)": dict(advantage_estimator="grpo", num_generations=4, scale_rewards=False),
    "reinforce_pp (k=4)": dict(advantage_estimator="reinforce_pp", num_generations=4),
}
COMMON = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_mini_batches=2, num_ppo_epochs=2,
              response_length=12, temperature=0.7, missing_eos_penalty=1.0, kl_coef=0.2, learning_rate=1e-3,
              lr_scheduler_type="constant", vf_coef=0.1)
STEPS_PER_ITERATION = COMMON["num_ppo_epochs"] * COMMON["num_mini_batches"]
LAST = 3  # iterations averaged for the final reward


def demo_models() -> tuple[Path, Path]:
    """The demo's SFT policy and reward model, built into the demo's cache if missing."""
    import demo

    cache = ROOT / "outputs" / "demo" / "cache" / demo.CACHE_VERSION
    demo.cached(lambda d: demo.build_sft_policy(d), cache / "sft", False, "SFT policy")
    demo.cached(lambda d: demo.build_reward(d), cache / "reward", False, "reward model")
    return cache / "sft", cache / "reward"


def run_seeds(task: str, label: str, seeds: list[int], iters: int) -> dict:
    """Train one estimator on one task for each seed in this process; return its measurements."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import demo
    from hf_ppo import PPOConfig, PPOLMTrainer
    from hf_ppo.cli.tiny import synthetic_reviews

    torch.set_num_threads(1)
    sft, reward_path = demo_models()
    tokenizer = AutoTokenizer.from_pretrained(sft)
    prompts = [" ".join(r.split()[:demo.PROMPT_WORDS]) for r in synthetic_reviews(256, seed=11)]
    reward = str(reward_path) if task == "demo" else (lambda p, c: [rule_score(x) for x in c])
    result = {"task": task, "estimator": label, "first": [], "final": [], "s_per_iter": [], "cpu_s_per_iter": []}
    for seed in seeds:
        args = PPOConfig(output_dir=str(ROOT / "bench" / "out" / "estimators" / f"{task}-{seed}"), seed=seed,
                         max_steps=iters * STEPS_PER_ITERATION, logging_steps=STEPS_PER_ITERATION, report_to=[],
                         save_strategy="no", num_sample_generations=0, disable_tqdm=True, use_cpu=True,
                         **COMMON, **ESTIMATORS[label])
        trainer = PPOLMTrainer(model=str(sft), args=args, processing_class=tokenizer, reward_model=reward,
                               train_dataset=Dataset.from_dict({"prompt": prompts}),
                               peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                      task_type="CAUSAL_LM"))
        clock, scores = IterationClock(), []
        trainer.add_callback(iteration_callback(clock, scores, STEPS_PER_ITERATION, cuda=False))
        trainer.train()
        result["first"].append(scores[0])
        result["final"].append(sum(scores[-LAST:]) / LAST)
        result["s_per_iter"].append(statistics.median(clock.durations()[1:]))
        result["cpu_s_per_iter"].append(statistics.median(clock.durations(cpu=True)[1:]))
        trained = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        result["trainable_params"] = sum(p.numel() for p in trained)
        result["optimizer_state_bytes"] = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                                              for t in s.values() if torch.is_tensor(t))
        result["has_critic"] = trainer.model.has_critic
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return result


def spread(values: list[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.2f} [{min(values):.2f}, {max(values):.2f}]" if len(values) > 1 else f"{mean:.2f}"


def table(results: list[dict]) -> str:
    lines = ["| estimator | demo RM: first -> last 3 iters | rule: first -> last 3 iters | s/iter (CPU s) | "
             "peak RSS MB | trainable params | optimizer state |",
             "|---|---|---|---|---|---|---|"]
    by = {(r["task"], r["estimator"]): r for r in results}
    for label in ESTIMATORS:
        demo_row, rule_row = by.get(("demo", label)), by.get(("rule", label))
        cells = [f"{spread(r['first'])} -> {spread(r['final'])}" if r else "-" for r in (demo_row, rule_row)]
        timed = [r for r in (demo_row, rule_row) if r]
        wall = statistics.median([s for r in timed for s in r["s_per_iter"]])
        cpu = statistics.median([s for r in timed for s in r["cpu_s_per_iter"]])
        rss = "/".join(f"{r['peak_rss_mb']:.0f}" for r in timed)
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {wall:.2f} ({cpu:.2f}) | {rss} | "
                     f"{timed[0]['trainable_params']:,} | {timed[0]['optimizer_state_bytes'] / 2**20:.2f} MiB |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=15, help="PPO iterations per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", nargs="+", default=["demo", "rule"], choices=["demo", "rule"])
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "estimators.json"))
    p.add_argument("--one", nargs=2, metavar=("TASK", "ESTIMATOR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print("ESTIMATOR_RESULT " + json.dumps(run_seeds(a.one[0], a.one[1], a.seeds, a.iters)), flush=True)
        return
    demo_models()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    results = []
    for task in a.tasks:
        for label in ESTIMATORS:
            out = subprocess.run([sys.executable, __file__, "--one", task, label, "--iters", str(a.iters), "--seeds",
                                  *map(str, a.seeds)], env=env, capture_output=True, text=True, check=False)
            line = next((x for x in out.stdout.splitlines() if x.startswith("ESTIMATOR_RESULT ")), None)
            if line is None:
                sys.exit(f"{task} / {label} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(line.split(" ", 1)[1]))
            r = results[-1]
            print(f"{task:5s} {label:32s} first {spread(r['first'])}  final {spread(r['final'])}  "
                  f"{statistics.median(r['s_per_iter']):.2f} s/iter  {r['peak_rss_mb']:.0f} MB", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"iters": a.iters, "seeds": a.seeds, "results": results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
