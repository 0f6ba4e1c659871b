"""The learning table: which critic / estimator configuration learns best at equal samples, beside trl 1.12.

    python bench/learning.py --dry-run              # the runs the full table makes, without running them
    python bench/learning.py --quick                # a smoke run: every configuration and the peer, 2 iterations
    python bench/learning.py                        # the full table: 30 iterations, seeds 0-4, both tasks
    python bench/learning.py --iterations 10        # the same table at a third of the budget: who learns faster
    python bench/learning.py --jobs 1               # one run at a time (default 2: one per core, 1 thread each)

Every configuration trains the same LoRA (r 16, all linear layers) adapter on the demo's 4-bit SFT policy (hf_ppo's
demo cache under outputs/demo, built if missing; `--quick` uses the demo's quick cache) with the demo recipe's
settings (recipes/configs/demo.yaml: 12-token responses, temperature 0.7, `missing_eos_penalty` 1.0, lr 2e-4
constant, kl_coef 0.2, vf_coef 0.1, 4 PPO epochs x 2 minibatches) and **64 responses per iteration**, so 30
iterations are 1,920 samples (gae: 64 prompts x k=1; grpo / rloo: 16 prompts x k=4). Tasks: "demo" (the demo's
trained reward model, 4-bit) and "rule" (`common.rule_score`, +1 per " great"; no reward model, so the separate
critics start from the SFT checkpoint). Configurations (`CONFIGS`): today's default (shared value head); the separate
critic from the reward model; the critic recipe (shared head with `critic_learning_rate` 10x the policy's, a
one-iteration warm-up, `critic_updates_per_step=2`, `lam_critic=1.0`); grpo and rloo with k=4; and the peer,
trl 1.12's `trl.experimental.ppo.PPOTrainer` (`bench/learning_peer.py`, run in `bench/.venv-trl` as bench.py makes
it) with the same policy, adapter, data, settings and a full-precision copy of the reward model (rule task: of the
SFT checkpoint) as its critic, the critic it requires.

Every run saves its trained adapter, and **one evaluator scores them all**: hf_ppo's `evaluate()` around the saved
policy (`PPOLMTrainer(model=<adapter folder>)`, the path `hf-ppo evaluate` takes) samples one response per held-out
prompt (256 prompts no run trains on) from the policy and one from the SFT reference with the training sampling
settings and the run's seed, in one batch with the RNG seeded just before it (so the reference's samples are the
same for every configuration at a given seed, and the policies share the random stream), and scores both with the task's reward. Per run: the held-out reward (the policy's
mean raw score), the win rate over the SFT reference, the held-out KL to the reference (summed
over tokens), and the CPU seconds of `train()` (one torch thread per run: robust to other load). The table gives
mean +/- sd over seeds. Each run is a process of its own; its result goes to bench/out/learning/<task>/<config>/
seed<N>.json and is reused by a later call (`--fresh` reruns), so an interrupted table resumes. The table is
written to bench/out/learning.md and, for the full table, into bench/RESULTS.md (between `bench:learning` marks).

`--quick` numbers mean nothing: it proves the pipeline (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from common import rule_score  # noqa: E402

PEER = "trl 1.12 PPOTrainer"
# name: PPOConfig overrides on top of the demo recipe's settings (the peer: None).
CONFIGS = {
    "default (shared head)": {},
    "separate critic": {"critic": "separate"},
    "critic recipe": {"critic_learning_rate": 2e-3, "critic_warmup_steps": 16, "critic_updates_per_step": 2,
                      "lam_critic": 1.0},
    "grpo k=4": {"advantage_estimator": "grpo", "num_generations": 4},
    "rloo k=4": {"advantage_estimator": "rloo", "num_generations": 4},
    PEER: None,
}
# Follow-ups run on the rule task only when named (`--tasks rule --configs ...`): what might close the gap to the peer
# there (bench/RESULTS.md, below the table).
FOLLOW_UPS = {
    "separate, critic lr 10x": {"critic": "separate", "critic_learning_rate": 2e-3},
    "shared, critic lr 50x": {"critic_learning_rate": 1e-2},
    "separate critic recipe": {"critic": "separate", "critic_learning_rate": 2e-3, "critic_warmup_steps": 16,
                               "critic_updates_per_step": 2, "lam_critic": 1.0},
    "default, no grad clipping": {"max_grad_norm": 0.0},
    "separate, no grad clipping": {"critic": "separate", "max_grad_norm": 0.0},
    "grpo k=4, no std (Dr. GRPO)": {"advantage_estimator": "grpo", "num_generations": 4, "scale_rewards": False},
}
TASKS = ("demo", "rule")
ALL = {**CONFIGS, **FOLLOW_UPS}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
# The demo recipe's settings, shared by hf_ppo's runs, the peer's and the evaluator.
SETTINGS = {"response_length": 12, "temperature": 0.7, "missing_eos_penalty": 1.0, "learning_rate": 2e-4,
            "lr_scheduler_type": "constant", "kl_coef": 0.2, "vf_coef": 0.1, "num_ppo_epochs": 4, "num_mini_batches": 2}
OUT = HERE / "out"
DEMO_CACHE = ROOT / "outputs" / "demo" / "cache"
BEGIN, END = "<!-- bench:learning:begin -->", "<!-- bench:learning:end -->"


ITERATIONS = 30  # the table's budget: 30 x 64 = 1,920 samples


def sizes(quick: bool, iterations: int | None = None) -> tuple[int, int, int]:
    """(iterations, responses per iteration, held-out prompts); `iterations` overrides the budget (`--iterations`)."""
    default = (2, 16, 16) if quick else (ITERATIONS, 64, 256)
    return (iterations or default[0], *default[1:])


def marks(iterations: int) -> tuple[str, str]:
    """RESULTS.md's marks around the table of a budget (the table's own budget keeps the plain marks)."""
    if iterations == ITERATIONS:
        return BEGIN, END
    return BEGIN.replace("learning", f"learning-it{iterations}"), END.replace("learning", f"learning-it{iterations}")


def demo_models(quick: bool) -> tuple[str, str]:
    """The demo's SFT policy and reward model (hf_ppo.demo's cache under outputs/demo; built if missing)."""
    from hf_ppo.cli import demo

    cache = DEMO_CACHE / (demo.CACHE_VERSION + ("-quick" if quick else ""))
    steps = {"max_steps": 30} if quick else {}
    demo.cached(lambda d: demo.build_sft_policy(d, **steps), cache / "sft", False, "SFT policy")
    demo.cached(lambda d: demo.build_reward(d, **steps), cache / "reward", False, "reward model")
    return str(cache / "sft"), str(cache / "reward")


def rule_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [rule_score(c) for c in completions]


def prompts(n: int, seed: int) -> list[str]:
    from hf_ppo.cli import demo

    path = demo.write_prompts(Path(tempfile.mkdtemp()) / "p.jsonl", n=n, seed=seed)
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def train_prompts() -> list[str]:
    return prompts(2000, seed=1000)


def held_out_prompts(n: int) -> list[str]:
    return prompts(n, seed=2000)


# ---- one run (a process of its own: `--one`) ---------------------------------------------------------------------
def train_hf_ppo(task: str, config: str, seed: int, iterations: int, responses: int, sft: str, reward: str,
                 policy_dir: str) -> dict:
    """Train one hf_ppo configuration; save its adapter to `policy_dir`; its CPU seconds and last logged KL."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_ppo import PPOConfig, PPOLMTrainer

    overrides = ALL[config]
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=responses // SETTINGS["num_mini_batches"],
        num_total_batches=iterations, policy_quantization="4bit", reward_quantization="4bit", report_to=[],
        save_strategy="no", disable_tqdm=True, num_sample_generations=0, seed=seed, **SETTINGS, **overrides)
    args.logging_steps = args.optimizer_steps_per_iteration  # one log entry per iteration
    rule = task == "rule"
    trainer = PPOLMTrainer(
        model=sft, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
        reward_model=rule_reward if rule else reward,
        train_dataset=Dataset.from_dict({"prompt": train_prompts()}),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
        critic_model=sft if rule and overrides.get("critic") == "separate" else None)
    quiet(trainer)
    start = time.process_time()
    trainer.train()
    seconds = time.process_time() - start
    trainer.save_model(policy_dir)
    logs = [e for e in trainer.state.log_history if "objective/kl" in e]
    return {"cpu_seconds": round(seconds, 1), "train_kl": logs[-1]["objective/kl"]}


def train_peer(task: str, seed: int, iterations: int, responses: int, sft: str, reward: str, policy_dir: str) -> dict:
    """Train the peer in its own venv (bench/learning_peer.py); its CPU seconds and last logged KL."""
    import bench

    if not bench.peer_python().exists():  # main() made it for a whole table; a lone `--one` makes it here
        bench.ensure_peer_env()
    spec = {"task": task, "seed": seed, "iterations": iterations, "responses": responses, "sft": sft,
            "reward": reward, "policy_dir": policy_dir, "lora": LORA, "settings": SETTINGS, "prompts": train_prompts()}
    spec_file = Path(tempfile.mkdtemp()) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1",
               TMPDIR=tempfile.gettempdir())  # the run's folder (`one`): removed with it
    proc = subprocess.run([str(bench.peer_python()), str(HERE / "learning_peer.py"), str(spec_file)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LEARNING_PEER ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the peer's run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def evaluate(task: str, seed: int, held_out: int, sft: str, reward: str, policy_dir: str) -> dict:
    """The one evaluator of every run: hf_ppo's `evaluate()` of the saved adapter against the SFT policy."""
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed

    from hf_ppo import PPOConfig, PPOLMTrainer

    keep = ("response_length", "temperature", "missing_eos_penalty")
    args = PPOConfig(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=held_out, seed=seed, report_to=[],
                     save_strategy="no", disable_tqdm=True, policy_quantization="4bit", reward_quantization="4bit",
                     **{k: SETTINGS[k] for k in keep})
    trainer = PPOLMTrainer(model=policy_dir, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
                           reward_model=rule_reward if task == "rule" else reward, ref_model=sft,
                           eval_dataset=Dataset.from_dict({"prompt": held_out_prompts(held_out)}))
    quiet(trainer)
    # One batch, and the RNG set just before it: for a given seed the reference's samples are the same for every
    # configuration, and the policies sample from the same random stream (common random numbers).
    set_seed(seed)
    m = trainer.evaluate()
    name = next(k for k in m if k.endswith("/win_rate"))[len("eval_reward/"):-len("/win_rate")]
    return {"held_out_reward": m[f"eval_reward/{name}/policy"], "reference_reward": m[f"eval_reward/{name}/reference"],
            "win_rate": m[f"eval_reward/{name}/win_rate"], "held_out_kl": m["eval_kl_to_reference"]}


def quiet(trainer) -> None:
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def one(task: str, config: str, seed: int, quick: bool, iterations: int | None = None) -> dict:
    """One run, start to finish: train (hf_ppo in this process, the peer in its venv), save, evaluate."""
    import torch

    from hf_ppo.cli.recipe import silence_known_warnings

    torch.set_num_threads(1)
    silence_known_warnings()
    iterations, responses, held_out = sizes(quick, iterations)
    sft, reward = demo_models(quick)
    # Every temporary file of the run (prompts, output folders, the saved adapter) goes into one folder, removed at
    # the end: a table of 60 runs leaves nothing behind in the system's temporary directory.
    outer = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="learning-run-") as tmp:
        tempfile.tempdir = tmp
        try:
            policy_dir = os.path.join(tmp, "policy")
            if ALL[config] is None:
                trained = train_peer(task, seed, iterations, responses, sft, reward, policy_dir)
            else:
                trained = train_hf_ppo(task, config, seed, iterations, responses, sft, reward, policy_dir)
            scores = evaluate(task, seed, held_out, sft, reward, policy_dir)
        finally:
            tempfile.tempdir = outer
    return {"task": task, "config": config, "seed": seed, "iterations": iterations, "responses": responses,
            "samples": iterations * responses, **trained, **scores}


def result_path(task: str, config: str, seed: int, quick: bool, iterations: int | None = None) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", config.lower()).strip("-")
    folder = "learning-quick" if quick else "learning"
    if iterations not in (None, ITERATIONS):
        folder += f"-it{iterations}"
    return OUT / folder / task / slug / f"seed{seed}.json"


def launch(task: str, config: str, seed: int, quick: bool, fresh: bool, iterations: int | None = None) -> dict:
    """Run `one` in a process of its own (one torch thread), or reuse its saved result."""
    path = result_path(task, config, seed, quick, iterations)
    if path.exists() and not fresh:
        return json.loads(path.read_text())
    cmd = [sys.executable, __file__, "--one", task, config, str(seed)] + (["--quick"] if quick else [])
    cmd += ["--iterations", str(iterations)] if iterations else []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    log = path.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"[learning] {task} / {config} / seed {seed} failed (exit {proc.returncode}); log: {log}\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    path.write_text(json.dumps(result, indent=1))
    return result


# ---- the table ---------------------------------------------------------------------------------------------------
def mean_sd(values: list[float], digits: int = 2) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.{digits}f} +/- {sd:.{digits}f}"


def versus_peer(rows: list[dict], peer: list[dict]) -> str:
    """The held-out reward's difference from the peer's, +/- twice its standard error over seeds (Welch): a
    configuration beats the peer by more than the seed noise when the interval excludes 0."""
    if len(rows) < 2 or len(peer) < 2:
        return ""
    a, b = [r["held_out_reward"] for r in rows], [r["held_out_reward"] for r in peer]
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return f"{statistics.mean(a) - statistics.mean(b):+.2f} +/- {2 * se:.2f}"


def table(runs: list[dict]) -> str:
    lines = ["| task | configuration | held-out reward | vs the peer (+/- 2 SE) | win rate vs SFT | held-out KL | "
             "CPU s (train) | seeds |", "|---|---|---|---|---|---|---|---|"]
    for task in TASKS:
        peer = [r for r in runs if r["task"] == task and r["config"] == PEER]
        for config in ALL:
            rows = [r for r in runs if r["task"] == task and r["config"] == config]
            if rows:
                col = lambda key, digits=2: mean_sd([r[key] for r in rows], digits)  # noqa: E731
                lines.append(f"| {task} | {config} | {col('held_out_reward')} | "
                             f"{versus_peer(rows, peer) if config != PEER else ''} | {col('win_rate')} | "
                             f"{col('held_out_kl')} | {statistics.mean(r['cpu_seconds'] for r in rows):.0f} | "
                             f"{len(rows)} |")
        reference = [r["reference_reward"] for r in runs if r["task"] == task]
        if reference:
            lines.append(f"| {task} | (the SFT reference, same evaluations) | {mean_sd(reference)} | | | | | |")
    return "\n".join(lines)


def write_results(runs: list[dict], command: str, results: Path = HERE / "RESULTS.md") -> None:
    """The table into `results` (bench/RESULTS.md) between its budget's marks (appended the first time)."""
    import platform

    import torch
    import transformers

    iterations = runs[0]["iterations"]
    begin, end = marks(iterations)
    title = "The learning table" + ("" if iterations == ITERATIONS else f" at {iterations} iterations")
    block = (f"{begin}\n## {title}\n\nDate: {time.strftime('%Y-%m-%d')}. Machine: {platform.machine()}, "
             f"{os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"trl 1.12.0 for the peer. Command: `{command}` (one torch thread per run, two runs at a time). "
             f"{runs[0]['iterations']} iterations x {runs[0]['responses']} responses = {runs[0]['samples']} samples "
             f"per run; held-out reward, win rate and KL from one evaluator on 256 held-out prompts (see "
             f"bench/learning.py); mean +/- sd over seeds.\n\n{table(runs)}\n{end}")
    text = results.read_text()
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    results.write_text(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the runs, run none")
    parser.add_argument("--quick", action="store_true",
                        help="2 iterations of 16 responses, seed 0, 16 held-out prompts, the demo's quick models")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0-4 (quick: 0)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(ALL),
                        help="default: the table's (CONFIGS); FOLLOW_UPS run only when named")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each one torch thread)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results are saved")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"the budget per run (default {ITERATIONS}; quick: 2): a shorter one shows who learns faster")
    parser.add_argument("--one", nargs=3, metavar=("TASK", "CONFIG", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        task, config, seed = args.one
        print(json.dumps(one(task, config, int(seed), args.quick, args.iterations)))
        return []
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2, 3, 4])
    iterations, responses, held_out = sizes(args.quick, args.iterations)
    plan = [(task, config, seed) for task in args.tasks for config in args.configs for seed in seeds]
    print(f"[learning] {len(plan)} runs of {iterations} iterations x {responses} responses "
          f"({iterations * responses} samples each); {held_out} held-out prompts")
    if args.dry_run:
        for task, config, seed in plan:
            print(f"  {task:5s} {config:22s} seed {seed}: {json.dumps(ALL[config])}")
        return []
    demo_models(args.quick)  # built once, before the runs share it
    if any(ALL[c] is None for c in args.configs):
        import bench

        bench.ensure_peer_env()

    def go(item):
        r = launch(*item, args.quick, args.fresh, args.iterations)
        print(f"[learning] {r['task']} / {r['config']} / seed {r['seed']}: held-out reward {r['held_out_reward']:+.3f}"
              f" (SFT {r['reference_reward']:+.3f}), win rate {r['win_rate']:.2f}, KL {r['held_out_kl']:.2f}, "
              f"{r['cpu_seconds']} CPU s", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(go, plan))
    md = table(runs)
    out = OUT / ("learning-quick.md" if args.quick else
                 "learning.md" if iterations == ITERATIONS else f"learning-it{iterations}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md + "\n")
    if not args.quick and set(args.tasks) == set(TASKS) and set(args.configs) == set(CONFIGS) and len(seeds) >= 5:
        write_results(runs, "python bench/learning.py" + ("" if iterations == ITERATIONS else
                                                           f" --iterations {iterations}"))
    print("\n" + md)
    return runs


if __name__ == "__main__":
    main()
