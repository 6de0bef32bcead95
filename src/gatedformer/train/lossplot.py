"""A run's ``loss.png``: train loss and the validation metric against step, drawn by :func:`train` at the end of
every run (where matplotlib is installed), so a run trained from Python gets it as one trained from the command line.

It lives beside the loop rather than in ``analysis`` because the loop may not import ``analysis``
(ARCHITECTURE.md); the comparison figures, which read several runs, are in :mod:`gatedformer.analysis.plots`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from gatedformer.io import atomic_write
from gatedformer.train.runlog import eval_series, read_log, series

__all__ = ["WHOLE_SPLIT", "can_draw", "metric_of", "plot_run", "write_loss_curve"]

# The legend entry of a last evaluation that scored the whole validation split, where the curve scored a part.
WHOLE_SPLIT = "end of run, whole valid split"

# ``valid_*`` fields of the log that count the validation split rather than score it.
_NOT_METRICS = {"loss", "windows", "examples", "sentences"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png"))
    plt.close(fig)
    return path


def can_draw() -> bool:
    """Whether matplotlib is installed (the ``plot`` extra), without importing it."""
    return importlib.util.find_spec("matplotlib") is not None


def metric_of(run_dir: str | Path, records: list[dict[str, Any]] | None = None) -> str:
    """The metric a run scores (``bpc``, ``bleu``, ``accuracy``...): as its ``results.json`` names it, else its test
    record's, else the first ``valid_<metric>`` of its evaluations; ``loss`` where it has none yet."""
    results = Path(run_dir) / "results.json"
    try:
        named = json.loads(results.read_text(encoding="utf-8")).get("metric") if results.is_file() else None
    except (OSError, ValueError, AttributeError):
        named = None
    if isinstance(named, str) and named:
        return named
    records = read_log(run_dir) if records is None else records
    for event, prefix in (("test", "test_"), ("eval", "valid_")):
        for record in records:
            if record.get("event") != event:
                continue
            for key in sorted(record):
                name = key[len(prefix):]
                if key.startswith(prefix) and name not in _NOT_METRICS:
                    return name
    return "loss"


def plot_run(run_dir: str | Path, metric: str | None = None) -> Path:
    """``run_dir/loss.png``: train loss and validation metric against step (needs matplotlib)."""
    plt = _pyplot()
    records = read_log(run_dir)
    metric = metric or metric_of(run_dir, records)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps, losses = series(records, "train", "train_loss")
    left.plot(steps, losses, label="train")
    (vsteps, vlosses), whole = eval_series(records, "valid_loss")
    left.plot(vsteps, vlosses, marker="o", label="valid")
    if whole:
        left.plot(*whole, marker="*", markersize=12, linestyle="none", color="tab:orange", label=WHOLE_SPLIT)
    left.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    left.legend()
    (msteps, values), whole = eval_series(records, f"valid_{metric}")
    right.plot(msteps, values, marker="o", color="tab:orange")
    if whole:
        right.plot(*whole, marker="*", markersize=12, linestyle="none", color="tab:red", label=WHOLE_SPLIT)
        right.legend()
    right.set(xlabel="step", ylabel=f"valid {metric}", title=f"valid {metric}")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    return _save(fig, Path(run_dir) / "loss.png")


def write_loss_curve(run_dir: str | Path, metric: str | None = None) -> Path | None:
    """:func:`plot_run` where matplotlib is installed; ``None`` (nothing drawn) where it is not."""
    if not can_draw():
        return None
    return plot_run(run_dir, metric)
