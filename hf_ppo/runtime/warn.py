"""`warn_user`: the one way hf_ppo warns, pointing at the user's own line rather than at library internals.

On the lowest floor because nearly every module warns; it imports nothing of hf_ppo. Also the two messages of
other packages that hf_ppo silences, each where it is raised (`quiet_bitsandbytes_kernels_note`,
`without_checkpointing_deprecation`)."""

from __future__ import annotations

import functools
import logging
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


# Other packages' messages that read like a broken install but are not: each silenced where it is raised, never with
# a process-wide warnings filter, so the same words from anywhere else still show.
BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BITSANDBYTES_KERNELS_NOTE = "Failed to load CPU gemm_4bit_forward from kernels-community"
GRADIENT_CHECKPOINTING_NOTE = r"`is_gradient_checkpointing` is deprecated"


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`; lets every other record through."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_bitsandbytes_kernels_note() -> None:
    """bitsandbytes logs, on import on a CPU with AVX512-BF16, that the optional `kernels` package (a faster 4-bit CPU
    matmul) is missing and how to install it: a note about an optional speed-up that, printed on every
    `import hf_ppo`, reads like a failed install. The filter sits on that one logger (created now if bitsandbytes is
    not imported yet) and drops that one message; bitsandbytes' other records still show."""
    logger = logging.getLogger(BITSANDBYTES_CPU_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(BITSANDBYTES_KERNELS_NOTE))


def without_checkpointing_deprecation(func):
    """`func` run with transformers' FutureWarning for `is_gradient_checkpointing` ignored: peft reads that property
    whenever it wraps a model (`PeftModel.__init__`), so every construction with LoRA warned about a name hf_ppo
    never uses. Only inside `func`, and only that message from transformers.modeling_utils."""

    @functools.wraps(func)
    def quiet(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_NOTE, category=FutureWarning,
                                    module="transformers.modeling_utils")
            return func(*args, **kwargs)

    return quiet
