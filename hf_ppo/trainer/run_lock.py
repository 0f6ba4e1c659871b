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
lock, so the trainer and `hf-ppo train` can refuse before any model loads. The trainer holds the folder through its
final save as well (`SavingSeams._holding_output_dir`: `hf-ppo train` across training and the save, `save_model()`
while it writes). The recorded command has its secrets masked (`masked_command`); a lock path that is no plain file
(a FIFO, whose read would wait for ever; a symbolic link, whose write would land in its target) is never opened.

TRL 0.11's `step()` loop has no end that hf_ppo sees, so with save_strategy="steps" (checkpoints written into
output_dir) its first call takes the folder for the trainer's life (`hold_for_steps`): released when the trainer is
garbage-collected or the process ends (the kernel drops the OS lock in any case). Inside one process a later trainer takes a folder over from an earlier trainer's step() loop (a notebook
cell run again builds a second trainer while the first is still bound), with a note; the earlier trainer's next
`step()` is then refused (`still_held`), since two writers in one folder overwrite each other's checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import stat
import sys
import weakref
from collections.abc import Callable

from ..runtime.warn import warn_user

try:
    import fcntl
except ImportError:  # Windows: the recorded process decides (see the module's docstring)
    fcntl = None

LOCK_FILE = "hf_ppo_train.lock"
WRITER = "hf_ppo"
STEP_LOOP = "step() loop"

# output_dir (absolute) -> the lock a step() loop of this process holds there, taken over by a later trainer.
_step_locks: dict[str, RunLock] = {}


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


# A command-line option whose value is a secret (--hub_token, --api_key, --db_password, ...), and a Hub token's shape
# wherever it stands: masked in the recorded command, which anyone who can read the folder reads.
_SECRET_OPTION = re.compile(r"^-{1,2}[\w.-]*(token|secret|password|passwd|key)[\w.-]*$", re.IGNORECASE)
_HUB_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
MASK = "***"


def masked_command(argv: list[str]) -> str:
    """`argv` as one line, each secret's value replaced by `MASK`: the value of an option named like a secret (in
    both forms, `--hub_token VALUE` and `--hub_token=VALUE`) and anything shaped like a Hub token (hf_...)."""
    words, secret_next = [], False
    for word in argv:
        name, eq, _ = word.partition("=")
        if secret_next and not word.startswith("-"):
            word = MASK
        elif eq and _SECRET_OPTION.match(name):
            word = f"{name}={MASK}"
        secret_next = not eq and bool(_SECRET_OPTION.match(word))
        words.append(_HUB_TOKEN.sub(MASK, word))
    return " ".join(words)


def _record(by: str) -> dict:
    """What the lock file says about this process, holding the folder for `by` ("train()" or `STEP_LOOP`); its
    command with the secrets masked (`masked_command`)."""
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"writer": WRITER, "pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
            "since": since, "command": masked_command(sys.argv)[:300], "by": by}


def _kind(path: str) -> str | None:
    """What `path` is when it is not a plain file (a FIFO, whose read would wait forever, a symbolic link, whose
    write would land in its target, a folder, ...), None when it is one (or is gone)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _read(path: str) -> dict | None:
    """The lock file's record; {} when it is empty (a process killed between creating and writing it: the record is
    written in one write), None when it is not a lock file hf_ppo wrote (or not a plain file: never opened)."""
    if _kind(path) is not None:
        return None
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
    elif record.get("by") == STEP_LOOP:
        process += (" (a step() loop: it holds the folder from its first step() call until its trainer is deleted "
                    "or its process ends)")
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
    kind = _kind(path)
    what = f"is {kind}, not a lock file hf_ppo wrote" if kind else "was not written by hf_ppo"
    return (f"{path} exists and {what}: it is left as it is, and hf_ppo cannot mark the folder as "
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
    if _step_locks.get(os.path.abspath(output_dir)) is not None:
        return None  # an earlier trainer's step() loop in this process: taken over when this run starts
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
    """`output_dir`'s lock, held by this process (`acquire`) until `release`; `taken_over` says since when a later
    trainer of this process holds the folder instead (`hold_for_steps`)."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd, self.taken_over = path, fd, None

    def release(self) -> None:
        """Remove the lock file (only while it is still this lock's: its inode) and drop the OS lock."""
        folder = os.path.dirname(self.path)
        if _step_locks.get(folder) is self:
            del _step_locks[folder]
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


def _take_from_step_loop(output_dir: str) -> None:
    """Release the lock an earlier trainer's step() loop of this process holds on `output_dir` (if one does), with a
    note, marking it taken over so that loop's next step() is refused."""
    earlier = _step_locks.pop(output_dir, None)
    if earlier is None:
        return
    earlier.taken_over = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    earlier.release()
    warn_user(f"output_dir {output_dir} was held by the step() loop of an earlier PPOLMTrainer in this process: this "
              "run takes it over, and that trainer's step() is refused from now on (two trainers writing into one "
              "folder overwrite each other's checkpoints). Give each trainer its own output_dir to use both.")


def acquire(output_dir: str, by: str = "train()") -> RunLock:
    """Take `output_dir` for this process, for `by` ("train()" or `STEP_LOOP`): create (or take over) its lock file
    and hold it, after taking it from an earlier trainer's step() loop in this process. Raises `OutputDirInUseError`
    naming the process that holds it, when one does."""
    output_dir = os.path.abspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)  # (Trainer made it already, on the main process)
    path = os.path.join(output_dir, LOCK_FILE)
    if os.path.lexists(path) and _read(path) is None:
        raise OutputDirInUseError(_not_ours(path))
    _take_from_step_loop(output_dir)
    while True:
        if os.path.lexists(path) and _read(path) is None:
            raise OutputDirInUseError(_not_ours(path))
        # Never through a symbolic link, never waiting on a FIFO put there since the check above.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o644)
        if _kind(path) is not None:
            os.close(fd)
            raise OutputDirInUseError(_not_ours(path))
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
    if previous and _alive(previous) is None:  # the OS lock was free: no process on any host that shares it holds it
        warn_user(f"{path} was left by {_who(previous)}, another host: its lock on the file is gone (that run ended, "
                  "or its host's filesystem does not share locks with this one: then two runs write into this "
                  "folder). This run takes the output folder over; if that run still trains, stop one of the two.")
    elif previous:
        warn_user(f"{path} was left by {_who(previous)}, which is no longer running (it stopped without releasing "
                  "it): this run takes the output folder over.")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(_record(by), indent=2).encode())
    os.fsync(fd)
    return RunLock(path, fd)


Broadcast = Callable[[str | None], str | None]


def _acquire_everywhere(output_dir: str, is_main: bool, broadcast: Broadcast, by: str) -> RunLock | None:
    """`acquire` on the main process; `broadcast` hands its refusal (or None) to every process, so all of them raise
    it together. The main process's lock (None on the others)."""
    lock, refusal = None, None
    if is_main:
        try:
            lock = acquire(output_dir, by)
        except OutputDirInUseError as err:
            refusal = str(err)
    refusal = broadcast(refusal)
    if refusal is not None:
        if lock is not None:
            lock.release()
        raise OutputDirInUseError(refusal)
    return lock


@contextlib.contextmanager
def holding(output_dir: str, is_main: bool, broadcast: Broadcast = lambda value: value, held: bool = False):
    """Hold `output_dir` for the `with` block (`acquire` on the main process, released at its end, also on error).
    `broadcast` hands the main process's refusal (or None) to every process, so all of them raise it together. With
    `held` (this trainer's own step() loop holds the folder still: `still_held`), the folder is already this run's: it
    is neither taken again nor released at the end."""
    lock = None if held else _acquire_everywhere(output_dir, is_main, broadcast, "train()")
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def hold_for_steps(output_dir: str, is_main: bool, owner, broadcast: Broadcast = lambda value: value) -> RunLock | None:
    """Take `output_dir` for `owner`'s step() loop until `owner` is garbage-collected or the process ends (the main
    process's lock; None on the others). Refused like `holding` while another run holds it."""
    lock = _acquire_everywhere(output_dir, is_main, broadcast, STEP_LOOP)
    if lock is not None:
        _step_locks[os.path.dirname(lock.path)] = lock
        weakref.finalize(owner, lock.release)
    return lock


def still_held(lock: RunLock | None, output_dir: str) -> str | None:
    """Why a step() loop holding `lock` (None on the processes other than the main one) may no longer write into
    `output_dir` (a later trainer of this process took it over), or None."""
    if lock is None or lock.taken_over is None:
        return None
    return (f"step(): output_dir {os.path.abspath(output_dir)} was taken over at {lock.taken_over} by a later "
            "PPOLMTrainer in this process (its train() or step() loop), so this trainer's step() would write into a "
            "folder another trainer writes into, overwriting its checkpoints. Go on with the later trainer, or build "
            "this one again with another output_dir to train both.")
