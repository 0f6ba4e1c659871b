"""The CPU suite runs unchanged where CUDA is visible (the lent GPU machine runs it so: bench/gpu_session.sh). There a
trainer puts its models on the GPU and turns bf16 on by default; a test that builds tensors for a model, or compares
a model's tensors with ones it made, takes the device from here instead of assuming the CPU."""

from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()


def device_of(module: torch.nn.Module) -> torch.device:
    """Where `module`'s parameters are (a trainer's model, a reward model, a value-head wrapper)."""
    return next(module.parameters()).device


def on_device_of(module: torch.nn.Module, *tensors: torch.Tensor):
    """`tensors` moved to `module`'s device (one tensor: that tensor; several: a tuple)."""
    device = device_of(module)
    moved = tuple(t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved
