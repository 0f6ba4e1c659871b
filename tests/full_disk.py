"""A full disk, simulated: safetensors' writer (every policy save goes through it) fails as it does on a full disk."""

from __future__ import annotations

import os


def half_written_then_full(out, monkeypatch) -> None:
    """Make safetensors write half of each file under `out` (outside its checkpoints), then fail with the error a
    full disk gives ("I/O error: No space left on device (os error 28)"): a save straight into a folder would leave
    the truncated file in place of the earlier one. Undone with `monkeypatch.undo()`."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.serialize_file

    def full_disk(tensors, filename, metadata=None):
        if str(out) not in str(filename) or "checkpoint-" in str(filename):
            return real(tensors, filename, metadata)
        whole = str(filename) + ".whole"
        real(tensors, whole, metadata)
        with open(whole, "rb") as f:
            data = f.read()
        os.remove(whole)
        with open(filename, "wb") as f:
            f.write(data[:len(data) // 2])
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "serialize_file", full_disk)
