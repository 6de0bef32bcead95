"""Trained runs: a run folder's model loaded for evaluation, generation or translation, whatever its task."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gatedformer.config import RunConfig
from gatedformer.devices import resolve_device
from gatedformer.errors import ConfigError
from gatedformer.tasks import Task, get_task, task_for
from gatedformer.train.checkpoint import load_run_weights, read_run_config

__all__ = ["TrainedRun", "evaluate_run", "load_trained"]


@dataclass
class TrainedRun:
    """A run folder's config, task, model (in eval mode, on its device) and what the model needs besides its
    weights (:meth:`~gatedformer.tasks.base.Task.inference_data`: the corpus of a language model, the vocabularies
    of a translation model)."""

    run_dir: Path
    config: RunConfig
    task: Task
    model: nn.Module
    data: Any

    def require(self, task: str, command: str, instead: str) -> None:
        """A :class:`ConfigError` if the run's task is not ``task``: ``command`` needs that task; ``instead`` says
        what to use for this run."""
        if self.task.name != task:
            wanted = get_task(task).title
            raise ConfigError(f"{self.run_dir} is a {self.task.title} run ({self.config.data.corpus}), not a {wanted} "
                              f"run as {command} needs; {instead}")


def load_trained(run_dir: str | Path, data_dir: str | Path | None = None, device: str = "auto") -> TrainedRun:
    """The run in ``run_dir`` with its final weights, else its latest checkpoint's."""
    run_dir = Path(run_dir)
    target = resolve_device(device)
    config = read_run_config(run_dir)
    task = task_for(config)
    data = task.inference_data(config, run_dir, data_dir)
    model = task.build_model(config, data)
    load_run_weights(model, run_dir, config.to_dict())
    model.to(target).eval()
    return TrainedRun(run_dir, config, task, model, data)


def evaluate_run(run_dir: str | Path, split: str = "valid", data_dir: str | Path | None = None,
                 device: str = "auto") -> dict[str, float]:
    """Loss and metric (bpc, perplexity or BLEU) of a trained run on a whole split."""
    run = load_trained(run_dir, data_dir, device)
    return run.task.evaluate_split(run.model, run.config, split, data_dir, resolve_device(device), run.data)
