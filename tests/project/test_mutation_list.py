"""tests/mutation_check.py stays runnable between its (long) full runs: every planted bug's snippet occurs exactly
once in today's code (a snippet that moved makes the mutation STALE, and the check would plant nothing), names are
unique, and every test the SUBSET names exists. Nothing is planted or run here."""

from __future__ import annotations

import ast
from pathlib import Path

import tests.mutation_check as mutation_check

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutation_snippet_occurs_once_in_the_code():
    stale = {m.name: mutation_check.check_snippets(m) for m in mutation_check.MUTATIONS}
    stale = {name: why for name, why in stale.items() if why is not None}
    assert not stale, f"stale mutations (move each with its code: same bug, new snippet): {stale}"


def test_mutation_names_are_unique():
    names = [m.name for m in mutation_check.MUTATIONS]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")}


def test_every_subset_entry_names_a_test_that_exists():
    missing = []
    for entry in mutation_check.SUBSET:
        if entry.startswith("-"):
            continue
        path, _, test = entry.partition("::")
        name = test.split("[")[0]
        if not (ROOT / path).is_file() or (name and name not in _test_names(ROOT / path)):
            missing.append(entry)
    assert not missing, f"SUBSET names tests that do not exist: {missing}"


def test_every_vllm_subset_entry_names_a_test_that_exists():
    missing = []
    for entry in mutation_check.VLLM_SUBSET:
        path, _, test = entry.partition("::")
        if not (ROOT / path).is_file() or test.split("[")[0] not in _test_names(ROOT / path):
            missing.append(entry)
    assert not missing, f"VLLM_SUBSET names tests that do not exist: {missing}"
