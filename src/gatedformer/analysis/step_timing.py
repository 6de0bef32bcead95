"""Every variant's training step timed in one process, interleaved, for the training-time table of ``compare``.

The runs of a comparison train one after another, so their seconds per step also measure whatever else the
machine did meanwhile: with one other process running, the README's main job once reported +σ SDU at ×1.84 and
+tanh SDU at ×2.52 the baseline's step time. Here each variant's model, optimiser and first training batch are
built as its run builds them, and their steps are timed round-robin — one step of each per round, in an order
shuffled every round (:func:`~gatedformer.analysis.bench.timing.time_round_robin`, as ``gatedformer bench`` does) —
so load that comes and goes falls on all of them alike. Ratios are medians of per-round ratios against the baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gatedformer.analysis.bench.timing import Timing, paired_ratio, time_round_robin
from gatedformer.config import RunConfig
from gatedformer.devices import resolve_device
from gatedformer.tasks import task_for
from gatedformer.train.init import initialise
from gatedformer.train.optim import build_optimizer

__all__ = ["StepTimes", "interleaved_step_times"]

ROUNDS = 10
WARMUP = 2


class StepTimes(dict[str, Timing]):
    """Seconds per training step by variant, measured interleaved; ``ratio(name)`` against the first."""

    def ratio(self, name: str) -> float:
        base = next(iter(self.values()))
        return paired_ratio(self[name], base)


def _step(config: RunConfig, data: Any, device: torch.device) -> Callable[[], None]:
    """One training step of ``config``'s model on its first batch: forward, loss, backward, optimiser."""
    task = task_for(config)
    torch.manual_seed(config.train.seed)
    model = task.build_model(config, data)
    initialise(model, config.init)
    model.to(device).train()
    optimizer = build_optimizer(model, config.optim)
    batch = next(task.train_batches(data, config, 0, None))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = task.loss(model, batch, None, config, device)
        loss.backward()
        optimizer.step()

    return step


def interleaved_step_times(configs: dict[str, RunConfig], data_dir: str | Path | None = None, shared: Any = None,
                           rounds: int = ROUNDS, warmup: int = WARMUP) -> StepTimes:
    """Seconds per training step of every variant (name → its first seed's config, baseline first), timed
    round-robin in this process after ``warmup`` untimed rounds."""
    first = next(iter(configs.values()))
    if first.train.threads:
        torch.set_num_threads(first.train.threads)
    device = resolve_device(first.train.device, "train.device")
    loaded: dict[str, Any] = {}
    contenders = {}
    for name, config in configs.items():
        # Variants that read the same data share it (a translation variant may change its vocabulary).
        key = repr((config.data, config.translation))
        if key not in loaded:
            loaded[key] = task_for(config).load_data(config, data_dir, shared=shared)
        contenders[name] = _step(config, loaded[key], device)
    return StepTimes(time_round_robin(contenders, repeats=rounds, warmup=warmup, device=device))
