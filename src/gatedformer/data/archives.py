"""Corpus files that do not come one by one from their canonical addresses: members of a zip archive (GLUE's task
archives, WikiText-103) and files built from their sources (MRPC, which GLUE does not host: its files are made from
the SentEval copies of the Microsoft Research Paraphrase Corpus and GLUE's list of dev-set pairs, as GLUE's download
script makes them).

An archive is downloaded once for all its members (from its address, then each fallback address in turn), checked
against its published SHA-256 where there is one, and each member taken out is checked against its own (and its
size) before it is moved into place; a built file likewise. Nothing unverified is ever left in the data root. A
mirror (``--mirror``) serves a data root's files themselves, so with one these files are fetched like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

from gatedformer.io import publish

from ..errors import DataError
from .registry import CorpusSpec, FileSpec
from .verify import record_facts

__all__ = ["MRPC_SOURCES", "build_mrpc", "fetch_special"]

_CHUNK = 1 << 16
TIMEOUT_S = 60
ARCHIVE_LIMIT = 1 << 31
"""The most bytes an archive download may bring (WikiText-103's is 190 MB): a server that sends on is stopped."""
# Some hosts (WikiText-103's) refuse urllib's own user agent.
_USER_AGENT = "Mozilla/5.0 (X11; Linux x86_64) gatedformer"
_SENTEVAL = "https://dl.fbaipublicfiles.com/senteval/senteval_data"
MRPC_SOURCES = {
    "train": (f"{_SENTEVAL}/msr_paraphrase_train.txt",
              "60a9b09084528f0673eedee2b69cb941920f0b8cd0eeccefc464a98768457f89"),
    "test": (f"{_SENTEVAL}/msr_paraphrase_test.txt",
             "a04e271090879aaba6423d65b94950c089298587d9c084bf9cd7439bd785f784"),
    "dev_ids": ("https://dl.fbaipublicfiles.com/glue/data/mrpc_dev_ids.tsv",
                "971d7767d81b997fd9060ade0ec23c4fc31cbb226a55d1bd4a1bac474eb81dc7"),
}
"""MRPC's sources and their SHA-256 (as TensorFlow Datasets records them)."""


def download(url: str, path: Path, limit: int) -> tuple[str, str]:
    """Stream ``url`` into ``path`` (at most ``limit`` bytes); its sha256 and md5 (what sources publish)."""
    digest, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    count = 0
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(path, "wb") as out:
        length = response.headers.get("Content-Length")
        if length and length.isdigit() and int(length) > limit:
            raise DataError(f"{url} announces {int(length)} bytes, more than the {limit} expected; nothing was saved")
        while chunk := response.read(_CHUNK):
            count += len(chunk)
            if count > limit:
                raise DataError(f"{url} sent more than the {limit} bytes expected; it was stopped and nothing was "
                                "saved")
            out.write(chunk)
            digest.update(chunk)
            md5.update(chunk)
        if length and length.isdigit() and count != int(length):
            raise DataError(f"download of {url} was cut short ({count} of {length} bytes); run the fetch again")
    return digest.hexdigest(), md5.hexdigest()


def _download_first(urls: tuple[str, ...], path: Path, limit: int, want: str | None, name: str) -> str:
    """Download the first of ``urls`` that answers (and, with ``want``, whose bytes hash to it) into ``path``."""
    failures = []
    for url in urls:
        try:
            sha = download(url, path, limit)[0]
        except OSError as err:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
            failures.append(f"{url}: {getattr(err, 'reason', None) or err.strerror or err}")
            continue
        if want is not None and sha != want:
            failures.append(f"{url}: sha256 {sha[:16]}..., expected {want[:16]}...")
            continue
        return url
    raise DataError(f"could not fetch {name} ({'; '.join(failures)}); nothing was saved; retry later, or use a mirror "
                    "(--mirror URL)")


def _place(dest: Path, f: FileSpec, write: Callable[[Path], None], corpus: str, source: str) -> None:
    """Write ``f`` by ``write(tmp)`` beside its place, check its size and sha256, then move it into place."""
    target = dest / f.path
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        size = tmp.stat().st_size
        if f.size is not None and size != f.size:
            raise DataError(f"{f.path} from {source} has {size} bytes, expected {f.size}; nothing was saved; retry, "
                            f"or fetch {corpus} from a mirror (--mirror URL)")
        digest = hashlib.sha256()
        with open(tmp, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        sha = digest.hexdigest()
        if f.sha256 is not None and sha != f.sha256:
            raise DataError(f"checksum mismatch for {f.path} from {source}: sha256 {sha[:16]}..., expected "
                            f"{f.sha256[:16]}...; nothing was saved; retry, or use a mirror (--mirror URL)")
        publish(tmp, target)
        record_facts(target, sha)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _extract(archive: zipfile.ZipFile, member: str, limit: int | None, url: str) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise DataError(f"{url} holds no {member}; nothing was saved; retry, or use a mirror (--mirror URL)") \
                from None
        if limit is not None and info.file_size > limit:
            raise DataError(f"{member} in {url} unpacks to {info.file_size} bytes, more than its {limit}; nothing "
                            "was saved")
        with archive.open(info) as source, open(tmp, "wb") as out:
            count = 0
            while chunk := source.read(_CHUNK):
                count += len(chunk)
                if limit is not None and count > limit:
                    raise DataError(f"{member} in {url} unpacks to more than its {limit} bytes; nothing was saved")
                out.write(chunk)
    return write


def _fetch_archive(spec: CorpusSpec, files: list[FileSpec], dest: Path) -> None:
    first = files[0]
    urls = (first.url, *first.fallback_urls)  # type: ignore[arg-type]
    dest.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest, prefix=f".{spec.name}.", suffix=".zip.part")
    os.close(fd)
    tmp = Path(name)
    try:
        url = _download_first(urls, tmp, ARCHIVE_LIMIT, first.archive_sha256, f"the archive of {spec.name}")
        try:
            with zipfile.ZipFile(tmp) as archive:
                for f in files:
                    _place(dest, f, _extract(archive, f.member, f.size, url), spec.name, url)  # type: ignore[arg-type]
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise DataError(f"{url} is not a readable zip archive ({err}); nothing was saved; retry, or use a mirror "
                            "(--mirror URL)") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _lines(text: str) -> list[str]:
    # Lines end as a text-mode file's do (\n, \r\n or \r), never at the other characters str.splitlines takes.
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def build_mrpc(train_source: str, test_source: str, dev_ids: str) -> dict[str, str]:
    """GLUE's MRPC ``train.tsv``, ``dev.tsv`` and ``test.tsv`` from the SentEval files' text: the header line goes to
    train and dev as it is, each row to dev if its pair of ids is in ``dev_ids`` (one ``id1<TAB>id2`` a line), else
    to train; the test rows lose their label to an ``index`` counted from 0 under a header of its own."""
    pairs = {tuple(line.strip().split("\t")) for line in _lines(dev_ids) if line.strip()}
    lines = _lines(train_source)
    if not lines:
        raise DataError("msr_paraphrase_train.txt is empty; nothing was saved; retry the fetch")
    train, dev = [lines[0] + "\n"], [lines[0] + "\n"]
    for number, line in enumerate(lines[1:], start=2):
        fields = line.strip().split("\t")
        if len(fields) != 5:
            raise DataError(f"msr_paraphrase_train.txt line {number}: {len(fields)} fields, not 5; nothing was saved")
        (dev if (fields[1], fields[2]) in pairs else train).append("\t".join(fields) + "\n")
    test = ["index\t#1 ID\t#2 ID\t#1 String\t#2 String\n"]
    for index, line in enumerate(_lines(test_source)[1:]):
        fields = line.strip().split("\t")
        if len(fields) != 5:
            raise DataError(f"msr_paraphrase_test.txt line {index + 2}: {len(fields)} fields, not 5; nothing was saved")
        test.append("\t".join([str(index), *fields[1:]]) + "\n")
    return {"train": "".join(train), "dev": "".join(dev), "test": "".join(test)}


def _fetch_mrpc(spec: CorpusSpec, files: list[FileSpec], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    texts = {}
    with tempfile.TemporaryDirectory(dir=dest, prefix=".mrpc-sources.") as folder:
        for part, (url, sha256) in MRPC_SOURCES.items():
            path = Path(folder) / part
            _download_first((url,), path, 1 << 24, sha256, f"MRPC's {part} source")
            # Read as the download script does: UTF-8 text, the byte-order mark kept as text of the header line.
            texts[part] = path.read_text(encoding="utf-8")
    built = build_mrpc(texts["train"], texts["test"], texts["dev_ids"])
    for f in files:
        stem = Path(f.path).stem
        _place(dest, f, lambda tmp, text=built[stem]: tmp.write_text(text, encoding="utf-8", newline="\n"),
               spec.name, "MRPC's sources")


def fetch_special(spec: CorpusSpec, wanted: list[FileSpec], dest: Path, mirror: str | None) -> list[FileSpec]:
    """Fetch the files of ``wanted`` that come out of an archive or are built from sources (none with a ``mirror``,
    which serves them as they are); return the others, for a fetch one by one."""
    if mirror:
        return wanted
    if spec.name == "glue-mrpc":
        _fetch_mrpc(spec, [f for f in wanted if f.path.startswith("glue/MRPC/")], dest)
        return [f for f in wanted if not f.path.startswith("glue/MRPC/")]
    members = [f for f in wanted if f.member is not None]
    for url in dict.fromkeys(f.url for f in members):
        _fetch_archive(spec, [f for f in members if f.url == url], dest)
    return [f for f in wanted if f.member is None]
