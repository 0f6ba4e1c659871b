"""The tested dependency range and what differs inside it (hf_ppo/runtime/ranges.py and versions.py, deps/).

The cache rename of transformers 5.24 (`past_key_values` -> `cache`) is read under the installed version's name,
with no deprecation warning from hf_ppo's own calls; the range in pyproject.toml is the one CI tests (its floors are
deps/floors.txt), and `import hf_ppo` outside it warns once, naming the range.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from hf_ppo import AutoModelForCausalLMWithValueHead
from hf_ppo.runtime import ranges, versions
from hf_ppo.rollout.engines import SamplingSettings, generate
from hf_ppo.cli.tiny import build_causal_lm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deps"))
import test_latest  # noqa: E402


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def deprecations():
    """Every Python warning and every transformers log line emitted inside the test, as text (transformers'
    `warning_once` cache is cleared first, so a message logged earlier in the session is logged again)."""
    logging.Logger.warning_once.cache_clear()
    handler = _Messages()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [str(w.message) for w in caught] + handler.lines
    logger.removeHandler(handler)


def _cache_news(lines):
    return [line for line in lines if "past_key_values" in line or "cache" in line.lower() and "deprecat" in line]


def test_kv_sampler_and_value_head_use_the_installed_cache_name(tok, inputs, deprecations):
    model = build_causal_lm(tok)
    wrapper = AutoModelForCausalLMWithValueHead(model)
    with torch.no_grad():
        out = wrapper(**inputs, return_past_key_values=True)
        cache = getattr(out, versions.CACHE)
        assert cache is not None
        # TRL's name and transformers 5.24's name read the same object; the fourth tuple element is it too.
        assert out.past_key_values is cache and out.cache is cache and tuple(out)[3] is cache
        assert list(out.keys())[-1] == versions.CACHE
        # A cache passed back in under either name continues the sequence.
        last = inputs["input_ids"][:, -1:]
        mask = torch.cat([inputs["attention_mask"], inputs["attention_mask"][:, -1:]], dim=1)
        for name in ("past_key_values", "cache"):
            again = wrapper(**inputs, return_past_key_values=True)
            step = wrapper(input_ids=last, attention_mask=mask, use_cache=True, **{name: getattr(again, name)})
            full = wrapper(input_ids=torch.cat([inputs["input_ids"], last], 1), attention_mask=mask)
            torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], rtol=1e-4, atol=1e-5)
        generate(model, inputs["input_ids"], inputs["attention_mask"].bool(),
                 SamplingSettings(response_length=4, forward_batch_size=2, temperature=1.0), stop_token_ids=[],
                 pad_token_id=0)
    assert _cache_news(deprecations()) == []


def test_cache_name_follows_transformers():
    installed = Version(importlib.metadata.version("transformers"))
    assert versions.CACHE == ("cache" if installed >= Version("5.24.0.dev0") else "past_key_values")


# ---- the declared range ------------------------------------------------------------------------------------------
def _pyproject_requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {ranges._normal(Requirement(d).name): Requirement(d) for d in deps}


def test_every_checked_package_has_a_floor_and_a_ceiling_and_the_floor_is_what_ci_installs():
    reqs = _pyproject_requirements()
    floors = {}
    for line in (ROOT / "deps" / "floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            floors[ranges._normal(name)] = version.strip()
    for name in ranges.CHECKED:
        req = reqs[ranges._normal(name)]
        lows = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lows) == 1, f"{name}: one floor"
        if name == "torch":  # the CPU wheel CI installs is one version; no ceiling keeps users' CUDA builds free
            continue
        assert test_latest.ceiling(req) is not None, f"{name} has no ceiling"
        assert Version(floors[ranges._normal(name)]) == Version(lows[0]), f"{name}: pyproject floor != CI's floor"


def _declared_requires() -> list[str] | None:
    """hf_ppo's requirements as installing it records them (pyproject.toml's dependencies) when this interpreter
    finds no installed hf_ppo (a source tree on PYTHONPATH, as on the GPU machine, where `out_of_range` has nothing to
    read and stays silent by design); None when hf_ppo is installed: its own metadata is read then."""
    try:
        importlib.metadata.requires("hf_ppo")
        return None
    except importlib.metadata.PackageNotFoundError:
        return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.fixture
def declared_range(monkeypatch):
    """The range check reads hf_ppo's declared range whether or not hf_ppo is installed here (_declared_requires)."""
    declared = _declared_requires()
    if declared is not None:
        real = importlib.metadata.requires
        monkeypatch.setattr(importlib.metadata, "requires", lambda name: declared if name == "hf_ppo" else real(name))
    return declared


def test_import_warns_once_naming_the_range_when_a_version_is_outside(monkeypatch, declared_range):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "5.99.0" if name == "transformers" else real(name))
    with pytest.warns(UserWarning, match=r"transformers 5\.99\.0 \(tested: .*<5\.\d+.*\)") as caught:
        ranges.warn_if_out_of_range()
    assert len(caught) == 1
    monkeypatch.setattr(importlib.metadata, "version", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranges.warn_if_out_of_range()  # the environment the tests run in is inside the range


def test_the_warning_points_at_the_importers_line(tmp_path, monkeypatch):
    import subprocess

    script = tmp_path / "user_script.py"
    lines = ["import importlib.metadata as m",
             "real = m.version",
             "m.version = lambda n: '0.1.0' if n == 'peft' else real(n)"]
    declared = _declared_requires()
    if declared is not None:  # no installed hf_ppo here: its declared range, as an install records it
        lines += ["real_requires = m.requires",
                  f"m.requires = lambda n: {declared!r} if n == 'hf_ppo' else real_requires(n)"]
    lines.append("import hf_ppo")  # the line the warning must point at
    script.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{script}:{len(lines)}: UserWarning: hf_ppo is tested with" in done.stderr
    assert "peft 0.1.0 (tested: " in done.stderr


def test_latest_verdicts_raise_only_on_a_green_run():
    reqs = [Requirement("transformers>=5.19,<5.25"), Requirement("peft>=0.18,<0.22"), Requirement("rich")]
    installed = {"transformers": "5.25.1", "peft": "0.21.2", "rich": "14.0"}
    green = {r[0]: r[3] for r in test_latest.verdicts(reqs, installed, green=True)}
    assert green == {"transformers": "green above the ceiling: raise to <5.26",
                     "peft": "within the range: nothing to raise"}
    red = {r[0]: r[3] for r in test_latest.verdicts(reqs, installed, green=False)}
    assert red["transformers"].startswith("above the ceiling, and the suite failed: keep")
