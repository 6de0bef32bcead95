"""A corpus that is missing but fetchable is fetched on first use (as ``data fetch`` fetches it), unless offline mode
(``GATEDFORMER_OFFLINE``, else ``HF_HUB_OFFLINE``) says not to: then one line names ``gatedformer data fetch``."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import threading
from pathlib import Path

import pytest

from gatedformer.cli import main
from gatedformer.data import fetch as fetch_mod
from gatedformer.data import load_corpus
from gatedformer.data import paths as paths_mod
from gatedformer.data.registry import CORPORA, FileSpec
from gatedformer.errors import DataError
from gatedformer.io import FolderLock

TEXTS = {"train": " the cat sat \n the dog sat \n a cat \n", "valid": " the dog sat \n", "test": " a cat sat \n"}


class _Handler(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        _Handler.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A local HTTP server holding a small ``ptb`` (registered with its real hashes) in a data root's layout,
    named by ``GATEDFORMER_MIRROR``; no other data folder is searched and fetching is on."""
    root = tmp_path / "mirror"
    files = []
    for split, text in TEXTS.items():
        rel = f"ptb/{split}.txt"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
        files.append(FileSpec(rel, split, hashlib.sha256(text.encode()).hexdigest(), None, len(text.encode())))
    monkeypatch.setitem(CORPORA, "ptb", dataclasses.replace(CORPORA["ptb"], files=tuple(files)))
    monkeypatch.setattr(paths_mod, "project_default_dirs", lambda: [paths_mod.user_data_dir()])
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GATEDFORMER_DATA", raising=False)
    monkeypatch.delenv("GATEDFORMER_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("no_proxy", "*")
    _Handler.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv("GATEDFORMER_MIRROR", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield root
    finally:
        server.shutdown()
        server.server_close()


def test_a_missing_corpus_is_fetched_on_first_use(mirror: Path, capsys: pytest.CaptureFixture) -> None:
    corpus = load_corpus("ptb")
    assert corpus.vocab.itos[:3] == ("the", "cat", "sat")
    fetched = paths_mod.user_data_dir() / "ptb"
    assert sorted(p.name for p in fetched.iterdir()) == ["test.txt", "train.txt", "valid.txt"]  # no .part left
    err = capsys.readouterr().err
    assert f"corpus 'ptb' is not in {paths_mod.user_data_dir()}; fetching it into {paths_mod.user_data_dir()}" in err
    assert "gatedformer data fetch ptb" in err and "GATEDFORMER_OFFLINE=1" in err
    # Once there, it is read, never fetched again.
    asked = len(_Handler.requests)
    load_corpus("ptb")
    assert len(_Handler.requests) == asked == 3


def test_a_named_data_folder_is_where_it_goes(mirror: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    load_corpus("ptb", mine)
    assert (mine / "ptb" / "train.txt").read_text(encoding="utf-8") == TEXTS["train"]
    assert not (paths_mod.user_data_dir() / "ptb").exists()


@pytest.mark.parametrize(("env", "named"), [({"GATEDFORMER_OFFLINE": "1"}, "GATEDFORMER_OFFLINE=1"),
                                            ({"GATEDFORMER_OFFLINE": "True"}, "GATEDFORMER_OFFLINE=True"),
                                            ({"HF_HUB_OFFLINE": "yes"}, "HF_HUB_OFFLINE=yes"),
                                            ({"GATEDFORMER_OFFLINE": "on", "HF_HUB_OFFLINE": "0"},
                                             "GATEDFORMER_OFFLINE=on")])
def test_offline_mode_stops_with_one_line_naming_data_fetch(mirror: Path, monkeypatch: pytest.MonkeyPatch,
                                                            env: dict[str, str], named: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DataError) as err:
        load_corpus("ptb")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("corpus 'ptb' not found")
    assert f"{named} keeps it from being fetched on first use: run `gatedformer data fetch ptb`" in msg
    assert _Handler.requests == [] and not (paths_mod.user_data_dir() / "ptb").exists()


def test_gatedformer_offline_0_fetches_under_hf_hub_offline(mirror: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GATEDFORMER_OFFLINE", "0")
    assert len(load_corpus("ptb").train) > 0
    assert len(_Handler.requests) == 3


def test_an_unclear_offline_value_is_refused(mirror: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_OFFLINE", "maybe")
    with pytest.raises(DataError, match="GATEDFORMER_OFFLINE='maybe' is neither on nor off; set it to 1"):
        load_corpus("ptb")
    assert _Handler.requests == []


def test_the_cli_in_offline_mode_prints_one_line(mirror: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("GATEDFORMER_OFFLINE", "1")
    code = main(["train", "--recipe", "ptb-word-tiny", "--data", "ptb", "--out", str(tmp_path / "run"),
                 "--set", "train.steps=1"])
    out, err = capsys.readouterr()
    assert code != 0 and out == "" and err.count("\n") == 1, err
    assert err.startswith("gatedformer: error: corpus 'ptb' not found") and "gatedformer data fetch ptb" in err


def test_a_failed_first_use_fetch_is_one_line_and_leaves_nothing(mirror: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    (mirror / "ptb" / "valid.txt").write_text(" the cat sat \n", encoding="utf-8")  # its size, not its hash
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path / "dest")
    assert "\n" not in str(err.value) and "checksum mismatch" in str(err.value)
    assert not (tmp_path / "dest" / "ptb" / "valid.txt").exists()


def test_a_run_waits_for_another_process_fetching_the_same_folder(mirror: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    # The ranks of a torchrun job each find the corpus missing: one fetches, the others wait and read it.
    dest = paths_mod.user_data_dir()
    dest.mkdir(parents=True)
    other = FolderLock(dest / fetch_mod.FETCH_LOCK, "fetch ptb", remove=True)
    assert other.acquire()
    monkeypatch.setattr(fetch_mod, "FIRST_USE_WAIT_S", 0.05)
    timer = threading.Timer(0.3, other.release)
    timer.start()
    try:
        assert len(load_corpus("ptb").train) > 0
    finally:
        timer.join()
    assert "another process is fetching into" in capsys.readouterr().err


@pytest.mark.parametrize("corpus", ["multi30k", "wmt14"])
def test_the_translation_corpora_are_fetched_on_first_use_too(corpus: str, mirror: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.data.translation import locate_multi30k
    from gatedformer.data.wmt14 import locate_wmt14

    locate = (lambda: locate_multi30k("en", "de", tmp_path / "d")[0]) if corpus == "multi30k" else (
        lambda: locate_wmt14(tmp_path / "d"))
    monkeypatch.setenv("GATEDFORMER_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        locate()
    msg = str(err.value)
    assert "\n" not in msg and f"corpus '{corpus}' not found" in msg
    assert "GATEDFORMER_OFFLINE=1 keeps it from being fetched on first use" in msg
    assert f"gatedformer data fetch {corpus}" in msg
    # Online, the corpus goes through data fetch (here a stand-in that records the call and places the files).
    asked = []

    def fetch(name: str, data_dir: Path, searched: list[Path]) -> Path:
        from gatedformer.data.translation import multi30k_spec

        asked.append(name)
        files = [f.path for f in multi30k_spec("en", "de").files] if name == "multi30k" else ["wmt14/PREPARED.json"]
        for rel in files:
            (Path(data_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(data_dir) / rel).write_text("x\n", encoding="utf-8")
        return Path(data_dir)

    monkeypatch.setenv("GATEDFORMER_OFFLINE", "0")
    monkeypatch.setattr(paths_mod, "_first_use_fetch", [fetch])
    assert locate() == tmp_path / "d" and asked == [corpus]
