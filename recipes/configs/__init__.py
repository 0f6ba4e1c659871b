"""The recipe configs (shipped inside the wheel as `hf_ppo.configs`, so that `hf-ppo demo` finds demo.yaml)."""
