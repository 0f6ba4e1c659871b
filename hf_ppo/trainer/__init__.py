"""Floor 6, the trainer: `PPOLMTrainer` on transformers.Trainer's seams, `PPOConfig`, the assembly of the four models,
data and sampler, the minibatch schedule, checkpoints, the output folder's run lock, the non-finite guard, the collapse
watch, progress, and TRL 0.11's `step()`."""

from .assembly import LoadedModels, load_models
from .checkpoint import CheckpointError, CheckpointWriteError, SaveWriteError
from .config import PPOConfig
from .guard import NonFiniteError
from .ppo_trainer import PPOLMTrainer
from .run_lock import OutputDirInUseError
from .schedule import MinibatchSchedule
from .watch import CollapseWarning

__all__ = ["CheckpointError", "CheckpointWriteError", "CollapseWarning", "LoadedModels", "MinibatchSchedule",
           "NonFiniteError", "OutputDirInUseError", "PPOConfig", "PPOLMTrainer", "SaveWriteError", "load_models"]
