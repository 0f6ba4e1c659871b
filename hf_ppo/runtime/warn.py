"""`warn_user`: the one way hf_ppo warns, pointing at the user's own line rather than at library internals.

On the lowest floor because nearly every module warns; it imports nothing of hf_ppo."""

from __future__ import annotations

import os
import sys
import warnings


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def _library_dirs() -> tuple[str, ...]:
    """Code that runs between the user's line and an hf_ppo warning: hf_ppo itself and the libraries that call it
    (Trainer's loop, accelerate, torch, peft, datasets)."""
    import accelerate
    import datasets
    import peft
    import torch
    import transformers

    hf_ppo = sys.modules[__package__.partition(".")[0]]  # the whole package, every floor
    return tuple(_package_dir(m) for m in (hf_ppo, transformers, accelerate, torch, peft, datasets))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the first frame of the user's code (a script, a notebook cell), found by walking
    up past hf_ppo, the libraries that call it and generated code (a dataclass `__init__`), so the warning names the
    line that constructed the trainer or called `train()`, not an hf_ppo internal."""
    libraries = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(libraries)
                                        or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
