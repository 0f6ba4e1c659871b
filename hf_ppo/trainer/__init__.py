"""Floor 6, the trainer: `PPOLMTrainer` on transformers.Trainer's seams, `PPOConfig`, the assembly of the four models,
data and sampler, the minibatch schedule, checkpoints, the non-finite guard, the collapse watch, progress, and TRL
0.11's `step()`."""

from .assembly import LoadedModels, load_models
from .checkpoint import CheckpointError
from .config import PPOConfig
from .guard import NonFiniteError
from .ppo_trainer import PPOLMTrainer
from .schedule import MinibatchSchedule
from .watch import CollapseWarning

__all__ = ["CheckpointError", "CollapseWarning", "LoadedModels", "MinibatchSchedule", "NonFiniteError", "PPOConfig",
           "PPOLMTrainer", "load_models"]
