"""Tests for gatedformer.data: locating, verifying, caching, fetching, tokenizing and batching corpora."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import http.server
import io
import os
import shutil
import socket
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gatedformer.data import (
    CORPORA,
    Corpus,
    LMStream,
    Vocab,
    check_corpora,
    data_dir_candidates,
    fetch_corpus,
    fetch_target_dir,
    list_corpora,
    load_corpus,
    resolve_data_dir,
)
from gatedformer.data import corpora as corpora_mod
from gatedformer.data import paths as paths_mod
from gatedformer.data import tokenize as tokenize_mod
from gatedformer.data import verify as verify_mod
from gatedformer.data.registry import FileSpec
from gatedformer.errors import DataError

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(
    not (SHARED / "ptb" / "ptb.char.train.txt").is_file(),
    reason=f"real corpora not available at {SHARED} (the read-only shared data directory)",
)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and ";" in msg, msg  # problem; fix
    return msg


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Every test gets its own cache and sees no user data dirs or mirrors."""
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GATEDFORMER_DATA", raising=False)
    monkeypatch.delenv("GATEDFORMER_MIRROR", raising=False)
    monkeypatch.setenv("no_proxy", "*")


@pytest.fixture
def no_defaults(monkeypatch):
    """Hide ../shared/data so that "missing" really is missing."""
    monkeypatch.setattr(paths_mod, "project_default_dirs", lambda: [paths_mod.user_data_dir()])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install_word_corpus(monkeypatch, root: Path, texts: dict[str, str], name: str = "ptb") -> None:
    """Write a small corpus under ``root`` and register it as ``name`` with its real hashes."""
    files = []
    for split, text in texts.items():
        rel = f"{name}/{split}.txt"
        data = text.encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files.append(FileSpec(rel, split, sha(data), None, len(data)))
    monkeypatch.setitem(CORPORA, name, dataclasses.replace(CORPORA[name], files=tuple(files)))


WORDS = {
    "train": " the cat sat \n the dog <unk> sat \n\n a cat \n",
    "valid": " the bird sat \n",
    "test": " a dog \n a",
}


# --- registry and paths ----------------------------------------------------------------------------------


def test_list_corpora_has_every_corpus_with_fields():
    rows = {r["name"]: r for r in list_corpora()}
    assert {"ptb", "ptb-char", "wikitext2", "wikitext2-char", "enwik8", "text:PATH"} <= set(rows)
    assert rows["ptb"]["files"] == ["ptb/ptb.train.txt", "ptb/ptb.valid.txt", "ptb/ptb.test.txt"]
    assert (rows["ptb-char"]["level"], rows["ptb-char"]["metric"]) == ("char", "bpc")
    assert (rows["wikitext2"]["level"], rows["wikitext2"]["metric"]) == ("word", "ppl")
    assert (rows["enwik8"]["level"], rows["enwik8"]["metric"]) == ("byte", "bpc")
    assert rows["enwik8"]["urls"] == ["http://mattmahoney.net/dc/enwik8.zip"]
    for r in rows.values():
        assert set(r) >= {"name", "level", "metric", "description", "files"}


def test_unknown_corpus_lists_known_names():
    with pytest.raises(DataError) as err:
        load_corpus("penn-treebank")
    msg = one_line(err)
    for name in ("ptb", "ptb-char", "wikitext2", "wikitext2-char", "enwik8", "text:PATH"):
        assert name in msg
    with pytest.raises(DataError):
        fetch_corpus("nope", progress=False)


def test_data_dir_search_order(monkeypatch, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    work = tmp_path / "work" / "main"
    work.mkdir(parents=True)
    (tmp_path / "work" / "shared" / "data").mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("GATEDFORMER_DATA", str(b))
    # A folder the user names is the only one searched: --data-dir first, then GATEDFORMER_DATA.
    assert data_dir_candidates(a) == [a]
    assert data_dir_candidates() == [b]
    assert resolve_data_dir(a) == a
    assert resolve_data_dir() == b
    monkeypatch.delenv("GATEDFORMER_DATA")
    cands = data_dir_candidates()
    assert cands[0] == tmp_path / "work" / "shared" / "data"
    assert cands[-1] == tmp_path / "cache" / "data"
    checkout = Path(paths_mod.__file__).resolve().parents[3].parent / "shared" / "data"
    assert checkout in cands or os.path.realpath(checkout) in {os.path.realpath(c) for c in cands}
    assert resolve_data_dir() == tmp_path / "work" / "shared" / "data"


def test_a_named_data_dir_never_falls_through(monkeypatch, tmp_path, no_defaults):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    install_word_corpus(monkeypatch, b, WORDS)
    monkeypatch.setenv("GATEDFORMER_DATA", str(b))
    assert resolve_data_dir(corpus="ptb") == b
    assert load_corpus("ptb").vocab.itos[0] == "the"
    with pytest.raises(DataError) as err:
        resolve_data_dir(a, corpus="ptb")  # named, and without the corpus: no silent fallback to b
    assert str(a) in one_line(err)


def test_fetch_target_order(monkeypatch, tmp_path):
    assert fetch_target_dir() == tmp_path / "cache" / "data"
    monkeypatch.setenv("GATEDFORMER_DATA", str(tmp_path / "env"))
    assert fetch_target_dir() == tmp_path / "env"
    assert fetch_target_dir(tmp_path / "x") == tmp_path / "x"


# --- loading synthetic corpora ----------------------------------------------------------------------------


def test_word_corpus_tokens_and_vocab(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    c = load_corpus("ptb", tmp_path)
    assert isinstance(c, Corpus) and (c.level, c.metric) == ("word", "ppl")
    v = c.vocab
    assert v.itos == ("the", "cat", "sat", "<eos>", "dog", "<unk>", "a")
    # One <eos> per line, blank lines included; the unterminated "a" of test is a line too.
    assert v.decode(c.train) == "the cat sat\nthe dog <unk> sat\n\na cat\n"
    assert v.decode(c.valid) == "the <unk> sat\n"  # "bird" is not in train
    assert v.decode(c.test) == "a dog\na\n"
    assert c.train.dtype == torch.int64 and c.train.dim() == 1
    assert c.split("valid") is c.valid
    with pytest.raises(DataError):
        c.split("dev")


def test_second_load_uses_caches(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    first = load_corpus("ptb", tmp_path)

    def boom(*args, **kwargs):
        raise AssertionError("should have come from the cache")

    with monkeypatch.context() as m:
        m.setattr(corpora_mod, "_tokenize", boom)
        m.setattr(verify_mod, "sha256_file", boom)
        again = load_corpus("ptb", tmp_path)
    assert again.vocab == first.vocab
    for s in ("train", "valid", "test"):
        assert torch.equal(again.split(s), first.split(s))
    # A touched file is hashed again (the stamp is keyed by size and mtime) but still verifies.
    calls = []
    real = verify_mod.sha256_file
    monkeypatch.setattr(verify_mod, "sha256_file", lambda p: calls.append(p) or real(p))
    path = tmp_path / "ptb" / "valid.txt"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    load_corpus("ptb", tmp_path)
    assert calls == [path]


def test_tokenizer_version_invalidates_cache(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    load_corpus("ptb", tmp_path)
    calls = []
    real = corpora_mod._tokenize
    monkeypatch.setattr(corpora_mod, "_tokenize", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(tokenize_mod, "TOKENIZER_VERSION", tokenize_mod.TOKENIZER_VERSION + 1)
    load_corpus("ptb", tmp_path)
    assert calls == [1]


def test_token_cache_files_are_written_atomically(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    load_corpus("ptb", tmp_path)
    names = sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir())
    assert len(names) == 4 and not any(n.endswith(".part") for n in names)
    assert sum(n.endswith(".npy") for n in names) == 3 and sum(n.endswith(".vocab.json") for n in names) == 1


def test_missing_file_names_path_dirs_and_fix(monkeypatch, tmp_path, no_defaults):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    (tmp_path / "ptb" / "test.txt").unlink()
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    msg = one_line(err)
    assert str(tmp_path / "ptb" / "test.txt") in msg
    assert f"data dirs searched: {tmp_path}" in msg
    assert "--data-dir" in msg and "GATEDFORMER_DATA" in msg and "gatedformer data fetch ptb" in msg


def test_checksum_mismatch_after_tampering(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    load_corpus("ptb", tmp_path)  # verified once and stamped
    path = tmp_path / "ptb" / "train.txt"
    data = bytearray(path.read_bytes())
    data[1] ^= 0x20  # same size, different bytes: the stamp must not hide it
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    msg = one_line(err)
    assert "checksum mismatch" in msg and str(path) in msg
    # Loading reads the first folder holding the files: the fix must refill that one, not the user cache.
    assert f"gatedformer data fetch ptb --data-dir {tmp_path}" in msg


def test_truncated_file_is_a_mismatch(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    path = tmp_path / "ptb" / "train.txt"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    assert "checksum mismatch" in one_line(err)


def test_manifest_in_data_root_is_honoured(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    (tmp_path / "MANIFEST.sha256").write_text(f"{'0' * 64}  ptb/valid.txt\n")
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    msg = one_line(err)
    assert "checksum mismatch" in msg and "MANIFEST.sha256" in msg
    good = sha((tmp_path / "ptb" / "valid.txt").read_bytes())
    (tmp_path / "MANIFEST.sha256").write_text(f"{good}  ptb/valid.txt\n")
    assert len(load_corpus("ptb", tmp_path).valid) == 4


def test_empty_corpus_file(monkeypatch, tmp_path):
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    (tmp_path / "ptb" / "test.txt").write_bytes(b"")
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    msg = one_line(err)
    assert "empty" in msg and str(tmp_path / "ptb" / "test.txt") in msg


def test_check_corpora_reports_ok_missing_corrupt(monkeypatch, tmp_path, no_defaults):
    install_word_corpus(monkeypatch, tmp_path, WORDS, name="ptb")
    install_word_corpus(monkeypatch, tmp_path, WORDS, name="wikitext2")
    (tmp_path / "wikitext2" / "test.txt").write_bytes(b" a cat \n")
    rows = {r["name"]: r for r in check_corpora(tmp_path)}
    assert rows["ptb"]["status"] == "ok" and rows["ptb"]["path"] == str(tmp_path / "ptb")
    assert rows["wikitext2"]["status"] == "corrupt" and "checksum mismatch" in rows["wikitext2"]["detail"]
    assert rows["enwik8"]["status"] == "missing" and "gatedformer data fetch enwik8" in rows["enwik8"]["detail"]
    assert set(rows) == set(CORPORA) | {"multi30k", "wmt14"}
    assert rows["multi30k"]["status"] == rows["wmt14"]["status"] == "missing"
    assert [row["name"] for row in check_corpora(tmp_path, "PTB")] == ["ptb"]  # one corpus alone, any case


# --- text: corpora -----------------------------------------------------------------------------------------


def test_text_corpus_splits_90_5_5(tmp_path, monkeypatch):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(1000)) + "\nünï"
    f = tmp_path / "notes.txt"
    f.write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    c = load_corpus("text:notes.txt")
    n = len(text)
    assert (len(c.train), len(c.valid), len(c.test)) == (n - 2 * (n // 20), n // 20, n // 20)
    assert (c.level, c.metric) == ("char", "bpc")
    assert list(c.vocab.itos) == sorted(set(text))
    assert c.vocab.decode(torch.cat([c.train, c.valid, c.test])) == text
    # Not checksummed, but still cached; an edit is picked up.
    monkeypatch.setattr(verify_mod, "sha256_file", lambda p: pytest.fail("text: files are not hashed"))
    assert torch.equal(load_corpus(f"text:{f}").train, c.train)
    f.write_text(text.upper(), encoding="utf-8")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert c.vocab.decode(c.train) != load_corpus(f"text:{f}").vocab.decode(load_corpus(f"text:{f}").train)


def test_text_corpus_invalid_utf8_names_file_and_offset(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"hello world, this is fine " * 3 + b"\xff oops")
    with pytest.raises(DataError) as err:
        load_corpus(f"text:{f}")
    msg = one_line(err)
    assert str(f) in msg and "byte offset 78" in msg


@pytest.mark.parametrize(
    ("content", "needle"), [(b"", "empty"), (b"tiny", "too few"), (None, "not found"), (b"x", "text:")]
)
def test_text_corpus_bad_inputs(tmp_path, content, needle):
    f = tmp_path / "t.txt"
    if content is not None:
        f.write_bytes(content)
    name = "text:" if needle == "text:" else f"text:{f}"
    with pytest.raises(DataError) as err:
        load_corpus(name)
    assert needle in one_line(err)


def test_fetch_text_is_refused():
    with pytest.raises(DataError) as err:
        fetch_corpus("text:foo.txt", progress=False)
    assert "nothing to fetch" in one_line(err)


# --- enwik8 (synthetic) and fetching ------------------------------------------------------------------------


def fake_enwik8(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


def zipped(payload: bytes, member: str = "enwik8") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
    return buf.getvalue()


@pytest.fixture
def small_enwik8(monkeypatch):
    """enwik8 with the exact-size check set to 2,000 bytes."""
    n = 2000
    spec = CORPORA["enwik8"]
    # Synthetic bytes: the real zip's and content's hashes and the zip's size do not apply.
    f = dataclasses.replace(spec.files[0], decoded_size=n, sha256=None, size=None, decoded_sha256=None)
    monkeypatch.setitem(CORPORA, "enwik8", dataclasses.replace(spec, files=(f,)))
    return n


@pytest.mark.parametrize("form", ["zip", "raw"])
def test_enwik8_bytes_split(tmp_path, small_enwik8, form):
    payload = fake_enwik8(small_enwik8)
    (tmp_path / "enwik8").mkdir()
    if form == "zip":
        (tmp_path / "enwik8" / "enwik8.zip").write_bytes(zipped(payload))
    else:
        (tmp_path / "enwik8" / "enwik8").write_bytes(payload)
    c = load_corpus("enwik8", tmp_path)
    assert (c.level, c.metric, len(c.vocab)) == ("byte", "bpc", 256)
    assert (len(c.train), len(c.valid), len(c.test)) == (1800, 100, 100)
    assert bytes(torch.cat([c.train, c.valid, c.test]).tolist()) == payload


def test_enwik8_wrong_size_is_corrupt(tmp_path, small_enwik8):
    (tmp_path / "enwik8").mkdir()
    (tmp_path / "enwik8" / "enwik8.zip").write_bytes(zipped(fake_enwik8(small_enwik8 - 1)))
    with pytest.raises(DataError) as err:
        load_corpus("enwik8", tmp_path)
    msg = one_line(err)
    assert "1999" in msg and "2000" in msg and "gatedformer data fetch enwik8" in msg


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        super().do_GET()


@pytest.fixture
def mirror(tmp_path):
    """(directory, base_url) of a local HTTP server."""
    root = tmp_path / "mirror"
    root.mkdir()
    _QuietHandler.requests = []
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob("*") if p.is_file()) if d.exists() else []


def test_fetch_enwik8_from_mirror(tmp_path, mirror, small_enwik8):
    root, url = mirror
    payload = fake_enwik8(small_enwik8)
    (root / "enwik8").mkdir()
    (root / "enwik8" / "enwik8.zip").write_bytes(zipped(payload))
    dest = tmp_path / "dest"
    assert fetch_corpus("enwik8", dest, base_url=url, progress=False) == dest
    assert leftovers(dest) == ["enwik8.zip"]
    assert bytes(load_corpus("enwik8", dest).train.tolist()) == payload[:1800]
    # Present and valid: a second fetch downloads nothing.
    n = len(_QuietHandler.requests)
    fetch_corpus("enwik8", dest, base_url=url, progress=False)
    assert len(_QuietHandler.requests) == n


@pytest.mark.parametrize("bad", ["short", "not-a-zip"])
def test_fetch_corrupt_enwik8_leaves_nothing(tmp_path, mirror, small_enwik8, bad):
    root, url = mirror
    (root / "enwik8").mkdir()
    body = zipped(fake_enwik8(small_enwik8 + 5)) if bad == "short" else b"<html>not found</html>"
    (root / "enwik8" / "enwik8.zip").write_bytes(body)
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as err:
        fetch_corpus("enwik8", dest, base_url=url, progress=False)
    msg = one_line(err)
    assert "corrupt" in msg and f"{url}/enwik8/enwik8.zip" in msg and "nothing was saved" in msg
    assert leftovers(dest) == []


def test_fetch_word_corpus_checks_sha(monkeypatch, tmp_path, mirror):
    root, url = mirror
    install_word_corpus(monkeypatch, root, WORDS)  # the mirror holds the right files
    dest = tmp_path / "dest"
    monkeypatch.setenv("GATEDFORMER_MIRROR", url)
    fetch_corpus("ptb", dest, progress=True)
    assert leftovers(dest) == ["test.txt", "train.txt", "valid.txt"]
    assert load_corpus("ptb", dest).vocab.itos[:3] == ("the", "cat", "sat")
    # The mirror goes bad: a fresh fetch must refuse it and leave nothing behind.
    (root / "ptb" / "valid.txt").write_text(" the cat cat \n")
    dest2 = tmp_path / "dest2"
    with pytest.raises(DataError) as err:
        fetch_corpus("ptb", dest2, progress=False)
    msg = one_line(err)
    assert "checksum mismatch" in msg and f"{url}/ptb/valid.txt" in msg
    assert "valid.txt" not in leftovers(dest2) and not any(n.endswith(".part") for n in leftovers(dest2))


def test_fetch_replaces_a_corrupt_local_copy(monkeypatch, tmp_path, mirror):
    root, url = mirror
    install_word_corpus(monkeypatch, root, WORDS)
    dest = tmp_path / "dest"
    shutil.copytree(root / "ptb", dest / "ptb")
    (dest / "ptb" / "train.txt").write_text("garbage")
    fetch_corpus("ptb", dest, base_url=url, progress=False)
    assert _QuietHandler.requests == ["/ptb/train.txt"]
    assert len(load_corpus("ptb", dest).train) == 13


def test_fetch_network_errors(monkeypatch, tmp_path, mirror):
    _, url = mirror
    install_word_corpus(monkeypatch, tmp_path / "src", WORDS)
    with pytest.raises(DataError) as err:  # 404
        fetch_corpus("ptb", tmp_path / "d1", base_url=url + "/nowhere", progress=False)
    msg = one_line(err)
    assert f"{url}/nowhere/ptb/train.txt" in msg and "by hand" in msg and "--mirror URL" in msg
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(DataError) as err:
        fetch_corpus("ptb", tmp_path / "d2", base_url=dead, progress=False)
    assert dead in one_line(err)
    assert leftovers(tmp_path / "d1") == [] and leftovers(tmp_path / "d2") == []


def test_every_download_is_pinned_by_its_hash_and_size():
    from gatedformer.data import registry
    from gatedformer.data.translation import multi30k_download_spec

    enwik8 = registry.CORPORA["enwik8"].files[0]
    assert (enwik8.sha256, enwik8.size) == (registry.ENWIK8_ZIP_SHA256, 36_445_475)  # the zip at mattmahoney.net
    assert (enwik8.decoded_size, enwik8.decoded_sha256) == (10**8, registry.ENWIK8_SHA256)  # what it holds
    for spec in [registry.CORPORA[name] for name in ("ptb", "ptb-char", "wikitext2")] + [multi30k_download_spec()]:
        assert all(len(f.sha256 or "") == 64 and f.size for f in spec.files), spec.name


@pytest.mark.parametrize("form", ["zip", "raw"])
def test_enwik8_of_the_right_size_but_other_bytes_is_refused(tmp_path, small_enwik8, monkeypatch, form):
    good, other = fake_enwik8(small_enwik8, seed=0), fake_enwik8(small_enwik8, seed=1)
    spec = CORPORA["enwik8"]
    monkeypatch.setitem(CORPORA, "enwik8", dataclasses.replace(
        spec, files=(dataclasses.replace(spec.files[0], decoded_sha256=sha(good)),)))
    (tmp_path / "enwik8").mkdir()
    path = tmp_path / "enwik8" / ("enwik8.zip" if form == "zip" else "enwik8")
    path.write_bytes(zipped(other) if form == "zip" else other)
    with pytest.raises(DataError) as err:
        load_corpus("enwik8", tmp_path)
    assert "checksum mismatch" in one_line(err) and "its content has sha256" in str(err.value)
    path.write_bytes(zipped(good) if form == "zip" else good)
    assert bytes(load_corpus("enwik8", tmp_path).train.tolist()) == good[:1800]


class _Endless(http.server.BaseHTTPRequestHandler):
    """A server that streams bytes without end and without saying how many."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(4096):  # 256 MiB at most, should the client not stop
                self.wfile.write(b"x" * (1 << 16))


def test_a_download_stops_at_the_known_size(monkeypatch, tmp_path, mirror):
    root, url = mirror
    install_word_corpus(monkeypatch, root, WORDS)
    (root / "ptb" / "train.txt").write_bytes(b"the cat sat " * 1000)  # far more than the file has
    with pytest.raises(DataError) as err:
        fetch_corpus("ptb", tmp_path / "d1", base_url=url, progress=False)
    assert f"announces 12000 bytes, more than the {len(WORDS['train'])} bytes the file has" in one_line(err)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with pytest.raises(DataError) as err:
            fetch_corpus("ptb", tmp_path / "d2", base_url=f"http://127.0.0.1:{server.server_address[1]}",
                         progress=False)
    finally:
        server.shutdown()
        server.server_close()
    assert "sent more than the" in one_line(err) and "nothing was saved" in str(err.value)
    assert leftovers(tmp_path / "d1") == [] and leftovers(tmp_path / "d2") == []


def test_a_killed_fetch_is_cleaned_up_by_the_next_and_two_fetches_never_share_a_folder(tmp_path, mirror,
                                                                                         small_enwik8):
    from gatedformer.data.fetch import FETCH_LOCK
    from gatedformer.errors import InUseError
    from gatedformer.io import FolderLock

    root, url = mirror
    (root / "enwik8").mkdir()
    (root / "enwik8" / "enwik8.zip").write_bytes(zipped(fake_enwik8(small_enwik8)))
    dest = tmp_path / "dest"
    (dest / "enwik8").mkdir(parents=True)
    for name in (".enwik8.zip.k1lled.part", ".enwik8.zip.k2lled.part.plain", ".keep"):
        (dest / "enwik8" / name).write_bytes(b"left behind")
    lock = FolderLock(dest / FETCH_LOCK, "fetch enwik8")
    assert lock.acquire()
    try:
        with pytest.raises(InUseError, match=f"is being fetched into by process {os.getpid()} "):
            fetch_corpus("enwik8", dest, base_url=url, progress=False)
    finally:
        lock.release()
    fetch_corpus("enwik8", dest, base_url=url, progress=False)
    assert leftovers(dest) == [".keep", "enwik8.zip"]


def _small_multi30k(monkeypatch, root: Path) -> dict[str, bytes]:
    """Small Multi30K files laid out as the dataset's repository serves them under ``root``: the tokenised files
    as they are, the raw references gzip-compressed; the loader's hashes and address pointed at them."""
    import gzip

    from gatedformer.data import translation as mt

    files: dict[str, bytes] = {}
    for spec_file in mt.multi30k_download_spec().files:
        lang = spec_file.path.rsplit(".", 1)[1]
        files[spec_file.path] = f"a {lang} line of {spec_file.split}\nanother one\n".encode()
    for rel, data in files.items():
        served = root / "data" / "task1" / ("tok" if "/tok/" in rel else "raw") / Path(rel).name
        served.parent.mkdir(parents=True, exist_ok=True)
        if "/tok/" in rel:
            served.write_bytes(data)
        else:
            served.with_name(served.name + ".gz").write_bytes(gzip.compress(data))
    monkeypatch.setattr(mt, "MULTI30K_SHA256", {rel: sha(data) for rel, data in files.items()})
    return files


def test_fetch_multi30k_from_its_address_gunzips_the_raw_references(monkeypatch, tmp_path, mirror):
    from gatedformer.data import translation as mt

    root, url = mirror
    files = _small_multi30k(monkeypatch, root)
    monkeypatch.setattr(mt, "_MULTI30K_BASE", f"{url}/data/task1")
    monkeypatch.delenv("GATEDFORMER_MIRROR", raising=False)
    dest = tmp_path / "dest"
    assert fetch_corpus("multi30k", dest, progress=False) == dest
    assert len(files) == 10  # tokenised train/valid/test of en and de, raw valid/test references of both
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data, rel
    assert leftovers(dest) == sorted(Path(rel).name for rel in files)
    for pair in mt.PAIRS:  # both directions load from what was fetched
        assert mt.locate_multi30k(*pair, dest)[0] == dest
    assert sum(r.endswith(".gz") for r in _QuietHandler.requests) == 4
    requests = len(_QuietHandler.requests)
    fetch_corpus("multi30k", dest, progress=False)  # all there and verified: nothing downloaded
    assert len(_QuietHandler.requests) == requests


@pytest.mark.parametrize("bad", ["not-gzip", "other-text"])
def test_fetch_multi30k_refuses_a_bad_reference_and_keeps_nothing_of_it(monkeypatch, tmp_path, mirror, bad):
    import gzip

    from gatedformer.data import translation as mt

    root, url = mirror
    _small_multi30k(monkeypatch, root)
    served = root / "data" / "task1" / "raw" / "val.de.gz"
    served.write_bytes(b"<html>rate limited</html>" if bad == "not-gzip" else gzip.compress(b"changed\n"))
    monkeypatch.setattr(mt, "_MULTI30K_BASE", f"{url}/data/task1")
    monkeypatch.delenv("GATEDFORMER_MIRROR", raising=False)
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as err:
        fetch_corpus("multi30k", dest, progress=False)
    msg = one_line(err)
    assert f"{url}/data/task1/raw/val.de.gz" in msg and "nothing was saved" in msg
    assert ("not a readable gzip file" if bad == "not-gzip" else "checksum mismatch") in msg
    assert "val.de" not in leftovers(dest) and not any(".part" in name for name in leftovers(dest))


def test_fetch_multi30k_from_a_mirror_of_a_data_root(monkeypatch, tmp_path, mirror):
    root, url = mirror
    files = _small_multi30k(monkeypatch, tmp_path / "unused")
    for rel, data in files.items():  # a mirror holds the files as a data root stores them: decompressed
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    dest = tmp_path / "dest"
    fetch_corpus("multi30k", dest, base_url=url, progress=False)
    assert all((dest / rel).read_bytes() == data for rel, data in files.items())
    assert not any(r.endswith(".gz") for r in _QuietHandler.requests)


def test_multi30k_downloads_are_pinned_and_hashed():
    from gatedformer.data import translation as mt

    files = mt.multi30k_download_spec().files
    assert all(f.sha256 and f.url and "/a3d2e0d26b56f3846f66a952536ffed4e401d05a/" in f.url for f in files)
    assert {f.url.rsplit("/", 2)[1] for f in files if f.gzipped} == {"raw"} and sum(f.gzipped for f in files) == 4
    with pytest.raises(DataError, match="fetchable corpora: .*multi30k"):
        fetch_corpus("multi31k")


@pytest.mark.skipif(not (SHARED / "multi30k" / "tok").is_dir(), reason=f"Multi30K not available at {SHARED}")
def test_multi30k_download_hashes_match_the_real_files():
    from gatedformer.data import translation as mt
    from gatedformer.data.verify import verify_file

    for f in mt.multi30k_download_spec().files:
        verify_file(SHARED / f.path, f, SHARED, "multi30k")


# --- vocab -------------------------------------------------------------------------------------------------


def test_vocab_word_encode_decode():
    v = Vocab(("the", "cat", "<eos>", "<unk>"))
    assert v.encode("the dog\ncat") == [0, 3, 2, 1]
    assert v.decode([0, 1, 2, 1]) == "the cat\ncat"
    assert len(v) == 4 and v.stoi["cat"] == 1 and (v.eos_id, v.unk_id) == (2, 3)
    with pytest.raises(DataError) as err:
        Vocab(("the", "<eos>")).encode("the dog")
    assert "'dog'" in one_line(err)
    assert hash(v) == hash(Vocab(("the", "cat", "<eos>", "<unk>")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.itos = ()


def test_vocab_ptb_char_prompt():
    v = Vocab(tuple("acehtx_") + ("<eos>",), kind="ptb-char")
    ids = v.encode("the  cat\nax")
    assert [v.itos[i] for i in ids] == [*"the_cat", "<eos>", "a", "x"]
    assert v.decode(ids) == "the cat\nax"
    with pytest.raises(DataError) as err:
        v.encode("The")
    assert "'T'" in one_line(err)


def test_vocab_char_and_byte():
    v = Vocab(("\n", " ", "a", "b"), kind="char")
    assert v.encode("ab\n a") == [2, 3, 0, 1, 2] and v.decode([2, 3, 0]) == "ab\n"
    with pytest.raises(DataError):
        v.encode("abc")
    b = Vocab.bytes256()
    assert len(b) == 256 and b.encode("é") == [0xC3, 0xA9] and b.decode([0xC3, 0xA9, 0x41]) == "éA"
    assert b.decode([0xFF, 0x41]) == "\ufffdA"


# --- LMStream ----------------------------------------------------------------------------------------------


@st.composite
def stream_cases(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    batch = world * draw(st.integers(1, 3))
    seq = draw(st.integers(1, 9))
    T = draw(st.integers(seq + 1, seq * 4 + 3))
    extra = draw(st.integers(0, batch - 1))
    return batch * T + extra, batch, seq, world


@settings(max_examples=60, deadline=None)
@given(stream_cases())
def test_lmstream_windows_reproduce_columns(case):
    n, batch, seq, world = case
    tokens = torch.arange(n) * 3 + 1  # distinct values make every misplacement visible
    T = n // batch
    full = LMStream(tokens, batch, seq)
    xs, ys = zip(*full, strict=True)
    assert len(full) == len(xs) == -(-(T - 1) // seq)
    assert all(x.shape == (batch, seq) for x in xs[:-1]) and 1 <= xs[-1].shape[1] <= seq
    for x, y in zip(xs, ys, strict=True):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape
    X, Y = torch.cat(xs, dim=1), torch.cat(ys, dim=1)
    cols = tokens[: batch * T].view(batch, T)
    for b in range(batch):  # row b is the b-th contiguous chunk of the stream
        assert torch.equal(cols[b], tokens[b * T : (b + 1) * T])
    assert torch.equal(X, cols[:, :-1]) and torch.equal(Y, cols[:, 1:])
    assert full.n_tokens == X.numel() == batch * (T - 1)
    shards = [LMStream(tokens, batch, seq, shard=(r, world)) for r in range(world)]
    assert all(len(s) == len(full) for s in shards)
    for k in range(len(full)):  # shards partition the columns, in rank order
        assert torch.equal(torch.cat([s.window(k)[0] for s in shards]), xs[k])
        assert torch.equal(torch.cat([s.window(k)[1] for s in shards]), ys[k])
    assert sum(s.n_tokens for s in shards) == full.n_tokens
    assert [w[0].tolist() for w in full.iter_from(len(full) - 1)] == [xs[-1].tolist()]


def test_lmstream_errors():
    with pytest.raises(DataError) as err:
        LMStream(torch.arange(100), batch_size=4, seq_len=30, split="valid")
    msg = one_line(err)
    assert "valid" in msg and "100 tokens" in msg and "set data.eval_batch_size=3 or data.eval_seq_len=24" in msg
    LMStream(torch.arange(100), batch_size=4, seq_len=24)  # exactly one full window fits
    with pytest.raises(DataError) as err:
        LMStream(torch.arange(100), batch_size=6, seq_len=4, shard=(0, 4))
    assert "divisible" in one_line(err)
    with pytest.raises(DataError):
        LMStream(torch.arange(100), batch_size=4, seq_len=4, shard=(4, 4))
    with pytest.raises(IndexError):
        LMStream(torch.arange(100), batch_size=4, seq_len=4).window(7)


# --- the real corpora (cheap ones only) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("real-cache")


@needs_shared
def test_real_ptb_char(monkeypatch, real_cache):
    monkeypatch.setenv("GATEDFORMER_CACHE", str(real_cache))
    c = load_corpus("ptb-char", SHARED)
    assert len(c.vocab) == 50 and "<eos>" in c.vocab.stoi and "_" in c.vocab.stoi
    assert (len(c.train), len(c.valid), len(c.test)) == (5_017_482, 393_042, 442_423)
    assert c.vocab.decode(c.vocab.encode("the cat")) == "the cat"
    with monkeypatch.context() as m:  # the second load comes from the caches
        m.setattr(corpora_mod, "_tokenize", lambda *a: pytest.fail("re-tokenized"))
        m.setattr(verify_mod, "sha256_file", lambda p: pytest.fail("re-hashed"))
        again = load_corpus("ptb-char")
    assert torch.equal(again.train, c.train) and again.vocab == c.vocab


@needs_shared
def test_real_ptb_word(monkeypatch, real_cache):
    monkeypatch.setenv("GATEDFORMER_CACHE", str(real_cache))
    c = load_corpus("ptb", SHARED)
    assert len(c.vocab) == 10_000
    assert (len(c.train), len(c.valid), len(c.test)) == (929_589, 73_760, 82_430)
    assert c.vocab.decode(c.vocab.encode("the stock fell\n")) == "the stock fell\n"


@needs_shared
def test_real_tampered_copy_is_rejected(tmp_path):
    dest = tmp_path / "copy" / "ptb"
    dest.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        os.symlink(SHARED / "ptb" / f"ptb.{split}.txt", dest / f"ptb.{split}.txt")
    (dest / "ptb.test.txt").unlink()
    data = bytearray((SHARED / "ptb" / "ptb.test.txt").read_bytes())
    data[1000] = ord("#")
    (dest / "ptb.test.txt").write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path / "copy")
    msg = one_line(err)
    assert "checksum mismatch" in msg and str(dest / "ptb.test.txt") in msg and "data fetch ptb" in msg


def test_atomic_writes_leave_normal_permissions_and_no_temp_files(tmp_path):
    import json
    import os
    import stat

    from gatedformer.errors import OutputError
    from gatedformer.io import atomic_open, atomic_write, atomic_write_json

    def disk_full(tmp):
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    mask = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "report.json", {"a": 1})
        with atomic_open(tmp_path / "tokens.bin", durable=True) as handle:
            handle.write(b"\x00" * 10)
        with pytest.raises(RuntimeError), atomic_open(tmp_path / "broken.bin") as handle:
            handle.write(b"half")
            raise RuntimeError("interrupted")
        with pytest.raises(OutputError, match=r"^cannot write .*report.json \(No space left on device\); free space"):
            atomic_write(tmp_path / "report.json", disk_full)
        with pytest.raises(OutputError, match=r"^cannot write .*tokens.bin \(No space left on device\)"), \
                atomic_open(tmp_path / "tokens.bin") as handle:
            handle.write(b"half")
            raise OSError(28, "No space left on device")
    finally:
        os.umask(mask)
    for name in ("report.json", "tokens.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644  # not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "tokens.bin"]  # no .part left behind
    assert json.loads((tmp_path / "report.json").read_text()) == {"a": 1}  # the failed writes left the old files
    assert (tmp_path / "tokens.bin").read_bytes() == b"\x00" * 10


def test_an_unwritable_cache_only_warns(monkeypatch, tmp_path):
    # The output-folder error is an OSError too, so a cache path blocked by a file still only costs a warning.
    install_word_corpus(monkeypatch, tmp_path, WORDS)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("GATEDFORMER_CACHE", str(blocked / "cache"))
    with pytest.warns(UserWarning, match="could not write token cache"):
        corpus = load_corpus("ptb", tmp_path)
    assert corpus.train.numel() > 0


def test_make_folder_names_the_path_and_the_reason(tmp_path):
    from gatedformer.errors import OutputError
    from gatedformer.io import atomic_write_text, make_folder

    assert make_folder(tmp_path / "a" / "b").is_dir()
    assert make_folder(tmp_path / "a" / "b").is_dir()  # an existing folder is fine
    blocked = tmp_path / "a-file"
    blocked.write_text("kept")
    with pytest.raises(OutputError, match=f"^{blocked} is a file, not a folder; choose another run folder"):
        make_folder(blocked, "run folder")
    with pytest.raises(OutputError, match=r"cannot create the output folder .*a-file/x \(Not a directory\)"):
        make_folder(blocked / "x")
    with pytest.raises(OutputError, match="folder for report.md"):
        atomic_write_text(blocked / "report.md", "text")
    assert blocked.read_text() == "kept"
