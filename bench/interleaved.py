"""hf_ppo and the peer (trl 1.12, its per-iteration gc.collect() off) in ONE process, taking turns an iteration at a
time: the per-iteration ratio that other load on a shared machine cannot bend.

    bench/.venv-trl/bin/python bench/interleaved.py --rows b8-r32-h64 lora-r8 --iters 20     # make bench-interleaved

`bench.py` times each trainer in a process of its own, one after the other: on a loaded 2-core machine the load
changes between those processes, and the ratio of two such runs moved between 0.86 and 1.01 within ten minutes (the
same code). Here both trainers are built in one process (the peer's environment, `bench/.venv-trl`, where trl 1.12
shadows hf_ppo's trl; hf_ppo's trainer imports no trl), each trains in a thread of its own, and a baton passes at the
end of every PPO iteration: exactly one trainer computes at any moment, and the two alternate iteration by iteration,
so whatever else the machine does falls on both alike. An iteration's time is its thread's CPU seconds
(`time.thread_time`, with one torch thread: all of a trainer's compute runs on its own thread).

Both are wired exactly as in `bench.py` (`run_hf_ppo.build_trainer`, `run_trl.build_trainer`: the same row, tokenizer,
weights, prompts, batch, epochs, minibatches and seed). The ratio reported is the median over iterations of hf_ppo's
time over the peer's iteration right beside it, and the ratio of the medians; `--warmup` first iterations of each
are left out. The peer with its gc.collect() on is not measured here: it would collect both trainers' objects.
What it leaves out: GPU rows, memory (one process holds both), the learning runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


class Baton:
    """Whose turn it is: one of `names` at a time; a finished trainer leaves the rotation."""

    def __init__(self, names: list[str]):
        self.names, self.turn, self.finished = list(names), names[0], set()
        self.cond = threading.Condition()
        self.handovers: list[str] = []  # who handed over, in order: strictly alternating while both train

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.cond:
            if finished:
                self.finished.add(name)
            self.handovers.append(name)
            i = self.names.index(name)
            order = self.names[i + 1:] + self.names[:i + 1]
            self.turn = next((n for n in order if n not in self.finished), None)
            self.cond.notify_all()


def turn_callback(name: str, baton: Baton, times: dict, steps_per_iteration: int):
    """At the end of each PPO iteration: record the thread's CPU seconds (and wall seconds) since the last mark,
    hand over, wait for the next turn."""
    from transformers import TrainerCallback

    class Turn(TrainerCallback):
        last = None

        def on_train_begin(self, args, state, control, **kwargs):
            Turn.last = (time.thread_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_iteration:
                return
            times["cpu"].append(time.thread_time() - Turn.last[0])
            times["wall"].append(time.perf_counter() - Turn.last[1])
            baton.pass_on(name)
            baton.wait(name)
            Turn.last = (time.thread_time(), time.perf_counter())

    return Turn()


def run_row(row_dir: Path, iters: int, warmup: int, seed: int, against: str = "trl-nogc") -> dict:
    """One row: hf_ppo against the peer (`against="trl-nogc"`), or against a second hf_ppo trainer of the same row
    (`"hf_ppo"`: the method's own check, whose ratio must come out 1). With one torch thread (set here, and put back
    after): with more, torch's worker threads do part of each trainer's work, which its thread's clock does not see
    (a quarter of the process's CPU time, measured with 2)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_row(row_dir, iters, warmup, seed, against)
    finally:
        torch.set_num_threads(threads)


def _run_row(row_dir: Path, iters: int, warmup: int, seed: int, against: str) -> dict:
    import torch

    import run_hf_ppo
    from common import row_from_json

    row = row_from_json((row_dir / "row.json").read_text())
    a = types.SimpleNamespace(iters=iters, warmup=warmup, reward="model", seed=seed, set=[])
    other = "hf_ppo (2)" if against == "hf_ppo" else "trl-nogc"
    baton = Baton(["hf_ppo", other])
    times = {name: {"cpu": [], "wall": [], "thread_total": 0.0} for name in baton.names}
    steps = row.num_ppo_epochs * row.num_mini_batches
    hf, *_ = run_hf_ppo.build_trainer(a, row_dir, [turn_callback("hf_ppo", baton, times["hf_ppo"], steps)])
    if against == "hf_ppo":
        peer, *_ = run_hf_ppo.build_trainer(a, row_dir, [turn_callback(other, baton, times[other], steps)])
    else:  # trl 1.12: in the peer's environment only
        import run_trl
        import trl.experimental.ppo.ppo_trainer as ppo_module

        ppo_module.gc = types.SimpleNamespace(collect=lambda *args, **kwargs: 0)  # the peer's gc.collect() off
        peer, _ = run_trl.build_trainer(a, row_dir, [turn_callback(other, baton, times[other], 1)])
    # What exists now (both trainers' models and data) leaves the cyclic collector's view: a collection that one
    # trainer's allocations trigger would otherwise walk the other trainer's objects too.
    gc.collect()
    gc.freeze()
    errors = {}

    def train(name, trainer):
        baton.wait(name)
        start = time.thread_time()
        try:
            trainer.train()
        except BaseException as error:  # noqa: BLE001 - reported, and the other trainer must not wait forever
            errors[name] = repr(error)
        finally:
            times[name]["thread_total"] = time.thread_time() - start
            baton.pass_on(name, finished=True)

    threads = [threading.Thread(target=train, args=(name, trainer))
               for name, trainer in (("hf_ppo", hf), (other, peer))]
    process_start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):  # both print every log dict
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    process_seconds = time.process_time() - process_start
    if errors:
        raise RuntimeError(f"{row_dir.name}: {errors}")
    gc.unfreeze()
    ours, theirs = times["hf_ppo"]["cpu"][warmup:], times[other]["cpu"][warmup:]
    pairs = [o / t for o, t in zip(ours, theirs)]
    wall = [o / t for o, t in zip(times["hf_ppo"]["wall"][warmup:], times[other]["wall"][warmup:])]
    # CPU time spent by other threads than the two trainers' own (a helper thread of a library): not in either
    # trainer's time, so it is reported; near 0 means the thread clocks saw all the work.
    threads_total = sum(t["thread_total"] for t in times.values())
    return {"row": row_dir.name, "against": against, "hf_ppo_cpu_s": ours, "trl_nogc_cpu_s": theirs,
            "hf_ppo_median": statistics.median(ours), "trl_nogc_median": statistics.median(theirs),
            "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
            "median_pair_ratio": statistics.median(pairs), "median_pair_ratio_wall": statistics.median(wall),
            "other_threads_share": (process_seconds - threads_total) / process_seconds,
            "threads": torch.get_num_threads(), "iters": len(pairs), "load_average": os.getloadavg(),
            "handovers": baton.handovers}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["b8-r32-h64"], help="rows of bench/common.py's ROWS")
    p.add_argument("--iters", type=int, default=20, help="timed iterations of each trainer")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against", choices=["trl-nogc", "hf_ppo"], default="trl-nogc",
                   help="the other trainer: the peer, or a second hf_ppo (the method's check: its ratio must be 1)")
    p.add_argument("--json", type=Path, default=HERE / "out" / "interleaved.json")
    a = p.parse_args(argv)
    os.environ.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from common import ROWS
    from setup_models import build_row

    results = []
    for name in a.rows:
        row_dir = build_row(ROWS[name], HERE / "out" / "models")
        result = run_row(row_dir, a.iters, a.warmup, a.seed, a.against)
        results.append(result)
        print(f"[interleaved] {name}: hf_ppo {result['hf_ppo_median']:.4f} CPU s/iter, {a.against} "
              f"{result['trl_nogc_median']:.4f}; median pair ratio {result['median_pair_ratio']:.2f} (wall "
              f"{result['median_pair_ratio_wall']:.2f}); other threads' share of the CPU time "
              f"{result['other_threads_share']:.1%}", flush=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(results, indent=1))
    print("\n| row | hf_ppo CPU s/iter | trl 1.12 gc off CPU s/iter | hf/TRL, median of pairs (<= 0.8) "
          "| ratio of medians | iterations | load average |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {r['hf_ppo_median']:.4f} | {r['trl_nogc_median']:.4f} | {r['median_pair_ratio']:.2f} "
              f"| {r['ratio_of_medians']:.2f} | {r['iters']} | {r['load_average'][0]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
