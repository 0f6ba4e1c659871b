"""GGUF checkpoints (`model_init_kwargs={"gguf_file": ...}`, or the `.gguf` file itself as the model), converted
once into a plain safetensors folder.

transformers loads a GGUF file by dequantizing it, but then refuses to quantize it again (no 4-bit QLoRA) and to
save it (`save_model()` of a full fine-tune fails, and an adapter's `base_model_name_or_path` names a folder that
loads only with the same `gguf_file`). hf_ppo therefore converts the checkpoint once, on first use, into a folder
of its own (weights, config, generation config and tokenizer; written under a temporary name and renamed when
complete) and loads that folder instead: every path then works as for any Hub model, and a saved adapter names a
base that `from_pretrained` loads as it is. The folder lives in `$HF_PPO_CACHE` (default
`$HF_HOME/hf_ppo/gguf`, i.e. `~/.cache/huggingface/hf_ppo/gguf`), keyed by the real file (its resolved path, size
and modification time): one file named by a relative path, an absolute one or a Hub id is converted once.

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


def split_gguf_path(name_or_path: str, init_kwargs: dict | None) -> tuple[str, dict | None]:
    """A local `.gguf` file given as the model itself, as transformers wants it: (its folder, init_kwargs with
    `gguf_file` = its name). Anything else is returned unchanged; a file given together with a different
    `gguf_file` is an error naming both."""
    if not (isinstance(name_or_path, str) and name_or_path.lower().endswith(".gguf")
            and os.path.isfile(os.path.expanduser(name_or_path))):
        return name_or_path, init_kwargs
    path = os.path.abspath(os.path.expanduser(name_or_path))
    given = (init_kwargs or {}).get("gguf_file")
    if given and os.path.abspath(os.path.join(os.path.dirname(path), given)) != path:
        raise ValueError(f"The model is the GGUF file {name_or_path!r}, and gguf_file={given!r} names another one: "
                         "pass the file as the model alone, or its folder as the model and the file as gguf_file.")
    return os.path.dirname(path), {**(init_kwargs or {}), "gguf_file": os.path.basename(path)}


def converted(name_or_path: str, init_kwargs: dict | None, role: str) -> tuple[str, dict | None]:
    """(folder, init_kwargs without `gguf_file`) for a GGUF checkpoint (a folder or Hub repo with `gguf_file`, or a
    local `.gguf` file given as the model itself); the arguments unchanged otherwise."""
    given = os.path.expanduser(name_or_path) if isinstance(name_or_path, str) else ""
    if given.lower().endswith(".gguf") and not os.path.exists(given):  # a file that is not there: what is?
        check_local_gguf(os.path.dirname(given) or ".", os.path.basename(given), None, role)
    name_or_path, init_kwargs = split_gguf_path(name_or_path, init_kwargs)
    gguf_file = (init_kwargs or {}).get("gguf_file")
    if not gguf_file:
        return name_or_path, init_kwargs
    source = {k: v for k, v in init_kwargs.items() if k in _SOURCE_KWARGS}
    check_local_gguf(name_or_path, gguf_file, source.get("subfolder"), role)
    rest = {k: v for k, v in init_kwargs.items() if k != "gguf_file"}
    folder = cache_root() / _key(name_or_path, gguf_file, source)
    remove_dead_partials(folder.parent)
    if not (folder / "config.json").is_file():
        _convert(name_or_path, gguf_file, source, rest.get("trust_remote_code", False), folder, role)
    return str(folder), rest


def check_local_gguf(name_or_path: str, gguf_file: str, subfolder: str | None, role: str) -> None:
    """A ValueError listing the `.gguf` files a local folder has when `gguf_file` is not one of them (from_pretrained
    would take the folder for a Hub id and answer with a Hub URL and login advice); nothing for a Hub id, or for an
    absolute `gguf_file` that exists."""
    folder = os.path.join(os.path.expanduser(name_or_path), subfolder or "")
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, gguf_file)) or (
            os.path.isabs(gguf_file) and os.path.isfile(gguf_file)):
        return
    found = sorted(p.name for p in Path(folder).iterdir() if p.name.lower().endswith(".gguf") and p.is_file())
    has = (f"its GGUF files are {found}: set gguf_file to one of them" if found else
           "it has no .gguf file: pass the folder (or the .gguf file itself) that holds the checkpoint")
    raise ValueError(f"The {role}'s folder {folder} has no GGUF file {gguf_file!r}; {has} (gguf_file in "
                     "model_init_kwargs, or the file's path as the model).")


def _key(name_or_path: str, gguf_file: str, source: dict) -> str:
    """A folder name: the file's stem and a hash of the real file it names (its resolved path, size and mtime), so
    one file reached by a relative path, an absolute one, a link or a Hub id whose download is that file converts
    once. A file that cannot be found here (a Hub file not downloaded yet) is keyed by the names that pick it."""
    real = _local_file(name_or_path, gguf_file, source)
    if real is not None:
        stat = os.stat(real)
        parts = [os.path.realpath(real), str(stat.st_size), str(stat.st_mtime_ns)]
    else:
        parts = [name_or_path, gguf_file, repr(sorted((k, str(v)) for k, v in source.items() if k != "token"))]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{Path(gguf_file).stem}-{digest}"


def _local_file(name_or_path: str, gguf_file: str, source: dict) -> str | None:
    """The GGUF file on this machine: in the local folder, as an absolute `gguf_file`, or a Hub file (downloaded
    into the HF cache here, as from_pretrained would); None when it cannot be found (from_pretrained then names the
    checkpoint and the remedies)."""
    folder = os.path.expanduser(name_or_path)
    if os.path.isdir(folder):
        path = os.path.join(folder, source.get("subfolder") or "", gguf_file)
        return path if os.path.isfile(path) else None
    if os.path.isabs(gguf_file):
        return gguf_file if os.path.isfile(gguf_file) else None
    from transformers.utils import cached_file

    try:
        return cached_file(name_or_path, gguf_file, **source)
    except (OSError, ValueError):
        return None


def _convert(name_or_path: str, gguf_file: str, source: dict, trust_remote_code: bool, folder: Path,
             role: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {**source, "gguf_file": gguf_file, "trust_remote_code": trust_remote_code}
    path = _local_file(name_or_path, gguf_file, source)
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
