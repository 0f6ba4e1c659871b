"""The transformers.Trainer seams hf_ppo relies on: each test names the method or attribute that disappeared or changed.

pyproject.toml pins `transformers>=5.19`, the first release with `Trainer.loss_is_scaled_for_ga` (without it the
token-normalised PPO loss is divided by gradient_accumulation_steps a second time). When one of these tests fails
after a transformers upgrade, fix the override named in the message before raising the pin.
"""

import inspect

import pytest
import transformers
import transformers.trainer
from transformers import Trainer, TrainerState

from hf_ppo import PPOLMTrainer

# Trainer method -> the leading parameters PPOLMTrainer's override (or call) passes, in order.
SEAMS = {
    "_prepare_inputs": ["inputs"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "training_step": ["model", "inputs", "num_items_in_batch"],
    "_get_train_sampler": ["train_dataset"],
    "_get_dataloader": ["dataset", "description", "batch_size", "sampler_fn", "is_training"],
    "create_optimizer": ["model"],
    "_get_grad_norm": ["model", "grad_norm"],
    "log": ["logs", "start_time"],
    "prediction_step": ["model", "inputs", "prediction_loss_only", "ignore_keys"],
    "save_model": ["output_dir", "_internal_call"],
    "_save": ["output_dir", "state_dict"],
    "_save_checkpoint": ["model", "trial"],
    "_get_output_dir": ["trial"],
    "_hp_search_setup": ["trial"],
    "_load_from_checkpoint": ["resume_from_checkpoint", "model"],
    "init_hf_repo": ["token"],
    "_push_from_checkpoint": ["checkpoint_folder"],
    "push_to_hub": ["commit_message", "blocking", "token", "revision"],
    "pop_callback": ["callback"],
    "add_callback": ["callback"],
    "is_world_process_zero": [],
}


def _params(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("name", sorted(SEAMS))
def test_trainer_has_the_method_with_its_parameters(name):
    assert hasattr(Trainer, name), f"transformers {transformers.__version__}: Trainer.{name} is gone; hf_ppo " \
                                   f"overrides or calls it (see hf_ppo/trainer/ppo_trainer.py)."
    params = _params(getattr(Trainer, name))
    expected = SEAMS[name]
    assert params[:len(expected)] == expected, (
        f"transformers {transformers.__version__}: Trainer.{name}{tuple(params)} no longer starts with "
        f"{tuple(expected)}; update PPOLMTrainer.{name}.")


def test_every_override_accepts_what_trainer_passes():
    for name, member in vars(PPOLMTrainer).items():
        if not inspect.isfunction(member) or not inspect.isfunction(getattr(Trainer, name, None)) or name == "__init__":
            continue
        ours, theirs = _params(member), _params(getattr(Trainer, name))
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(member).parameters.values())
        missing = [p for p in theirs if p not in ours and not p.startswith("*")]
        assert not missing or accepts_kwargs, (
            f"transformers {transformers.__version__}: Trainer.{name} takes {missing} that PPOLMTrainer.{name} "
            "does not accept.")


def test_loss_is_scaled_for_ga_is_read_by_training_step():
    assert "loss_is_scaled_for_ga" in vars(Trainer), (
        f"transformers {transformers.__version__}: Trainer.loss_is_scaled_for_ga is gone; PPOLMTrainer's loss is "
        "already normalised over the minibatch and would be divided by gradient_accumulation_steps again.")
    assert "self.loss_is_scaled_for_ga" in inspect.getsource(Trainer.training_step), "Trainer.training_step no " \
        "longer reads loss_is_scaled_for_ga."


def _order(source: str, *needles: str) -> list[int]:
    return [source.find(n) for n in needles]


def test_save_checkpoint_writes_trainer_state_last_then_rotates():
    """checkpoint.py's completeness rule: trainer_state.json is Trainer's last file, and rotation comes after it."""
    source = inspect.getsource(Trainer._save_checkpoint)
    positions = _order(source, "self.save_model(", "_save_rng_state(", "save_to_json(", "rotate_checkpoints(")
    assert -1 not in positions and positions == sorted(positions), (
        f"transformers {transformers.__version__}: Trainer._save_checkpoint no longer writes the model, RNG state, "
        f"trainer_state.json, then rotates (positions {positions}); hf_ppo's checkpoint completeness rule relies on it.")
    assert hasattr(transformers.trainer, "rotate_checkpoints") and hasattr(TrainerState, "save_to_json")


def test_train_calls_hp_search_setup_before_resolving_the_last_checkpoint():
    source = inspect.getsource(Trainer.train)
    positions = _order(source, "self._hp_search_setup(", "get_last_checkpoint(", "self._load_from_checkpoint(")
    assert -1 not in positions and positions == sorted(positions), (
        f"transformers {transformers.__version__}: Trainer.train no longer calls _hp_search_setup before resolving "
        "resume_from_checkpoint=True; PPOLMTrainer._hp_search_setup moves incomplete checkpoints aside there.")


def test_grad_norm_is_taken_right_before_the_optimizer_step():
    source = inspect.getsource(transformers.trainer)
    norm, step = source.find("self._get_grad_norm(model"), source.find("self.optimizer.step()")
    assert 0 <= norm < step, (
        f"transformers {transformers.__version__}: Trainer no longer calls _get_grad_norm right before "
        "optimizer.step(); PPOLMTrainer._get_grad_norm skips non-finite steps there.")
