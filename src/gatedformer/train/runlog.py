"""Reading a run's JSONL log back, the scalars of its records, and the interface every logger of it implements
(:class:`RunLogger`; the loggers are in :mod:`gatedformer.train.loggers`)."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_RECORD_BYTES = 1 << 24
"""The longest log line read (a record with every gate's statistics is kilobytes)."""


def log_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a log file in order, read a line at a time, skipping what the run cannot have written: a last
    line cut short by a crash, a damaged line, one over :data:`MAX_RECORD_BYTES`, a record whose ``step`` is not a
    whole number."""
    with open(path, "rb") as handle:
        while raw := handle.readline(MAX_RECORD_BYTES + 1):
            if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of the over-long line
                    raw = handle.readline(MAX_RECORD_BYTES + 1)
                continue
            try:
                record = json.loads(raw)
            except ValueError:  # not JSON, or not UTF-8
                continue
            step = record.get("step", 0) if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                yield record


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``run_dir/log.jsonl`` (see :func:`log_records`); none where it is missing or not a file."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    try:
        return list(log_records(path))
    except OSError:
        return []


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def series(records: list[dict[str, Any]], event: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of ``key`` over the records of one ``event`` kind (those where both are finite numbers)."""
    picked = [r for r in records if r.get("event") == event and _number(r.get(key)) and _number(r.get(x))]
    return [r[x] for r in picked], [r[key] for r in picked]


def _scored_part(record: dict[str, Any], key: str) -> Any:
    """How much of the validation split an evaluation scored ``key`` on (``None``: not recorded)."""
    return record.get("bleu_sentences" if key.endswith("_bleu") else "valid_windows")


def eval_series(records: list[dict[str, Any]], key: str,
                x: str = "step") -> tuple[tuple[list[float], list[float]], tuple[float, float] | None]:
    """A validation curve of ``key``, and the last evaluation apart when it scored another part of the split.

    Evaluations during training may score the first windows (``train.eval_windows``) or sentences
    (``translation.bleu_sentences``) of the validation split, and the last one the whole split. Those are
    different measurements, so the curve holds the evaluations on the same part as the first, and the
    last evaluation on another part comes back as a point of its own.
    """
    picked = [r for r in records if r.get("event") == "eval" and _number(r.get(key)) and _number(r.get(x))]
    if not picked:
        return ([], []), None
    part = _scored_part(picked[0], key)
    same = [r for r in picked if _scored_part(r, key) == part]
    other = [r for r in picked if _scored_part(r, key) != part]
    last = (other[-1][x], other[-1][key]) if other else None
    return ([r[x] for r in same], [r[key] for r in same]), last


_NOT_SCALARS = {"event", "step", "time", "tokens", "gates", "epoch"}


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one log record as TensorBoard and W&B name them (``train/loss``, ``valid/bpc``,
    ``gates/...``)."""
    event = record.get("event")
    if event not in ("train", "eval", "test"):
        return {}
    section = "valid" if event == "eval" else event
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_SCALARS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        name = key.removeprefix(f"{section}_") if key.startswith(f"{section}_") else key
        out[f"{section}/{name}"] = float(value)
    for gate, stats in (record.get("gates") or {}).items():
        for stat in ("mean", "std"):
            if isinstance(stats, dict) and stat in stats:
                out[f"gates/{gate}/{stat}"] = float(stats[stat])
    return out


class RunLogger(ABC):
    """Where a run's log records go: one call per record, in order, then :meth:`close`."""

    @abstractmethod
    def record(self, record: dict[str, Any]) -> None:
        """Take one log record (``event`` ``start``, ``train``, ``eval``, ``test``... with its step and numbers)."""

    def close(self) -> None:  # noqa: B027 - most loggers hold nothing open
        """Flush and let go of whatever the logger holds open."""
