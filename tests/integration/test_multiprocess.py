"""recipes/ppo.py under `accelerate launch` with 2 CPU processes (gloo DDP): ranks stay in sync, one save.

`accelerate launch --cpu --num_processes 2` runs ONE process unless mpirun is installed (accelerate 1.15 sends
`--cpu` to its simple launcher), so the test uses the DDP config (torchrun) with `use_cpu: true` in the PPO config:
two processes, gloo backend, no GPU.
"""

from __future__ import annotations

import json
import os
import sys
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from hf_ppo.cli import tiny

ROOT = Path(__file__).resolve().parents[2]

# Runs the recipe's main() in each process, then records what that rank holds: a hash of its trainable weights
# (LoRA + the critic's), whether it was the saving process, and the first completions it sampled.
DRIVER = textwrap.dedent("""
    import faulthandler; faulthandler.enable()  # a crash prints each thread's Python stack
    import hashlib, importlib.util, json, os, sys
    import torch
    spec = importlib.util.spec_from_file_location("ppo_recipe", sys.argv[1])
    ppo = importlib.util.module_from_spec(spec)
    sys.modules["ppo_recipe"] = ppo
    spec.loader.exec_module(ppo)
    trainer = ppo.main(sys.argv[3:])
    model = trainer.accelerator.unwrap_model(trainer.model)
    def sha(params):
        digest = hashlib.sha256()
        for name, param in sorted(params):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()
    named = list(model.named_parameters())
    trained = sha((n, p) for n, p in named if p.requires_grad)
    lora = sha((n.removeprefix("pretrained_model."), p) for n, p in named
               if "lora_" in n and n.startswith("pretrained_model."))  # the policy's adapter (not a critic's)
    rank = trainer.args.process_index
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": trainer.args.world_size, "sha": trained, "lora_sha": lora,
                   "should_save": trainer.args.should_save, "steps": trainer.state.global_step,
                   "sampling_seed": torch.initial_seed()}, f)
    trainer.accelerator.end_training()  # as `hf-ppo train` ends: the process group destroyed
    # Then out without interpreter finalization, where gloo's worker threads can abort a process whose work is
    # done (pytorch/pytorch#190489): the test reads what each rank wrote, and a teardown abort would fail it.
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
""")


def lora_hash(model) -> str:
    """The driver's hash of the LoRA weights, for a model loaded back with PeftModel.from_pretrained."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in sorted((n, p) for n, p in model.named_parameters() if "lora_" in n):
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("variant", [
    {},  # PPO with the shared value head
    {"critic": "reward_lora"},  # a critic inside the module DDP wraps, on the frozen reward model's base
    {"advantage_estimator": "grpo", "num_generations": 2},  # no critic; each rank's batch is one whole group
], ids=["shared", "reward_lora", "grpo_k2"])
def test_two_cpu_processes_train_identical_adapters_and_save_once(tmp_path, variant):
    policy, reward = tiny.save_tiny_models(tmp_path / "models", hidden_size=64)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in tiny.synthetic_reviews(16, seed=3)))
    config = {
        "dataset_name": str(prompts), "model_name_or_path": policy, "reward_model_name_or_path": reward,
        "output_dir": str(tmp_path / "out"),
        # Full precision: the multi-process path under test is DDP + LoRA, not bitsandbytes.
        "use_peft": True, "lora_r": 4, "lora_alpha": 8, "policy_quantization": "none", "reward_quantization": "none",
        "response_length": 4, "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 2,
        "max_steps": 4, "learning_rate": 1.0e-3, "logging_steps": 2, "num_sample_generations": 0,
        "report_to": "none", "save_strategy": "no", "disable_tqdm": True, "seed": 0, "use_cpu": True, **variant,
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "driver.py").write_text(DRIVER)
    ranks = tmp_path / "ranks"
    ranks.mkdir()

    # The checkout first on the path, before what the tests' own PYTHONPATH holds (packages may be installed there).
    # CUDA hidden: the test is about gloo DDP between CPU processes (use_cpu), also where a GPU is visible.
    python_path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": python_path,
           "CUDA_VISIBLE_DEVICES": ""}
    # The interpreter running the tests, not whichever `accelerate` comes first on PATH (another environment's).
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/ddp.yaml"),
               "--num_processes", "2", "--main_process_port", "29533", str(tmp_path / "driver.py"), str(ROOT / "recipes/ppo.py"),
               str(ranks), "--config", str(tmp_path / "config.yaml")]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    reports = [json.loads((ranks / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert [r["steps"] for r in reports] == [4, 4]
    assert reports[0]["sha"] == reports[1]["sha"], "the two ranks ended with different trained weights"
    assert [r["should_save"] for r in reports] == [True, False], "exactly one process (rank 0) saves"
    assert reports[0]["sampling_seed"] != reports[1]["sampling_seed"], "both ranks sampled with the same seed"

    # One saved adapter, loadable, equal to what both ranks trained (the value head is not part of the export).
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("adapter_model*")) == ["adapter_model.safetensors"]
    assert not [p for p in out.rglob("*") if p.suffix in (".tmp", ".lock") or p.name.startswith("tmp")]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy), out)
    assert lora_hash(loaded) == reports[0]["lora_sha"] == reports[1]["lora_sha"]
    assert any("lora_B" in name and param.abs().sum() > 0 for name, param in loaded.named_parameters())


# Two ranks of TRL 0.11's step() loop (save_strategy="steps") into one output_dir: rank 0 holds the folder from the
# first call, both ranks learn every answer of the lock together (a refusal on one rank alone would hang the other
# at its next collective), and when a later trainer of the same processes takes the folder over, the earlier
# trainer's step() is refused on both.
STEP_DRIVER = textwrap.dedent("""
    import json, os, sys, warnings
    import torch
    from transformers import AutoTokenizer
    from hf_ppo import PPOConfig, PPOLMTrainer
    from hf_ppo.trainer import OutputDirInUseError
    policy, out, reports = sys.argv[1:4]
    tokenizer = AutoTokenizer.from_pretrained(policy)

    def build():
        args = PPOConfig(output_dir=out, per_device_train_batch_size=2, num_mini_batches=1, num_ppo_epochs=1,
                         max_steps=8, response_length=4, report_to=[], save_strategy="steps", save_steps=1,
                         num_sample_generations=0, disable_tqdm=True, lr_scheduler_type="constant", use_cpu=True,
                         seed=0)
        return PPOLMTrainer(model=policy, args=args, processing_class=tokenizer)

    query = torch.tensor(tokenizer.encode("the movie was"))

    def step(trainer):
        return trainer.step([query, query.clone()], [torch.tensor([10, 11])] * 2, [1.0, 0.0])

    first = build()
    step(first)
    step(first)
    lock = os.path.join(out, "hf_ppo_train.lock")
    held = json.load(open(lock))["by"] if os.path.exists(lock) else None
    second = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(second)
    try:
        step(first)
        refused = None
    except OutputDirInUseError as err:
        refused = str(err)
    step(second)  # still in step: the refusal left no collective behind
    rank = first.args.process_index
    with open(os.path.join(reports, f"rank{rank}.json"), "w") as f:
        json.dump({"held": held, "refused": refused, "took_over": any("takes it over" in str(w.message) for w in caught),
                   "steps": [first.state.global_step, second.state.global_step]}, f)
    first.accelerator.end_training()
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
""")


def test_two_cpu_processes_of_a_step_loop_hold_the_folder_and_are_refused_together(tmp_path):
    policy, _ = tiny.save_tiny_models(tmp_path / "models", hidden_size=64)
    (tmp_path / "driver.py").write_text(STEP_DRIVER)
    reports = tmp_path / "ranks"
    reports.mkdir()
    python_path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": python_path,
           "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate/ddp.yaml"), "--num_processes", "2", "--main_process_port", "29534",
               str(tmp_path / "driver.py"), policy, str(tmp_path / "out"), str(reports)]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["held"] for r in ranks] == ["step() loop", "step() loop"]  # (both ranks read rank 0's file)
    assert [r["took_over"] for r in ranks] == [True, False]  # the note comes from the process that holds the lock
    for r in ranks:
        assert r["refused"] is not None and "was taken over at" in r["refused"] and "by a later PPOLMTrainer" in r["refused"]
        assert r["steps"] == [2, 2]
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
