"""Downloading corpora from their public addresses (or a mirror), verified before they land."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

from gatedformer.io import FolderLock, publish, remove_stale_temp_files

from ..errors import DataError, InUseError, OutputError
from .archives import fetch_special
from .paths import ENV_MIRROR, ENV_OFFLINE, fetch_target_dir, find_file, register_first_use_fetch
from .registry import CORPORA, CorpusSpec, FileSpec, get_spec, is_text_corpus
from .squad import is_squad_json
from .verify import MANIFEST, decoded_facts, read_manifest, record_facts, verify_file

_CHUNK = 1 << 16
MULTI30K = "multi30k"  # fetched here, loaded by .translation (which imports torch)
WMT14 = "wmt14"  # fetched and prepared by .wmt14
TIMEOUT_S = 60
FETCH_LOCK = ".gatedformer-fetch.lock"
"""In a data root: held by the fetch writing into it, so that two fetches never write the same files."""


def _url_for(f: FileSpec, base_url: str | None) -> str | None:
    # A mirror has the layout of a data root: <base>/<relative path of the file>.
    if base_url:
        return base_url.rstrip("/") + "/" + urllib.parse.quote(f.path)
    return f.url


def _too_long(url: str, what: str, limit: int) -> DataError:
    return DataError(f"download of {url} {what} than the {limit} bytes the file has; it was stopped and nothing was "
                     "saved; check the address, or use another mirror (--mirror URL)")


def _download(url: str, tmp_fd: int, label: str, progress: bool, limit: int | None = None) -> tuple[str, int]:
    """Stream ``url`` into the open temp file, stopping past ``limit`` bytes (the file's known size); return
    (sha256, bytes)."""
    h = hashlib.sha256()
    n = 0
    req = urllib.request.Request(url, headers={"User-Agent": "gatedformer"})
    with os.fdopen(tmp_fd, "wb") as out, urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        length = resp.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        if limit is not None and total is not None and total > limit:
            raise _too_long(url, f"announces {total} bytes, more", limit)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, leave=False)
        try:
            while chunk := resp.read(_CHUNK):
                n += len(chunk)
                if limit is not None and n > limit:
                    raise _too_long(url, "sent more", limit)
                out.write(chunk)
                h.update(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
        out.flush()
        os.fsync(out.fileno())
    if total is not None and n != total:
        raise DataError(f"download of {url} was cut short ({n} of {total} bytes); run the fetch again")
    return h.hexdigest(), n


def _fetch_file(name: str, f: FileSpec, dest: Path, base_url: str | None, progress: bool) -> None:
    target = dest / f.path
    url = _url_for(f, base_url)
    manual = f"place the file at {target} by hand, or use a mirror (--mirror URL / {ENV_MIRROR})"
    if url is None:
        raise DataError(f"corpus {name!r} has no download address for {f.path}; {manual}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    except OSError as err:
        raise DataError(
            f"cannot write to {target.parent} ({err.strerror or err}); pass a writable --data-dir "
            "or set GATEDFORMER_DATA"
        ) from None
    gzipped = f.gzipped and url == f.url
    # The file's known size bounds what is read (a compressed download of text is smaller than the text).
    limit = None if f.size is None else f.size + f.size // 100 + 1024 if gzipped else f.size
    try:
        try:
            sha, _ = _download(url, fd, f.path, progress, limit)
        except OSError as err:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
            reason = getattr(err, "reason", None) or err.strerror or err
            raise DataError(f"could not download {url} ({reason}); {manual}") from None
        if gzipped:
            sha = _gunzip_in_place(Path(tmp), url, manual, f.size)
        wants = [(f.sha256, "known hash")] if f.sha256 else []
        listed = read_manifest(dest).get(f.path)
        if listed:
            wants.append((listed, str(dest / MANIFEST)))
        for want, source in wants:
            if sha != want:
                raise DataError(
                    f"checksum mismatch for download {url}: sha256 {sha[:16]}..., expected {want[:16]}... "
                    f"({source}); nothing was saved; retry, or {manual}"
                )
        decoded = decoded_sha = None
        if f.decoded_size is not None or f.decoded_sha256 is not None:
            try:
                decoded, decoded_sha = decoded_facts(Path(tmp), name, as_name=target.name)
            except DataError:
                decoded = None
            if decoded is None or (f.decoded_size is not None and decoded != f.decoded_size):
                got = "is not a readable archive" if decoded is None else f"decompresses to {decoded} bytes"
                raise DataError(
                    f"download of {url} is corrupt: it {got}, expected exactly {f.decoded_size} bytes; "
                    f"nothing was saved; retry, or {manual}"
                )
            if f.decoded_sha256 is not None and decoded_sha != f.decoded_sha256:
                raise DataError(
                    f"checksum mismatch for download {url}: its content has sha256 {decoded_sha[:16]}..., expected "
                    f"{f.decoded_sha256[:16]}... (known hash); nothing was saved; retry, or {manual}"
                )
        publish(tmp, target)
        record_facts(target, sha, decoded, decoded_sha)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _gunzip_in_place(path: Path, url: str, manual: str, limit: int | None = None) -> str:
    """Replace the downloaded gzip file at ``path`` by its content (stopping past ``limit`` bytes, the content's
    known size); return the content's sha256."""
    plain = path.with_name(path.name + ".plain")
    digest = hashlib.sha256()
    written = 0
    try:
        with gzip.open(path, "rb") as source, open(plain, "wb") as out:
            while chunk := source.read(_CHUNK):
                written += len(chunk)
                if limit is not None and written > limit:
                    raise DataError(f"download of {url} decompresses to more than the {limit} bytes the file has; "
                                    f"nothing was saved; retry, or {manual}")
                out.write(chunk)
                digest.update(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(plain, path)
    except (OSError, EOFError, zlib.error):  # gzip.BadGzipFile is an OSError
        raise DataError(f"download of {url} is not a readable gzip file; nothing was saved; retry, or {manual}") \
            from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(plain)
    return digest.hexdigest()


def _download_spec(name: str) -> CorpusSpec:
    if name.strip().lower() == MULTI30K:
        from .translation import multi30k_download_spec

        return multi30k_download_spec()
    try:
        return get_spec(name)
    except DataError:
        fetchable = ", ".join([*CORPORA, MULTI30K, WMT14])
        raise DataError(f"unknown corpus {name!r}; fetchable corpora: {fetchable} (see `gatedformer data list`)") \
            from None


def fetch_corpus(
    name: str, data_dir: str | Path | None = None, base_url: str | None = None, progress: bool = True
) -> Path:
    """Download the files of ``name`` that are missing or corrupt; return the data root holding them.

    Files go to ``data_dir``, else ``$GATEDFORMER_DATA``, else the user cache data dir. ``base_url`` (or
    ``$GATEDFORMER_MIRROR``) replaces the public addresses with ``<base_url>/<relative path>``.
    """
    if is_text_corpus(name):
        raise DataError(f"{name!r} is a local file, so there is nothing to fetch; load it directly")
    if is_squad_json(name):
        raise DataError(f"{name!r} is a local folder, so there is nothing to fetch; train on it directly")
    if name.strip().lower() == WMT14:  # archives, then Moses and BPE: prepared, not copied (see .wmt14)
        from .wmt14 import fetch_wmt14

        return fetch_wmt14(data_dir, base_url or os.environ.get(ENV_MIRROR) or None, progress)
    spec = _download_spec(name)
    dest = fetch_target_dir(data_dir)
    base = base_url or os.environ.get(ENV_MIRROR) or None
    wanted = []
    for f in spec.files:
        existing = find_file(dest, f.candidates)
        if existing is not None:
            try:
                verify_file(existing, f, dest, spec.name)
                continue
            except DataError:
                pass  # corrupt or truncated: download a fresh copy over it
        wanted.append(f)
    if not wanted:
        return dest
    lock = FolderLock(dest / FETCH_LOCK, f"fetch {spec.name}", remove=True)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        taken = lock.acquire()
    except (OSError, OutputError) as err:
        raise DataError(f"cannot write to {dest} ({getattr(err, 'strerror', None) or err}); pass a writable "
                        "--data-dir or set GATEDFORMER_DATA") from None
    if not taken:
        raise InUseError(f"{dest} is being fetched into by {lock.holder()}; wait for that fetch to end, then run this "
                         "one again")
    try:
        for f in wanted:  # the temp files of a fetch killed before it finished, which no one else writes now
            remove_stale_temp_files((dest / f.path).parent, [Path(f.path).name])
        for f in fetch_special(spec, wanted, dest, base):  # archives' members and built files first
            _fetch_file(spec.name, f, dest, base, progress)
    finally:
        lock.release()
    return dest


FIRST_USE_WAIT_S = 2.0
"""How often a run that needs a corpus another process is fetching looks whether that fetch has ended."""


def fetch_on_first_use(name: str, data_dir: str | Path | None, searched: list[Path]) -> Path:
    """Fetch the missing corpus ``name`` as ``data fetch`` does (verified, with a progress bar, moved into place
    atomically) and return the data root it went to; said on stderr first, since a run that was expected to start
    downloads instead. Where another process is fetching into the same folder (the ranks of a torchrun job, two
    runs started together), wait for it and use what it fetched."""
    dest = fetch_target_dir(data_dir)
    dirs = ", ".join(str(p) for p in searched)
    print(f"gatedformer: corpus {name!r} is not in {dirs}; fetching it into {dest} (what `gatedformer data fetch "
          f"{name}` does; {ENV_OFFLINE}=1 turns this off)", file=sys.stderr, flush=True)
    told = False
    while True:
        try:
            return fetch_corpus(name, data_dir, progress=True)
        except InUseError:
            if not told:
                print(f"gatedformer: another process is fetching into {dest}; waiting for it", file=sys.stderr,
                      flush=True)
                told = True
            time.sleep(FIRST_USE_WAIT_S)


register_first_use_fetch(fetch_on_first_use)
