"""SQuAD data: the registered corpus and its fetch (against a local HTTP server), ``squad-json:DIR``, one error line
for a malformed file, and the words' character offsets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from gatedformer.data import fetch_corpus
from gatedformer.data.registry import CORPORA
from gatedformer.data.squad import load_squad, read_squad_file, tokenize_with_offsets
from gatedformer.errors import DataError

pytest.importorskip("tokenizers")

CONTEXT = ("The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in "
           "France.")


def squad_document(contexts: list[tuple[str, list[tuple[str, str, list[str]]]]], title: str = "Normans"
                   ) -> dict[str, Any]:
    """A SQuAD v1.1 document of one article: ``contexts`` is ``[(context, [(id, question, [answer texts])])]``, each
    answer placed at its first occurrence in its context."""
    paragraphs = [{"context": context,
                   "qas": [{"id": qid, "question": question,
                            "answers": [{"text": a, "answer_start": context.index(a)} for a in answers]}
                           for qid, question, answers in qas]}
                  for context, qas in contexts]
    return {"version": "1.1", "data": [{"title": title, "paragraphs": paragraphs}]}


def write_squad(folder: Path, train: dict[str, Any], dev: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps(train), encoding="utf-8")
    (folder / "dev.json").write_text(json.dumps(dev), encoding="utf-8")
    return folder


SMALL = squad_document([(CONTEXT, [("q1", "In what country is Normandy located?", ["France", "France."]),
                                   ("q2", "When were the Normans in Normandy?", ["10th and 11th centuries"])])])


def test_a_squad_json_folder_reads_as_given(tmp_path: Path) -> None:
    folder = write_squad(tmp_path / "sq", SMALL, SMALL)
    splits = load_squad(f"squad-json:{folder}")
    assert [q.id for q in splits.train[0].questions] == ["q1", "q2"]
    first = splits.dev[0].questions[0]
    assert [(a.text, a.start) for a in first.answers] == [("France", CONTEXT.index("France")),
                                                          ("France.", CONTEXT.index("France"))]
    assert splits.sources["dev"] == str(folder / "dev.json")


@pytest.mark.parametrize(("entry", "change", "message"), [
    ("data[0].paragraphs[0].qas[1].answers[0]", lambda d: d["data"][0]["paragraphs"][0]["qas"][1]["answers"][0]
     .update(answer_start=500), r"answer_start 500 does not place the answer"),
    ("data[0].paragraphs[0].qas[0]", lambda d: d["data"][0]["paragraphs"][0]["qas"][0].pop("question"),
     r"'question' is missing"),
    ("data[0].paragraphs[0]", lambda d: d["data"][0]["paragraphs"][0].update(context=3),
     r"'context' is missing or not"),
    ("data[0].paragraphs[0].qas[1]", lambda d: d["data"][0]["paragraphs"][0]["qas"][1].update(id="q1"),
     r"question id 'q1' is used twice"),
    ("data[0].paragraphs[0].qas[0]", lambda d: d["data"][0]["paragraphs"][0]["qas"][0].update(answers=[]),
     r"a question without answers"),
])
def test_a_malformed_file_is_one_error_naming_the_file_and_the_entry(tmp_path: Path, entry: str, change: Any,
                                                                     message: str) -> None:
    bad = json.loads(json.dumps(SMALL))
    change(bad)
    folder = write_squad(tmp_path / "sq", SMALL, bad)
    with pytest.raises(DataError, match=message) as caught:
        load_squad(f"squad-json:{folder}")
    text = str(caught.value)
    assert text.startswith(f"{folder / 'dev.json'}: {entry}: ") and "\n" not in text


def test_files_that_are_not_squad_json_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(DataError, match=r"is not UTF-8"):
        read_squad_file(path)
    path.write_text("{\"data\": [", encoding="utf-8")
    with pytest.raises(DataError, match=r"is not JSON"):
        read_squad_file(path)
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(DataError, match=r"the document: 'data' is missing"):
        read_squad_file(path)
    with pytest.raises(DataError, match=r"missing .*train.json, .*dev.json"):
        load_squad(f"squad-json:{tmp_path}")
    with pytest.raises(DataError, match=r"is not a folder"):
        load_squad(f"squad-json:{tmp_path / 'nowhere'}")


def test_words_keep_their_character_offsets() -> None:
    text = "Café—in 1990s, the \"U.S.\" won 3.5%"
    words = tokenize_with_offsets(text)
    assert all(text[start:end] == word for word, start, end in words)
    assert [w for w, _, _ in words] == ["Café", "—", "in", "1990s", ",", "the", "\"", "U", ".", "S", ".", "\"", "won",
                                        "3", ".", "5", "%"]


def test_the_registry_pins_the_official_files() -> None:
    spec = CORPORA["squad"]
    assert [(f.path, f.split, f.size) for f in spec.files] == [("squad/train-v1.1.json", "train", 30_288_272),
                                                              ("squad/dev-v1.1.json", "valid", 4_854_279)]
    assert spec.files[0].url == "https://rajpurkar.github.io/SQuAD-explorer/dataset/train-v1.1.json"
    assert spec.files[1].sha256 == "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"
    with pytest.raises(DataError, match=r"is a local folder, so there is nothing to fetch"):
        fetch_corpus("squad-json:somewhere", progress=False)


def _pin(monkeypatch: pytest.MonkeyPatch, url: str, texts: dict[str, bytes]) -> None:
    """The registry's squad entry with the fixture's hashes and sizes, served from ``url``."""
    spec = CORPORA["squad"]
    files = tuple(dataclasses.replace(f, url=f"{url}/{Path(f.path).name}",
                                      sha256=hashlib.sha256(texts[Path(f.path).name]).hexdigest(),
                                      size=len(texts[Path(f.path).name])) for f in spec.files)
    monkeypatch.setitem(CORPORA, "squad", dataclasses.replace(spec, files=files))


def test_squad_is_fetched_verified_and_read(server: tuple[Path, str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    texts = {"train-v1.1.json": json.dumps(SMALL).encode(), "dev-v1.1.json": json.dumps(SMALL).encode()}
    for name, data in texts.items():
        (served / name).write_bytes(data)
    _pin(monkeypatch, url, texts)
    dest = fetch_corpus("squad", tmp_path / "data", progress=False)
    assert (dest / "squad" / "dev-v1.1.json").read_bytes() == texts["dev-v1.1.json"]
    assert [q.id for q in load_squad("squad", dest).dev[0].questions] == ["q1", "q2"]


def test_a_download_that_does_not_match_saves_nothing_and_a_mirror_serves_it(
        server: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    texts = {"train-v1.1.json": json.dumps(SMALL).encode(), "dev-v1.1.json": json.dumps(SMALL).encode()}
    _pin(monkeypatch, url, texts)
    for name, data in texts.items():  # the address serves other bytes of the same size
        (served / name).write_bytes(data.replace(b"France", b"Franc3"))
    with pytest.raises(DataError, match=r"checksum mismatch .*nothing was saved"):
        fetch_corpus("squad", tmp_path / "bad", progress=False)
    assert not [p for p in (tmp_path / "bad").rglob("*.json")]
    (served / "mirror" / "squad").mkdir(parents=True)
    for name, data in texts.items():
        (served / "mirror" / "squad" / name).write_bytes(data)
    from gatedformer.cli import main

    dest = tmp_path / "data"
    assert main(["data", "fetch", "squad", "--mirror", f"{url}/mirror", "--data-dir", str(dest), "--quiet"]) == 0
    assert (dest / "squad" / "train-v1.1.json").read_bytes() == texts["train-v1.1.json"]
    assert main(["data", "check", "squad", "--data-dir", str(dest)]) == 0
