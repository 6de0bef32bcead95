"""Tasks: what kind of experiment a run is (:mod:`gatedformer.tasks.base`). The corpus a config names picks its
task (:func:`gatedformer.config.task_of`); :data:`TASKS` is the one list of them.

* ``lm`` — causal language modelling (:mod:`gatedformer.tasks.lm`);
* ``translation`` — translation with an encoder-decoder (:mod:`gatedformer.tasks.translation`);
* ``mlm`` — masked language modelling, BERT's pretraining (:mod:`gatedformer.tasks.mlm`; ``data.task=mlm``);
* ``glue`` — fine-tuning on a GLUE task (:mod:`gatedformer.tasks.glue`);
* ``sentclass`` — sentence classification (:mod:`gatedformer.tasks.sentclass`).
"""

from __future__ import annotations

from gatedformer.config import RunConfig, task_of
from gatedformer.errors import ConfigError
from gatedformer.tasks.base import Task, TrainBatch
from gatedformer.tasks.glue import GlueFinetuneTask
from gatedformer.tasks.lm import LanguageModelTask
from gatedformer.tasks.mlm import MaskedLMTask
from gatedformer.tasks.sentclass import SentenceClassificationTask
from gatedformer.tasks.translation import TranslationTask

TASKS: dict[str, Task] = {task.name: task for task in (LanguageModelTask(), TranslationTask(), MaskedLMTask(),
                                                       GlueFinetuneTask(), SentenceClassificationTask())}
"""Every task, by name."""


def get_task(name: str) -> Task:
    """The task called ``name``."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; the tasks are {', '.join(TASKS)}")
    return TASKS[name]


def task_for(config: RunConfig) -> Task:
    """The task a run of ``config`` is."""
    return get_task(task_of(config))


__all__ = ["TASKS", "Task", "TrainBatch", "get_task", "task_for"]
