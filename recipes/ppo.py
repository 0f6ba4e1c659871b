"""PPO (RLHF) from a YAML config: the one hf_ppo recipe, a thin wrapper over `hf_ppo.cli.train` (`hf-ppo train`).

    python recipes/ppo.py --config hf_ppo/cli/configs/demo.yaml       # offline, after one `make demo`
    python recipes/ppo.py --config hf_ppo/cli/configs/qlora_24gb.yaml --learning_rate 5e-6 --output_dir runs/my-ppo
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/ppo.py \\
        --config hf_ppo/cli/configs/qlora_24gb.yaml
    accelerate launch --config_file recipes/accelerate/fsdp.yaml recipes/ppo.py --config ...   # FSDP2: shard the policy

`python recipes/ppo.py --help` says the rest; `hf-ppo train` (installed with the package) is the same command.
"""

from __future__ import annotations

# Every name the recipe had when its code lived here, for scripts and tests that load this file as a module.
from hf_ppo.cli.train import *  # noqa: F401,F403
from hf_ppo.cli.train import run

if __name__ == "__main__":
    run()
