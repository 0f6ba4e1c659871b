"""FSDP2 (`recipes/accelerate/fsdp.yaml`) with 2 CPU processes (gloo), and the configurations refused at construction.

accelerate 1.15 only turns an FSDP config into FSDP on GPUs (on CPU its state stays MULTI_CPU, i.e. DDP). The driver
below therefore makes accelerate's state FSDP when the launcher asked for it on CPU; everything after that (Trainer's
`accelerator.prepare`, `fully_shard` per decoder layer, the sharded checkpoints) is the real code path. The reference
is the same run under DDP (`recipes/accelerate/ddp.yaml`): same seeds, same per-rank prompts and sampling, so the only
difference is that FSDP shards the parameters, gradients and optimizer state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from hf_ppo import PPOConfig
from hf_ppo.cli import tiny
from hf_ppo.runtime.sharding import FSDP_ACCELERATE, fsdp_supported, fsdp_version, sharding_problems

# The FSDP2 path is tested with accelerate >= ACCELERATE_FSDP2 only (CI's floor leg has an older one: it checks the
# error). The guard reads accelerate's version itself, never through fsdp_supported(), which the first test checks.
from tests.guards import ACCELERATE_FSDP2, installed_at_least, needs_fsdp2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Runs the recipe's main() in each process, then writes what that rank holds: its actor-critic's full weights
# (gathered from the shards under FSDP), whether it saved, whether its model was sharded.
DRIVER = textwrap.dedent("""
    import faulthandler; faulthandler.enable()  # a crash prints each thread's Python stack
    import json, os, sys
    import torch
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    def init_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
    AcceleratorState.__init__ = init_fsdp_on_cpu

    from hf_ppo.runtime import sharding
    sys.path.insert(0, os.path.dirname(sys.argv[1]))
    import ppo  # recipes/ppo.py

    trainer = ppo.main(sys.argv[3:])
    model = trainer.accelerator.unwrap_model(trainer.model)
    with sharding.gathered(model):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    rank = trainer.args.process_index
    torch.save(weights, os.path.join(sys.argv[2], f"rank{rank}.pt"))
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
        json.dump({"should_save": trainer.args.should_save, "steps": trainer.state.global_step,
                   "shard_groups": len(sharding.fsdp_modules(model)), "fsdp": trainer.is_fsdp_enabled}, f)
    trainer.accelerator.end_training()  # as `hf-ppo train` ends: the process group destroyed
    # Then out without interpreter finalization, where gloo's worker threads can abort a process whose work is
    # done (pytorch/pytorch#190489): the test reads what each rank wrote, and a teardown abort would fail it.
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
""")

VARIANTS = {
    "full": {"use_peft": False},
    # LoRA with the critic on the reward model's frozen base: that base is shared with the (unsharded) reward model.
    "lora": {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "critic": "reward_lora"},
    # QLoRA: the 4-bit base is stored in the compute dtype under FSDP, so it is sharded too.
    "qlora": {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "policy_quantization": "4bit"},
}


def launch(run: Path, models: tuple[str, str], prompts: Path, accelerate_config: str, port: int, **overrides) -> dict:
    """Run recipes/ppo.py with 2 CPU processes under `accelerate_config`; return the ranks' reports and weights."""
    policy, reward = models
    config = {
        "dataset_name": str(prompts), "model_name_or_path": policy, "reward_model_name_or_path": reward,
        "output_dir": str(run / "out"), "policy_quantization": "none", "reward_quantization": "none",
        "ref_quantization": "none",
        "response_length": 4, "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 2,
        "max_steps": 4, "learning_rate": 1.0e-3, "logging_steps": 2, "num_sample_generations": 0,
        "report_to": "none", "save_strategy": "steps", "save_steps": 2, "disable_tqdm": True, "seed": 0,
        "use_cpu": True, **overrides,
    }
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "driver.py").write_text(DRIVER)
    ranks = run / "ranks"
    ranks.mkdir(exist_ok=True)
    # The checkout first on the path, before what the caller's PYTHONPATH holds (packages may be installed there, as
    # on the GPU machine); gloo CPU processes: CUDA hidden from them.
    python_path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": python_path,
           "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate" / accelerate_config), "--num_processes", "2",
               "--main_process_port", str(port), str(run / "driver.py"), str(ROOT / "recipes/ppo.py"), str(ranks),
               "--config", str(run / "config.yaml")]
    result = subprocess.run(command, env=env, cwd=run, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return {r: {**json.loads((ranks / f"rank{r}.json").read_text()), "weights": torch.load(ranks / f"rank{r}.pt")}
            for r in (0, 1)}


def assert_close(a: dict, b: dict, atol: float) -> None:
    """Equal within `atol`, parameter by parameter. A 4-bit base is stored as uint8 under DDP and in the compute
    dtype under FSDP (the same packed values): it is frozen, so only the trained parameters are compared then."""
    assert a.keys() == b.keys()
    keys = [k for k in a if a[k].dtype == b[k].dtype and a[k].shape == b[k].shape]
    assert all(k in keys for k in a if "lora_" in k or "v_head" in k) and len(keys) > len(a) // 2
    worst = max((a[k] - b[k]).abs().max().item() for k in keys)
    assert worst <= atol, f"largest difference {worst:.3g} > {atol}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    models = tiny.save_tiny_models(root / "models", hidden_size=64)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in tiny.synthetic_reviews(16, seed=3)))
    return root, models, prompts


@pytest.fixture(scope="module")
def fsdp_runs(setup):
    root, models, prompts = setup
    return {name: launch(root / f"fsdp_{name}", models, prompts, "fsdp.yaml", 29541 + i, **variant)
            for i, (name, variant) in enumerate(VARIANTS.items())}


@needs_fsdp2
@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_fsdp_trains_like_ddp_and_rank0_saves_a_normal_policy(setup, fsdp_runs, name):
    root, models, prompts = setup
    fsdp = fsdp_runs[name]
    ddp = launch(root / f"ddp_{name}", models, prompts, "ddp.yaml", 29551, **VARIANTS[name])
    # One shard group per decoder layer (2 in the policy; 2 more in a critic's own backbone) and one for the rest.
    groups = 5 if VARIANTS[name].get("critic") == "reward_lora" else 3
    assert [fsdp[r]["fsdp"] and fsdp[r]["shard_groups"] for r in (0, 1)] == [groups, groups]
    assert ddp[0]["shard_groups"] == 0
    assert [fsdp[r]["steps"] for r in (0, 1)] == [4, 4]
    # Both ranks hold the same actor-critic, and it is the one DDP trains from the same global batch.
    assert_close(fsdp[0]["weights"], fsdp[1]["weights"], atol=0.0)
    assert_close(fsdp[0]["weights"], ddp[0]["weights"], atol=2e-5)

    # Rank 0 alone saved; the folder is a normal policy, equal to what the ranks trained.
    assert [fsdp[r]["should_save"] for r in (0, 1)] == [True, False]
    out = root / f"fsdp_{name}" / "out"
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(models[0])
    if name != "full":
        from peft import PeftModel

        assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
        loaded = PeftModel.from_pretrained(base, out)
    else:
        assert (out / "model.safetensors").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(out)
    prefix = "pretrained_model."
    saved = {prefix + k: p for k, p in loaded.named_parameters() if name == "full" or "lora_" in k}
    assert saved and saved.keys() <= fsdp[0]["weights"].keys()
    for key, value in saved.items():
        assert torch.equal(value, fsdp[0]["weights"][key]), key
    # ... and training moved it away from where it started.
    initial = {prefix + k: p for k, p in base.named_parameters()}
    assert any(not torch.equal(value, initial[key]) for key, value in saved.items() if key in initial) \
        or any(value.abs().sum() > 0 for key, value in saved.items() if "lora_B" in key)


@pytest.mark.slow
@needs_fsdp2
def test_fsdp_resume_from_a_sharded_checkpoint_matches_the_uninterrupted_run(setup, fsdp_runs):
    root, models, prompts = setup
    uninterrupted = root / "fsdp_full"
    checkpoint = uninterrupted / "out" / "checkpoint-2"
    assert [p.name for p in checkpoint.glob("pytorch_model_fsdp_*")], "no sharded model state in the checkpoint"
    resumed = launch(root / "resumed", models, prompts, "fsdp.yaml", 29561, resume_from_checkpoint=str(checkpoint),
                     **VARIANTS["full"])
    assert resumed[0]["steps"] == 4
    assert_close(resumed[0]["weights"], fsdp_runs["full"][0]["weights"], atol=1e-6)
    assert_close(resumed[1]["weights"], fsdp_runs["full"][1]["weights"], atol=1e-6)


@pytest.mark.parametrize("setting, env, needle", [
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, {}, "ZeRO-3"),
    ({}, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "ZeRO-3"),
    ({}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP version 1"),
], ids=["zero3_args", "zero3_accelerate", "fsdp1"])
@needs_fsdp2
def test_unshardable_configurations_fail_at_construction(monkeypatch, tmp_path, setting, env, needle):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=needle) as error:
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, **setting)
    assert "fsdp.yaml" in str(error.value)


@needs_fsdp2
def test_fsdp2_configuration_is_accepted_and_stores_4bit_weights_in_the_compute_dtype(monkeypatch, tmp_path):
    from hf_ppo.models.pretrained import quantization_config

    assert quantization_config("4bit", torch.bfloat16).bnb_4bit_quant_storage == torch.uint8  # unsharded: packed bytes
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    PPOConfig(output_dir=str(tmp_path), use_cpu=True, policy_quantization="4bit")
    # fully_shard shards floating-point tensors only: the 4-bit base must be stored as bf16 to be sharded.
    assert quantization_config("4bit", torch.bfloat16).bnb_4bit_quant_storage == torch.bfloat16


def test_fsdp_support_agrees_with_the_installed_accelerate():
    """The FSDP tests skip on the guard of tests/guards.py, which reads accelerate's version itself: a bug that made
    fsdp_supported() say no on the tested accelerate would otherwise turn every FSDP test into a skip, and refuse FSDP
    to users, while the run reports green."""
    assert FSDP_ACCELERATE == ACCELERATE_FSDP2
    assert fsdp_supported() == installed_at_least("accelerate", ACCELERATE_FSDP2)


@needs_fsdp2
def test_the_fsdp_version_of_a_launcher_that_sets_none_is_accelerates_default(monkeypatch):
    """`accelerate launch` with an FSDP config that names no fsdp_version sets ACCELERATE_USE_FSDP and no FSDP_VERSION;
    accelerate then builds FSDP version 1, which hf_ppo cannot sample from: hf_ppo must read the same default and
    refuse it, naming the fix. accelerate's own plugin is asked what it builds, so a change of its default shows."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    args = (None, None)  # fsdp, fsdp_config: nothing set in the arguments
    assert fsdp_version(*args) == FullyShardedDataParallelPlugin().fsdp_version == 1
    [problem] = sharding_problems(*args, None)
    assert "FSDP version 1 is not supported" in problem and "fsdp_version: 2" in problem
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp_version(*args) == FullyShardedDataParallelPlugin().fsdp_version == 2
    assert sharding_problems(*args, None) == []


def test_fsdp_with_an_accelerate_older_than_the_tested_one_is_refused(monkeypatch, tmp_path):
    from hf_ppo.runtime import sharding

    monkeypatch.setattr(sharding, "FSDP_ACCELERATE", "99.0")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match=r"FSDP with hf_ppo needs accelerate >= 99.0 .*pip install -U 'accelerate>=99.0'"):
        PPOConfig(output_dir=str(tmp_path), use_cpu=True)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    PPOConfig(output_dir=str(tmp_path), use_cpu=True)  # without FSDP, any accelerate of the tested range


# ---- accelerate's process-wide state: put back after a refused construction, and before a trainer trains ---------
def _state_copy():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return [dict(s._shared_state) for s in (PartialState, AcceleratorState, GradientState)]


def _same(now, before):
    return all(a.keys() == b.keys() and all(a[k] is b[k] for k in b) for a, b in zip(now, before))


def test_a_refused_ppoconfig_leaves_accelerates_state_as_it_found_it(tmp_path):
    """TrainingArguments empties accelerate's AcceleratorState (and starts PartialState again) before PPOConfig's own
    checks refuse it: the Accelerator of a trainer built before would have had no state left to train with."""
    from accelerate import Accelerator

    Accelerator(cpu=True)
    before = _state_copy()
    assert before[1], "no AcceleratorState to keep"
    with pytest.raises(ValueError, match="kl_coef"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, kl_coef=-1.0)
    assert _same(_state_copy(), before)


def test_a_trainers_accelerate_state_goes_back_with_the_loops_own_kept(tmp_path):
    """`reinstate_accelerate_state` puts back the device, mixed precision and gradient settings a trainer was built
    with after another construction (a bf16 one here) replaced them; what a loop in progress holds stays."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from hf_ppo.runtime.sharding import accelerate_state, reinstate_accelerate_state

    Accelerator(cpu=True)
    saved = accelerate_state()
    PPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=True)
    Accelerator(cpu=True, mixed_precision="bf16")
    GradientState()._set_sync_gradients(False)
    assert AcceleratorState().mixed_precision == "bf16"
    reinstate_accelerate_state(saved)
    assert AcceleratorState().mixed_precision == "no" and _same(_state_copy()[:2], saved[:2])
    assert GradientState().sync_gradients is False  # the loop's, not the settings'
    GradientState()._set_sync_gradients(True)
