"""Floor 1, the runtime: which library versions are installed and what they renamed (`versions`; the tested range in
`ranges`), how the run is sharded (`sharding`: FSDP2 / DeepSpeed through accelerate), `file_problem`, whether a file
about to be read opens, and `warn_user`, the one way hf_ppo warns. Imports nothing of hf_ppo.

`import hf_ppo` imports this package first (the range check), and `hf-ppo --help` must not load torch: the names of
the modules that import torch or transformers (`files`, `sharding`) are handed on when first asked for."""

import importlib

from .ranges import out_of_range, warn_if_out_of_range
from .warn import quiet_bitsandbytes_kernels_note, warn_user, without_checkpointing_deprecation

_ON_FIRST_USE = {"file_problem": "files", "fsdp_version": "sharding", "sharded_by_accelerate": "sharding"}


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["file_problem", "fsdp_version", "out_of_range", "quiet_bitsandbytes_kernels_note", "sharded_by_accelerate",
           "warn_if_out_of_range", "warn_user", "without_checkpointing_deprecation"]
