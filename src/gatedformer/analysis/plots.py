"""Figures: the convergence of several variants, and (from :mod:`gatedformer.train.lossplot`, where the training
loop draws it at the end of every run) a run's loss curve. Needs matplotlib."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gatedformer.train.lossplot import WHOLE_SPLIT, _pyplot, _save, plot_run
from gatedformer.train.runlog import eval_series, read_log, series

__all__ = ["WHOLE_SPLIT", "plot_convergence", "plot_run"]


def _whole_split(axis, points: list[tuple[float, float] | None], color) -> None:
    """The seeds' mean last evaluation on the whole split, where the curve scored a part of it."""
    known = [p for p in points if p is not None]
    if known:
        axis.plot(np.mean([p[0] for p in known]), np.mean([p[1] for p in known]), marker="*", markersize=12,
                  linestyle="none", color=color)


def _band(axis, runs: list[tuple[list[float], list[float]]], label: str, color) -> None:
    """Mean line with the seeds' min-max spread shaded, on the x values all seeds share."""
    runs = [r for r in runs if r[0]]
    if not runs:
        return
    length = min(len(xs) for xs, _ in runs)
    xs = np.mean([np.asarray(r[0][:length], dtype=float) for r in runs], axis=0)
    ys = np.asarray([r[1][:length] for r in runs], dtype=float)
    axis.plot(xs, ys.mean(axis=0), label=label, color=color)
    if len(runs) > 1:
        axis.fill_between(xs, ys.min(axis=0), ys.max(axis=0), alpha=0.2, color=color)


def plot_convergence(runs: dict[str, list[Path]], metric: str, out_path: Path) -> Path:
    """Valid metric against step and wall-clock time, and train loss against step, for every
    variant in one figure; the spread over seeds is shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    wholes = False
    for i, (name, run_dirs) in enumerate(runs.items()):
        logs = [read_log(d) for d in run_dirs]
        color = colors[i % len(colors)]
        for axis, x in ((axes[0], "step"), (axes[1], "time")):
            curves = [eval_series(r, f"valid_{metric}", x) for r in logs]
            _band(axis, [curve for curve, _ in curves], name, color)
            _whole_split(axis, [last for _, last in curves], color)
            wholes |= any(last is not None for _, last in curves)
        _band(axes[2], [series(r, "train", "train_loss") for r in logs], name, color)
    axes[0].set(xlabel="step", ylabel=f"valid {metric}", title=f"valid {metric} vs step")
    axes[1].set(xlabel="training time (s)", ylabel=f"valid {metric}", title=f"valid {metric} vs time")
    axes[2].set(xlabel="step", ylabel="train loss (nats/token)", title="train loss vs step")
    if wholes:
        for axis in axes[:2]:
            axis.plot([], [], marker="*", markersize=10, linestyle="none", color="gray", label=WHOLE_SPLIT)
    for axis in axes:
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a run too short to evaluate leaves its panels empty
            axis.legend(fontsize=8)
    return _save(fig, Path(out_path))
