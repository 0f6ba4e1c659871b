"""Skip guards that never call the code they guard.

A guard that asks hf_ppo whether a feature is supported turns a bug in that answer into a skip, and the run reports
green: `fsdp_supported()` returning False on the tested accelerate would silently skip every FSDP test. These guards
read the installed versions themselves; `tests/runtime/test_sharding.py` checks that hf_ppo's answer agrees with them.
Each reason says where the skip is expected, so the CI log (`pytest -rs`) shows whether a skip is the planned one.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
from packaging.version import Version

# The accelerate release hf_ppo's FSDP2 path is tested with (hf_ppo.runtime.sharding.FSDP_ACCELERATE, restated here
# on purpose: the two are compared by a test, never derived from each other).
ACCELERATE_FSDP2 = "1.15.0"


def installed_at_least(package: str, release: str) -> bool:
    return Version(version(package)) >= Version(release)


needs_fsdp2 = pytest.mark.skipif(
    not installed_at_least("accelerate", ACCELERATE_FSDP2),
    reason=f"FSDP2 needs accelerate >= {ACCELERATE_FSDP2}: expected on CI's floor leg (deps/floors.txt), which "
           "checks the refusal instead")
