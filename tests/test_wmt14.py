"""WMT'14 en-de: fetched from (stand-ins of) its canonical archives on a local server, checked, Moses-tokenised,
split, joint-BPE'd and cleaned; then loaded, trained on, translated and scored like Multi30K."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import random
import re
import tarfile
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from gatedformer.cli import main
from gatedformer.config import RunConfig, apply_overrides, build_config, load_recipe, validate
from gatedformer.data import translation as mt
from gatedformer.data import wmt14
from gatedformer.errors import DataError
from gatedformer.runs import load_trained
from gatedformer.tasks.translation import translate_lines
from gatedformer.train.loop import train

pytest.importorskip("sacremoses")
pytest.importorskip("tokenizers")

EN = ["the", "house", "is", "small", "big", "red", "a", "man", "sees", "dog", "well-known", "today", "car", "Mr."]
DE = {"the": "das", "house": "Haus", "is": "ist", "small": "klein", "big": "groß", "red": "rot", "a": "ein",
      "man": "Mann", "sees": "sieht", "dog": "Hund", "well-known": "bekannte", "today": "heute", "car": "Auto",
      "Mr.": "Herr"}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path):  # noqa: ANN201
    root = tmp_path / "served"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _tgz(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _sentences(rng: random.Random, count: int) -> tuple[list[str], list[str]]:
    en, de = [], []
    for _ in range(count):
        words = [rng.choice(EN) for _ in range(rng.randint(2, 7))]
        en.append(" ".join(words).capitalize() + ", “quoted” .")
        de.append(" ".join(DE[w] for w in words).capitalize() + ", „zitiert“ .")
    return en, de


@pytest.fixture
def stand_ins(server: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, dict[str, bytes]]:
    """Small archives with the real ones' member names, served where the real ones are (their checksums patched
    in); also under ``wmt14/archives/`` as a mirror serves them."""
    root, url = server
    rng = random.Random(0)
    blobs, archives = {}, {}
    for key, archive in wmt14.ARCHIVES.items():
        if archive.split == "test":
            en, de = _sentences(rng, 12)
            seg = "<srcset setid=\"newstest2014\">\n<doc>\n{}</doc>\n</srcset>\n"
            members = {archive.members["en"]: seg.format("".join(f"<seg id=\"{i}\"> {s} </seg>\n"
                                                                 for i, s in enumerate(en, 1))),
                       archive.members["de"]: seg.format("".join(f"<seg id=\"{i}\">{s.replace('.', '&amp; .')}</seg>\n"
                                                                 for i, s in enumerate(de, 1)))}
        else:
            en, de = _sentences(rng, 150)
            en.append("")  # an empty pair, dropped
            de.append("")
            en.append(" ".join(["house"] * 300))  # too long, cleaned away
            de.append(" ".join(["Haus"] * 300))
            members = {archive.members["en"]: "\n".join(en) + "\n", archive.members["de"]: "\n".join(de) + "\n"}
        blob = _tgz(members)
        blobs[key] = blob
        (root / archive.file).write_bytes(blob)
        mirrored = root / "wmt14" / "archives" / archive.file
        mirrored.parent.mkdir(parents=True, exist_ok=True)
        mirrored.write_bytes(blob)
        digest = {"sha256": hashlib.sha256(blob).hexdigest()} if archive.sha256 else {
            "md5": hashlib.md5(blob).hexdigest()}
        archives[key] = replace(archive, url=f"{url}/{archive.file}", size=len(blob) if archive.size else None,
                                **digest)
    monkeypatch.setattr(wmt14, "ARCHIVES", archives)
    return root, url, blobs


def test_fetch_prepares_the_corpus_from_its_archives(stand_ins: tuple, tmp_path: Path) -> None:
    data_root = tmp_path / "data"
    assert wmt14.fetch_wmt14(data_root, progress=False, bpe_size=120) == data_root
    folder = data_root / "wmt14"
    record = json.loads((folder / "PREPARED.json").read_text())
    lines = {name.split("/")[1]: count for name, count in record["lines"].items()}
    # 3 archives of 150 pairs, an empty one and an overlong one: the 3 empty pairs dropped, every 100th of the 453
    # others held out for validation, the 3 overlong ones cleaned away
    assert lines["valid.en"] == lines["valid.de"] == 4
    assert lines["train.en"] == lines["train.de"] == 3 * 152 - 3 - 4 - 3
    assert lines["test.en"] == lines["test.ref.de"] == 12
    train_en = (folder / "train.en").read_text().splitlines()
    assert all(0 < len(line.split()) <= 250 for line in train_en)
    assert any("@@" in line for line in train_en) and "&quot;" in " ".join(train_en)  # BPE units, Moses escapes
    assert "well @-@ known" in (folder / "train.en").read_text().replace("@@ ", "")  # aggressive hyphen split
    references = (folder / "test.ref.de").read_text().splitlines()
    assert "„zitiert“" in references[0] and "& ." in references[0]  # the SGML's text, entities undone
    detokenised = [wmt14.detokenize(line.split(), "de") for line in (folder / "test.de").read_text().splitlines()]
    # BPE units joined and Moses undone give the words back (only the punctuation is normalised: „“ become ")
    assert [re.findall(r"\w+|&", text) for text in detokenised] == [re.findall(r"\w+|&", text) for text in references]
    # prepared once: a second fetch reads the files' checksums and downloads nothing
    (tmp_path / "served" / wmt14.ARCHIVES["europarl"].file).unlink()
    assert wmt14.fetch_wmt14(data_root, progress=False, bpe_size=120) == data_root


def test_a_corrupt_archive_is_refused_and_nothing_is_kept(stand_ins: tuple, tmp_path: Path) -> None:
    root, _, blobs = stand_ins
    (root / wmt14.ARCHIVES["news-commentary"].file).write_bytes(blobs["news-commentary"][:-10] + b"0123456789")
    with pytest.raises(DataError, match=r"checksum mismatch for download .*training-parallel-nc-v9.tgz") as info:
        wmt14.fetch_wmt14(tmp_path / "data", progress=False, bpe_size=120)
    assert "\n" not in str(info.value)
    folder = tmp_path / "data" / "wmt14"
    assert not (folder / "PREPARED.json").exists() and not (folder / "train.en").exists()
    assert sorted(p.name for p in (folder / "archives").iterdir()) == sorted(
        wmt14.ARCHIVES[key].file for key in ("europarl", "commoncrawl"))  # the good ones before it are kept
    with pytest.raises(DataError, match="run `gatedformer data fetch wmt14`"):
        mt.load_translation_data(corpus="wmt14", data_dir=tmp_path / "data")


@pytest.mark.slow
def test_fetch_from_a_mirror_then_train_translate_and_score(stand_ins: tuple, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _, url, _ = stand_ins
    monkeypatch.setattr(wmt14, "BPE_SIZE", 120)
    # the mirror serves the archives; the canonical addresses are not asked
    monkeypatch.setattr(wmt14, "ARCHIVES", {k: replace(a, url="http://127.0.0.1:9/nowhere")
                                            for k, a in wmt14.ARCHIVES.items()})
    monkeypatch.setattr(wmt14, "fetch_wmt14", functools.partial(wmt14.fetch_wmt14, bpe_size=120))
    data_root = tmp_path / "data"
    assert main(["data", "fetch", "wmt14", "--data-dir", str(data_root), "--mirror", url, "--quiet"]) == 0
    assert "wmt14: ready" in capsys.readouterr().out
    (data_root / "wmt14" / "test.de").write_text((data_root / "wmt14" / "test.de").read_text() + "x\n")
    with pytest.raises(DataError, match=r"checksum mismatch for .*test.de .*data fetch wmt14"):
        mt.load_translation_data(corpus="wmt14", data_dir=data_root)
    assert main(["data", "fetch", "wmt14", "--data-dir", str(data_root), "--mirror", url, "--quiet"]) == 0

    data = mt.load_translation_data(corpus="wmt14", data_dir=data_root, min_freq=1, max_len=64, shared_vocab=True)
    assert data.src_vocab is data.tgt_vocab and data.bpe_json is not None
    assert data.valid.references[0] == wmt14.detokenize(
        [data.tgt_vocab.itos[i] for i in data.valid.tgt[0]], "de")
    config = validate(apply_overrides(RunConfig(), [
        "data.corpus=wmt14", "data.batch_size=32", "data.eval_batch_size=16", "model.d_model=16", "model.n_layers=1",
        "model.n_heads=2", "model.d_ffn=32", "translation.max_len=64", "translation.min_freq=1",
        "translation.shared_vocab=true", "model.share_embeddings=true", "model.tie_embeddings=true",
        "translation.beam_size=2", "train.steps=2", "train.eval_every=2", "train.log_every=1"]))
    result = train(config, tmp_path / "run", data_root, progress=False)
    assert result is not None and 0.0 <= result.test_metric <= 100.0
    assert (tmp_path / "run" / "bpe.json").read_text() == data.bpe_json
    run = load_trained(tmp_path / "run")  # translates with the run's own BPE model, without the corpus
    assert run.data.bpe_json == data.bpe_json
    out = translate_lines(run.model, run.config, run.data, ["The red house is well-known.", ""], beam=2)
    assert len(out) == 2 and out[1] == "" and "@@" not in out[0]

    # Every WMT'14 miniature recipe runs on the corpus as it ships (its models shrunk, one step).
    shrink = ["model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.n_layers=1", "data.eval_batch_size=16",
              "translation.max_len=32", "translation.max_tokens=256", "translation.beam_size=2",
              "translation.bleu_sentences=2", "train.steps=1", "train.eval_every=1", "train.log_every=1"]
    for name, variant in (("wmt14-tiny", "+EAU+GRC"), ("wmt14-sru-tiny", "w/ SRU (5 layers)"),
                          ("wmt14-convs2s-tiny", "ConvS2S")):
        recipe = load_recipe(name)
        sizes = [o for o in shrink if "convs2s" not in name or not o.startswith(("model.n_heads", "model.d_ffn"))]
        config = build_config(recipe, sizes, next(v for v in recipe.variants if v.name == variant))
        assert config.translation.shared_vocab and config.model.share_embeddings
        result = train(config, tmp_path / name, data_root, progress=False)
        assert result is not None and 0.0 <= result.test_metric <= 100.0, name
