"""PNG of anomaly score over time per rank, with the threshold, each fault's bursts shaded and the
rank's measured step rate on a second axis."""
from __future__ import annotations

import math
from pathlib import Path

from fleetscope.eval.scorer import Truth, WindowResult


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to add it."""


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable("the score plot needs matplotlib, which is not installed in this environment "
                              "(add it to pyproject's dependencies and reinstall: .venv/bin/pip install "
                              f"matplotlib); the JSON and table results do not need it ({e})") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def plot_scores(truth: Truth, results: list[WindowResult], path: Path, title: str = "",
                rates: dict[int, list] | None = None) -> Path:
    """One panel per rank: score per window (x = window middle, seconds), threshold, flags (waiting
    flags hollow), fault shading (orange: this rank is a culprit), step rate (green, right axis)."""
    plt = _pyplot()
    ranks = list(truth.ranks)
    fig, axes = plt.subplots(len(ranks), 1, sharex=True, figsize=(10, 1.8 + 1.6 * len(ranks)), squeeze=False)
    w = truth.window_s
    for ax, rank in zip(axes[:, 0], ranks):
        mine = sorted((r for r in results if r.rank == rank), key=lambda r: r.window)
        xs = [(r.window + 0.5) * w for r in mine]
        ax.plot(xs, [r.score for r in mine], marker=".", lw=1, label="score")
        thr = [(x, r.threshold) for x, r in zip(xs, mine) if not math.isnan(r.threshold)]
        if thr:
            ax.step([x for x, _ in thr], [t for _, t in thr], where="mid", ls="--", color="gray", label="threshold")
        flagged = [(x, r.score) for x, r in zip(xs, mine) if r.culprit_flag]
        if flagged:
            ax.scatter([x for x, _ in flagged], [s for _, s in flagged], color="red", zorder=3, label="flagged")
        waiting = [(x, r.score) for x, r in zip(xs, mine) if r.flagged and not r.culprit_flag]
        if waiting:
            ax.scatter([x for x, _ in waiting], [s for _, s in waiting], facecolors="none", edgecolors="red",
                       zorder=3, label="flagged, waiting")
        labelled = set()
        for f in truth.faults:
            culprit = rank in f.culprits
            lab = "fault" if culprit else "fault (other rank)"
            for a, b in f.intervals:
                ax.axvspan(a, b, color="orange" if culprit else "gray", alpha=0.25 if culprit else 0.1,
                           label=None if lab in labelled else lab)
                labelled.add(lab)
        if rates and rates.get(rank):
            ax2 = ax.twinx()
            pts = [((k + 0.5) * w, v) for k, v in enumerate(rates[rank]) if v is not None]
            ax2.plot([x for x, _ in pts], [v for _, v in pts], color="green", lw=0.8, alpha=0.7)
            ax2.set_ylabel("steps/s", color="green", fontsize=7)
            ax2.set_ylim(bottom=0)
        ax.set_ylabel(f"rank {rank}")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since start")
    axes[-1, 0].set_xlim(0, truth.duration_s)
    fig.suptitle(title or "anomaly score per rank")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
