"""The tested range of each dependency hf_ppo leans on, read back from the installed package's metadata, and the one
warning given on `import hf_ppo` when the environment holds a version outside it.

Apart from `versions` (which reads transformers' classes) so that the check costs no heavy import: `import hf_ppo`
and `hf-ppo --help` run it before torch or transformers is loaded."""

from __future__ import annotations

import importlib.metadata
import warnings

# The packages whose internals hf_ppo leans on: their range in pyproject.toml is a tested one.
CHECKED = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "datasets", "huggingface_hub")


def out_of_range() -> list[str]:
    """`name version (tested: range)` for every checked package installed outside the range hf_ppo declares."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("hf_ppo") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return []
    found = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None or _normal(req.name) not in {_normal(n) for n in CHECKED}:
            continue  # extras (`[test]`) and packages whose version does not matter
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # its import fails with its own message
        if req.specifier and not req.specifier.contains(have.split("+")[0], prereleases=True):
            found.append(f"{req.name} {have} (tested: {req.specifier})")
    return found


def warn_if_out_of_range() -> None:
    """One warning naming every checked package outside the tested range, and the range."""
    found = out_of_range()
    if found:
        warnings.warn(
            "hf_ppo is tested with versions this environment does not have: " + "; ".join(found)
            + ". It may work, or fail in ways the tests would have caught. Install the tested range with "
            "`pip install hf_ppo` (without --no-deps), or see the tested versions (docs/getting-started/installation.md).",
            UserWarning, stacklevel=3)


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")
