"""PPO state in checkpoints: written before Trainer commits the folder, checked on resume.

A checkpoint is complete or invisible:

- `save_ppo_state` writes the value head, the rollout buffer of an unfinished iteration and `ppo_state.json` into
  `checkpoint-N` *before* `Trainer._save_checkpoint` writes its own files. Trainer writes `trainer_state.json` last,
  after the weights, optimizer, scheduler and RNG states, and only then rotates old checkpoints away; so a folder with
  a readable `trainer_state.json` holds everything, and rotation only runs once the new checkpoint is complete.
- `problems` lists what keeps a folder from being complete: a missing file, or one that does not load (truncated
  JSON, safetensors or torch zip). `hide_incomplete` moves incomplete checkpoints newer than the last complete one
  to `incomplete-checkpoint-N`, so `resume_from_checkpoint=True` (which takes the highest `checkpoint-N`) resumes
  from the last complete one; `load_ppo_state` refuses an incomplete folder naming the missing file.
- The checkpoint records the PPO settings (`settings`) and the rewards (`scoring.RewardSet.identities`: each one's
  name, and a function's import path or a model's name); a resume with other values or other rewards is an error
  listing each difference unless `allow_config_change_on_resume` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..models.value_head import VALUE_HEAD_FILE
from ..runtime.files import file_problem
from ..runtime.warn import warn_user
from .schedule import MinibatchSchedule

PPO_STATE_FILE = "ppo_state.json"
ROLLOUT_BUFFER_FILE = "rollout_buffer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: the last file Trainer writes
FORMAT_VERSION = 1
INCOMPLETE_PREFIX = "incomplete-"
# Written first into every checkpoint folder hf_ppo creates: what proves a `checkpoint-N` is hf_ppo's to move or
# replace. A folder without it (another program's) is never renamed, moved or deleted.
MARKER_FILE = "hf_ppo_checkpoint.json"

# PPOConfig fields that do not change what training computes (or may hold secrets, like a `token` in the init
# kwargs): never compared on resume.
_NOT_COMPARED = {"model_init_kwargs", "ref_model_init_kwargs", "reward_model_init_kwargs", "num_sample_generations",
                 "num_eval_samples",
                 "push_merged_model", "critic_hub_model_id", "max_consecutive_nonfinite",
                 "allow_config_change_on_resume",
                 # TRL's run-length and bookkeeping names: they set max_steps / run_name / map workers, which a resume
                 # may change (a longer run), and never what one iteration does.
                 "total_episodes", "num_total_batches", "dataset_num_proc", "ds3_gather_for_generation", "exp_name",
                 "print_metrics",
                 # The prompts, like the dataset itself, may change on resume (a checkpoint written before these were
                 # PPOConfig fields never recorded them); max_completion_length is response_length, compared.
                 "prompt_column", "system_prompt", "max_completion_length",
                 # The collapse watch reads the logs: when it warns or stops, never what a step computes.
                 "watch_collapse", "stop_on_collapse", "collapse_kl_threshold",
                 # Which rollouts run the skipped passes for the metrics: no update reads them (issue 59).
                 "stats_pass_every",
                 # How vLLM holds its copy of the policy: it samples the policy either way, and the old log-probs
                 # stay the policy's own (rollout_engine itself is compared).
                 "vllm_gpu_memory_utilization", "vllm_max_model_len", "vllm_dtype", "vllm_enable_sleep_mode"}
# TrainingArguments fields that fix the batch geometry (and the prompt order): compared like the PPO fields.
_GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
_TRAINING_ARGUMENTS_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: incomplete, unreadable, or written with other settings."""


# ---- settings ----------------------------------------------------------------------------------------------------
def settings(args) -> dict:
    """The values a resume must agree on: every PPO field of `args` (a PPOConfig) and the batch geometry."""
    names = [f.name for f in dataclasses.fields(args)
             if f.name not in _TRAINING_ARGUMENTS_FIELDS and f.name not in _NOT_COMPARED]
    values = {name: getattr(args, name) for name in [*names, *_GEOMETRY]}
    values["world_size"] = args.world_size
    return _plain(values)


def _plain(values: dict) -> dict:
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}


def default_settings(args) -> dict:
    """The declared default of every field of `args`' dataclass, as `settings` records values.

    A checkpoint written by an hf_ppo that predates a field does not record it; that version ran as the field's
    default does (a new field's default keeps the earlier behaviour), so the field is only a change when it is set to
    something else now."""
    defaults = {}
    for f in dataclasses.fields(args):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return _plain(defaults)


# A value an earlier hf_ppo saved under a name that now means something else: read as its new name (the same run).
_RENAMED_VALUES = {("loss_aggregation", "seq_mean_token_sum_norm"): "dr_grpo", ("scale_rewards", True): "group",
                   ("scale_rewards", False): "none"}


def compare_settings(saved: dict, current: dict, defaults: dict | None = None) -> dict[str, str]:
    """{setting: "checkpoint X, now Y"} for each setting that differs between the checkpoint and this run. A setting
    the checkpoint does not record (written before it existed) is not a change while it holds its value in
    `defaults` (`default_settings`)."""
    missing, defaults = object(), defaults or {}
    saved = {name: _RENAMED_VALUES.get((name, value), value) for name, value in saved.items()}
    return {name: f"checkpoint {saved.get(name, '(not recorded)')!r}, now {current.get(name, '(not set)')!r}"
            for name in sorted(set(saved) | set(current)) if saved.get(name, missing) != current.get(name, missing)
            and not (name not in saved and name in current and current[name] == defaults.get(name, missing))}


def describe_changes(changed: dict[str, str], sep: str = "\n- ") -> str:
    return sep.join(f"{name}: {change}" for name, change in changed.items())


# ---- writing ------------------------------------------------------------------------------------------------------
def checkpoint_folder(run_dir: str, global_step: int) -> str:
    """The folder Trainer._save_checkpoint writes for `global_step`."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def save_ppo_state(folder: str, *, state: dict, value_head: dict[str, torch.Tensor],
                   rollout_buffer: dict[str, torch.Tensor] | None) -> None:
    """Write the PPO part of a checkpoint into a fresh `folder`, before Trainer writes its part.

    `state`: JSON-able PPO state (iteration, KL controller, reward moments, ...); the settings, the format version and
    the list of files a resume needs are added here. A folder left from an interrupted save of the same step is
    removed first, so nothing stale can pass for part of this checkpoint.
    """
    if os.path.isdir(folder):
        if not written_by_hf_ppo(folder):
            raise CheckpointError(f"{folder} exists and was not written by hf_ppo (no {MARKER_FILE}): hf_ppo will not "
                                  "replace another program's files. Choose another output_dir, or move that folder.")
        shutil.rmtree(folder)
    _created_with_marker(folder)
    _atomic_safetensors(os.path.join(folder, VALUE_HEAD_FILE), value_head)
    if rollout_buffer is not None:
        _atomic_safetensors(os.path.join(folder, ROLLOUT_BUFFER_FILE), rollout_buffer)
    state = {"format": FORMAT_VERSION, **state, "rollout_buffer": rollout_buffer is not None}
    _atomic_write(os.path.join(folder, PPO_STATE_FILE), json.dumps(state, indent=2).encode())


# A checkpoint folder is made under this name beside its final one, its marker written, then renamed into place: a
# kill between the two never leaves a `checkpoint-N` without the marker that makes it hf_ppo's to move aside.
_NEW_SUFFIX = ".hf_ppo-new"


def _created_with_marker(folder: str) -> None:
    """Create `folder` holding `MARKER_FILE` in one step (made aside, then renamed into place). A leftover of a killed
    creation (the aside name, empty or holding the marker alone) is hf_ppo's and is replaced; anything else there is
    another program's and stops the save."""
    new = os.path.normpath(folder) + _NEW_SUFFIX
    if os.path.lexists(new):
        if not os.path.isdir(new) or os.path.islink(new) or set(os.listdir(new)) - {MARKER_FILE, MARKER_FILE + ".tmp"}:
            raise CheckpointError(f"{new} exists and was not written by hf_ppo (the name hf_ppo creates a checkpoint "
                                  "under before moving it into place): move it away, then train again.")
        shutil.rmtree(new)
    os.makedirs(new)
    _atomic_write(os.path.join(new, MARKER_FILE), json.dumps({"writer": "hf_ppo", "format": FORMAT_VERSION}).encode())
    os.rename(new, folder)


def save_trainer_state(folder: str, *, args, iteration: int, kl_controller, reward_moments, guard, peft: bool,
                       metrics: dict[str, list[torch.Tensor]], critic_state: dict[str, torch.Tensor],
                       rollout_buffer: dict[str, torch.Tensor] | None, rewards=None) -> None:
    """Assemble the PPO trainer's state (iteration, KL controller, reward statistics, each reward's statistics of a
    `scoring.RewardSet` `rewards`, non-finite guard, metrics not yet logged, the settings) and write it with the
    critic and an unfinished iteration's rollout (`save_ppo_state`)."""
    state = {"iteration": iteration, "kl_controller": kl_controller.state_dict(),
             "reward_moments": reward_moments.state_dict() if reward_moments else None,
             "each_reward_moments": rewards.state_dict() if rewards is not None else None,
             "nonfinite": guard.state_dict(), "peft": peft,
             "optimizer_saved": not args.save_only_model, "settings": settings(args),
             "rewards": rewards.identities() if rewards is not None else None,
             "sharded": args.fsdp_version is not None,
             "pending_metrics": {k: [v.item() for v in vs] for k, vs in metrics.items()}}
    save_ppo_state(folder, state=state, value_head=critic_state, rollout_buffer=rollout_buffer)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    # A copy: under FSDP the tensors are views into the gathered weights, whose storage safetensors cannot read.
    _atomic_write(path, save({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
                             metadata={"format": "pt"}))


# ---- a failed write (a full disk) ----------------------------------------------------------------------------------
class CheckpointWriteError(OSError):
    """A checkpoint could not be written (no space left, a quota, a permission): the message names the cause, the
    folder, the free space on its disk and the last complete checkpoint, which is intact (`write_failures_named`)."""


# torch's zip writer reports a failed write as a bare RuntimeError ("[enforce fail at inline_container.cc] ...
# unexpected pos"), safetensors as a SafetensorError ("I/O error: ... (os error 28)"): neither is an OSError.
_FAILED_WRITE = re.compile(r"unexpected pos|inline_container|PytorchStreamWriter|file write failed|I/O error|"
                           r"os error \d+|No space left|quota", re.IGNORECASE)
_OS_ERROR = re.compile(r"os error (\d+)")
_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_MIN_FREE = 64 * 2**20  # below this (or below one checkpoint's size) the disk counts as full


def _failed_write(err: BaseException) -> tuple[bool, int | None]:
    """(whether `err` is a write that failed, its errno when it carries one)."""
    if isinstance(err, (CheckpointWriteError, SaveWriteError)) or not isinstance(err, (OSError, RuntimeError,
                                                                                          SafetensorError)):
        return False, None
    if isinstance(err, OSError):
        return True, err.errno
    match = _OS_ERROR.search(str(err))
    return bool(_FAILED_WRITE.search(str(err))), int(match.group(1)) if match else None


def _disk_of(path: str) -> tuple[str, int | None]:
    """(the mount point of the disk holding `path`, its free bytes; None when it cannot be read)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    while not os.path.ismount(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path, free


def _folder_bytes(folder: str | None) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder or "") for name in names
               if os.path.isfile(os.path.join(root, name)))


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"


def _write_cause(code: int | None, short: bool) -> str:
    """What stopped a write: a quota, no space (the errno says so, or the disk has less room than the write takes
    and the error gives no other errno), or the errno's own words."""
    if code == getattr(errno, "EDQUOT", None):
        return "disk quota exceeded"
    if code == errno.ENOSPC or (short and code in (None, *_SPACE_ERRNOS)):
        return "no space left on device"
    return os.strerror(code).lower() if code else "the write failed"


def write_failure_message(err: BaseException, code: int | None, folder: str, run_dir: str) -> str:
    """The cause of a failed checkpoint write (no space left when the errno says so or the disk has less room than
    one checkpoint takes), the folder, the disk and its free space, what is intact, and how to go on."""
    mount, free = _disk_of(run_dir)
    last = last_complete(run_dir)
    one_checkpoint = _folder_bytes(last) if last else 0
    cause = _write_cause(code, free is not None and free < max(_MIN_FREE, one_checkpoint))
    said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    room = f"{_human(free)} free" if free is not None else "free space unknown"
    intact = (f"{last} is the last complete checkpoint: it is intact, and a resume starts from it" if last else
              f"No checkpoint of this run in {run_dir} is complete yet, so there is nothing to resume from")
    size = f" (a checkpoint of this run takes {_human(one_checkpoint)})" if one_checkpoint else ""
    partial = (f" {folder} is incomplete ({_human(_folder_bytes(folder))}): the next train() moves it aside to "
               f"{_hidden_name(folder)}; delete it to free that space." if os.path.isdir(folder) else "")
    if cause in ("no space left on device", "disk quota exceeded"):
        fix = (f"Free space on that disk{size}, keep fewer checkpoints (save_total_limit), or train into an output_dir "
               "on a disk with room")
    elif code is None:
        fix = "Check that disk (space, quota, errors: the writer gave no reason)"
    else:
        fix = f"Fix the cause ({cause})"
    then = ("then resume: trainer.train(resume_from_checkpoint=True), or with hf-ppo train, the same command with "
            "--resume_from_checkpoint true." if last else "then start the run again.")
    return (f"Could not write checkpoint {folder}: {cause} ({room} on the disk mounted at {mount}, which holds "
            f"{run_dir}; {type(err).__name__}: {said}). Training stopped. {intact}.{partial} {fix}, {then}")


@contextlib.contextmanager
def _failed_writes_as(error):
    """Around a write: one that fails (an OSError, or torch's and safetensors' errors for one: `_failed_write`)
    becomes `error(err, errno)`, the original chained. Any other error passes through unchanged."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - only failed writes are turned into the named error; others re-raise
        failed, code = _failed_write(err)
        if not failed:
            raise
        raise error(err, code) from err


def write_failures_named(folder: str, run_dir: str):
    """Around the writing of checkpoint `folder` of the run in `run_dir`: a write that fails becomes a
    `CheckpointWriteError` saying why, where, and what is intact (`write_failure_message`)."""
    return _failed_writes_as(lambda err, code: CheckpointWriteError(write_failure_message(err, code, folder, run_dir)))


# ---- the final save (save_model): written aside, then moved in ------------------------------------------------------
# Inside the folder saved to, so on its disk: moving the finished files in is a rename, which needs no space.
STAGING_DIR = ".hf_ppo-saving"
_STAGING_MARKER = "hf_ppo_saving"  # what proves a leftover STAGING_DIR (a killed save's) is hf_ppo's to delete


class SaveWriteError(OSError):
    """The policy (or the training state) could not be saved (no space left, a quota, a permission): the message
    names the cause, the folder, the space left and needed, what is intact and the fix (`save_failure_message`)."""


def policy_bytes(policy, trained_adapter: str | None, state_dict: dict | None = None) -> int:
    """About what saving the policy writes: its adapter's tensors (or all of its own, or `state_dict`'s), each
    storage once (tied weights are saved once)."""
    if state_dict:
        tensors = state_dict.values()
    elif trained_adapter is not None:
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(policy, adapter_name=trained_adapter).values()
    else:
        tensors = policy.state_dict().values()
    storages = {}
    for t in tensors:
        if torch.is_tensor(t):
            storages[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return sum(storages.values())


def save_failure_message(err: BaseException, code: int | None, folder: str, run_dir: str, what: str,
                         needed: int | None, intact: str, call: str) -> str:
    """The cause of a failed final save of `what` into `folder` (as `write_failure_message` says it for a
    checkpoint), the space left and needed, what is `intact`, the run's last complete checkpoint, and how to go on:
    in Python (`call` again: the trainer still holds the policy) and with hf-ppo train (whose process has ended)."""
    mount, free = _disk_of(folder)
    cause = _write_cause(code, free is not None and free < max(_MIN_FREE, needed or 0))
    said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    room = f"{_human(free)} free" if free is not None else "free space unknown"
    size = f"; {what} takes about {_human(needed)}" if needed else ""
    last = last_complete(run_dir)
    checkpoint = (f"{last} is the run's last complete checkpoint: its policy loads with from_pretrained, and a resume "
                  "starts from it" if last else f"No checkpoint of this run in {run_dir} is complete")
    if cause in ("no space left on device", "disk quota exceeded"):
        fix = f"Free space on that disk{f' (at least {_human(needed)})' if needed else ''}, or save to a disk with room"
    elif code is None:
        fix = "Check that disk (space, quota, errors: the writer gave no reason)"
    else:
        fix = f"Fix the cause ({cause})"
    again = ("with hf-ppo train, run the same command again with --resume_from_checkpoint true (it resumes from "
             f"{last} and saves at the end)" if last else "with hf-ppo train, run the command again (no checkpoint to "
             "resume from: save_strategy='steps' keeps some)")
    return (f"Could not save {what} to {folder}: {cause} ({room} on the disk mounted at {mount}{size}; "
            f"{type(err).__name__}: {said}). {intact}. {checkpoint}. {fix}, then: in Python, call {call} again (the "
            "trainer still holds the trained policy; trainer.save_model('<a folder on a disk with room>') saves it "
            f"elsewhere); {again}.")


def save_failures_named(folder: str, run_dir: str, what: str, intact: str, needed=None,
                        call: str = "trainer.save_model()"):
    """Around a final save of `what` into `folder` (of the run in `run_dir`): a failed write (as
    `write_failures_named` tells one) becomes a `SaveWriteError` (`save_failure_message`; `needed`: a callable giving
    the bytes the save takes, `intact` a text or a callable giving one, both asked only then)."""
    def error(err: BaseException, code: int | None) -> SaveWriteError:
        try:
            size = needed() if needed else None
        except Exception:  # noqa: BLE001 - the size is a hint: never let it hide the failed write
            size = None
        said = intact() if callable(intact) else intact
        return SaveWriteError(save_failure_message(err, code, folder, run_dir, what, size, said, call))

    return _failed_writes_as(error)


@contextlib.contextmanager
def staged_save(folder: str, run_dir: str, needed=None, last: tuple[str, ...] = (),
                superseded: tuple[str, ...] = ()):
    """Yield a fresh folder (`STAGING_DIR`, inside `folder`) to write the policy into; when the body ends, each file
    written there moves to its place in `folder` (a rename: no space needed), replacing the earlier save's file of
    that name; the files named in `last` (the run record, which says what the folder holds) move after all others,
    so a kill between the moves never leaves this save's record over the earlier save's weights; the earlier save's
    files named in `superseded` (a full model's weights under an adapter's save) go once all of this save is in. A
    failed write leaves `folder` as it was (an earlier complete save stays whole), deletes what the save wrote, and
    raises `SaveWriteError` naming the folder, the space and the last complete checkpoint."""
    staging = os.path.join(folder, STAGING_DIR)
    if os.path.isdir(staging) and not os.path.isfile(os.path.join(staging, _STAGING_MARKER)):
        raise FileExistsError(f"Cannot save the policy to {folder}: {staging}, the folder hf_ppo writes a save into "
                              "before moving it in, exists and hf_ppo did not write it. Move it away, then save again.")
    moved: list[str] = []

    def intact() -> str:
        if moved:  # a rename failed part-way (not for space: a rename needs none)
            return (f"{len(moved)} file(s) of this save were already moved into {folder} ({', '.join(moved[:3])}"
                    f"{', ...' if len(moved) > 3 else ''}): it mixes this save and the one before, so save again")
        return (f"Nothing in {folder} was replaced: any policy saved there before is intact, and the part of this "
                "save already written was deleted")

    created = not os.path.isdir(folder)
    with save_failures_named(folder, run_dir, "the policy", intact, needed):
        shutil.rmtree(staging, ignore_errors=True)  # hf_ppo's, left by a save killed before it moved its files in
        os.makedirs(staging)
        try:
            open(os.path.join(staging, _STAGING_MARKER), "wb").close()
            yield staging
            written = [os.path.relpath(os.path.join(root, name), staging) for root, _, names in os.walk(staging)
                       for name in names]
            for name in sorted((n for n in written if n != _STAGING_MARKER), key=lambda n: n in last):
                target = os.path.join(folder, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(os.path.join(staging, name), target)
                moved.append(name)
            for name in superseded:
                if name not in moved and os.path.isfile(os.path.join(folder, name)):
                    os.remove(os.path.join(folder, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if created and not moved and os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)  # a first save that failed leaves no empty folder behind


# ---- checking ----------------------------------------------------------------------------------------------------
def written_by_hf_ppo(folder: str) -> bool:
    """Whether hf_ppo created `folder` (its marker, or the PPO state of a checkpoint written before the marker)."""
    return os.path.isfile(os.path.join(folder, MARKER_FILE)) or os.path.isfile(os.path.join(folder, PPO_STATE_FILE))


def problems(folder: str) -> list[str]:
    """What keeps `folder` from being a complete hf_ppo checkpoint: one line per missing or unreadable file."""
    if not os.path.isdir(folder):
        return [f"{folder} is not a directory"]
    issues: list[str] = []
    _read_json(folder, TRAINER_STATE_FILE, issues)
    ppo = _read_json(folder, PPO_STATE_FILE, issues)
    if ppo is None or "format" not in ppo:  # another hf_ppo version: load_ppo_state says so, nothing is moved aside
        return issues
    for name in required_files(folder, ppo, issues):
        _check_file(os.path.join(folder, name), name, issues)
    return issues


def required_files(folder: str, ppo: dict, issues: list[str]) -> list[str]:
    """The files besides the two JSON states that a resume from `folder` reads, from what `ppo_state.json` says."""
    names = [VALUE_HEAD_FILE] + ([ROLLOUT_BUFFER_FILE] if ppo.get("rollout_buffer") else [])
    names += required_policy_files(folder, bool(ppo.get("peft")), issues)
    if ppo.get("sharded"):  # FSDP: Trainer's sharded model state, whose .metadata is written last
        names += [os.path.join("pytorch_model_fsdp_0", ".metadata")]
    if ppo.get("optimizer_saved"):
        world_size = ppo.get("settings", {}).get("world_size", 1)
        names += [os.path.join("optimizer_0", ".metadata") if ppo.get("sharded") else "optimizer.pt", "scheduler.pt"]
        names += ["rng_state.pth"] if world_size == 1 else [f"rng_state_{i}.pth" for i in range(world_size)]
    return names


def required_policy_files(folder: str, peft: bool, issues: list[str]) -> list[str]:
    """The policy's weight files `save_pretrained` wrote: the adapter, one full file, or the shards of its index."""
    if peft:
        return ["adapter_model.safetensors"]
    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        index = _read_json(folder, "model.safetensors.index.json", issues)
        return sorted(set(index["weight_map"].values())) if index else []
    return ["model.safetensors"]


def _read_json(folder: str, name: str, issues: list[str]) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        issues.append(f"missing {name}")
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        issues.append(f"{name} is unreadable (truncated or corrupt: {err})")
        return None


def _check_file(path: str, name: str, issues: list[str]) -> None:
    """Cheap load check (`file_problem`): a missing or damaged file is an issue named by its file name."""
    problem = file_problem(path)
    if problem is not None:
        issues.append(f"{problem} {name}" if problem == "missing" else f"{name} is {problem}")


def checkpoints_by_step(run_dir: str) -> list[str]:
    """The `checkpoint-N` folders of `run_dir`, lowest step first (the order Trainer's resolution of True uses)."""
    if not os.path.isdir(run_dir):
        return []
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir)
             if (m := pattern.match(name)) and os.path.isdir(os.path.join(run_dir, name))]
    return [os.path.join(run_dir, name) for _, name in sorted(found)]


def last_complete(run_dir: str) -> str | None:
    """The highest complete checkpoint in `run_dir`, or None."""
    return next((c for c in reversed(checkpoints_by_step(run_dir)) if not problems(c)), None)


def hide_incomplete(run_dir: str) -> list[tuple[str, str, list[str]]]:
    """Move each incomplete checkpoint above the last complete one to `incomplete-checkpoint-N`.

    Trainer resolves `resume_from_checkpoint=True` to the highest `checkpoint-N`; after this, that is the last complete
    one. Returns (folder, moved_to, problems) for each folder moved.
    """
    moved = []
    for folder in reversed(checkpoints_by_step(run_dir)):
        if not written_by_hf_ppo(folder) and os.listdir(folder):
            continue  # another program's: never moved (a resume from it says it is not an hf_ppo checkpoint)
        # (an empty one holds nothing of anyone's: left by a kill between creating a checkpoint and writing its marker)
        issues = problems(folder)
        if not issues:
            break
        target = _hidden_name(folder)
        if os.path.isdir(target):
            if not written_by_hf_ppo(target):
                continue  # the name is taken by a folder hf_ppo did not write: both stay; a resume names the problem
            shutil.rmtree(target)
        os.replace(folder, target)
        moved.append((folder, target, issues))
    return moved


def _hidden_name(folder: str) -> str:
    folder = os.path.normpath(folder)
    return os.path.join(os.path.dirname(folder), INCOMPLETE_PREFIX + os.path.basename(folder))


def check_complete(folder: str) -> None:
    """Raise `CheckpointError` naming every missing or unreadable file when `folder` is not a complete checkpoint."""
    hidden = _hidden_name(folder)
    if not os.path.isdir(folder) and os.path.isdir(hidden):
        raise CheckpointError(
            f"Cannot resume from {folder}: it is incomplete ({'; '.join(problems(hidden))}); the run stopped while "
            f"writing it, and it was moved to {hidden}. Resume from the last complete checkpoint "
            f"({last_complete(os.path.dirname(os.path.normpath(folder))) or 'none found'}), or pass "
            "resume_from_checkpoint=True.")
    if os.path.isdir(folder) and not written_by_hf_ppo(folder):
        raise CheckpointError(f"Cannot resume from {folder}: hf_ppo did not write it (no {MARKER_FILE} or "
                              f"{PPO_STATE_FILE}; another program's checkpoint?). Resume from an hf_ppo checkpoint, or "
                              "train in another output_dir.")
    issues = problems(folder)
    if issues:
        latest = last_complete(os.path.dirname(os.path.normpath(folder)))
        raise CheckpointError(
            f"Cannot resume from {folder}: {'; '.join(issues)}. It is incomplete (the run stopped while writing it) "
            f"or not an hf_ppo checkpoint. Resume from the last complete checkpoint ({latest or 'none found'}), or "
            "pass resume_from_checkpoint=True to take it.")


# ---- reading -----------------------------------------------------------------------------------------------------
@dataclass
class SavedPPOState:
    """What `load_ppo_state` returns: the JSON state, the value head, the rollout buffer (or None), and the settings
    that changed (non-empty only with `allow_config_change_on_resume`)."""

    state: dict
    value_head: dict[str, torch.Tensor]
    rollout_buffer: dict[str, torch.Tensor] | None
    changed: dict[str, str]


def describe_rewards(identities: list[dict[str, str]]) -> str:
    """'[exact (function my_pkg.rewards.exact), rm (model org/rm)]' for `RewardSet.identities()`."""
    return "[" + ", ".join(f"{r.get('name')} ({', '.join(f'{k} {v}' for k, v in r.items() if k != 'name')})"
                           for r in identities) + "]"


def compare_rewards(saved: list | None, rewards) -> dict[str, str]:
    """{"rewards": "checkpoint [...], now [...]"} when this run's rewards (a `RewardSet`) are not the ones the
    checkpoint recorded (names, order, and what each is); {} when they are, or when either side has none recorded
    (a checkpoint written before rewards were recorded)."""
    if saved is None or rewards is None:
        return {}
    now = rewards.identities()
    if saved == now:
        return {}
    return {"rewards": f"checkpoint {describe_rewards(saved)}, now {describe_rewards(now)}"}


def load_ppo_state(folder: str, args, device, rewards=None) -> SavedPPOState:
    """Check that `folder` is complete and was written with this run's settings and rewards (`rewards`: the run's
    `RewardSet`; `compare_rewards`), then read its PPO part.

    Raises `CheckpointError` for an incomplete folder (naming the missing file), another format, or changed settings
    or rewards (listing each) unless `args.allow_config_change_on_resume`.
    """
    from safetensors.torch import load_file

    check_complete(folder)
    with open(os.path.join(folder, PPO_STATE_FILE)) as f:
        state = json.load(f)
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{os.path.join(folder, PPO_STATE_FILE)} has format {state.get('format')!r}; this "
                              f"hf_ppo reads format {FORMAT_VERSION}. Resume with the hf_ppo version that wrote it.")
    changed = compare_settings(state["settings"], settings(args), default_settings(args))
    changed.update(compare_rewards(state.get("rewards"), rewards))
    if changed and not args.allow_config_change_on_resume:
        raise CheckpointError(
            f"{folder} was written with other settings:\n- " + describe_changes(changed) + "\nResume with the "
            "checkpoint's values, or set allow_config_change_on_resume=True to train on with the new ones.")
    if not state.get("optimizer_saved", True):
        warn_user(f"{folder} was saved with save_only_model=True (no optimizer.pt, scheduler.pt, rng_state.pth): the "
                  "weights and the PPO state resume, but the optimizer's moments and the learning-rate schedule start "
                  "afresh, so the run does not continue exactly. Save with save_only_model=False for exact resumes.")
    value_head = load_file(os.path.join(folder, VALUE_HEAD_FILE), device=str(device))
    buffer = (load_file(os.path.join(folder, ROLLOUT_BUFFER_FILE), device=str(device))
              if state["rollout_buffer"] else None)
    return SavedPPOState(state, value_head, buffer, changed)


def restore_trainer_state(saved: SavedPPOState, *, kl_controller, reward_moments, guard,
                          metrics: dict[str, list[torch.Tensor]], rewards=None) -> int:
    """Put the state written by `save_trainer_state` back into the trainer's objects; return the iteration.

    A changed kl_coef (allowed on resume) restarts the controller from the new value instead.
    """
    state = saved.state
    if "kl_coef" not in saved.changed:
        kl_controller.load_state_dict(state["kl_controller"])
    if reward_moments is not None and state["reward_moments"]:
        reward_moments.load_state_dict(state["reward_moments"])
    if rewards is not None:
        try:  # other rewards (allowed on resume): those of the same name keep their statistics, the others start afresh
            rewards.load_state_dict(state.get("each_reward_moments"), matching_only="rewards" in saved.changed)
        except ValueError as err:
            raise CheckpointError(str(err)) from err
    guard.load_state_dict(state["nonfinite"])
    metrics.clear()
    for key, values in state["pending_metrics"].items():
        metrics[key] = [torch.tensor(v) for v in values]
    return state["iteration"]


def load_policy_weights(policy, folder: str, peft: bool, device, adapter_name: str | None = None) -> None:
    """Load the policy's trainable weights saved by `save_pretrained` (the adapter, or the full weights/shards).

    `adapter_name`: the trained adapter of a PeftModel that holds several (a reference adapter beside it)."""
    from safetensors.torch import load_file

    adapter = os.path.join(folder, "adapter_model.safetensors")
    if not peft and os.path.isfile(adapter):
        raise CheckpointError(f"{folder} holds a LoRA adapter (adapter_model.safetensors), but this run trains the "
                              "whole model: pass the peft_config the run started with (PPOLMTrainer(..., "
                              "peft_config=LoraConfig(...))) to resume it.")
    if peft and not os.path.isfile(adapter):
        raise CheckpointError(f"{folder} holds full model weights (no adapter_model.safetensors), but this run trains "
                              "a LoRA adapter: resume it without peft_config.")
    if peft:
        from peft import set_peft_model_state_dict

        _check_adapter_config(folder, policy.peft_config[adapter_name or "default"])
        set_peft_model_state_dict(policy, load_file(adapter, device=str(device)), adapter_name=adapter_name or "default")
        return
    for name in required_policy_files(folder, False, []):
        policy.load_state_dict(load_file(os.path.join(folder, name)), strict=False)


def load_actor_critic(wrapper, folder: str, saved: SavedPPOState, device, adapter_name: str | None = None) -> bool:
    """Load a checkpoint's policy weights (see `load_policy_weights`) and critic into the unsharded actor-critic.
    Returns whether the critic changed on resume (`critic_changed_on_resume`): then the checkpoint's optimizer state
    no longer fits the optimizer's parameters and is not loaded."""
    load_policy_weights(wrapper.policy_model, folder, wrapper.is_peft_model, device, adapter_name=adapter_name)
    changed = critic_changed_on_resume(wrapper.has_critic, folder, saved)
    if wrapper.has_critic and not changed:
        wrapper.load_critic_state_dict(saved.value_head)
    return changed


def critic_changed_on_resume(has_critic: bool, folder: str, saved: SavedPPOState) -> bool:
    """Whether this run's critic is not the checkpoint's: a critic-free estimator resuming a checkpoint with a critic,
    a critic resuming a critic-free checkpoint, or another `critic`. With `allow_config_change_on_resume` the run
    asked for that change: the policy resumes, a critic this run has no use for stays in the checkpoint untouched, a
    critic the checkpoint lacks (or holds of another kind) starts fresh, and the optimizer (whose parameters changed
    with the critic) starts afresh; a warning says so. Without the flag, an error."""
    was = {name: saved.state.get("settings", {}).get(name) for name in ("advantage_estimator", "critic")}
    recorded = f"advantage_estimator={was['advantage_estimator']!r}, critic={was['critic']!r}"
    stored = f"{len(saved.value_head)} tensors in {VALUE_HEAD_FILE}"
    optimizer = ("The optimizer's moments and the learning-rate schedule start afresh: the optimizer's parameters "
                 "changed with the critic, so its saved state fits them no longer.")
    if not has_critic and saved.value_head:
        if not saved.changed:
            raise CheckpointError(f"{folder} holds a critic ({stored}), but this run has none. Resume with the "
                                  f"checkpoint's settings ({recorded}), or set allow_config_change_on_resume=True to "
                                  "resume the policy alone.")
        warn_user(f"Resuming from {folder} without its critic: it was written with {recorded}, and this run's "
                  "advantage estimator uses no critic (allow_config_change_on_resume). The policy resumes; the "
                  f"checkpoint's critic ({stored}) is not loaded and stays in the checkpoint, untouched. " + optimizer)
        return True
    if has_critic and (not saved.value_head or "critic" in saved.changed):
        if not saved.changed:
            raise CheckpointError(f"{folder} holds no critic ({recorded}), but this run trains one. Resume with the "
                                  "checkpoint's settings, or set allow_config_change_on_resume=True to start the "
                                  "critic fresh.")
        what = ("holds no critic" if not saved.value_head else f"holds another critic ({stored}), which this run's "
                "cannot load")
        warn_user(f"Resuming from {folder}, written with {recorded}: it {what}. The policy resumes; this run's "
                  "critic starts fresh, untrained, as it would in a new run (allow_config_change_on_resume), so its "
                  "first value estimates are poor: critic_warmup_steps trains it alone first (it counts from the "
                  "run's first step: set it above the checkpoint's step). " + optimizer)
        return True
    return False


def _check_adapter_config(folder: str, current) -> None:
    """The LoRA shape the checkpoint was trained with must be this run's: another rank or other target modules
    cannot hold its weights (a raw size mismatch otherwise)."""
    saved = _read_json(folder, "adapter_config.json", [])
    if saved is None:
        return
    differ = []
    for name in ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora"):
        mine, theirs = getattr(current, name, None), saved.get(name)
        if isinstance(mine, (set, list, tuple)) and isinstance(theirs, (list, tuple)):
            mine, theirs = sorted(mine), sorted(theirs)
        if name in saved and mine != theirs:
            differ.append(f"{name}: checkpoint {theirs!r}, this run {mine!r}")
    if differ:
        raise CheckpointError(f"{folder} was trained with another LoRA configuration ({'; '.join(differ)}): resume "
                              "with the checkpoint's LoraConfig, or start a new run.")


def prepare_run_dir(run_dir: str, save_total_limit: int | None) -> None:
    """Before training: refuse a rotation that would delete another program's checkpoints, then `hide_incomplete`
    with a warning naming each checkpoint moved aside."""
    check_rotation(run_dir, save_total_limit)
    for folder, moved_to, issues in hide_incomplete(run_dir):
        warn_user(f"Skipping incomplete checkpoint {folder} ({'; '.join(issues)}): the run stopped while writing "
                  f"it. Moved to {moved_to}.")


def finished_run(run_dir: str, resume_from_checkpoint, max_steps: int, save_total_limit: int | None,
                 should_save: bool) -> tuple[str, int] | None:
    """(the checkpoint, its step) when `resume_from_checkpoint` (True: the last complete checkpoint of `run_dir`,
    after `prepare_run_dir`; a path: that folder) already reached `max_steps`: the run finished, and its final save
    failed or was killed. None for any other resume: none asked, a run set by epochs (max_steps <= 0; Trainer trains
    nothing past its last epoch), a checkpoint short of max_steps, or one Trainer's own resume refuses."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False or max_steps <= 0:
        return None
    if resume_from_checkpoint is True:
        if should_save:
            prepare_run_dir(run_dir, save_total_limit)
        found = checkpoints_by_step(run_dir)
        folder = found[-1] if found else None  # what Trainer resolves True to (get_last_checkpoint)
    else:
        folder = str(resume_from_checkpoint)
    if folder is None or not os.path.isdir(folder) or not written_by_hf_ppo(folder) or problems(folder):
        return None
    step = (_read_json(folder, TRAINER_STATE_FILE, []) or {}).get("global_step")
    return (folder, step) if isinstance(step, int) and step >= max_steps else None


def check_rotation(run_dir: str, save_total_limit: int | None) -> None:
    """Trainer's `save_total_limit` deletes the oldest `checkpoint-N` folders of the output folder, whoever wrote
    them: with a folder there that hf_ppo did not write, that is an error before the first step, naming it."""
    if not save_total_limit:
        return
    foreign = [os.path.basename(c) for c in checkpoints_by_step(run_dir) if not written_by_hf_ppo(c)]
    if foreign:
        raise CheckpointError(
            f"save_total_limit={save_total_limit} would let Trainer delete checkpoints in {run_dir} that hf_ppo did "
            f"not write ({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}: no {MARKER_FILE}). Use another "
            "output_dir, move those folders away, or unset save_total_limit.")


def resumed_schedule(saved: SavedPPOState, folder: str, args) -> MinibatchSchedule | None:
    """The interrupted iteration's schedule (rollout, shuffles, position) to finish after a resume, or None.

    With settings changed on resume (`allow_config_change_on_resume`) the rollout no longer matches them: a warning
    lists the changes, and a fresh rollout serves the iteration's remaining steps.
    """
    if saved.changed:
        warn_user(f"Resuming from {folder} with changed settings (allow_config_change_on_resume): "
                  + describe_changes(saved.changed, "; ") + ". The new values apply from now on"
                  + ("; the interrupted iteration's rollout is discarded (a fresh one serves its remaining steps)."
                     if saved.rollout_buffer is not None else "."))
        return None
    if saved.rollout_buffer is None:
        return None
    return MinibatchSchedule.from_state_dict(saved.rollout_buffer, **args.schedule_settings)
