"""Atomic file writes: a reader (or a crash) never sees a half-written file."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from gatedformer.errors import OutputError


def _umask() -> int:
    # os.umask can only be read by setting it; restore it at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(tmp: str | Path, path: str | Path) -> None:
    """Give a finished temp file normal permissions (mkstemp makes it 0600) and rename it into place."""
    with contextlib.suppress(OSError):
        os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def make_folder(path: str | Path, purpose: str = "output folder") -> Path:
    """Create the folder ``path`` and its parents where missing; raise :class:`OutputError` naming the path and the
    reason where it cannot be one (a file in the way, no permission, a read-only file system)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{path} is a file, not a folder; choose another {purpose}") from None
    except OSError as err:
        raise OutputError(f"cannot create the {purpose} {path} ({err.strerror or err}); "
                          "choose a path you can write to") from None
    return path


def _temp_beside(path: Path) -> tuple[int, Path]:
    make_folder(path.parent, "folder for " + path.name)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except OSError as err:
        raise OutputError(f"cannot write {path} ({err.strerror or err}); choose a path you can write to") from None
    return fd, Path(tmp_name)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", durable: bool = False) -> Iterator[IO]:
    """Write through the yielded file to a temp file beside ``path``, then rename it over ``path``.

    With ``durable`` the data and the rename are fsynced (what a crash must not lose, such as results).
    """
    path = Path(path)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        publish(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise cannot_write(path, err) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def cannot_write(path: Path, err: OSError) -> OutputError:
    """The one-line error of a write that failed (disk full, no permission), naming the file and the fix."""
    if isinstance(err, OutputError):
        return err
    return OutputError(f"cannot write {path} ({err.strerror or err}); free space there or choose a folder you "
                       "can write to; what was written before is intact")


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary path beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        publish(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise cannot_write(path, err) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; some file systems refuse to open a directory, which is fine.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
