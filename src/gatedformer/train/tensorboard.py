"""Optional TensorBoard scalars (``train.tensorboard=true`` or ``--tensorboard``).

The training loop writes every log record to ``log.jsonl``; :class:`TensorBoardLog` turns the same
records into scalars under ``<run>/tensorboard`` (``tensorboard --logdir <run or compare folder>``).
It needs the ``tensorboard`` package (``pip install 'gatedformer[tensorboard]'``), which
:func:`require_tensorboard` checks before any training starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gatedformer.errors import GatedformerError
from gatedformer.train.runlog import RunLogger, read_log, scalars_of

TENSORBOARD_DIR = "tensorboard"


def require_tensorboard() -> type:
    """``SummaryWriter``, or one line saying how to install what is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise GatedformerError("train.tensorboard=true needs the tensorboard package; install it with "
                               "pip install 'gatedformer[tensorboard]' or drop --tensorboard") from None
    return SummaryWriter


class TensorBoardLog(RunLogger):
    """Writes log records of one run as TensorBoard scalars under ``run_dir/tensorboard``."""

    def __init__(self, run_dir: str | Path, replay: bool = False) -> None:
        """``replay=True`` starts the folder afresh from the records already in ``log.jsonl`` (a resumed
        run has dropped the lines after its checkpoint; TensorBoard must not keep them either)."""
        writer_class = require_tensorboard()
        self.path = Path(run_dir) / TENSORBOARD_DIR
        if replay:
            shutil.rmtree(self.path, ignore_errors=True)
        self.writer = writer_class(log_dir=str(self.path))
        if replay:
            for record in read_log(run_dir):
                self.record(record)

    def record(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in scalars_of(record).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def replay_log(run_dir: str | Path) -> Path:
    """Write a whole ``log.jsonl`` to fresh TensorBoard files (for loops without a record hook)."""
    board = TensorBoardLog(run_dir, replay=True)
    board.close()
    return board.path
