"""Which comparison a recipe's task takes: the BERT recipes (masked LM) pretrain and fine-tune on GLUE
(:mod:`gatedformer.analysis.glue`), the sentence-classification ones cross-validate on every set
(:mod:`gatedformer.analysis.sentclass`); every other recipe is :func:`gatedformer.analysis.compare.run_comparison`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gatedformer.config import Recipe, task_of

__all__ = ["comparison_for"]


def comparison_for(recipe: Recipe) -> Callable[..., Any] | None:
    """The comparison of ``recipe``'s task, or ``None`` where it is the generic one."""
    task = task_of(recipe.config)
    if task == "mlm":
        from gatedformer.analysis.glue import run_glue_comparison

        return run_glue_comparison
    if task == "sentclass":
        from gatedformer.analysis.sentclass import run_sentclass_comparison

        return run_sentclass_comparison
    return None
