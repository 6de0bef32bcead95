"""Atomic file writes: a reader (or a crash) never sees a half-written file. Also the file-system safeguards the
other parts share: names a file system can hold, locks that die with their holder, the leftovers of killed
writes, and readers that stop at a bound."""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import math
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from gatedformer.errors import DataError, OutputError

try:
    import fcntl
except ImportError:  # not a POSIX system: no advisory locks
    fcntl = None  # type: ignore[assignment]


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
def _published_or_removed(tmp: Path, path: Path) -> Iterator[None]:
    """Rename the temp file ``tmp`` over ``path`` once the block has written it; if the block fails, remove it and
    leave ``path`` as it was (an :class:`OSError` becomes the one-line :func:`cannot_write` error)."""
    try:
        yield
        publish(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise cannot_write(path, err) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", durable: bool = False) -> Iterator[IO]:
    """Write through the yielded file to a temp file beside ``path``, then rename it over ``path``.

    With ``durable`` the data and the rename are fsynced (what a crash must not lose, such as results).
    """
    path = Path(path)
    fd, tmp = _temp_beside(path)
    with _published_or_removed(tmp, path), os.fdopen(fd, mode) as handle:
        yield handle
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    if durable:
        _fsync_dir(path.parent)


def cannot_write(path: Path, err: OSError) -> OutputError:
    """The one-line error of a write that failed, naming the file, the cause and the fix for that cause: space to
    free on a full disk, another folder on a read-only file system or without permission."""
    if isinstance(err, OutputError):
        return err
    # The reason in brackets is the system's own (``Read-only file system``); the fix follows from it.
    if err.errno == errno.EROFS:
        fix = "choose a folder on a writable file system (or remount this one read-write)"
    elif err.errno in (errno.ENOSPC, errno.EDQUOT) or "no space left" in str(err).lower():  # (a library's words)
        fix = "free space there or choose a folder on another disk"
    else:  # no permission, and what else a folder may refuse
        fix = "choose a folder you can write to"
    return OutputError(f"cannot write {path} ({err.strerror or err}); {fix}; what was written before is intact")


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary path beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    with _published_or_removed(tmp, path):
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
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


def json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot hold (a NaN, an infinity) as ``None``: Python's reader takes ``NaN``, strict
    ones (``jq``, JavaScript, most other languages) refuse the whole file."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def number(value: Any) -> float:
    """A number read back from JSON that :func:`json_safe` wrote: ``None`` (no finite value) is NaN."""
    return math.nan if value is None else float(value)


def atomic_write_json(path: str | Path, data: Any) -> Path:
    """``data`` as strict JSON (see :func:`json_safe`), written whole or not at all."""
    return atomic_write_text(path, json.dumps(json_safe(data), indent=2, sort_keys=True, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Names a file system can hold


def _name_max(path: Path) -> int:
    """The longest file name (bytes) the file system under ``path`` takes (255 where it does not say)."""
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError, ValueError):
            if folder.exists():
                return os.pathconf(folder, "PC_NAME_MAX")
    return 255


def output_path(text: str | os.PathLike[str], option: str) -> Path:
    """``text`` (a command's ``option``, e.g. ``--out``) as the path of a folder to write into; one
    :class:`OutputError` where it is empty (which would mean the current folder) or names a file or folder longer
    than the file system allows."""
    raw = os.fspath(text)
    if not str(raw).strip():
        raise OutputError(f"{option} is empty; name the folder to write into, e.g. {option} runs/first")
    path = Path(raw)
    limit = _name_max(Path(os.path.abspath(path)))
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > limit:
            raise OutputError(f"{option}: the name {part[:32]!r}… is {size} bytes long, over the {limit}-byte limit of "
                              "a file name here; choose a shorter name")
    return path


# ---------------------------------------------------------------------------------------------
# Exclusive locks that die with their holder


class FolderLock:
    """An exclusive advisory lock (``flock``) on the file ``path``, held from :meth:`acquire` until :meth:`release`
    or the holder's end: the kernel drops it when the process exits, however it exits, so a crash never leaves it
    stuck. The file records who holds it (pid, host, since when, what for), for the message a second process gets.

    ``flock`` locks are advisory: they keep out processes that ask for the same lock, i.e. other gatedformer
    commands. On a system without ``fcntl`` the lock is always granted. With ``remove`` the file is deleted on
    release (while still locked; a process that locked the deleted file sees so and tries again)."""

    def __init__(self, path: str | Path, purpose: str, remove: bool = False) -> None:
        self.path = Path(path)
        self.purpose = purpose
        self.remove = remove
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock if no one holds it; ``False`` where another process does."""
        if fcntl is None:
            return True
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as err:
                raise cannot_write(self.path, err) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except OSError as err:
                os.close(fd)
                raise OutputError(f"cannot lock {self.path} ({err.strerror or err}); the file system may not support "
                                  "locks: choose a folder on a local disk") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except OSError:
                same = False
            if same:
                break
            os.close(fd)  # the holder we waited on deleted the file as it let go: lock the one there now
        record = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                  "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        with contextlib.suppress(OSError):  # the record only names the holder; the lock is what counts
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record, sort_keys=True) + "\n").encode(), 0)
        self._fd = fd
        return True

    def holder(self) -> str:
        """Who holds the lock, as its file records it: ``process 123 on host h (train, since …)``."""
        try:
            with open(self.path, "rb") as handle:
                record = json.loads(handle.read(4096).decode("utf-8"))
            pid, host = int(record["pid"]), str(record["host"])[:100]
            what = " since ".join(str(record[key])[:60] for key in ("purpose", "since") if key in record)
        except (OSError, ValueError, KeyError, TypeError):
            return "another process (which has not recorded its name yet)"
        return f"process {pid} on host {host}" + (f" ({what})" if what else "")

    def release(self) -> None:
        if self._fd is not None:
            if self.remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None or fcntl is None


# ---------------------------------------------------------------------------------------------
# Leftovers of killed writes


def remove_stale_temp_files(folder: str | Path, names: list[str] | None = None) -> list[Path]:
    """Delete the temp files (``.<name>.<random>.part``) that writes killed before their rename left in ``folder``
    (of the files ``names`` only, if given). Call it only while holding the lock that every writer into ``folder``
    holds: a live write's temp file looks the same."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in Path(folder).iterdir():
            name = entry.name
            if not (name.startswith(".") and (name.endswith(".part") or name.endswith(".part.plain"))):
                continue
            if names is not None and not any(name.startswith(f".{target}.") for target in names):
                continue
            with contextlib.suppress(OSError):
                if entry.is_file() and not entry.is_symlink():
                    entry.unlink()
                    removed.append(entry)
    return removed


# ---------------------------------------------------------------------------------------------
# Readers with a bound


def read_limited(path: str | Path, limit: int) -> bytes:
    """The bytes of ``path``, read up to ``limit``: a :class:`ValueError` (``over N bytes``) where it holds more,
    so that a file replaced by something huge (or by ``/dev/zero``) is refused, not read until memory runs out."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"over {limit} bytes")
    return data


def bounded_lines(stream: BinaryIO, what: str, max_line_bytes: int, fix: str) -> Iterator[str]:
    """The lines of UTF-8 text read from ``stream`` as they come, each at most ``max_line_bytes`` long, split like
    ``str.splitlines``. A longer line or bytes that are not UTF-8 end it with one :class:`DataError` naming
    ``what`` (e.g. ``--input notes.txt``), the line and ``fix``."""
    number = 0
    while True:
        chunk = stream.readline(max_line_bytes + 1)
        if not chunk:
            return
        number += 1
        if len(chunk) > max_line_bytes and not chunk.endswith(b"\n"):
            raise DataError(f"line {number} of {what} is longer than {max_line_bytes} bytes; {fix}")
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"line {number} of {what} is not UTF-8 text (byte {err.start}: "
                            f"{chunk[err.start:err.start + 4]!r}); {fix}") from None
        yield from text.splitlines()



MAX_INPUT_LINE_BYTES = 1 << 16
"""The longest line a command reads as its input (``translate``'s sentences, ``classify``'s): a sentence is at most
a few hundred bytes."""


def input_lines(path: str | Path | None, fix: str) -> Iterator[str]:
    """The lines a command reads as its input, from the file ``path`` (``None``: standard input), as they come: each
    at most :data:`MAX_INPUT_LINE_BYTES` long, so that an endless input without line breaks (``/dev/zero``) is one
    clear error, not a read until memory runs out (``fix`` says what to give instead). The file is opened here, so
    one that cannot be read fails before a model is loaded."""
    if path is None:
        return bounded_lines(sys.stdin.buffer, "standard input", MAX_INPUT_LINE_BYTES, fix)
    try:
        if Path(path).is_dir():
            raise IsADirectoryError(21, "a folder, not a file")
        stream = open(path, "rb")  # noqa: SIM115 (read to its end by the generator, closed with it)
    except OSError as err:
        raise DataError(f"cannot read --input {path} ({err.strerror or err}); {fix}") from None

    def lines() -> Iterator[str]:
        with stream:
            yield from bounded_lines(stream, f"--input {path}", MAX_INPUT_LINE_BYTES, fix)

    return lines()
