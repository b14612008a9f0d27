"""End-of-run report: PNG plots of the learning curves, written to the run directory."""

from __future__ import annotations

import os

PANELS = [("val/acc", "held-out accuracy"), ("reward/mean", "reward"), ("response_length/mean", "response length"),
          ("actor/entropy_rollout", "entropy (start-of-step policy)"), ("mismatch/mismatch_kl", "mismatch KL (rollout vs trainer)"),
          ("mismatch/rollout_is_eff_sample_size", "IS effective sample size")]


def write_report(history: list[dict], run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(h["step"], h[key]) for h in history if key in h]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(run_dir, "report.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
