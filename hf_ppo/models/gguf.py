"""GGUF checkpoints (`model_init_kwargs={"gguf_file": ...}`), converted once into a plain safetensors folder.

transformers loads a GGUF file by dequantizing it, but then refuses to quantize it again (no 4-bit QLoRA) and to
save it (`save_model()` of a full fine-tune fails, and an adapter's `base_model_name_or_path` names a folder that
loads only with the same `gguf_file`). hf_ppo therefore converts the checkpoint once, on first use, into a folder
of its own (weights, config, generation config and tokenizer; written under a temporary name and renamed when
complete) and loads that folder instead: every path then works as for any Hub model, and a saved adapter names a
base that `from_pretrained` loads as it is. The folder lives in `$HF_PPO_CACHE` (default
`$HF_HOME/hf_ppo/gguf`, i.e. `~/.cache/huggingface/hf_ppo/gguf`), keyed by the source, the file and its revision.

A GGUF file is checked against its own header before it is read (`check_gguf_file`): a download or copy cut short
would otherwise fail deep inside the reader (a numpy reshape, a struct error) without naming the file. A conversion
killed midway leaves its temporary folder (`<name>.partial-<host>-<pid>`, hundreds of MB); each later use removes
those of this host's processes that are gone, and only those.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import shutil
import socket
import struct
from pathlib import Path

from .pretrained import from_pretrained

# The from_pretrained keyword arguments that say where the checkpoint is (they pick the file to convert).
_SOURCE_KWARGS = ("revision", "subfolder", "token", "cache_dir")
# hf_ppo's temporary conversion folders: `<stem>-<16 hex>.partial-<host>-<pid>` (before: `.partial-<pid>`, no host).
_PARTIAL = re.compile(r".+-[0-9a-f]{16}\.partial-(?:(?P<host>.+)-)?(?P<pid>[0-9]+)")
# GGUF metadata value types (by their code) of a fixed size: struct formats, little-endian.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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
    remove_dead_partials(folder.parent)
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
    from transformers.utils import cached_file

    kwargs = {**source, "gguf_file": gguf_file, "trust_remote_code": trust_remote_code}
    try:  # the local path (a Hub file is downloaded here, as from_pretrained would)
        path = cached_file(name_or_path, gguf_file, **source)
    except (OSError, ValueError):  # not found: from_pretrained names the checkpoint and the remedies
        path = None
    if path is not None:
        check_gguf_file(path)
    loaded = from_pretrained(AutoModelForCausalLM, name_or_path, role, **kwargs)  # dequantized by transformers
    tokenizer = from_pretrained(AutoTokenizer, name_or_path, f"{role} tokenizer", **kwargs)
    # A model built from the config alone is a plain one (no GGUF quantizer), so it saves like any other.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype, trust_remote_code=trust_remote_code)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    partial = folder.with_name(f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    except BaseException:  # a disk full, an interrupt: nothing half-written stays behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(partial, folder)
    except OSError:  # another process finished the same conversion first: keep its folder
        shutil.rmtree(partial, ignore_errors=True)


def remove_dead_partials(root: Path) -> None:
    """Delete the temporary folders of conversions killed midway: hf_ppo's own naming (`_PARTIAL`), made on this
    host by a process that no longer exists. A live process's folder (another conversion running now, this one
    included) is never touched, nor one another host made (a shared cache: its pid means nothing here)."""
    if not root.is_dir():
        return
    host = socket.gethostname()
    for entry in root.iterdir():
        match = _PARTIAL.fullmatch(entry.name)
        if match is None or not entry.is_dir() or match["host"] not in (None, host):
            continue
        if not _process_alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # exists, owned by another user (or cannot tell): keep its folder
        return True
    return True


def check_gguf_file(path: str) -> None:
    """A ValueError naming `path` when the GGUF file is damaged: not a GGUF file, cut inside its header, or shorter
    than the tensor data its header describes (an interrupted download or copy)."""
    size = os.path.getsize(path)
    blob = os.path.realpath(path)
    fix = ("Download or copy it again; hf_ppo does not delete it for you." if blob == os.path.abspath(path) else
           f"It is in the Hugging Face cache: delete the file {blob} and the link {path}, then run again to download "
           "it again; hf_ppo does not delete them for you.")
    if not size:
        raise ValueError(f"The GGUF file {path} is empty (0 bytes). {fix}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            expected = _gguf_size(data)
    except struct.error:
        raise ValueError(f"The GGUF file {path} is damaged: it ends inside its header, at byte {size:,} (a download "
                         f"or copy cut short). {fix}") from None
    except _NotGGUF:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'): pass a .gguf file as "
                         f"gguf_file. If it is one, it is damaged: {fix}") from None
    if expected is not None and size < expected:
        raise ValueError(f"The GGUF file {path} is damaged: it is {size:,} bytes, but its header describes "
                         f"{expected:,} (cut short by an interrupted download or copy). {fix}")


class _NotGGUF(Exception):
    pass


def _gguf_size(data) -> int | None:
    """The size in bytes a GGUF file's header says it has (header, then aligned tensor data); None when a tensor's
    type is unknown here. Raises struct.error when the file ends inside the header, _NotGGUF without the magic."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if data[:4] != b"GGUF":
        raise _NotGGUF
    version, tensors, values = struct.unpack_from("<IQQ", data, 4)
    pos, alignment = 24, 32
    if version < 2:  # GGUF v1 (32-bit counts) predates every model transformers reads
        return None

    def string(at: int) -> tuple[bytes, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        if at + 8 + length > len(data):
            raise struct.error("string past the end")
        return data[at + 8:at + 8 + length], at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            return string(at)[1]
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _SCALARS:
                return at + count * struct.calcsize(_SCALARS[item])
            for _ in range(count):
                at = skip(item, at)
            return at
        raise struct.error(f"unknown value type {kind}")

    for _ in range(values):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        if key == b"general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", data, pos + 4)
        pos = skip(kind, pos + 4)
    end = 0
    for _ in range(tensors):
        _, pos = string(pos)
        (dims,) = struct.unpack_from("<I", data, pos)
        shape = struct.unpack_from(f"<{dims}Q", data, pos + 4)
        kind, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            return None
        elements = 1
        for n in shape:
            elements *= n
        end = max(end, offset + elements // block * block_bytes)
    if pos > len(data):
        raise struct.error("header past the end")
    start = -(-pos // alignment) * alignment
    return start + end
