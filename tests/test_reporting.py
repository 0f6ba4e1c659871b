"""What the user reads while PPO runs (hf_ppo/trainer/progress.py): the progress bar's caption and the sample tables."""

from __future__ import annotations

import io

import pytest
from tqdm.auto import tqdm

from hf_ppo import PPOConfig
from hf_ppo.trainer.progress import PPOProgressCallback, log_samples_table


@pytest.mark.parametrize("estimator,label", [("k1", "kl_k1"), ("k2", "kl"), ("k3", "kl")])
def test_the_bar_names_the_kl_estimate_it_shows(tmp_path, estimator, label):
    """k1's batch mean can be negative: the bar does not call it `kl`; k2 and k3 are never negative."""
    args = PPOConfig(output_dir=str(tmp_path), kl_estimator=estimator, num_mini_batches=2, num_ppo_epochs=2)
    callback = PPOProgressCallback(args)
    assert callback.kl_label == label and callback.steps_per_iteration == 4

    class State:
        max_steps = 8

    callback.training_bar = tqdm(total=8, file=io.StringIO())  # tqdm's own set_postfix, whatever the reward names
    callback.caption(State(), {"objective/scores": 0.5, "objective/kl": -0.0123, "iteration": 1})
    assert callback.training_bar.postfix == f"reward=0.500, {label}=-0.012"
    assert callback.training_bar.desc.startswith("PPO iteration 1/2")  # tqdm adds ": "
    # Reward names are the caller's: one named like a tqdm argument ("refresh") is just a caption field.
    callback.caption(State(), {"objective/scores": 0.5, "objective/kl": 0.1, "iteration": 1,
                               "rewards/refresh/mean": 0.25})
    assert callback.training_bar.postfix == f"reward=0.500, refresh=0.250, {label}=0.100"


def test_sample_tables_are_written_above_the_progress_bar(monkeypatch):
    """With no tracker, the table goes through tqdm.write (which clears the bar, prints, and draws it again below),
    never straight into the middle of the bar's line."""
    import tqdm.auto

    written = []
    monkeypatch.setattr(tqdm.auto.tqdm, "write", classmethod(lambda cls, text, *a, **k: written.append(text)))
    log_samples_table([("the movie was", " great fun", 1.25)], iteration=3, step=12, report_to=["none"])
    assert len(written) == 1 and "Samples at PPO iteration 3 (step 12)" in written[0]
    assert "great fun" in written[0] and "1.250" in written[0]
    log_samples_table([("p", "c", 0.0)], iteration=4, step=16, report_to=["tensorboard"])  # no table type there
    assert len(written) == 1
