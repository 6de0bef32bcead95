"""The run log's one interface: every log record the training loop writes goes to each :class:`RunLogger` of the
run — ``log.jsonl`` (:class:`JsonlLog`, always), TensorBoard (``train.tensorboard``,
:class:`~gatedformer.train.tensorboard.TensorBoardLog`) and Weights & Biases (``train.wandb``, :class:`WandbLog`) —
so the loop calls :func:`open_loggers` once and then ``record`` and ``close``, never a logger by name.

A logger other than ``log.jsonl`` starts from the records the log already holds (``replay``): a resumed run has
dropped the lines after its checkpoint, and its scalars go on from there.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gatedformer.config import RunConfig
from gatedformer.errors import GatedformerError
from gatedformer.train.runlog import RunLogger, read_log, scalars_of

__all__ = ["CallbackLog", "JsonlLog", "RunLogger", "WandbLog", "check_loggers", "open_loggers", "require_wandb",
           "scalars_of"]

WANDB_DIR = "wandb"


class JsonlLog(RunLogger):
    """``log.jsonl``: one JSON object per line, appended (the run's own log, which the other loggers replay)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")


class CallbackLog(RunLogger):
    """A function called with each record (``train(..., on_record=...)``: progress bars, tests)."""

    def __init__(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self.callback = callback

    def record(self, record: dict[str, Any]) -> None:
        self.callback(record)


def require_wandb() -> Any:
    """The ``wandb`` module, or one line saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise GatedformerError("train.wandb=true needs the wandb package; install it with "
                               "pip install 'gatedformer[wandb]' or drop train.wandb") from None
    return wandb


class WandbLog(RunLogger):
    """The log's scalars (as TensorBoard names them: ``train/loss``, ``valid/bpc``, ``gates/...``) to a Weights &
    Biases run of project ``train.wandb_project``, its files under ``<run>/wandb``. The W&B run's id is the run
    folder's (kept in ``<run>/wandb/run_id``), so a resumed run goes on in the same W&B run. Offline
    (``WANDB_MODE=offline``) it needs no network; ``wandb sync`` uploads later."""

    def __init__(self, run_dir: Path, config: RunConfig, replay: list[dict[str, Any]] | None = None) -> None:
        wandb = require_wandb()
        self._scalars = scalars_of
        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else None
        if not run_id:
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id + "\n", encoding="utf-8")
        try:
            self.run = wandb.init(project=config.train.wandb_project, name=run_dir.name, id=run_id, resume="allow",
                                  dir=str(folder), config=config.to_dict(),
                                  mode=os.environ.get("WANDB_MODE") or None)
        except Exception as err:  # noqa: BLE001 - no network, no login: one line, and how to train without it
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise GatedformerError(f"Weights & Biases could not start ({first}); log in (wandb login), set "
                                   "WANDB_MODE=offline, or drop train.wandb") from None
        self._last_step = -1
        for record in replay or ():
            self.record(record)

    def record(self, record: dict[str, Any]) -> None:
        scalars = self._scalars(record)
        if not scalars:
            return
        # W&B takes steps in order only; a replayed or repeated step goes in with the step it has.
        step = max(int(record.get("step", 0)), self._last_step)
        self.run.log(scalars, step=step)
        self._last_step = step

    def close(self) -> None:
        self.run.finish()


def open_loggers(config: RunConfig, run_dir: Path, log_path: Path,
                 on_record: Callable[[dict[str, Any]], None] | None = None) -> list[RunLogger]:
    """The loggers of a run on its main process: ``log.jsonl``, then TensorBoard and W&B where the config asks,
    then ``on_record``."""
    loggers: list[RunLogger] = [JsonlLog(log_path)]
    if config.train.tensorboard:
        from gatedformer.train.tensorboard import TensorBoardLog

        loggers.append(TensorBoardLog(run_dir, replay=True))  # starts from the records kept in the log
    if config.train.wandb:
        loggers.append(WandbLog(run_dir, config, replay=read_log(run_dir) if log_path.is_file() else []))
    if on_record is not None:
        loggers.append(CallbackLog(on_record))
    return loggers


def check_loggers(config: RunConfig) -> None:
    """Fail before any work where a logger the config asks for is not installed."""
    if config.train.tensorboard:
        from gatedformer.train.tensorboard import require_tensorboard

        require_tensorboard()
    if config.train.wandb:
        require_wandb()
