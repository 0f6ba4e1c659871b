"""GGUF checkpoints (`model_init_kwargs={"gguf_file": ...}`), converted once into a plain safetensors folder.

transformers loads a GGUF file by dequantizing it, but then refuses to quantize it again (no 4-bit QLoRA) and to
save it (`save_model()` of a full fine-tune fails, and an adapter's `base_model_name_or_path` names a folder that
loads only with the same `gguf_file`). hf_ppo therefore converts the checkpoint once, on first use, into a folder
of its own (weights, config, generation config and tokenizer; written under a temporary name and renamed when
complete) and loads that folder instead: every path then works as for any Hub model, and a saved adapter names a
base that `from_pretrained` loads as it is. The folder lives in `$HF_PPO_CACHE` (default
`$HF_HOME/hf_ppo/gguf`, i.e. `~/.cache/huggingface/hf_ppo/gguf`), keyed by the source, the file and its revision.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .pretrained import from_pretrained

# The from_pretrained keyword arguments that say where the checkpoint is (they pick the file to convert).
_SOURCE_KWARGS = ("revision", "subfolder", "token", "cache_dir")


def cache_root() -> Path:
    if os.environ.get("HF_PPO_CACHE"):
        return Path(os.environ["HF_PPO_CACHE"])
    from huggingface_hub.constants import HF_HOME

    return Path(HF_HOME) / "hf_ppo" / "gguf"


def converted(name_or_path: str, init_kwargs: dict | None, role: str) -> tuple[str, dict | None]:
    """(folder, init_kwargs without `gguf_file`) for a GGUF checkpoint; the arguments unchanged otherwise."""
    gguf_file = (init_kwargs or {}).get("gguf_file")
    if not gguf_file:
        return name_or_path, init_kwargs
    source = {k: v for k, v in init_kwargs.items() if k in _SOURCE_KWARGS}
    rest = {k: v for k, v in init_kwargs.items() if k != "gguf_file"}
    folder = cache_root() / _key(name_or_path, gguf_file, source)
    if not (folder / "config.json").is_file():
        _convert(name_or_path, gguf_file, source, rest.get("trust_remote_code", False), folder, role)
    return str(folder), rest


def _key(name_or_path: str, gguf_file: str, source: dict) -> str:
    """A folder name: the file's stem and a hash of everything that picks it (a local file's size and mtime too)."""
    parts = [os.path.abspath(name_or_path) if os.path.exists(name_or_path) else name_or_path, gguf_file,
             repr(sorted((k, str(v)) for k, v in source.items() if k != "token"))]
    local = Path(name_or_path) / gguf_file if os.path.isdir(name_or_path) else Path(gguf_file)
    if local.is_file():
        parts.append(f"{local.stat().st_size}:{local.stat().st_mtime_ns}")
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{Path(gguf_file).stem}-{digest}"


def _convert(name_or_path: str, gguf_file: str, source: dict, trust_remote_code: bool, folder: Path,
             role: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {**source, "gguf_file": gguf_file, "trust_remote_code": trust_remote_code}
    loaded = from_pretrained(AutoModelForCausalLM, name_or_path, role, **kwargs)  # dequantized by transformers
    tokenizer = from_pretrained(AutoTokenizer, name_or_path, f"{role} tokenizer", **kwargs)
    # A model built from the config alone is a plain one (no GGUF quantizer), so it saves like any other.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype, trust_remote_code=trust_remote_code)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(partial, folder)
    except OSError:  # another process finished the same conversion first: keep its folder
        shutil.rmtree(partial, ignore_errors=True)
