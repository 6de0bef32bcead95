"""Tasks: what kind of experiment a run is (:mod:`gatedformer.tasks.base`). The corpus a config names picks its
task (:func:`gatedformer.config.task_of`); each task's class registers itself (``@register_task("name")``) in
:data:`TASKS`, the one list of them, when this package imports its module.

* ``lm`` — causal language modelling (:mod:`gatedformer.tasks.lm`);
* ``translation`` — translation with an encoder-decoder (:mod:`gatedformer.tasks.translation`);
* ``mlm`` — masked language modelling, BERT's pretraining (:mod:`gatedformer.tasks.mlm`; ``data.task=mlm``);
* ``glue`` — fine-tuning on a GLUE task (:mod:`gatedformer.tasks.glue`);
* ``sentclass`` — sentence classification (:mod:`gatedformer.tasks.sentclass`);
* ``qa`` — extractive question answering on SQuAD (:mod:`gatedformer.tasks.qa`).
"""

from __future__ import annotations

from gatedformer.config import RunConfig, task_of
from gatedformer.errors import ConfigError
from gatedformer.tasks.base import TASKS, Task, TrainBatch, register_task

# The task modules, imported for their registrations; in this order, which is the order get_task's error lists them.
# isort: off
from gatedformer.tasks import lm, translation, mlm, glue, sentclass, qa  # noqa: F401
# isort: on


def get_task(name: str) -> Task:
    """The task called ``name``."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; the tasks are {', '.join(TASKS)}")
    return TASKS[name]


def task_for(config: RunConfig) -> Task:
    """The task a run of ``config`` is."""
    return get_task(task_of(config))


__all__ = ["TASKS", "Task", "TrainBatch", "get_task", "register_task", "task_for"]
