"""`gatedformer data fetch` for the GLUE tasks, the sentence-classification sets and WikiText-103, against a local
HTTP server: members of zip archives (with fallback addresses), MRPC built from its sources, mirrors."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from gatedformer.data import archives, fetch_corpus
from gatedformer.data import glue as glue_data
from gatedformer.data.registry import CORPORA
from gatedformer.errors import DataError

RTE = {"train": "index\tsentence1\tsentence2\tlabel\n0\ta\t\"b\tentailment\n",
       "dev": "index\tsentence1\tsentence2\tlabel\n0\tc\td\tnot_entailment\n",
       "test": "index\tsentence1\tsentence2\n0\te\tf\n"}


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _zip(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def _serve_rte(monkeypatch: pytest.MonkeyPatch, served: Path, url: str, archive: bytes, members: dict[str, str],
               fallback: tuple[str, ...] = ()) -> None:
    (served / "RTE.zip").write_bytes(archive)
    spec = glue_data.GLUE_CORPORA["glue-rte"]
    files = tuple(dataclasses.replace(f, url=f"{url}/RTE.zip", sha256=_sha(members[f.member]), size=None,
                                      fallback_urls=fallback, archive_sha256=None) for f in spec.files)
    monkeypatch.setitem(CORPORA, "glue-rte", dataclasses.replace(spec, files=files))


def test_members_of_an_archive_are_fetched_and_verified(server: tuple[Path, str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    members = {f"RTE/{k}.tsv": v for k, v in RTE.items()}
    _serve_rte(monkeypatch, served, url, _zip(members), members)
    dest = tmp_path / "data"
    assert fetch_corpus("glue-rte", dest, progress=False) == dest.absolute()
    assert (dest / "glue" / "RTE" / "train.tsv").read_text() == RTE["train"]
    (served / "RTE.zip").unlink()  # everything is there and verified: nothing is downloaded again
    fetch_corpus("glue-rte", dest, progress=False)


def test_a_member_that_does_not_match_its_hash_saves_nothing(server: tuple[Path, str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    members = {f"RTE/{k}.tsv": v for k, v in RTE.items()}
    _serve_rte(monkeypatch, served, url, _zip({**members, "RTE/dev.tsv": "tampered\n"}), members)
    with pytest.raises(DataError, match=r"checksum mismatch for glue/RTE/dev.tsv") as err:
        fetch_corpus("glue-rte", tmp_path / "data", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "data" / "glue" / "RTE" / "dev.tsv").exists()
    assert not [p for p in (tmp_path / "data").rglob("*.part")]


def test_an_archive_falls_back_to_its_next_address(server: tuple[Path, str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    members = {f"RTE/{k}.tsv": v for k, v in RTE.items()}
    good = _zip(members)
    (served / "mirror").mkdir()
    (served / "mirror" / "RTE.zip").write_bytes(good)
    _serve_rte(monkeypatch, served, url, b"not a zip", members, fallback=(f"{url}/mirror/RTE.zip",))
    spec = CORPORA["glue-rte"]
    files = tuple(dataclasses.replace(f, archive_sha256=_sha(good)) for f in spec.files)
    monkeypatch.setitem(CORPORA, "glue-rte", dataclasses.replace(spec, files=files))
    fetch_corpus("glue-rte", tmp_path / "data", progress=False)
    assert (tmp_path / "data" / "glue" / "RTE" / "test.tsv").read_text() == RTE["test"]


def test_mrpc_is_built_from_its_sources(server: tuple[Path, str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\r\n"
    train = header + "1\t11\t12\tA cat .\tThe cat .\r\n0\t13\t14\t\"Quoted\tno\r\n1\t15\t16\tx\ty\r\n"
    test = header + "1\t21\t22\tp\tq\r\n0\t23\t24\tr\ts\r\n"
    ids = "13\t14\n"
    sources = {"train": train, "test": test, "dev_ids": ids}
    for part, text in sources.items():
        (served / f"{part}.txt").write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(archives, "MRPC_SOURCES", {p: (f"{url}/{p}.txt", _sha(t.encode("utf-8")))
                                                   for p, t in sources.items()})
    expected = {"train": header.replace("\r", "") + "1\t11\t12\tA cat .\tThe cat .\n1\t15\t16\tx\ty\n",
                "dev": header.replace("\r", "") + "0\t13\t14\t\"Quoted\tno\n",
                "test": "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t21\t22\tp\tq\n1\t23\t24\tr\ts\n"}
    spec = glue_data.GLUE_CORPORA["glue-mrpc"]
    files = tuple(dataclasses.replace(f, sha256=_sha(expected[Path(f.path).stem]), size=None) for f in spec.files)
    monkeypatch.setitem(CORPORA, "glue-mrpc", dataclasses.replace(spec, files=files))
    fetch_corpus("glue-mrpc", tmp_path / "data", progress=False)
    for stem, text in expected.items():
        assert (tmp_path / "data" / "glue" / "MRPC" / f"{stem}.tsv").read_bytes() == text.encode("utf-8")


def test_a_mirror_serves_the_files_themselves(server: tuple[Path, str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    served, url = server
    for stem, text in RTE.items():
        (served / "glue" / "RTE").mkdir(parents=True, exist_ok=True)
        (served / "glue" / "RTE" / f"{stem}.tsv").write_text(text)
    _serve_rte(monkeypatch, served, url + "/nowhere", b"", {f"RTE/{k}.tsv": v for k, v in RTE.items()})
    fetch_corpus("glue-rte", tmp_path / "data", base_url=url, progress=False)
    assert (tmp_path / "data" / "glue" / "RTE" / "dev.tsv").read_text() == RTE["dev"]


def test_wikitext103_is_fetched_from_its_archive_and_reads_as_words(server: tuple[Path, str], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.data import load_corpus

    served, url = server
    texts = {"train": " = Valkyria = \n the game began in 2011 .\n", "valid": " the game <unk> .\n",
             "test": " began in 2011 .\n"}
    archive = _zip({f"wikitext-103/wiki.{split}.tokens": text for split, text in texts.items()})
    (served / "wikitext-103-v1.zip").write_bytes(archive)
    (served / "mirror").mkdir()
    (served / "mirror" / "wikitext-103-v1.zip").write_bytes(archive)
    spec = CORPORA["wikitext103"]

    def serve(first: str, sha256: str) -> None:  # the canonical address first, the other as its fallback
        files = tuple(dataclasses.replace(f, url=first, fallback_urls=(f"{url}/mirror/wikitext-103-v1.zip",),
                                          archive_sha256=sha256) for f in spec.files)
        monkeypatch.setitem(CORPORA, "wikitext103", dataclasses.replace(spec, files=files))

    serve(f"{url}/wikitext-103-v1.zip", _sha(b"another archive"))  # neither copy matches: nothing is kept
    with pytest.raises(DataError, match=r"could not fetch the archive of wikitext103 .*sha256.*nothing was saved"):
        fetch_corpus("wikitext103", tmp_path / "bad", progress=False)
    assert not [p for p in (tmp_path / "bad").rglob("*") if p.is_file()]
    serve(f"{url}/gone.zip", _sha(archive))  # the first address fails; the fallback serves the archive
    dest = tmp_path / "data"
    fetch_corpus("wikitext103", dest, progress=False)
    assert (dest / "wikitext103" / "wiki.valid.tokens").read_text() == texts["valid"]
    corpus = load_corpus("wikitext103", dest)
    assert corpus.level == "word" and corpus.metric == "ppl"
    assert [corpus.vocab.itos[i] for i in corpus.test.tolist()] == ["began", "in", "2011", ".", "<eos>"]


def test_the_registry_knows_every_corpus_name_and_address() -> None:
    names = ["glue-cola", "glue-sst2", "glue-mrpc", "glue-stsb", "glue-rte", "glue-wnli", "glue-qnli", "wikitext103",
             "mr", "cr", "subj", "mpqa", "trec", "sst"]
    assert all(name in CORPORA for name in names)
    wt103 = CORPORA["wikitext103"].files[0]
    assert wt103.url.startswith("https://wikitext.smerity.com/") and wt103.fallback_urls[0].startswith(
        "https://s3.amazonaws.com/research.metamind.io/") and wt103.archive_sha256.startswith("242ba0f2")
    qnli = CORPORA["glue-qnli"].files[0]
    assert qnli.url.endswith("/QNLIv2.zip") and qnli.member == "QNLI/train.tsv"
    assert CORPORA["sst"].files[0].url.endswith("/d61ded09c99c0199d8c5bca946cd65864de2b296/data/"
                                                "stsa.binary.phrases.train")
