"""PNG plots of training curves from `trainer.state.log_history` (used by the model card and the demo)."""

from __future__ import annotations

from pathlib import Path

# Metric name -> axis label, in the order panels are drawn: the four panels the docs show (the model card's plot and
# the demo's), reward, KL, response length and entropy, each per PPO iteration.
DEFAULT_PANELS = {
    "objective/scores": "reward (score)",  # a reward model's, a function's or a weighted sum
    "objective/kl": "KL(policy || reference), nats/response",
    "rollout/response_length": "response length (tokens)",
    # objective/entropy sums -log p over a response (TRL's convention): per response, not per token
    "objective/entropy": "entropy (nats/response)",
}


# The x-axis label of each log-history key a plot can be drawn against.
X_LABELS = {"step": "optimizer step", "iteration": "PPO iteration"}


def metric_series(log_history: list[dict], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    """(x, values) of `key` across the logged entries that have it; x is `x_key` ("step" or "iteration")."""
    steps, values = [], []
    for entry in log_history:
        if key in entry and x_key in entry:
            steps.append(entry[x_key])
            values.append(float(entry[key]))
    return steps, values


def x_axis(log_history: list[dict]) -> str:
    """"iteration" when the log history records PPO iterations (every hf_ppo run does), else "step" (a history
    written before iterations were logged)."""
    return "iteration" if any("iteration" in entry for entry in log_history) else "step"


# The PNG `Software` text chunk of hf_ppo's plots: a later save redraws a plot that carries it, and keeps any other.
PLOT_STAMP = "hf_ppo training curves"


def plot_training_curves(
    log_history: list[dict], path: str | Path, panels: dict[str, str] | None = None, title: str = "PPO training",
    x_key: str = "step",
) -> Path | None:
    """Draw one panel per metric in `panels` that was logged, against `x_key` ("step": optimizer steps, or
    "iteration": PPO iterations); write `path` (PNG). None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels or DEFAULT_PANELS
    series = {k: metric_series(log_history, k, x_key) for k in panels}
    series = {k: v for k, v in series.items() if v[0]}
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for ax, (key, (steps, values)) in zip(axes[0], series.items()):
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(panels[key], fontsize=10)
        ax.set_xlabel(X_LABELS.get(x_key, x_key))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": PLOT_STAMP})
    plt.close(fig)
    return path
