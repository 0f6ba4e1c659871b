"""One run per output_dir (`hf_ppo.trainer.run_lock`): a second `train()` into a folder a live run
holds is refused naming that run; a lock left by a dead process (kill -9) is taken over with a note; the lock goes at
the end of `train()` and on error. The holder is a real second process training into the same folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer

LOCK = "hf_ppo_train.lock"


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def make_trainer(tiny_models, tokenizer, out, reward=count_e, **overrides):
    args = {"output_dir": str(out), "per_device_train_batch_size": 4, "num_mini_batches": 1, "num_ppo_epochs": 1,
            "max_steps": 1, "response_length": 4, "learning_rate": 1e-3, "report_to": [], "save_strategy": "steps",
            "save_steps": 1, "num_sample_generations": 0, "disable_tqdm": True, "seed": 0}
    args.update(overrides)
    return PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**args), processing_class=tokenizer,
                        reward_model=reward, train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 8}))


def start_run(tiny_models, out, then: str) -> subprocess.Popen:
    """Another process training into `out`: at the start of its first step it prints "training", then either waits
    until its stdin closes and finishes (`then="wait"`) or kills itself with SIGKILL (`then="die"`)."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        from datasets import Dataset
        from transformers import TrainerCallback
        from hf_ppo import PPOConfig, PPOLMTrainer
        torch.set_num_threads(1)

        class Hold(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                print("training", flush=True)
                if {then!r} == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                sys.stdin.read()

        args = PPOConfig(output_dir={str(out)!r}, per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                         max_steps=1, response_length=4, report_to=[], save_strategy="no", num_sample_generations=0,
                         disable_tqdm=True)
        PPOLMTrainer(model={tiny_models["policy"]!r}, args=args, reward_model=lambda p, c: [0.0] * len(c),
                     train_dataset=Dataset.from_dict({{"prompt": ["the movie was"] * 8}}), callbacks=[Hold()]).train()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # blocks until it trains (or ends)
    assert line.strip() == "training", process.communicate()[1][-3000:]
    return process


def test_a_second_run_into_a_folder_a_live_run_holds_is_refused_naming_it(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    mine = make_trainer(tiny_models, tokenizer, out)  # built before the other run starts
    other = start_run(tiny_models, out, then="wait")
    try:
        with pytest.raises(RuntimeError) as refused:
            mine.train()
        message = str(refused.value)
        assert type(refused.value).__name__ == "OutputDirInUseError"
        assert f"process {other.pid} on {socket.gethostname()}" in message and "training since" in message
        assert "another output_dir" in message and "--output_dir" in message and "wait for that run" in message
        assert not list(out.glob("checkpoint-*"))  # the refused run wrote nothing
        # A trainer built while the other run trains is refused at construction, before any model loads.
        with pytest.raises(RuntimeError, match=rf"in use by another hf_ppo run: process {other.pid}"):
            make_trainer(tiny_models, tokenizer, out)
    finally:
        other.communicate(input="", timeout=300)  # let it finish
    assert other.returncode == 0
    assert not (out / LOCK).exists()  # released at its end
    mine = make_trainer(tiny_models, tokenizer, out)  # (a refused construction resets accelerate's shared state)
    mine.train()  # the folder is free again
    assert (out / "checkpoint-1").is_dir() and not (out / LOCK).exists()


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_note(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    dead = start_run(tiny_models, out, then="die")
    dead.communicate(timeout=300)
    assert dead.returncode == -signal.SIGKILL
    record = json.loads((out / LOCK).read_text())  # left behind by kill -9
    assert record["pid"] == dead.pid
    trainer = make_trainer(tiny_models, tokenizer, out)  # a dead holder does not block construction
    with pytest.warns(UserWarning, match=rf"left by process {dead.pid} on .*no longer running.*takes the output "
                                         "folder over"):
        trainer.train()
    assert trainer.state.global_step == 1 and not (out / LOCK).exists()


def test_the_lock_is_held_while_training_and_released_at_the_end_and_on_error(tiny_models, tokenizer, tmp_path):
    from transformers import TrainerCallback

    out = tmp_path / "out"
    seen = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(json.loads((out / LOCK).read_text()))

    trainer = make_trainer(tiny_models, tokenizer, out)
    trainer.add_callback(Look())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fresh folder: no note
        trainer.train()
    assert seen and seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname()
    assert seen[0]["writer"] == "hf_ppo" and seen[0]["since"]
    assert not (out / LOCK).exists()

    calls = []

    def fails_at_the_second_rollout(prompts, completions):
        calls.append(1)
        if len(calls) > 2:  # the construction probe, the first rollout, then this
            raise KeyError("boom")
        return [0.0] * len(completions)

    failing = make_trainer(tiny_models, tokenizer, tmp_path / "failing", reward=fails_at_the_second_rollout,
                           max_steps=2)
    with pytest.raises(Exception, match="boom"):
        failing.train()
    assert not (tmp_path / "failing" / LOCK).exists()
    make_trainer(tiny_models, tokenizer, tmp_path / "failing").train()  # free for the next run


def test_a_file_of_that_name_hf_ppo_did_not_write_is_never_touched(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text("my own notes\n")
    with pytest.raises(RuntimeError, match=rf"{out / LOCK} exists and was not written by hf_ppo"):
        make_trainer(tiny_models, tokenizer, out)
    assert (out / LOCK).read_text() == "my own notes\n"


# ---- TRL 0.11's step() loop: its first call holds the folder for the trainer's life ------------------------------------
def step_trainer(tiny_models, tokenizer, out, train_dataset=None, **overrides):
    args = {"output_dir": str(out), "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1,
            "max_steps": 4, "response_length": 4, "report_to": [], "save_strategy": "steps", "save_steps": 1,
            "num_sample_generations": 0, "disable_tqdm": True, "seed": 0, "lr_scheduler_type": "constant"}
    args.update(overrides)
    return PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**args), processing_class=tokenizer,
                        reward_model=count_e if train_dataset is not None else None, train_dataset=train_dataset)


def one_step(trainer, tokenizer):
    import torch

    query = torch.tensor(tokenizer.encode("the movie was"))
    return trainer.step([query, query.clone()], [torch.tensor([10, 11])] * 2, [1.0, 0.0])


def test_a_step_loop_in_another_process_holds_the_folder_until_its_process_ends(tiny_models, tokenizer, tmp_path):
    out = tmp_path / "out"
    mine = make_trainer(tiny_models, tokenizer, out)  # built before the step() loop starts
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoTokenizer
        from hf_ppo import PPOConfig, PPOLMTrainer
        torch.set_num_threads(1)
        tokenizer = AutoTokenizer.from_pretrained({tiny_models["policy"]!r})
        args = PPOConfig(output_dir={str(out)!r}, per_device_train_batch_size=2, num_mini_batches=1, num_ppo_epochs=1,
                         max_steps=4, response_length=4, report_to=[], save_strategy="steps", save_steps=100,
                         num_sample_generations=0, disable_tqdm=True, lr_scheduler_type="constant")
        trainer = PPOLMTrainer(model={tiny_models["policy"]!r}, args=args, processing_class=tokenizer)
        query = torch.tensor(tokenizer.encode("the movie was"))
        trainer.step([query, query.clone()], [torch.tensor([10, 11])] * 2, [1.0, 0.0])
        print("stepped", flush=True)
        sys.stdin.read()  # the loop goes on; the folder stays held between calls
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    loop = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in loop.stdout:  # (step() logs its metrics to stdout first)
            if line.strip() == "stepped":
                break
        assert line.strip() == "stepped", loop.communicate()[1][-3000:]
        assert json.loads((out / LOCK).read_text())["by"] == "step() loop"
        with pytest.raises(RuntimeError) as refused:
            mine.train()
        message = str(refused.value)
        assert type(refused.value).__name__ == "OutputDirInUseError"
        assert f"process {loop.pid} on {socket.gethostname()} (a step() loop: it holds the folder from its first " \
               "step() call until its trainer is deleted or its process ends)" in message
        assert "another output_dir" in message
        with pytest.raises(RuntimeError, match=rf"in use by another hf_ppo run: process {loop.pid} .*a step\(\) loop"):
            step_trainer(tiny_models, tokenizer, out)  # refused at construction, before any model loads
        assert not list(out.glob("checkpoint-*"))
    finally:
        loop.communicate(input="", timeout=300)
    assert loop.returncode == 0
    assert not (out / LOCK).exists()  # removed as its process ended
    mine = make_trainer(tiny_models, tokenizer, out)
    mine.train()
    assert (out / "checkpoint-1").is_dir()


def test_in_one_process_a_later_trainer_takes_the_folder_over_and_the_earlier_step_loop_is_refused(
        tiny_models, tokenizer, tmp_path):
    import gc

    out = tmp_path / "out"
    first = step_trainer(tiny_models, tokenizer, out)
    assert not (out / LOCK).exists()  # nothing is held before the first step() call
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        one_step(first, tokenizer)
        one_step(first, tokenizer)  # the loop's later calls hold it still, without a note
    record = json.loads((out / LOCK).read_text())
    assert record["pid"] == os.getpid() and record["by"] == "step() loop"
    assert (out / "checkpoint-2").is_dir()

    prompts = Dataset.from_dict({"prompt": ["the movie was"] * 8})
    # A notebook cell run again: the second trainer is built while `first` is still bound.
    second = step_trainer(tiny_models, tokenizer, out, prompts, max_steps=2)
    with pytest.warns(UserWarning, match=r"held by the step\(\) loop of an earlier PPOLMTrainer in this process: this "
                                         r"run takes it over, and that trainer's step\(\) is refused from now on"):
        one_step(second, tokenizer)
    steps_before = first.state.global_step
    with pytest.raises(RuntimeError, match=r"step\(\): output_dir .* was taken over at .* by a later PPOLMTrainer in "
                                           r"this process .*Go on with the later trainer, or build this one again "
                                           r"with another output_dir"):
        one_step(first, tokenizer)
    assert first.state.global_step == steps_before  # refused before anything of the call ran
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()  # the second holds it

    # The trainer's own train() after its step() calls runs in the folder it holds, and leaves it held.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(output_dir|lock).*")
        second.train()
    assert (out / LOCK).exists()
    one_step(second, tokenizer)
    del first, second
    gc.collect()  # the trainers hold themselves in cycles (callbacks): collected, they release the folder
    assert not (out / LOCK).exists()

    # With save_strategy="no" step() writes nothing into output_dir, and holds nothing (TRL 0.11's loop made no folder).
    quiet = step_trainer(tiny_models, tokenizer, tmp_path / "quiet", save_strategy="no")
    one_step(quiet, tokenizer)
    assert not (tmp_path / "quiet").exists() or not any((tmp_path / "quiet").iterdir())


# ---- issue 60: what the lock file holds and what it is ------------------------------------------------------------
def test_the_recorded_command_masks_every_secret(tmp_path, monkeypatch):
    """Issue 60 item 8: the command line recorded in the lock file (which stays after a kill -9) had --hub_token's
    value in clear."""
    from hf_ppo.trainer import run_lock

    argv = ["hf-ppo", "train", "--hub_token", "hf_AbCdEfGhIjKlMnOpQrStUvWx", "--api_key=sk-123", "--db_password",
            "pw1", "--output_dir", "out", "--client_secret=s3", "--HF_TOKEN", "t0k", "--note", "hf_ZyXwVuTsRqPoNm12",
            "--learning_rate", "1e-5"]
    monkeypatch.setattr(sys, "argv", argv)
    lock = run_lock.acquire(str(tmp_path))
    try:
        command = json.loads((tmp_path / LOCK).read_text())["command"]
    finally:
        lock.release()
    for secret in ("hf_AbCdEfGhIjKlMnOpQrStUvWx", "sk-123", "pw1", "s3", "t0k", "hf_ZyXwVuTsRqPoNm12"):
        assert secret not in command
    assert command == ("hf-ppo train --hub_token *** --api_key=*** --db_password *** --output_dir out "
                       "--client_secret=*** --HF_TOKEN *** --note *** --learning_rate 1e-5")


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lock_path_that_is_a_fifo_or_a_symlink_is_refused_without_waiting_or_writing_through(tmp_path, kind):
    """Issue 60 items 5 and 10: reading a FIFO waited for ever (hf-ppo train hung); a symbolic link had the record
    written into its target. Both are named and left as they are."""
    import threading

    from hf_ppo.trainer import run_lock

    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    if kind == "fifo":
        os.mkfifo(out / LOCK)
    else:
        os.symlink(target, out / LOCK)
    outcome = {}

    def attempt():
        outcome["in_use"] = run_lock.in_use_message(str(out))
        try:
            run_lock.acquire(str(out)).release()
        except run_lock.OutputDirInUseError as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "hung"
    what = "a FIFO (named pipe)" if kind == "fifo" else "a symbolic link"
    assert f"{out / LOCK} exists and is {what}, not a lock file hf_ppo wrote" in outcome["error"]
    assert outcome["in_use"] == outcome["error"]
    assert target.read_text() == "mine\n" and os.path.lexists(out / LOCK)


# ---- issue 63 kind 1: the paths this machine never takes, simulated --------------------------------------------
def _record(tmp_path, **fields) -> "os.PathLike":
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    record = {"writer": "hf_ppo", "pid": 1, "host": socket.gethostname(), "start": None, "since": "earlier",
              "command": "hf-ppo train", "by": "train()", **fields}
    (out / LOCK).write_text(json.dumps(record))
    return out


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_recorded_pid_now_owned_by_another_process_is_no_run(tmp_path, monkeypatch):
    """Without flock the recorded process decides: a pid that lives, but started at another time than the record
    says, is another process that reused the number: taken over. The same pid with its own start time holds it."""
    from hf_ppo.trainer import run_lock

    monkeypatch.setattr(run_lock, "fcntl", None)  # no flock (Windows)
    monkeypatch.setattr(run_lock.os, "name", "posix")
    other = _sleeper()
    try:
        out = _record(tmp_path, pid=other.pid, start="1")  # its real start time is not 1 tick after boot
        with pytest.warns(UserWarning, match=rf"left by process {other.pid} on .*no longer running"):
            run_lock.acquire(str(out)).release()
        assert not (out / LOCK).exists()
        out = _record(tmp_path, pid=other.pid, start=run_lock._start_time(other.pid))
        with pytest.raises(run_lock.OutputDirInUseError, match=rf"in use by another hf_ppo run: process {other.pid}"):
            run_lock.acquire(str(out))
        assert json.loads((out / LOCK).read_text())["pid"] == other.pid  # left as it was
    finally:
        other.kill()
        other.wait()


def test_a_lock_recorded_on_another_host(tmp_path, monkeypatch):
    """A record from another host: with flock free, taken over with a note that says what is known (its lock on the
    file is gone) and what is not (issue 60 item 10: it claimed 'no longer running'); without flock, refused naming
    the file to delete if that run is over."""
    from hf_ppo.trainer import run_lock

    out = _record(tmp_path, host="node-7", pid=4242)
    with pytest.warns(UserWarning) as notes:
        run_lock.acquire(str(out)).release()
    (note,) = [str(w.message) for w in notes]
    assert "left by process 4242 on node-7" in note and "another host: its lock on the file is gone" in note
    assert "no longer running" not in note and "stop one of the two" in note

    out = _record(tmp_path, host="node-7", pid=4242)
    monkeypatch.setattr(run_lock, "fcntl", None)
    with pytest.raises(run_lock.OutputDirInUseError, match=rf"process 4242 on node-7.*That host cannot be asked from "
                                                           rf"here whether it still runs: if that run is over, delete "
                                                           rf"{out / LOCK}"):
        run_lock.acquire(str(out))
    assert json.loads((out / LOCK).read_text())["host"] == "node-7"


def test_a_filesystem_without_flock_lets_the_recorded_process_decide(tmp_path, monkeypatch):
    """flock refused by the filesystem (ENOLCK on some network mounts): a live recorded process on this host holds
    the folder; a dead one frees it; a fresh folder is taken."""
    import errno

    from hf_ppo.trainer import run_lock

    class NoFlock:
        LOCK_EX, LOCK_NB = 2, 4

        @staticmethod
        def flock(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock, "fcntl", NoFlock)
    fresh = tmp_path / "fresh"
    lock = run_lock.acquire(str(fresh))
    assert json.loads((fresh / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    other = _sleeper()
    try:
        out = _record(tmp_path, pid=other.pid, start=run_lock._start_time(other.pid))
        with pytest.raises(run_lock.OutputDirInUseError, match=rf"process {other.pid} on {socket.gethostname()}"):
            run_lock.acquire(str(out))
    finally:
        other.kill()
        other.wait()
    with pytest.warns(UserWarning, match=rf"left by process {other.pid} .*no longer running"):
        run_lock.acquire(str(out)).release()  # it died meanwhile


def test_a_refusal_broadcast_from_another_rank(tmp_path):
    """In a distributed run only the main process takes the lock; every process raises the refusal it broadcasts.
    A rank other than the main one raises rank 0's words and writes nothing; a main process whose lock the others'
    outcome overrides releases it."""
    from hf_ppo.trainer import run_lock

    out = tmp_path / "out"
    with pytest.raises(run_lock.OutputDirInUseError, match="^rank 0 says: in use$"):
        with run_lock.holding(str(out), is_main=False, broadcast=lambda mine: "rank 0 says: in use"):
            pass
    assert not out.exists()
    with pytest.raises(run_lock.OutputDirInUseError, match="^in use elsewhere$"):
        with run_lock.holding(str(out), is_main=True, broadcast=lambda mine: mine or "in use elsewhere"):
            pass
    assert not (out / LOCK).exists()  # the main process's own lock, released
    with run_lock.holding(str(out), is_main=False, broadcast=lambda mine: None) as lock:
        assert lock is None and not (out / LOCK).exists()  # nothing taken on that rank


# ---- issue 63 kind 2: leftovers on disk before the run ----------------------------------------------------------
def test_an_empty_lock_file_is_taken_over_in_silence(tmp_path):
    """A process killed between creating the file and writing its record (the record is one write)."""
    from hf_ppo.trainer import run_lock

    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text("")
    assert run_lock.in_use_message(str(out)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        lock = run_lock.acquire(str(out))
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK).exists()


def test_a_lock_file_replaced_by_another_runs_is_left_at_release(tmp_path):
    """A release removes the lock file only while it is still this lock's own (its inode): another run's file put in
    its place stays."""
    from hf_ppo.trainer import run_lock

    out = tmp_path / "out"
    lock = run_lock.acquire(str(out))
    theirs = json.dumps({"writer": "hf_ppo", "pid": 99999, "host": "node-2", "by": "train()"})
    (tmp_path / "theirs").write_text(theirs)
    os.replace(tmp_path / "theirs", out / LOCK)
    lock.release()
    assert (out / LOCK).read_text() == theirs


# ---- issue 60 item 7: the lock lasts until the final save is complete ---------------------------------------------
def test_the_final_save_holds_the_folder_and_is_refused_while_another_run_holds_it(tiny_models, tokenizer, tmp_path,
                                                                                   monkeypatch):
    """The lock ended with train(): a second run started before the final save wrote its weights under the first
    run's record, and the first printed "Saved". save_model() into output_dir now holds the folder while it writes
    (and is refused, writing nothing, while another run holds it); train()'s own hold is not taken twice."""
    from hf_ppo.hub import publish
    from hf_ppo.trainer import run_lock

    out = tmp_path / "out"
    trainer = make_trainer(tiny_models, tokenizer, out, save_strategy="no")
    trainer.train()
    assert not (out / LOCK).exists()
    seen = []
    real = publish.save_policy_folder

    def looking(*args, **kwargs):
        seen.append(json.loads((out / LOCK).read_text()) if (out / LOCK).exists() else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(publish, "save_policy_folder", looking)
    trainer.save_model()
    assert seen and seen[0]["pid"] == os.getpid() and not (out / LOCK).exists()

    other = run_lock.acquire(str(out))  # another run (its own open file: flock refuses this trainer's)
    (out / "model.safetensors").unlink()
    try:
        with pytest.raises(run_lock.OutputDirInUseError, match=rf"output_dir {out} is in use by another hf_ppo run"):
            trainer.save_model()
        assert not (out / "model.safetensors").exists()
    finally:
        other.release()
    trainer.save_model(str(tmp_path / "elsewhere"))  # a save outside output_dir takes nothing
    assert seen[-1] is None and (tmp_path / "elsewhere" / "model.safetensors").is_file()


def test_hf_ppo_train_holds_the_folder_until_its_final_save_is_written(tiny_models, tmp_path, monkeypatch):
    """hf-ppo train holds output_dir across train() and the final save (and the run record's dataset)."""
    import yaml

    from hf_ppo.cli import train as cli
    from hf_ppo.hub import publish

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was"]))
    config = {"dataset_name": str(data), "model_name_or_path": tiny_models["policy"],
              "reward_model_name_or_path": tiny_models["reward"], "output_dir": str(tmp_path / "out"),
              "response_length": 4, "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1,
              "max_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True, "disable_tqdm": True,
              "num_sample_generations": 0, "policy_quantization": "none", "reward_quantization": "none"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out, seen = tmp_path / "out", []
    for owner, name in [(publish, "save_policy_folder"), (cli, "record_dataset")]:
        real = getattr(owner, name)

        def looking(*args, _real=real, **kwargs):
            seen.append(json.loads((out / LOCK).read_text())["pid"])
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, looking)
    cli.main(["--config", str(tmp_path / "run.yaml")], command="hf-ppo train")
    assert seen == [os.getpid(), os.getpid()] and not (out / LOCK).exists()
