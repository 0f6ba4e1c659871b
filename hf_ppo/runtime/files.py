"""Whether a file hf_ppo is about to read opens: a cheap check before a load, so a damaged file (a save or download
cut short) is named with its path instead of failing deep inside a reader."""

from __future__ import annotations

import json
import os
import zipfile

from safetensors import safe_open


def file_problem(path: str) -> str | None:
    """None when `path` exists and opens (a safetensors header that covers the file, JSON that parses, a torch zip
    whose central directory reads); else what is wrong: "missing" or "unreadable (truncated or corrupt: ...)"."""
    if not os.path.isfile(path):
        return "missing"
    try:
        if path.endswith(".safetensors"):
            with safe_open(path, "pt"):
                pass
        elif path.endswith(".json"):
            with open(path) as f:
                json.load(f)
        elif path.endswith((".pt", ".pth", ".bin")):
            zipfile.ZipFile(path).close()  # torch.save's format; the directory sits at the end of the file
    except Exception as err:  # noqa: BLE001 - any failure to open is a damaged file, named with its cause
        return f"unreadable (truncated or corrupt: {type(err).__name__}: {err})"
    return None
