"""Jinja templates of the model cards hf_ppo pushes (shipped inside the wheel as `hf_ppo.model_cards`)."""
