"""The table of comparisons that are not :func:`gatedformer.analysis.compare.run_comparison`'s variants × seeds, by
the task whose recipes they compare: each registers itself beside its function (``@register_comparison("mlm")``),
as the BERT recipes' pretraining then fine-tuning on GLUE (:mod:`gatedformer.analysis.glue`) and the
sentence-classification recipes' folds of every set (:mod:`gatedformer.analysis.sentclass`) do. Importing
:mod:`gatedformer.analysis` fills it; ``gatedformer compare`` (:func:`gatedformer.cli.cmd_compare`) dispatches
through it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gatedformer.analysis.report import ComparisonReport
from gatedformer.config import Recipe, task_of

__all__ = ["COMPARISONS", "Comparison", "comparison_for", "register_comparison"]


class Comparison(Protocol):
    """How ``gatedformer compare`` calls a task's comparison."""

    def __call__(self, recipe: Recipe, out_dir: Path, seeds: int = 1, overrides: list[str] | None = None,
                 data_dir: str | Path | None = None, progress: bool = True,
                 only: list[str] | None = None) -> ComparisonReport: ...


COMPARISONS: dict[str, Comparison] = {}
"""The comparison of each task that has its own, by task name."""


def register_comparison(task: str) -> Callable[[Comparison], Comparison]:
    """A decorator that makes the function beside it the comparison of ``task``'s recipes; it returns the function
    unchanged."""

    def register(function: Comparison) -> Comparison:
        if task in COMPARISONS:
            raise ValueError(f"task {task!r} has two comparisons")
        COMPARISONS[task] = function
        return function

    return register


def comparison_for(recipe: Recipe) -> Comparison | None:
    """The comparison of ``recipe``'s task, or ``None`` where it is the generic one."""
    return COMPARISONS.get(task_of(recipe.config))
