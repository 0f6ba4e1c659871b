"""The offline arithmetic task's files (`hf_ppo.cli.arithmetic`): it rewrites its own question files and summary,
never a user's file of the same name. (The task's training run is pinned in tests/rewards/test_answers.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_ppo.cli import arithmetic


@pytest.mark.parametrize("name, content", [
    ("train.jsonl", '{"prompt": "my own prompt", "answer": "1"}\n'),
    ("test.jsonl", '{"prompt": "What is 2 + 2?", "answer": "5"}\n'),  # the task's shape, a wrong sum: not ours
    ("summary.json", '{"my": "results"}'),
    ("train.jsonl", "not json at all\n"),
])
def test_a_users_file_of_the_same_name_is_kept_and_the_run_refused(tmp_path, name, content):
    """Issue 49 item 11: `python -m hf_ppo.cli.arithmetic --output_dir DIR` overwrote DIR/train.jsonl, test.jsonl and
    summary.json whoever wrote them. A file hf_ppo did not write stops the run before anything is built or
    written, naming the file and the fix; the file is kept byte for byte."""
    (tmp_path / name).write_text(content)
    with pytest.raises(SystemExit, match=rf"{tmp_path / name}.*not written by hf_ppo.*--output_dir"):
        arithmetic.main(["--output_dir", str(tmp_path)])
    assert (tmp_path / name).read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing built, nothing else written


def test_the_tasks_own_files_are_recognised(tmp_path):
    train, held_out = arithmetic.split_pairs()
    arithmetic.write_jsonl(tmp_path / "train.jsonl", arithmetic.rows(train))
    arithmetic.write_jsonl(tmp_path / "test.jsonl", arithmetic.rows(held_out[:3]))  # an earlier version's split
    (tmp_path / "summary.json").write_text(json.dumps({"seed": 0, "accuracy_before": 0.1, "accuracy_after": 0.2,
                                                       "held_out_questions": 80, "optimizer_steps": 8,
                                                       "seconds": 1.0, "policy": "x"}))
    arithmetic.check_output_files(Path(tmp_path))  # no error: hf_ppo wrote them, a run rewrites them
