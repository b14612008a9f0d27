"""End-of-run report: PNG plots of the learning curves, written to the run directory."""

from __future__ import annotations

import os

from trainer.generation import val_core_acc

# (metric, title); "val-core acc" is the mean of the step's val-core/<data_source>/acc/mean@N values
PANELS = [("val-core acc", "held-out accuracy (val-core/*/acc)"), ("critic/score/mean", "score (critic/score/mean)"),
          ("response_length/mean", "response length"),
          ("actor/entropy", "entropy (start-of-step policy, actor/entropy)"),
          ("mismatch/mismatch_kl", "mismatch KL, k1 (rollout vs trainer)"),
          ("mismatch/rollout_is_eff_sample_size", "IS effective sample size")]


def _value(h: dict, key: str):
    if key == "val-core acc":
        return val_core_acc(h)
    return h.get(key)


def report_figure(history: list[dict]):
    """The report's figure. Tick labels are plain values: no offset ("+1e-3" above the axis) on
    flat series, which matplotlib would otherwise pick for e.g. an accuracy stuck near 1."""
    import matplotlib  # heavy (about a second) and only for the report's figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(h["step"], v) for h in history if (v := _value(h, key)) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        ax.ticklabel_format(axis="both", useOffset=False)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_report(history: list[dict], run_dir: str) -> str:
    import matplotlib.pyplot as plt

    fig = report_figure(history)
    path = os.path.join(run_dir, "report.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
