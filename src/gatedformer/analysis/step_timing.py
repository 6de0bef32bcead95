"""Every variant's training step timed in one process, interleaved, for the training-time table of ``compare``.

The runs of a comparison train one after another, so their seconds per step also measure whatever else the
machine did meanwhile: with one other process running, the README's main job once reported +σ SDU at ×1.84 and
+tanh SDU at ×2.52 the baseline's step time. Here each variant's model, optimiser and first training batch are
built as its run builds them, and their steps are timed round-robin — one step of each per round, in an order
shuffled every round (:func:`~gatedformer.analysis.bench.timing.time_round_robin`, as ``gatedformer bench`` does) —
so load that comes and goes falls on all of them alike. Ratios are medians of per-round ratios against the baseline.
That cancels load that stays the same over a round; load that starts or stops within rounds still moves a ratio,
by tens of percent on a shared machine with steps of milliseconds, so one measurement is not the last word.

A comparison's measurement is recorded in ``OUT/step_times.json`` (:func:`recorded_or_measured`) with its date and
the configs it timed: a re-run of the comparison shows the recorded one rather than silently replacing it, and
measures again only for variants whose configs no recorded measurement timed, adding that measurement beside the
earlier ones.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from gatedformer.analysis.bench.timing import Timing, paired_ratio, time_round_robin
from gatedformer.config import RunConfig
from gatedformer.devices import resolve_device
from gatedformer.io import atomic_write_json, read_limited
from gatedformer.tasks import task_for
from gatedformer.train.init import initialise
from gatedformer.train.optim import build_optimizer

__all__ = ["TIMES_FILE", "StepTimes", "interleaved_step_times", "recorded_or_measured"]

ROUNDS = 10
WARMUP = 2


TIMES_FILE = "step_times.json"
"""A comparison's step-time measurements, in its output folder."""
_TIMES_BYTES = 1 << 24


class StepTimes(dict[str, Timing]):
    """Seconds per training step by variant, measured interleaved; ``ratio(name)`` against the first. ``measured``
    says when (UTC), ``recorded`` whether it was read back from :data:`TIMES_FILE` rather than measured now, and
    ``earlier`` holds the file's other measurements of the same variants (oldest first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.measured = ""
        self.recorded = False
        self.earlier: list[StepTimes] = []

    def ratio(self, name: str) -> float:
        base = next(iter(self.values()))
        return paired_ratio(self[name], base)


def _fingerprint(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode("utf-8")).hexdigest()


def _read_measurements(path: Path) -> list[dict[str, Any]]:
    """The measurements recorded in ``path`` (none where it is missing); ``ValueError`` where it is not one this
    module wrote."""
    if not path.exists():
        return []
    try:
        record = json.loads(read_limited(path, _TIMES_BYTES))
    except (OSError, ValueError) as err:
        raise ValueError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None
    measurements = record.get("measurements") if isinstance(record, dict) else None
    if not isinstance(measurements, list) or not all(_well_formed(m) for m in measurements):
        raise ValueError("not a list of step-time measurements")
    return measurements


def _well_formed(measurement: Any) -> bool:
    if not isinstance(measurement, dict) or not isinstance(measurement.get("measured"), str):
        return False
    variants = measurement.get("variants")
    return isinstance(variants, dict) and bool(variants) and all(
        isinstance(v, dict) and isinstance(v.get("config_sha256"), str) and isinstance(v.get("samples"), list)
        and v["samples"] and all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in v["samples"])
        for v in variants.values())


def _times_of(measurement: dict[str, Any], names: list[str]) -> StepTimes:
    """The measurement's timings of ``names``, in that order (the first is the baseline of the ratios)."""
    variants = measurement["variants"]
    times = StepTimes({name: Timing([float(x) for x in variants[name]["samples"]], variants[name].get("first_call"))
                       for name in names})
    times.measured = measurement["measured"]
    times.recorded = True
    return times


def recorded_or_measured(configs: dict[str, RunConfig], out_dir: Path,
                         measure: Callable[[], StepTimes]) -> tuple[StepTimes, list[str]]:
    """The step times of ``configs`` (name → config, baseline first) as ``out_dir/step_times.json`` recorded them,
    the latest measurement that timed these very configs; where none did, ``measure()`` now, recorded beside the
    earlier measurements (never in their place). Returns the times and notes for the report."""
    path = Path(out_dir) / TIMES_FILE
    names = list(configs)
    prints = {name: _fingerprint(config) for name, config in configs.items()}
    notes: list[str] = []
    try:
        measurements = _read_measurements(path)
        readable = True
    except ValueError as err:
        measurements, readable = [], False
        notes.append(f"{path} could not be read ({err}): the step times were measured again and not recorded; move "
                     "that file aside to record them")
    same = [m for m in measurements
            if all(m["variants"].get(name, {}).get("config_sha256") == prints[name] for name in names)]
    if same:
        times = _times_of(same[-1], names)
        times.earlier = [_times_of(m, names) for m in same[:-1]]
        return times, notes
    times = measure()
    times.measured = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    if readable:
        entry = {"measured": times.measured,
                 "variants": {name: {"config_sha256": prints[name], "samples": times[name].samples,
                                     "first_call": times[name].first_call} for name in names}}
        atomic_write_json(path, {"measurements": [*measurements, entry]})
    return times, notes


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
