"""The PNG of reward and eval curves written at the end of a run."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: Path) -> Path | None:
    """Plot ``rollout/reward_mean`` and every ``eval/*/accuracy`` against the step.
    Returns the path, or None when matplotlib is not installed or nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rewards = [(m["rollout_id"], m["rollout/reward_mean"]) for m in history if "rollout/reward_mean" in m]
    evals: dict[str, list] = {}
    for metrics in history:
        for key, value in metrics.items():
            if key.startswith("eval/") and key.endswith("/accuracy"):
                evals.setdefault(key, []).append((metrics["rollout_id"] + 1, value))
    if not rewards and not evals:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    if rewards:
        axis.plot(*zip(*rewards), label="rollout/reward_mean")
    for key, points in evals.items():
        axis.plot(*zip(*points), marker="o", label=key)
    axis.set_xlabel("rollout")
    axis.set_ylabel("reward / accuracy")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
