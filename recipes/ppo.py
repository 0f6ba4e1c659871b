"""PPO (RLHF) from a YAML config: the one hf_ppo recipe, a thin wrapper over `hf_ppo.recipe` (`hf-ppo train`).

    python recipes/ppo.py --config recipes/configs/demo.yaml          # offline, after one `make demo`
    python recipes/ppo.py --config recipes/configs/qlora_24gb.yaml --learning_rate 5e-6 --output_dir runs/my-ppo
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/ppo.py --config recipes/configs/qlora_24gb.yaml

`python recipes/ppo.py --help` says the rest; `hf-ppo train` (installed with the package) is the same command.
"""

from __future__ import annotations

from hf_ppo.recipe import (  # noqa: F401  (the recipe's names, for scripts and tests that import this file)
    ConfigError,
    ModelArguments,
    PPOConfig,
    ScriptArguments,
    build_parser,
    main,
    parse_args,
    run,
)

if __name__ == "__main__":
    run()
