"""Checksums of corpus files, remembered in a stamp so that each file is hashed once; and of the vocabulary and
tokenizer files a run or an exported model keeps beside its weights (:func:`files_checksums`, :func:`check_files`)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from gatedformer.io import atomic_open

from ..errors import CheckpointError, DataError
from .paths import cache_root
from .registry import FileSpec

FILES_KEY = "files_sha256"
"""Weights metadata (and a checkpoint's ``meta.json``): the SHA-256 of each vocabulary or tokenizer file kept beside
the weights, as JSON ``{name: sha256}``. The weights' own checksum covers their metadata, so it covers these too."""
STAMP_FILE = "verified.json"
MANIFEST = "MANIFEST.sha256"
_CHUNK = 1 << 20

_manifest_cache: dict[tuple[str, int, int], dict[str, str]] = {}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def files_checksums(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` of the files ``names`` in ``folder``, as written: what :data:`FILES_KEY` records."""
    return {name: sha256_file(folder / name) for name in sorted(names)}


def check_files(folder: Path, recorded: Any, where: str, fix: str, listed: Iterable[str] = ()) -> None:
    """Check the files of ``folder`` against the checksums ``where`` (a weights file, a ``meta.json``) recorded
    when they were written (``recorded``: :data:`FILES_KEY`'s JSON text or dictionary), so that a changed
    vocabulary is one :class:`CheckpointError` naming the file, never a model reading ids that mean other tokens.
    A file that is missing is left to the
    reader (a run may read its vocabulary from the corpus instead). Each of ``listed`` must have a checksum, so a
    file that records none (``None``) passes only where nothing is listed."""
    if recorded is None:
        recorded = {}
    try:
        table = json.loads(recorded) if isinstance(recorded, str) else recorded
    except ValueError:
        table = None
    if not isinstance(table, dict) or not all(isinstance(name, str) and isinstance(digest, str)
                                              and Path(name).name == name for name, digest in table.items()):
        raise CheckpointError(f"{where} records no readable checksums of its vocabulary files; {fix}")
    unrecorded = sorted(set(listed) - set(table))
    if unrecorded:
        raise CheckpointError(f"{where} records no checksum of {', '.join(unrecorded[:3])}; {fix}")
    for name, digest in sorted(table.items()):
        path = folder / name
        if not path.exists():
            continue
        try:
            actual = sha256_file(path) if path.is_file() else None
        except OSError as err:
            raise CheckpointError(f"cannot read {path} ({err.strerror or err}); {fix}") from None
        if actual != digest:
            raise CheckpointError(f"{path} does not match the checksum {where} recorded when it was written: it was "
                                  f"changed since, and would map the model's ids to other text; {fix}")


def read_manifest(root: Path) -> dict[str, str]:
    """``relative posix path -> sha256`` from ``root/MANIFEST.sha256`` (``sha256sum`` format), if any."""
    path = root / MANIFEST
    try:
        st = path.stat()
    except OSError:
        return {}
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _manifest_cache:
        entries: dict[str, str] = {}
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) != 2 or len(parts[0]) != 64:
                continue
            rel = parts[1].lstrip("*")
            entries[rel.removeprefix("./")] = parts[0].lower()
        _manifest_cache[key] = entries
    return _manifest_cache[key]


def _open_member(path: Path, stack: contextlib.ExitStack, corpus: str, as_name: str | None) -> BinaryIO:
    """A binary stream of the decompressed content of ``path`` (zip, gzip or plain, judged by name)."""
    name = (as_name or path.name).lower()
    if name.endswith(".zip"):
        zf = stack.enter_context(zipfile.ZipFile(path))
        names = [n for n in zf.namelist() if not n.endswith("/")]
        stem = (as_name or path.name)[: -len(".zip")]
        if stem in names:
            member = stem
        elif len(names) == 1:
            member = names[0]
        else:
            raise DataError(
                f"{path} should hold one file ({stem}) but holds {len(names)}; "
                f"re-download with `gatedformer data fetch {corpus}`"
            )
        return stack.enter_context(zf.open(member))
    if name.endswith(".gz"):
        return stack.enter_context(gzip.open(path, "rb"))
    return stack.enter_context(open(path, "rb"))


def read_decoded(path: Path, corpus: str) -> bytes:
    """The decompressed bytes of a (possibly zipped or gzipped) file; corrupt archives raise DataError."""
    try:
        with contextlib.ExitStack() as stack:
            return _open_member(path, stack, corpus, None).read()
    except (zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile) as err:
        raise DataError(
            f"{path} is corrupt ({err}); re-download with `gatedformer data fetch {corpus}`"
        ) from None


def decoded_facts(path: Path, corpus: str, as_name: str | None = None) -> tuple[int, str]:
    """Length and sha256 of the decompressed content, streamed so that big archives are not held in memory."""
    total = 0
    digest = hashlib.sha256()
    try:
        with contextlib.ExitStack() as stack:
            fh = _open_member(path, stack, corpus, as_name)
            while chunk := fh.read(_CHUNK):
                total += len(chunk)
                digest.update(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile) as err:
        raise DataError(
            f"{path} is corrupt ({err}); re-download with `gatedformer data fetch {corpus}`"
        ) from None
    return total, digest.hexdigest()


def decoded_size(path: Path, corpus: str, as_name: str | None = None) -> int:
    """Length of the decompressed content (see :func:`decoded_facts`)."""
    return decoded_facts(path, corpus, as_name)[0]


def _stamp_path() -> Path:
    return cache_root() / STAMP_FILE


def _load_stamps() -> dict[str, dict]:
    try:
        data = json.loads(_stamp_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_stamp(key: str, entry: dict) -> None:
    # Read-modify-write without a lock: a lost entry only costs one re-hash later.
    stamps = _load_stamps()
    stamps[key] = entry
    with contextlib.suppress(OSError), atomic_open(_stamp_path(), "w") as fh:
        json.dump(stamps, fh, indent=0, sort_keys=True)


def record_facts(path: Path, sha256: str, decoded: int | None = None, decoded_sha256: str | None = None) -> None:
    """Remember facts computed elsewhere (e.g. while downloading) so the next load need not re-hash."""
    st = path.stat()
    entry: dict = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if decoded is not None and decoded_sha256 is not None:
        entry["decoded_size"], entry["decoded_sha256"] = decoded, decoded_sha256
    _save_stamp(os.path.realpath(path), entry)


def file_facts(path: Path, want_decoded: bool, corpus: str) -> dict:
    """``{"sha256", "size", "mtime_ns"[, "decoded_size"]}`` of ``path``, from the stamp when it is fresh."""
    st = path.stat()
    key = os.path.realpath(path)
    entry = _load_stamps().get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
        and (not want_decoded or (isinstance(entry.get("decoded_size"), int)
                                  and isinstance(entry.get("decoded_sha256"), str)))
    ):
        return entry
    entry = {"sha256": sha256_file(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if want_decoded:
        entry["decoded_size"], entry["decoded_sha256"] = decoded_facts(path, corpus)
    _save_stamp(key, entry)
    return entry


def expected_hashes(root: Path, path: Path, fspec: FileSpec) -> list[tuple[str, str]]:
    """``(sha256, source)`` pairs the file at ``path`` must match: the registry's and the root's manifest."""
    out: list[tuple[str, str]] = []
    if fspec.sha256 and path == root / fspec.path:
        out.append((fspec.sha256, "known hash"))
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        rel = None
    listed = read_manifest(root).get(rel) if rel else None
    if listed:
        out.append((listed, f"{root / MANIFEST}"))
    return out


def verify_file(path: Path, fspec: FileSpec, root: Path, corpus: str) -> dict:
    """Check ``path`` against everything known about it; return its facts. Raises DataError if corrupt."""
    # Loading reads the first folder that holds the files, so the fresh copy must go to this one.
    fix = f"re-download it there with `gatedformer data fetch {corpus} --data-dir {root}`"
    st = path.stat()
    if st.st_size == 0:
        raise DataError(f"corpus file {path} is empty; {fix}")
    primary = path == root / fspec.path
    if primary and fspec.size is not None and st.st_size != fspec.size:
        raise DataError(
            f"checksum mismatch for {path}: {st.st_size} bytes, expected {fspec.size} "
            f"(truncated or modified); {fix}"
        )
    facts = file_facts(path, fspec.decoded_size is not None or fspec.decoded_sha256 is not None, corpus)
    for want, source in expected_hashes(root, path, fspec):
        if facts["sha256"] != want:
            raise DataError(
                f"checksum mismatch for {path}: sha256 {facts['sha256'][:16]}..., expected "
                f"{want[:16]}... ({source}); {fix}"
            )
    if fspec.decoded_size is not None and facts["decoded_size"] != fspec.decoded_size:
        raise DataError(
            f"corrupt corpus file {path}: decompresses to {facts['decoded_size']} bytes, expected "
            f"exactly {fspec.decoded_size}; {fix}"
        )
    if fspec.decoded_sha256 is not None and facts["decoded_sha256"] != fspec.decoded_sha256:
        raise DataError(
            f"checksum mismatch for {path}: its content has sha256 {facts['decoded_sha256'][:16]}..., expected "
            f"{fspec.decoded_sha256[:16]}... (known hash); {fix}"
        )
    return facts
