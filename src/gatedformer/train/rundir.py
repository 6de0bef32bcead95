"""Run folders: trained by one process at a time, and never a folder that is not a run.

``train`` claims its ``--out`` (:func:`claim_run_folder`) before it reads or writes anything there. The claim

* refuses a folder that holds files but no gatedformer run (a user's folder is never written into), and an empty
  ``--out`` (which would be the current folder);
* takes the run's lock, ``run.lock``: an ``flock`` the kernel drops when its holder exits, however it exits, so a
  crashed run never leaves its folder locked, while a second ``train`` (a resubmitted job, a concurrent
  ``--resume``, a second ``compare``) stops at once with the holder's pid and host instead of mixing two runs in
  one folder;
* refuses run files that are not files (a ``log.jsonl`` that is a folder, a FIFO, a link) before anything is
  written, and deletes the temp files of writes a killed holder left behind.

A run folder written before the lock existed (no ``run.lock``) is recognised by its checkpoints or its config, and
is claimed like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path

from gatedformer.config import config_from_dict
from gatedformer.errors import GatedformerError, InUseError, OutputError
from gatedformer.io import FolderLock, make_folder, output_path, read_limited, remove_stale_temp_files

LOCK_FILE = "run.lock"
"""The run's lock file: who trains it now (or last did); locked while a ``train`` holds the folder."""
RUN_FILES = ("config.json", "log.jsonl", "results.json", "model.safetensors", "gate_biases.safetensors",
             "vocab.json", "test.hyp.txt", "loss.png", LOCK_FILE)
"""Files a run writes at its top level."""
RUN_FOLDERS = ("ckpt", "tensorboard")
"""Folders a run writes at its top level."""
CONFIG_BYTES = 1 << 22
"""The largest ``config.json`` read (a config is a few kilobytes)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a regular file"


def _looks_like_run_config(path: Path) -> bool:
    try:
        data = json.loads(read_limited(path, CONFIG_BYTES))
        if not isinstance(data, dict) or not {"data", "model"} <= data.keys():
            return False
        config_from_dict(data, where=str(path))
    except (OSError, ValueError, GatedformerError):
        return False
    return True


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a gatedformer run: its lock file, checkpoints, or a ``config.json`` that reads as a run
    config (a run from before the lock file, stopped before its first checkpoint)."""
    path = Path(path)
    if (path / LOCK_FILE).is_file():
        return True
    ckpt = path / "ckpt"
    if ckpt.is_dir() and ((ckpt / "LATEST").exists() or any(ckpt.glob("step-*"))):
        return True
    return _looks_like_run_config(path / "config.json")


def check_run_files(run_dir: str | Path) -> None:
    """One :class:`OutputError` for a run file that is not a regular file (a folder, FIFO, device or link where the
    run writes ``log.jsonl``, say) or a ``ckpt`` that is not a folder: writing or appending there would fail halfway,
    block, or write somewhere else."""
    run_dir = Path(run_dir)
    wanted_kinds = {**dict.fromkeys(RUN_FILES, "a regular file"), **dict.fromkeys(RUN_FOLDERS, "a folder")}
    for name, wanted in wanted_kinds.items():
        try:
            mode = os.lstat(run_dir / name).st_mode
        except FileNotFoundError:
            continue
        except OSError as err:
            raise OutputError(f"cannot read {run_dir / name} ({err.strerror or err}); make it readable") from None
        kind = _kind(mode)
        if kind != wanted:
            raise OutputError(f"{run_dir / name} is {kind}, not {wanted} as the run keeps there; move it out of "
                              f"{run_dir} and run again")


def claim_run_folder(out: str | Path, purpose: str = "train") -> FolderLock:
    """Claim ``out`` for one process (see the module's description); release the returned lock when done.

    Raises :class:`OutputError` for an empty ``out``, a name too long, a file in the way, a folder holding files that
    are not a run or run files of the wrong kind, and :class:`InUseError` naming the holder when another process
    holds it."""
    out_dir = output_path(out, "--out")
    if out_dir.is_dir():
        entries = sorted(os.listdir(out_dir))
        if entries and not is_run_folder(out_dir):
            shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
            raise OutputError(f"{out_dir} already holds files that are not a gatedformer run ({shown}); a run needs a "
                              "new or empty folder: choose another --out")
        check_run_files(out_dir)
    make_folder(out_dir, "run folder")
    lock = FolderLock(out_dir / LOCK_FILE, purpose)
    if not lock.acquire():
        raise InUseError(f"{out_dir} is in use by {lock.holder()}; a run folder is trained by one process at a time: "
                         "wait for that one to end (or stop it), or choose another --out")
    # Writes the last holder was killed in the middle of; no one else writes here while the lock is held.
    remove_stale_temp_files(out_dir)
    if (out_dir / "ckpt").is_dir():
        remove_stale_temp_files(out_dir / "ckpt")
    return lock


def release_run_folder(lock: FolderLock, created: bool) -> None:
    """Let go of a claimed run folder. A claim that came to nothing (the run failed on its config or corpus before
    writing anything) leaves no trace: its lock file is deleted and, if the claim made the folder, the folder too,
    so a mistyped command neither litters the disk nor turns a fresh name into a "run"."""
    out_dir = lock.path.parent
    try:
        untouched = os.listdir(out_dir) == [LOCK_FILE]
    except OSError:
        untouched = False
    if untouched:
        with contextlib.suppress(OSError):
            lock.path.unlink()  # while still locked: a process waiting on it sees the file gone and retries
    lock.release()
    if untouched and created:
        with contextlib.suppress(OSError):
            out_dir.rmdir()


def held_here(run_dir: str | Path) -> bool:
    """Whether the run's lock file names a live process on this host other than this one: a cheap guess, without
    touching the lock, that a ``train`` there will be refused (e.g. to leave out a note that would not apply)."""
    try:
        record = json.loads(read_limited(Path(run_dir) / LOCK_FILE, 4096))
        pid, host = int(record["pid"]), record["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, another user's
    return True
