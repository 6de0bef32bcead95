"""Reading a run's JSONL log back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``run_dir/log.jsonl``, skipping a last line cut short by a crash."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def series(records: list[dict[str, Any]], event: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of ``key`` over the records of one ``event`` kind."""
    picked = [r for r in records if r.get("event") == event and key in r]
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
    picked = [r for r in records if r.get("event") == "eval" and key in r]
    if not picked:
        return ([], []), None
    part = _scored_part(picked[0], key)
    same = [r for r in picked if _scored_part(r, key) == part]
    other = [r for r in picked if _scored_part(r, key) != part]
    last = (other[-1][x], other[-1][key]) if other else None
    return ([r[x] for r in same], [r[key] for r in same]), last
