"""`python -m hf_ppo.cli`: the `hf-ppo` command, for an environment whose scripts folder is not on PATH."""

from .command import main

main()
