"""Turning corpus text into id arrays, and caching those arrays on disk."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import warnings
from pathlib import Path

import numpy as np

from gatedformer.io import atomic_open

from ..errors import DataError
from .paths import cache_root
from .vocab import EOS, UNK, Vocab

# Bump whenever tokenization or the cache layout changes, so stale caches are ignored.
TOKENIZER_VERSION = 1


def decode_utf8(data: bytes, path: Path | str, fix: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 4]
        raise DataError(f"{path} is not valid UTF-8 (byte offset {err.start}: {bad!r}); {fix}") from None


def require_utf8(text: str, what: str, fix: str) -> str:
    """``text`` if it is text UTF-8 can write, else one :class:`DataError` naming ``what`` and the byte: bytes that
    are not UTF-8 on the command line reach Python as lone surrogates (``\\udcff`` for the byte ``0xff``), which no
    vocabulary holds and no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        shown = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"code point U+{code:04X}"
        raise DataError(f"{what} is not valid UTF-8 text ({shown} at character {err.start}); {fix}") from None
    return text


def _lines(text: str) -> list[str]:
    # One <eos> per newline-terminated line; a whitespace-only tail after the last newline (Mikolov's char
    # files end in "\n ") is not a line, but an unterminated line with content is.
    lines = text.split("\n")
    if not lines[-1].strip():
        lines.pop()
    return lines


def _word_ids(text: str, stoi: dict[str, int], grow: bool) -> list[int]:
    unk = stoi.get(UNK)
    ids: list[int] = []
    append = ids.append
    get = stoi.get
    for line in _lines(text):
        for tok in line.split():
            i = get(tok)
            if i is None:
                # Held-out tokens map to <unk> where the corpus has one; otherwise they join the vocab.
                if not grow and unk is not None:
                    i = unk
                else:
                    i = stoi[tok] = len(stoi)
            append(i)
        i = get(EOS)
        if i is None:
            i = stoi[EOS] = len(stoi)
        append(i)
    return ids


def _dtype(n: int) -> np.dtype:
    if n <= 1 << 8:
        return np.dtype(np.uint8)
    if n <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def tokenize_lines(texts: dict[str, str], kind: str) -> tuple[Vocab, dict[str, np.ndarray]]:
    """Whitespace tokens plus <eos> per line; vocab in order of first appearance in train."""
    stoi: dict[str, int] = {}
    lists = {split: _word_ids(texts[split], stoi, grow=(split == "train")) for split in texts}
    dt = _dtype(len(stoi))
    return Vocab(tuple(stoi), kind=kind), {s: np.asarray(ids, dtype=dt) for s, ids in lists.items()}


def tokenize_chars(texts: dict[str, str]) -> tuple[Vocab, dict[str, np.ndarray]]:
    """Every character a token; vocab = all characters of all splits, sorted by code point."""
    cps = {s: np.frombuffer(t.encode("utf-32-le"), dtype="<u4") for s, t in texts.items()}
    uniq = np.unique(np.concatenate(list(cps.values())))
    dt = _dtype(len(uniq))
    ids = {s: np.searchsorted(uniq, c).astype(dt) for s, c in cps.items()}
    return Vocab(tuple(chr(int(c)) for c in uniq), kind="char"), ids


def tokenize_bytes(data: dict[str, bytes]) -> tuple[Vocab, dict[str, np.ndarray]]:
    return Vocab.bytes256(), {s: np.frombuffer(b, dtype=np.uint8).copy() for s, b in data.items()}


def split_by_position(ids: np.ndarray) -> dict[str, np.ndarray]:
    """90/5/5 by position: for 10^8 tokens that is exactly 90M / 5M / 5M."""
    n = len(ids)
    held = n // 20
    return {"train": ids[: n - 2 * held], "valid": ids[n - 2 * held : n - held], "test": ids[n - held :]}


# --- on-disk cache of token ids ------------------------------------------------------------------------


def tokens_dir() -> Path:
    return cache_root() / "tokens"


def cache_key(name: str, tokenizer: str, sources: list[dict]) -> str:
    blob = json.dumps(
        {"name": name, "tokenizer": tokenizer, "version": TOKENIZER_VERSION, "sources": sources},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _stem(name: str, key: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.")[:40] or "corpus"
    return f"{safe}-{key}"


def ids_checksum(arr: np.ndarray) -> str:
    """SHA-256 of an id array's type and values: what a cache entry records of each split, and is checked against
    when read."""
    digest = hashlib.sha256(f"{arr.dtype.str}:{len(arr)}:".encode())
    digest.update(np.ascontiguousarray(arr).tobytes())
    return digest.hexdigest()


def damaged_cache(path: Path) -> None:
    """Say once that a cache entry was damaged and is built again (it is only a cache; never used as it is)."""
    warnings.warn(f"gatedformer: the cache file {path} does not match the checksum recorded when it was written; "
                  "building it again from the corpus", stacklevel=3)


def load_cached(name: str, key: str) -> tuple[Vocab, dict[str, np.ndarray]] | None:
    """The cached vocab and ids, or None when absent, unreadable or changed since written (then the caller
    re-tokenizes and writes the entry again)."""
    stem = _stem(name, key)
    meta_path = tokens_dir() / f"{stem}.vocab.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("version") != TOKENIZER_VERSION or not isinstance(meta.get("sha256"), dict):
            return None  # an entry from before checksums were recorded is built again, silently
        vocab = Vocab.from_json(meta["vocab"])
        ids = {}
        for split, n in meta["lengths"].items():
            path = tokens_dir() / f"{stem}.{split}.npy"
            arr = np.load(path, allow_pickle=False)
            if arr.ndim != 1 or len(arr) != n or arr.dtype.kind not in "iu":
                return None
            if ids_checksum(arr) != meta["sha256"].get(split):
                damaged_cache(path)
                return None
            # A damaged cache may hold ids the vocabulary does not have: tokenize again rather than index past it.
            if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= len(vocab)):
                return None
            ids[split] = arr
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return vocab, ids


def save_cached(name: str, key: str, vocab: Vocab, ids: dict[str, np.ndarray]) -> None:
    """Write the arrays, then the vocab JSON last: its presence marks a complete entry."""
    stem = _stem(name, key)
    try:
        for split, arr in ids.items():
            with atomic_open(tokens_dir() / f"{stem}.{split}.npy") as fh:
                np.save(fh, arr, allow_pickle=False)
        meta = {
            "version": TOKENIZER_VERSION,
            "name": name,
            "lengths": {s: len(a) for s, a in ids.items()},
            "sha256": {s: ids_checksum(a) for s, a in ids.items()},
            "vocab": vocab.to_json(),
        }
        with atomic_open(tokens_dir() / f"{stem}.vocab.json", "w") as fh:
            json.dump(meta, fh, ensure_ascii=True)
    except OSError as err:
        # A read-only or full cache must not stop training; it only makes the next load slower.
        warnings.warn(f"could not write token cache in {tokens_dir()}: {err}", stacklevel=3)
        with contextlib.suppress(OSError):
            (tokens_dir() / f"{stem}.vocab.json").unlink()
