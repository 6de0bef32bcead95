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
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def series(records: list[dict[str, Any]], event: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of ``key`` over the records of one ``event`` kind."""
    picked = [r for r in records if r.get("event") == event and key in r]
    return [r[x] for r in picked], [r[key] for r in picked]
