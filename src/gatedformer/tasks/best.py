"""The best evaluation of a run so far, kept in its folder: the tasks that report the best validation score (GLUE
fine-tuning, as BERT and the EAU/GRC paper report it; sentence classification, as the SRU paper) keep it with the
files written of it, so a resumed run goes on comparing against it.

``best.json`` holds the best evaluation's fields; the files of that evaluation (its predictions) are written before
it, each atomically, so the folder never names a best evaluation whose files are not there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gatedformer.errors import CheckpointError
from gatedformer.io import atomic_write_json, atomic_write_text, number

__all__ = ["BEST_FILE", "BestEvaluation"]

BEST_FILE = "best.json"


class BestEvaluation:
    """The best evaluation by ``key`` (higher is better; ties keep the earlier one)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.fields: dict[str, Any] | None = None
        self.folder: Path | None = None

    def open(self, folder: Path, resumed: bool) -> None:
        """Keep the best evaluation in ``folder``; a resumed run reads the one it kept, a new run starts afresh."""
        self.folder = folder
        path = folder / BEST_FILE
        if not resumed:
            path.unlink(missing_ok=True)
            self.fields = None
            return
        if path.is_file():
            try:
                fields = json.loads(path.read_text(encoding="utf-8"))
                number(fields[self.key])
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{path} is damaged ({type(err).__name__}); delete it and the run's ckpt "
                                      "folder to train the run again") from None
            self.fields = fields

    def value(self, fields: dict[str, Any] | None) -> float:
        score = number(fields[self.key]) if fields is not None else -math.inf
        return -math.inf if math.isnan(score) else score

    def beats(self, fields: dict[str, Any]) -> bool:
        """Whether an evaluation of ``fields`` beats the best so far."""
        return self.fields is None or self.value(fields) > self.value(self.fields)

    def keep(self, fields: dict[str, Any], files: dict[str, str]) -> None:
        """Make ``fields`` the best evaluation, writing ``files`` (name → text) of it first."""
        if self.folder is not None:
            for name, text in files.items():
                atomic_write_text(self.folder / name, text)
            atomic_write_json(self.folder / BEST_FILE, fields)
        self.fields = dict(fields)
