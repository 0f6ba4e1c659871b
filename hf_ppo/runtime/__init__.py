"""Floor 1, the runtime: which library versions are installed and what they renamed (`versions`), how the run is
sharded (`sharding`: FSDP2 / DeepSpeed through accelerate), `file_problem`, whether a file about to be read opens, and `warn_user`, the one way hf_ppo warns. Imports
nothing of hf_ppo."""

from .files import file_problem
from .sharding import fsdp_version, sharded_by_accelerate
from .versions import out_of_range, warn_if_out_of_range
from .warn import warn_user

__all__ = ["file_problem", "fsdp_version", "out_of_range", "sharded_by_accelerate", "warn_if_out_of_range", "warn_user"]
