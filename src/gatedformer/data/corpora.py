"""Loading, listing and checking corpora."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from . import tokenize as tok
from .paths import (
    data_dir_candidates,
    fetch_target_dir,
    find_file,
    holds,
    locate,
    missing_error,
)
from .registry import (
    CORPORA,
    SPLITS,
    TEXT_DESCRIPTION,
    TEXT_PREFIX,
    CorpusSpec,
    get_spec,
    is_text_corpus,
)
from .verify import read_decoded, verify_file
from .vocab import Vocab

LM_TOKENIZERS = ("bytes", "words", "ptb-char", "chars")
"""The tokenizers of the language-model corpora (:func:`load_corpus` reads those only)."""


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenized corpus: three 1-D int64 id streams sharing one vocabulary."""

    name: str
    level: str  # "word" | "char" | "byte"
    metric: str  # "ppl" | "bpc"
    vocab: Vocab
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor

    def split(self, which: str) -> torch.Tensor:
        if which not in SPLITS:
            raise DataError(f"unknown split {which!r}; use one of {', '.join(SPLITS)}")
        return getattr(self, which)

    def __repr__(self) -> str:
        return (
            f"Corpus(name={self.name!r}, level={self.level!r}, metric={self.metric!r}, "
            f"vocab={len(self.vocab)}, train={len(self.train)}, valid={len(self.valid)}, "
            f"test={len(self.test)})"
        )


def _tokenize(spec: CorpusSpec, paths: dict[str, Path]) -> tuple[Vocab, dict[str, np.ndarray]]:
    """Read and tokenize the (already verified) files of a registered corpus."""
    fix = f"re-download with `gatedformer data fetch {spec.name}`"
    if spec.tokenizer == "bytes":
        data = {s: read_decoded(p, spec.name) for s, p in paths.items()}
        vocab, ids = tok.tokenize_bytes(data)
    else:
        texts = {s: tok.decode_utf8(read_decoded(p, spec.name), p, fix) for s, p in paths.items()}
        if spec.tokenizer == "words":
            vocab, ids = tok.tokenize_lines(texts, kind="word")
        elif spec.tokenizer == "ptb-char":
            vocab, ids = tok.tokenize_lines(texts, kind="ptb-char")
        elif spec.tokenizer == "chars":
            vocab, ids = tok.tokenize_chars(texts)
        else:
            raise ValueError(f"corpus {spec.name!r} names unknown tokenizer {spec.tokenizer!r}")
    if spec.split_by_position:
        ids = tok.split_by_position(ids["all"])
    return vocab, ids


def _to_corpus(name: str, level: str, metric: str, vocab: Vocab, ids: dict[str, np.ndarray]) -> Corpus:
    tensors = {s: torch.from_numpy(ids[s].astype(np.int64)) for s in SPLITS}
    return Corpus(name, level, metric, vocab, tensors["train"], tensors["valid"], tensors["test"])


def _locate(spec: CorpusSpec, data_dir: str | Path | None) -> Path:
    candidates = data_dir_candidates(data_dir)
    for root in candidates:
        if holds(root, spec):
            return root
    raise missing_error(spec, candidates)  # checking: what is missing is the answer, not a reason to fetch


def load_corpus(name: str, data_dir: str | Path | None = None) -> Corpus:
    """Find, verify (once), tokenize (once, cached on disk) and return the corpus ``name``.

    ``name`` is a registered corpus (see :func:`list_corpora`) or ``text:PATH`` for a UTF-8 file.
    """
    try:
        return _load(name, data_dir)
    except OSError as err:
        where = err.filename or "a corpus file"
        raise DataError(
            f"cannot read {where} ({err.strerror or err}); check that it exists and is readable"
        ) from None


def _load(name: str, data_dir: str | Path | None) -> Corpus:
    if is_text_corpus(name):
        return _load_text(name, data_dir)
    spec = get_spec(name)
    if spec.tokenizer not in LM_TOKENIZERS:
        raise DataError(f"{spec.name} is a {spec.tokenizer} corpus of labelled sentences, not text to model; train "
                        f"on it with its own task (leave data.task empty)")
    root = locate(spec, data_dir)
    paths: dict[str, Path] = {}
    sources: list[dict] = []
    for f in spec.files:
        path = find_file(root, f.candidates)
        assert path is not None  # _locate checked
        facts = verify_file(path, f, root, spec.name)
        paths[f.split] = path
        sources.append({"split": f.split, "file": path.name, "sha256": facts["sha256"]})
    key = tok.cache_key(spec.name, spec.tokenizer, sources)
    cached = tok.load_cached(spec.name, key)
    if cached is None:
        vocab, ids = _tokenize(spec, paths)
        tok.save_cached(spec.name, key, vocab, ids)
    else:
        vocab, ids = cached
    return _to_corpus(spec.name, spec.level, spec.metric, vocab, ids)


def _find_text_file(raw: str, data_dir: str | Path | None) -> Path:
    try:
        p = Path(raw).expanduser()
    except RuntimeError:  # "~name/..." for a user this system does not know
        raise DataError(f"cannot expand {raw!r}: no home folder for that user; check the path after 'text:'") from None
    # Relative paths are tried against the working directory first, then each data root.
    roots = [] if p.is_absolute() else [Path.cwd(), *data_dir_candidates(data_dir)]
    looked = [root / p for root in roots] or [p]
    for cand in looked:
        if cand.is_file():
            return cand
        try:
            mode = cand.stat().st_mode
        except (OSError, ValueError):  # not there, or not a path (a NUL byte in it)
            continue
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise DataError(f"text: {cand} is {kind}, not a text file; point text: at a UTF-8 text file")
    where = ", ".join(str(c) for c in looked)
    raise DataError(f"text file {raw!r} not found (looked at: {where}); check the path after 'text:'")


TEXT_BYTES_PER_CHARACTER = 32
"""Memory that reading a ``text:`` file takes per character at its peak: the bytes, the string, its code points,
their sorted copy, the ids and the ids as a tensor."""


def _too_big(path: Path, size: int, memory: str) -> str:
    return (f"text file {path} ({size / 2**30:.1f} GiB) is too big to read here: a text: corpus is read into memory, "
            f"about {TEXT_BYTES_PER_CHARACTER} bytes a character, more than {memory}; use a part of it (e.g. "
            f"`head -c 1G {path} > part.txt`) or a machine with more memory")


def _check_fits_in_memory(path: Path, size: int) -> None:
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return  # the system does not say; a MemoryError is caught instead
    if memory > 0 and size * TEXT_BYTES_PER_CHARACTER > memory:
        raise DataError(_too_big(path, size, f"this machine's {memory / 2**30:.0f} GiB"))


def _load_text(name: str, data_dir: str | Path | None) -> Corpus:
    raw = name[len(TEXT_PREFIX) :]
    if not raw.strip():
        raise DataError("corpus 'text:' needs a file path; use e.g. --data text:notes.txt")
    path = _find_text_file(raw, data_dir)
    st = path.stat()
    if st.st_size == 0:
        raise DataError(f"text file {path} is empty; point text: at a file with some text in it")
    _check_fits_in_memory(path, st.st_size)
    # No checksum to verify: the key tracks the file's identity and modification instead.
    source = {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    key = tok.cache_key(name, "chars", [source])
    cached = tok.load_cached(name, key)
    if cached is None:
        try:
            text = tok.decode_utf8(
                path.read_bytes(), path, "convert it to UTF-8 (e.g. `iconv -t utf-8`) or use a different file"
            )
            if len(text) < 20:
                raise DataError(
                    f"text file {path} has only {len(text)} characters, too few for a 90/5/5 split; "
                    "use a file with at least a few thousand characters"
                )
            vocab, ids = tok.tokenize_chars({"all": text})
        except MemoryError:
            raise DataError(_too_big(path, st.st_size, "the memory left here")) from None
        ids = tok.split_by_position(ids["all"])
        tok.save_cached(name, key, vocab, ids)
    else:
        vocab, ids = cached
    return _to_corpus(name, "char", "bpc", vocab, ids)


def _all_specs() -> list[CorpusSpec]:
    """The language-model corpora and the translation corpora (Multi30K, en→de as the standard direction; WMT'14)."""
    from .translation import multi30k_spec
    from .wmt14 import wmt14_spec

    return [*CORPORA.values(), multi30k_spec("en", "de"), wmt14_spec()]


def list_corpora() -> list[dict]:
    """One dict per corpus: name, level, metric, description, files (relative to a data root), urls."""
    out = [
        {
            "name": spec.name,
            "level": spec.level,
            "metric": spec.metric,
            "description": spec.description,
            "files": [f.path for f in spec.files],
            "urls": [f.url for f in spec.files if f.url],
        }
        for spec in _all_specs()
    ]
    out.append(
        {
            "name": f"{TEXT_PREFIX}PATH",
            "level": "char",
            "metric": "bpc",
            "description": TEXT_DESCRIPTION,
            "files": [],
            "urls": [],
        }
    )
    return out


def check_corpora(data_dir: str | Path | None = None, name: str | None = None) -> list[dict]:
    """Status of every registered corpus, or of ``name`` alone: ``name``, ``status`` (ok|missing|corrupt),
    ``path``, ``detail``."""
    specs = _all_specs()
    if name is not None:
        specs = [spec for spec in specs if spec.name == name.strip().lower()]
        if not specs:
            known = ", ".join(spec.name for spec in _all_specs())
            raise DataError(f"unknown corpus {name!r}; check one of: {known} (or none, to check them all)")
    report = []
    for spec in specs:
        try:
            root = _locate(spec, data_dir)
        except DataError as err:
            where = fetch_target_dir(data_dir) / Path(spec.files[0].path).parent
            report.append({"name": spec.name, "status": "missing", "path": str(where), "detail": str(err)})
            continue
        where = root / Path(spec.files[0].path).parent
        try:
            for f in spec.files:
                path = find_file(root, f.candidates)
                assert path is not None
                verify_file(path, f, root, spec.name)
        except DataError as err:
            report.append({"name": spec.name, "status": "corrupt", "path": str(where), "detail": str(err)})
            continue
        detail = f"{len(spec.files)} file(s) verified"
        report.append({"name": spec.name, "status": "ok", "path": str(where), "detail": detail})
    return report
