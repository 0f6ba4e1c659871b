"""`make test-latest`: the test suite on the newest release of every dependency, past pyproject.toml's ceilings.

    python deps/test_latest.py [--torch 'torch==2.13.0'] [--fast] [--keep]

A throwaway virtualenv gets hf_ppo (without its declared ranges), then the newest release of every dependency that
pip can install together, and runs the suite. At the end it prints, for each package with a ceiling, the version
tested and whether the ceiling can be raised: only a green run on a version above a ceiling allows raising it (to
the next minor release after the one tested). Nothing in the repository is changed; raise ceilings by hand.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def declared() -> list[Requirement]:
    """The project's dependencies and its test extra, as pyproject.toml declares them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def ceiling(req: Requirement) -> Version | None:
    """The version a `<X` in the requirement excludes (None when there is no ceiling)."""
    bounds = [Version(s.version) for s in req.specifier if s.operator == "<"]
    return min(bounds) if bounds else None


def next_ceiling(version: Version) -> str:
    """The ceiling that admits `version` and nothing after its minor release series: 5.25.1 -> 5.26."""
    major, minor = (version.release + (0,))[:2]
    return f"{major}.{minor + 1}"


def verdicts(reqs: list[Requirement], installed: dict[str, str], green: bool) -> list[tuple[str, str, str, str]]:
    """(package, declared range, version tested, what to do) for each package with a ceiling."""
    rows = []
    for req in reqs:
        top = ceiling(req)
        have = installed.get(normal(req.name))
        if top is None or have is None:
            continue
        tested = Version(have.split("+")[0])
        if tested < top:
            action = "within the range: nothing to raise"
        elif green:
            action = f"green above the ceiling: raise to <{next_ceiling(tested)}"
        else:
            action = "above the ceiling, and the suite failed: keep the ceiling (see the failures above)"
        rows.append((req.name, str(req.specifier), have, action))
    return rows


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", default="torch", help="the torch requirement (the Makefile pins a local CPU wheel)")
    parser.add_argument("--fast", action="store_true", help="only the tests not marked slow")
    parser.add_argument("--keep", action="store_true", help="keep the virtualenv and print its path")
    args = parser.parse_args()

    reqs = declared()
    venv = Path(tempfile.mkdtemp(prefix="hf_ppo-latest-"))
    py = str(venv / "bin" / "python")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [py, "-m", "pip", "install", "-q"]
        subprocess.run([*pip, args.torch], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
        # Every dependency by name alone: pip picks the newest releases that install together.
        names = [r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") for r in reqs if r.name != "torch"]
        subprocess.run([*pip, "--upgrade", *names], check=True)
        listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                                text=True).stdout
        installed = {normal(n): v for n, v in (line.split("==", 1) for line in listed.splitlines() if "==" in line)}
        command = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"] + (["-m", "not slow"] if args.fast else [])
        green = subprocess.run(command, cwd=ROOT).returncode == 0
        print("\nmake test-latest: the suite", "PASSED" if green else "FAILED", "with:")
        for name, spec, have, action in verdicts(reqs, installed, green):
            print(f"  {name:16} {have:12} declared {spec:16} {action}")
        return 0 if green else 1
    finally:
        if args.keep:
            print(f"virtualenv kept at {venv}")
        else:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
