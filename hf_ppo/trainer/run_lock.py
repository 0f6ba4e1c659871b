"""One run per `output_dir`: `PPOLMTrainer.train()` holds its output folder with a lock file for as long as it runs.

Two runs writing into one output_dir overwrite each other's checkpoints and final weights, and both end without a
word. So `holding` takes `output_dir/hf_ppo_train.lock` (`LOCK_FILE`: JSON naming the process, its host, since when and
its command) at the start of `train()` and removes it at the end, also on error. A second run meanwhile is refused
(`OutputDirInUseError`), naming the process that holds the folder and the fix.

The lock is an OS lock on the open file (`fcntl.flock`), which the kernel drops when the process dies however it
dies (kill -9 included): a lock file left by a dead process never blocks, it is taken over with a note naming that
process. Where `flock` is missing (Windows) or refused (some network filesystems), the recorded process decides: one
that no longer runs on this host frees the folder; one on another host is named, with the file to delete if that run
is over. Only the main process takes the lock; the other processes of a distributed run learn its outcome (the
trainer's `broadcast`), so they all stop together. `in_use_message` is the same question asked without taking the
lock, so the trainer and `hf-ppo train` can refuse before any model loads.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Callable

from ..runtime.warn import warn_user

try:
    import fcntl
except ImportError:  # Windows: the recorded process decides (see the module's docstring)
    fcntl = None

LOCK_FILE = "hf_ppo_train.lock"
WRITER = "hf_ppo"


class OutputDirInUseError(RuntimeError):
    """Another live run holds `output_dir` (or a file of that name that hf_ppo did not write is there)."""


def _start_time(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc/<pid>/stat's start time, in clock ticks since boot), so that a pid
    reused by another process is not taken for the run that held the lock; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "(command name)", which may hold spaces
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def _running(pid: int, start: str | None) -> bool:
    """Whether process `pid` (started at `start`, when recorded) still runs on this host (a zombie does not)."""
    if os.name == "nt":  # os.kill(pid, 0) would end the process there: take it as running (the message says what to do)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        pass
    except OSError:
        return False
    now = _start_time(pid)
    if os.path.isdir("/proc") and os.path.isdir(f"/proc/{pid}") and now is None:
        return False  # a zombie: it has exited
    return start is None or now is None or now == start


def _record() -> dict:
    """What the lock file says about this process."""
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"writer": WRITER, "pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
            "since": since, "command": " ".join(sys.argv)[:300]}


def _read(path: str) -> dict | None:
    """The lock file's record; {} when it is empty (a process killed between creating and writing it: the record is
    written in one write), None when it is not a lock file hf_ppo wrote."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip():
        return {}
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("writer") == WRITER else None


def _alive(record: dict) -> bool | None:
    """Whether the process a lock record names runs: True / False on this host, None on another (unknowable)."""
    if not isinstance(record.get("pid"), int):
        return False
    if record.get("host") != socket.gethostname():
        return None
    return _running(record["pid"], record.get("start"))


def _who(record: dict) -> str:
    process = f"process {record.get('pid', '?')} on {record.get('host', '?')}"
    if record.get("pid") == os.getpid() and record.get("host") == socket.gethostname():
        process += " (this process: another trainer's train() is running in it)"
    since = f", training since {record['since']}" if record.get("since") else ""
    command = f" ({record['command']})" if record.get("command") else ""
    return process + since + command


def _refusal(output_dir: str, record: dict, unknowable: bool = False) -> str:
    path = os.path.join(output_dir, LOCK_FILE)
    over = (f" That host cannot be asked from here whether it still runs: if that run is over, delete {path}."
            if unknowable else f" The lock ({path}) goes when that run ends; one left by a process that died is taken "
            "over.")
    return (f"output_dir {output_dir} is in use by another hf_ppo run: {_who(record)}. Two runs in one output_dir "
            "overwrite each other's checkpoints and final weights. Train into another output_dir (hf-ppo train: "
            "--output_dir PATH, or output_dir in the YAML), or wait for that run to end." + over)


def _not_ours(path: str) -> str:
    return (f"{path} exists and was not written by hf_ppo: it is left as it is, and hf_ppo cannot mark the folder as "
            "in use by this run. Move that file away, or train into another output_dir.")


def in_use_message(output_dir: str) -> str | None:
    """Why `output_dir` cannot be trained into now, without taking it: the lock file of a process that still runs on
    this host (or a file of that name hf_ppo did not write); None when it is free, or when only `train()` can tell
    (a process on another host, which the OS lock answers for)."""
    path = os.path.join(output_dir, LOCK_FILE)
    if not os.path.lexists(path):
        return None
    record = _read(path)
    if record is None:
        return _not_ours(path)
    return _refusal(output_dir, record) if record and _alive(record) else None


def _try_flock(fd: int) -> bool | None:
    """Lock the open file `fd` exclusively without waiting: True, False when another process holds it, None where
    flock is missing or refused by the filesystem."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: a filesystem without flock
        return None
    return True


class RunLock:
    """`output_dir`'s lock, held by this process (`acquire`) until `release`."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Remove the lock file (only while it is still this lock's: its inode) and drop the OS lock."""
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def acquire(output_dir: str) -> RunLock:
    """Take `output_dir` for this process: create (or take over) its lock file and hold it. Raises
    `OutputDirInUseError` naming the process that holds it, when one does."""
    output_dir = os.path.abspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)  # (Trainer made it already, on the main process)
    path = os.path.join(output_dir, LOCK_FILE)
    while True:
        if os.path.lexists(path) and _read(path) is None:
            raise OutputDirInUseError(_not_ours(path))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _try_flock(fd)
            previous = _read(path) or {}
            if locked is False or (locked is None and previous and _alive(previous) is not False):
                raise OutputDirInUseError(_refusal(output_dir, previous, unknowable=locked is None
                                                   and _alive(previous) is None))
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # released and removed meanwhile: lock the new file
                os.close(fd)
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        break
    if previous:
        warn_user(f"{path} was left by {_who(previous)}, which is no longer running (it stopped without releasing "
                  "it): this run takes the output folder over.")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(_record(), indent=2).encode())
    os.fsync(fd)
    return RunLock(path, fd)


@contextlib.contextmanager
def holding(output_dir: str, is_main: bool, broadcast: Callable[[str | None], str | None] = lambda value: value):
    """Hold `output_dir` for the `with` block (`acquire` on the main process, released at its end, also on error).
    `broadcast` hands the main process's refusal (or None) to every process, so all of them raise it together."""
    lock, refusal = None, None
    if is_main:
        try:
            lock = acquire(output_dir)
        except OutputDirInUseError as err:
            refusal = str(err)
    refusal = broadcast(refusal)
    if refusal is not None:
        if lock is not None:
            lock.release()
        raise OutputDirInUseError(refusal)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
