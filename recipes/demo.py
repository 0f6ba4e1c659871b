"""RLHF in a box: the offline demo behind `make demo`, a thin wrapper over `hf_ppo.demo` (`hf-ppo demo`).

    python recipes/demo.py --output_dir outputs/demo            # what `make demo` runs
    python recipes/demo.py --output_dir /tmp/demo --quick       # a smoke run of every stage (what the tests run)

`python recipes/demo.py --help` says the rest.
"""

from hf_ppo.cli.demo import main

if __name__ == "__main__":
    main()
