"""bench/interleaved.py, the per-iteration ratio measured in one process: the baton's rotation, and the method's own
check (hf_ppo against a second hf_ppo trainer, both really training) end to end. The peer itself needs trl 1.12 in
bench/.venv-trl and is not run here; no timing is asserted."""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def interleaved():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("interleaved")
    finally:
        sys.path.remove(str(BENCH))


def test_the_baton_alternates_and_a_finished_trainer_leaves_the_rotation(interleaved):
    baton, order = interleaved.Baton(["a", "b"]), []

    def run(name, turns):
        baton.wait(name)
        for _ in range(turns):
            order.append(name)
            baton.pass_on(name)
            baton.wait(name)
        order.append(name)
        baton.pass_on(name, finished=True)

    threads = [threading.Thread(target=run, args=("a", 3)), threading.Thread(target=run, args=("b", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)  # nobody waits for a trainer that finished
    assert order == ["a", "b", "a", "b", "a", "a"]  # one at a time, in turn; alone once b is done


def test_two_hf_ppo_trainers_take_turns_an_iteration_at_a_time(interleaved, tmp_path):
    from common import ROWS
    from setup_models import build_row

    row_dir = build_row(ROWS["b8-r32-h64"], tmp_path)
    result = interleaved.run_row(row_dir, iters=3, warmup=1, seed=0, against="hf_ppo")
    assert result["iters"] == 3 and len(result["hf_ppo_cpu_s"]) == 3 == len(result["trl_nogc_cpu_s"])
    assert all(t > 0 for t in result["hf_ppo_cpu_s"] + result["trl_nogc_cpu_s"])
    # Every iteration's end handed over to the other trainer: strictly alternating until the first one finished.
    handovers = result["handovers"]
    assert handovers[:8] == ["hf_ppo", "hf_ppo (2)"] * 4, handovers
    assert -0.05 < result["other_threads_share"] < 0.1  # the two threads' clocks saw the work
