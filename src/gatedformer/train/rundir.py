"""Run folders: trained by one process at a time, and never a folder that is not a run.

``train`` claims its ``--out`` (:func:`claim_run_folder`) before it reads or writes anything there. The claim

* refuses a folder that holds files but no gatedformer run (a user's folder is never written into), and an empty
  ``--out`` (which would be the current folder). A run folder is one that holds the marker ``gatedformer.json``
  (``{"folder": "run"}``), written as the folder is claimed: never one recognised by its names (another tool's
  ``ckpt/step-1000`` or ``config.json`` look the same, and a resume would delete or overwrite them);
* takes the run's lock, ``run.lock``: an ``flock`` the kernel drops when its holder exits, however it exits, so a
  crashed run never leaves its folder locked, while a second ``train`` (a resubmitted job, a concurrent
  ``--resume``, a second ``compare``) stops at once with the holder's pid and host instead of mixing two runs in
  one folder;
* refuses run files that are not files (a ``log.jsonl`` that is a folder, a FIFO, a link) before anything is
  written, and deletes the temp files of writes a killed holder left behind.

``compare`` claims its ``--out`` the same way (:func:`claim_comparison_folder`), with the marker
``{"folder": "comparison"}``: re-running a comparison into its own folder picks it up, a folder of the user's files
(their ``report.md``) is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path

from gatedformer.errors import InUseError, OutputError
from gatedformer.io import (
    FolderLock,
    atomic_write_json,
    make_folder,
    output_path,
    read_limited,
    remove_stale_temp_files,
)
from gatedformer.version import __version__

LOCK_FILE = "run.lock"
"""The run's lock file: who trains it now (or last did); locked while a ``train`` holds the folder."""
MARKER_FILE = "gatedformer.json"
"""What makes a folder gatedformer's: ``{"folder": "run"}`` or ``{"folder": "comparison"}`` (see the module)."""
RUN_FILES = ("config.json", "log.jsonl", "results.json", "model.safetensors", "gate_biases.safetensors",
             "vocab.json", "test.hyp.txt", "loss.png", LOCK_FILE, MARKER_FILE)
"""Files a run writes at its top level."""
RUN_FOLDERS = ("ckpt", "tensorboard")
"""Folders a run writes at its top level."""
MARKER_BYTES = 4096
"""The largest marker or lock record read (they are a line)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a regular file"


def folder_kind(path: str | Path) -> str | None:
    """What the marker of the folder ``path`` says it is (``"run"``, ``"comparison"``), or ``None`` where it holds
    no marker gatedformer wrote."""
    marker = Path(path) / MARKER_FILE
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        record = json.loads(read_limited(marker, MARKER_BYTES))
    except (OSError, ValueError):
        return None
    kind = record.get("folder") if isinstance(record, dict) else None
    return kind if isinstance(kind, str) else None


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a gatedformer run: the marker ``train`` writes as it claims the folder."""
    return folder_kind(path) == "run"


def _claim_leftover(folder: Path, name: str) -> bool:
    """Whether ``name`` in ``folder`` is what a claim killed before it wrote the marker leaves: the lock file (empty,
    or holding a lock record) or the temp file of the marker's write."""
    if name.startswith(f".{MARKER_FILE}.") and name.endswith(".part"):
        return True
    if name != LOCK_FILE:
        return False
    try:
        text = read_limited(folder / name, MARKER_BYTES)
        record = json.loads(text) if text.strip() else {"pid": 0}
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "pid" in record


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")


def _check_claimable(out_dir: Path, kind: str, what: str) -> bool:
    """Refuse ``out_dir`` unless it is missing, empty, or marked as ``kind``; whether it holds that marker."""
    if not out_dir.is_dir():
        return False
    found = folder_kind(out_dir)
    if found == kind:
        return True
    entries = sorted(name for name in os.listdir(out_dir) if not _claim_leftover(out_dir, name))
    if not entries:
        return False
    if found is not None:
        raise OutputError(f"{out_dir} is a gatedformer {found} folder, not a {kind} folder; choose another --out")
    raise OutputError(f"{out_dir} already holds files that are not a gatedformer {what} ({_shown(entries)}); a "
                      f"{what} needs a new or empty folder: choose another --out")


def _mark(out_dir: Path, kind: str) -> None:
    atomic_write_json(out_dir / MARKER_FILE, {"folder": kind, "gatedformer": __version__})


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
    if _check_claimable(out_dir, "run", "run"):
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
    if folder_kind(out_dir) != "run":
        try:
            _mark(out_dir, "run")
        except BaseException:
            release_run_folder(lock, created=False)
            raise
    return lock


def release_run_folder(lock: FolderLock, created: bool) -> None:
    """Let go of a claimed run folder. A claim that came to nothing (the run failed on its config or corpus before
    writing anything) leaves no trace: its lock file is deleted and, if the claim made the folder, the folder too,
    so a mistyped command neither litters the disk nor turns a fresh name into a "run"."""
    out_dir = lock.path.parent
    try:
        untouched = set(os.listdir(out_dir)) <= {LOCK_FILE, MARKER_FILE}
    except OSError:
        untouched = False
    if untouched:
        with contextlib.suppress(OSError):
            (out_dir / MARKER_FILE).unlink(missing_ok=True)
            lock.path.unlink()  # while still locked: a process waiting on it sees the file gone and retries
    lock.release()
    if untouched and created:
        with contextlib.suppress(OSError):
            out_dir.rmdir()


def held_here(run_dir: str | Path) -> bool:
    """Whether the run's lock file names a live process on this host other than this one: a cheap guess, without
    touching the lock, that a ``train`` there will be refused (e.g. to leave out a note that would not apply)."""
    try:
        record = json.loads(read_limited(Path(run_dir) / LOCK_FILE, MARKER_BYTES))
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


def check_comparison_folder(out: str | Path) -> Path:
    """``compare``'s ``--out`` as a path, refused (one :class:`OutputError`) unless it is new, empty or a comparison
    folder already (its marker): a comparison writes ``report.md`` and figures at its top level, which must never
    replace the user's own."""
    out_dir = output_path(out, "--out")
    _check_claimable(out_dir, "comparison", "comparison")
    return out_dir


def claim_comparison_folder(out: str | Path) -> Path:
    """Create ``compare``'s ``--out`` where missing and mark it as a comparison folder, after
    :func:`check_comparison_folder`'s check."""
    out_dir = check_comparison_folder(out)
    make_folder(out_dir, "comparison folder")
    if folder_kind(out_dir) != "comparison":
        _mark(out_dir, "comparison")
    return out_dir
