"""Sharded training (FSDP2 through accelerate): what hf_ppo does beside Trainer's own FSDP support.

Trainer and accelerate shard the actor-critic (`fully_shard` on each decoder layer, then on the whole model), reduce
gradients and write the sharded checkpoints. hf_ppo adds what PPO needs on top:

- the rollout (and evaluation sampling) runs with every shard group gathered once and kept gathered until it ends
  (`gathered`): each decode step would otherwise all-gather every layer again, and ranks whose sampling stops at
  different steps would wait on each other's collectives forever. One full copy of the weights exists while it
  runs, beside the shards; it is freed right after.
- `save_model()` gathers the same way, so rank 0 writes a normal policy (full weights or the adapter);
- a 4-bit (QLoRA) base is stored in the compute dtype (`sharded_by_accelerate`, read by `models/pretrained.py`), so
  `fully_shard`, which shards floating-point tensors only, shards it too;
- configurations that cannot be sharded are refused when `PPOConfig` is built, before a model loads
  (`sharding_problems`): DeepSpeed ZeRO-3, FSDP version 1, an accelerate older than the tested one; FSDP in a single
  process when `PPOLMTrainer` is built (`one_process_problem`);
- a refused construction leaves `os.environ` and accelerate's process-wide state as it found them
  (`environment_restored_on_error`), and a trainer puts back its own accelerate state before it trains or evaluates
  (`reinstate_accelerate_state`): accelerate keeps one per process, which every later construction replaces.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

from torch import nn

FSDP_FIX = ("To shard parameters, use FSDP2: accelerate launch --config_file recipes/accelerate/fsdp.yaml "
            "recipes/ppo.py ... (fsdp_version: 2).")
_GATHERED: set[int] = set()  # ids of the FSDP roots gathered right now
# The accelerate release hf_ppo's FSDP2 path is tested with (CI's newest leg; accelerate has FSDP2 from 1.6, untested
# here below this): older ones are refused for FSDP, while the rest of hf_ppo keeps the wider range of pyproject.toml.
FSDP_ACCELERATE = "1.15.0"


def fsdp_supported() -> bool:
    """Whether the installed accelerate is one hf_ppo's FSDP2 path is tested with (>= `FSDP_ACCELERATE`)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("accelerate")) >= Version(FSDP_ACCELERATE)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("true", "1", "yes")


def _zero_stage(deepspeed) -> int | None:
    """The DeepSpeed ZeRO stage this run asks for: TrainingArguments' `deepspeed` (a dict or a JSON file), or the
    environment `accelerate launch` sets from a DeepSpeed config; None without DeepSpeed."""
    config = deepspeed
    if isinstance(config, str) and os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if isinstance(config, dict):
        stage = config.get("zero_optimization", {}).get("stage")
        return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        return int(stage) if stage.isdigit() else None
    return None


def sharded_by_accelerate() -> bool:
    """Whether accelerate will shard the model with FSDP, as known before the models load: `accelerate launch` with
    an FSDP config sets ACCELERATE_USE_FSDP (TrainingArguments' `fsdp` alone sets it only when Trainer starts)."""
    return _env_true("ACCELERATE_USE_FSDP")


def fsdp_version(fsdp, fsdp_config) -> int | None:
    """The FSDP version this run asks for (TrainingArguments' `fsdp` and `fsdp_config`, or `accelerate launch` with
    an FSDP config); None without FSDP."""
    if fsdp:  # Trainer builds the plugin from the arguments: transformers' default version is 2
        config = fsdp_config if isinstance(fsdp_config, dict) else {}
        return int(config.get("version") or config.get("fsdp_version") or 2)
    if _env_true("ACCELERATE_USE_FSDP"):  # accelerate builds it from the environment: its default is 1
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def environment_restored_on_error(construct):
    """Decorates a construction that may fail (`PPOConfig.__post_init__`, `PPOLMTrainer.__init__`): on an error,
    `os.environ` and accelerate's process-wide state (`accelerate_state`) are put back exactly as they were.
    TrainingArguments and accelerate's Accelerator set ACCELERATE_USE_FSDP / FSDP_* before a later check refuses the
    run (Trainer: "fsdp only works in distributed training"); left behind in a notebook, they would make every later
    PPOConfig of that process an FSDP one. TrainingArguments also empties accelerate's `AcceleratorState` (and an
    Accelerator fills it with its own settings) before a later check refuses it: left so, a trainer already built
    in that process could no longer train.
    A plain wrapper, not a contextlib one: its frame is hf_ppo's, so `warn_user` still finds the user's line."""
    @functools.wraps(construct)
    def constructing(*args, **kwargs):
        before, state = dict(os.environ), accelerate_state()
        try:
            return construct(*args, **kwargs)
        except BaseException:
            for key in [key for key in os.environ if key not in before]:
                del os.environ[key]
            for key, value in before.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value
            _restore_accelerate_state(state)
            raise
    return constructing


# ---- accelerate's state: one per process, however many trainers ---------------------------------------------------
def _shared_states() -> tuple[dict, dict, dict]:
    """The dicts accelerate's `PartialState`, `AcceleratorState` and `GradientState` share across all their instances
    (so across every Accelerator, every Trainer and every TrainingArguments' `distributed_state` of the process)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return PartialState._shared_state, AcceleratorState._shared_state, GradientState._shared_state


def accelerate_state() -> tuple[dict, dict, dict]:
    """A copy of accelerate's process-wide state (`_shared_states`; the values themselves shared).

    Every TrainingArguments (so every PPOConfig) empties `AcceleratorState` and starts `PartialState` again for
    itself, and every Accelerator fills them with its settings (mixed precision, CPU, plugins): a trainer built
    before reads whatever the last construction left, also a refused one."""
    return tuple(dict(shared) for shared in _shared_states())


def _put_back(shared: dict, values: dict) -> None:
    if shared.keys() != values.keys() or any(shared[key] is not value for key, value in values.items()):
        shared.clear()  # in place: every instance's __dict__ is this very dict
        shared.update(values)


def _restore_accelerate_state(saved: tuple[dict, dict, dict]) -> None:
    for shared, values in zip(_shared_states(), saved):
        _put_back(shared, values)


def reinstate_accelerate_state(saved: tuple[dict, dict, dict]) -> None:
    """Put back the accelerate state a trainer was built with (`accelerate_state()` taken right after its Accelerator
    was made) when a construction since (a PPOConfig, another trainer, refused or not) changed it: called before the
    trainer trains or evaluates, so it runs on its own device and mixed precision, never the last construction's.
    `GradientState` keeps what a loop in progress holds: only its settings (`plugin_kwargs`) go back. A no-op when
    nothing changed."""
    partial, accelerator, gradient = _shared_states()
    _put_back(partial, saved[0])
    _put_back(accelerator, saved[1])
    if not gradient:
        _put_back(gradient, saved[2])
    elif "plugin_kwargs" in saved[2]:
        gradient["plugin_kwargs"] = saved[2]["plugin_kwargs"]


def sharding_problems(fsdp, fsdp_config, deepspeed) -> list[str]:
    """Why this run cannot be sharded as configured (empty: it can). Read from TrainingArguments' `fsdp`,
    `fsdp_config` and `deepspeed` and the environment `accelerate launch` sets, so the error comes before any model
    loads."""
    problems = []
    if _zero_stage(deepspeed) == 3:
        problems.append("DeepSpeed ZeRO-3 is not supported: sampling would need every layer gathered per decode step "
                        f"through DeepSpeed's hooks, which hf_ppo does not drive. {FSDP_FIX} (ZeRO-2, which keeps "
                        "whole weights on every GPU, works: recipes/accelerate/deepspeed_zero2.yaml.)")
    version = fsdp_version(fsdp, fsdp_config)
    if version is None:
        return problems
    if not fsdp_supported():
        from importlib.metadata import version as installed

        problems.append(f"FSDP with hf_ppo needs accelerate >= {FSDP_ACCELERATE} (the release its FSDP2 path is tested "
                        f"with); this environment has accelerate {installed('accelerate')}: pip install -U "
                        f"'accelerate>={FSDP_ACCELERATE}'.")
        return problems
    if version != 2:
        fix = ('pass fsdp_config={"version": 2} to PPOConfig (or drop the version: 2 is the default)' if fsdp
               else "set fsdp_version: 2 in the accelerate config (recipes/accelerate/fsdp.yaml)")
        problems.append(f"FSDP version {version} is not supported: hf_ppo gathers the sharded weights for sampling "
                        f"with FSDP2's unshard/reshard. To shard with FSDP2, {fix}.")
    return problems


def one_process_problem(fsdp, fsdp_config, parallel_mode) -> str | None:
    """Trainer's refusal of `fsdp` in a run of one process ("fsdp only works in distributed training"), made by
    `PPOLMTrainer` before any model loads and before Trainer makes its Accelerator; None when the run may go on.
    `parallel_mode`: TrainingArguments' (`ParallelMode`)."""
    from transformers.training_args import ParallelMode

    xla = isinstance(fsdp_config, dict) and fsdp_config.get("xla", False)
    if not fsdp or xla or parallel_mode == ParallelMode.DISTRIBUTED:
        return None
    return (f"fsdp={fsdp!r} shards the model across processes, and this run is a single process (Trainer: 'Using "
            "fsdp only works in distributed training'). Launch it on several: accelerate launch --num_processes 2 "
            "your_script.py (or torchrun --nproc_per_node 2 your_script.py; the recipe: accelerate launch "
            "--config_file recipes/accelerate/fsdp.yaml recipes/ppo.py ...), or drop fsdp to train on one device.")


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` was applied to, root first (empty when the model is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Every shard group of `model` gathered for the body of the `with` (sampling, saving); sharded again after.

    Forward hooks stay installed but find the weights already gathered, so no collective runs inside: ranks may
    make different numbers of forward calls (sampling stops early when every sequence has stopped). Only reading
    happens inside: the gathered weights are a copy, and writes to them would be lost when they are freed.
    A model that is not sharded is used as it is.
    """
    modules = fsdp_modules(model)
    if not modules or id(modules[0]) in _GATHERED:  # not sharded, or already gathered by an enclosing `with`
        yield model
        return
    root = modules[0]
    # FSDP2 picks its root at the first forward, and sampling calls the policy's layers directly: initialise from
    # the root first (torch 2.13 has no public call for it).
    root._get_fsdp_state()._lazy_init()
    after_forward = [_reshards_after_forward(m) for m in modules]
    _GATHERED.add(id(root))
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield model
    finally:
        _GATHERED.discard(id(root))
        for module, reshard in zip(modules, after_forward):
            module.reshard()
            module.set_reshard_after_forward(reshard, recurse=False)


def policy_state_dict(model: nn.Module) -> dict:
    """The policy's full weights (keys as in `model.policy_model.state_dict()`), on rank 0's CPU, one tensor at a
    time; empty on the other ranks. Every rank must call it (it all-gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = next(name for name, module in model.named_modules() if module is model.policy_model) + "."
    return {key[len(prefix):]: tensor for key, tensor in full.items() if key.startswith(prefix)}


@contextlib.contextmanager
def gathered_policy(model: nn.Module):
    """For saving: the policy's full state dict (`policy_state_dict`; empty on ranks other than 0), with the model
    `gathered` around the body, so the NaN/inf check before a save reads whole parameters on every rank."""
    state_dict = policy_state_dict(model)  # before gathering: a state dict call reshards the model
    with gathered(model):
        yield state_dict


def _reshards_after_forward(module: nn.Module) -> bool:
    groups = module._get_fsdp_state()._fsdp_param_groups
    return any(group.post_forward_mesh_info is not None for group in groups)
