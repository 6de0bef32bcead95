"""Sentence classification with SRU: the loaders (Latin-1 files, byte 0x85 inside a line, cross-validation folds),
pretrained word vectors, training to the best validation accuracy, and the comparison over sets and folds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA, needs_shared

from gatedformer.config import build_config, load_recipe
from gatedformer.data import sentclass as sc
from gatedformer.data.registry import CORPORA
from gatedformer.errors import DataError
from gatedformer.tasks.sentclass import read_word_vectors
from gatedformer.train.loop import train

pytestmark = pytest.mark.usefixtures("one_thread_module")


POSITIVE, NEGATIVE = ["good", "great", "fine", "nice"], ["bad", "awful", "poor", "dull"]
FILLER = ["the", "film", "was", "very", "a", "plot", "and", "story"]


def _lines(n: int, seed: int) -> list[str]:
    generator = np.random.default_rng(seed)
    out = []
    for i in range(n):
        label = i % 2
        words = list(generator.choice(FILLER, 5)) + [generator.choice((NEGATIVE, POSITIVE)[label])]
        generator.shuffle(words)
        out.append(f"{label} {' '.join(words)}")
    return out


@pytest.fixture
def sentence_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MR and TREC as small files laid out like the real ones (MR Latin-1, with byte 0x85 inside a line)."""
    root = tmp_path / "data"
    (root / "sentclass" / "MR").mkdir(parents=True)
    (root / "sentclass" / "TREC").mkdir(parents=True)
    mr = _lines(200, 0)
    mr[3] = "1 the film\x85 was very good"
    (root / "sentclass" / "MR" / "rt-polarity.all").write_bytes(("\n".join(mr) + "\n").encode("latin-1"))
    trec = [line.replace("0 ", "4 ", 1) if i % 3 == 0 else line for i, line in enumerate(_lines(240, 1))]
    (root / "sentclass" / "TREC" / "TREC.train.all").write_bytes(("\n".join(trec[:200]) + "\n").encode("latin-1"))
    (root / "sentclass" / "TREC" / "TREC.test.all").write_text("\n".join(trec[200:]) + "\n")
    for name in ("mr", "trec"):
        spec = sc.SENTCLASS_CORPORA[name]
        loose = dataclasses.replace(spec, files=tuple(dataclasses.replace(f, sha256=None, size=None)
                                                      for f in spec.files))
        monkeypatch.setitem(sc.SENTCLASS_CORPORA, name, loose)
        monkeypatch.setitem(CORPORA, name, loose)
    return root


def test_latin1_byte_0x85_stays_inside_its_line_and_folds_partition(sentence_root: Path) -> None:
    folds = [sc.load_sentences("mr", sentence_root, folds=5, fold=k) for k in range(5)]
    assert all(len(f.train) + len(f.valid) + len(f.test) == 200 for f in folds)
    tests = [tuple(w) for f in folds for w, _ in f.test]
    assert len(tests) == 200  # every example is tested once
    # One example (U+0085 separates two of its words, as any whitespace), not two lines.
    assert sum(words == ["the", "film", "was", "very", "good"] for words, _ in folds[0].train + folds[0].valid
               + folds[0].test) == 1
    assert folds[1].valid == folds[2].test  # the fold after the test fold validates
    trec = sc.load_sentences("trec", sentence_root)
    assert (len(trec.train), len(trec.valid), len(trec.test)) == (180, 20, 40)


def test_a_malformed_line_names_file_and_line(sentence_root: Path) -> None:
    path = sentence_root / "sentclass" / "MR" / "rt-polarity.all"
    path.write_bytes(path.read_bytes().replace(b"1 the film\x85", b"x the film\x85", 1))
    with pytest.raises(DataError, match=r"rt-polarity.all line 4: expected '<label 0-1> <text>'"):
        sc.load_sentences("mr", sentence_root)


@needs_shared("sentclass/MR/rt-polarity.all", "sentclass/SUBJ/subj.all", "sentclass/TREC/TREC.train.all",
              "sentclass/SST/stsa.binary.phrases.train", "sentclass/CR/custrev.all", "sentclass/MPQA/mpqa.all")
def test_the_real_sets_hold_kims_counts() -> None:
    sizes = {"mr": 10662, "cr": 3775, "subj": 10000, "mpqa": 10606}
    for name, size in sizes.items():
        splits = sc.load_sentences(name, SHARED_DATA)
        assert len(splits.train) + len(splits.valid) + len(splits.test) == size, name
    trec = sc.load_sentences("trec", SHARED_DATA)
    assert len(trec.train) + len(trec.valid) == 5452 and len(trec.test) == 500
    assert trec.test[0][0][0] == "How"  # TREC keeps its case
    sst = sc.load_sentences("sst", SHARED_DATA)
    assert (len(sst.train), len(sst.valid), len(sst.test)) == (76961, 872, 1821)


def test_word_vectors_of_both_formats(tmp_path: Path) -> None:
    word2vec = tmp_path / "w2v.txt"
    word2vec.write_text("3 2\ngood 0.5 1\nbad -1 0.25\nother 9 9\n")
    found, size = read_word_vectors(word2vec, {"good", "bad", "missing"})
    assert size == 2 and set(found) == {"good", "bad"} and found["bad"].tolist() == [-1.0, 0.25]
    glove = tmp_path / "glove.txt"
    glove.write_text("good 1 2 3\nbad 4 5\n")
    with pytest.raises(DataError, match=r"glove.txt line 2: 2 numbers where the file's vectors have 3"):
        read_word_vectors(glove, {"good"})


def _overrides(corpus: str, steps: int = 40) -> list[str]:
    return [f"data.corpus={corpus}", "model.d_model=16", "sentclass.embedding_dim=16", "sentclass.folds=3",
            f"train.steps={steps}", "train.eval_every=10", "train.log_every=10", "optim.lr=0.01", "data.batch_size=16"]


def test_training_reports_test_accuracy_at_the_best_validation_accuracy(sentence_root: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    vectors = tmp_path / "vectors.txt"
    vectors.write_text("".join(f"{w} {' '.join(['1'] * 16 if w in POSITIVE else ['-1'] * 16)}\n"
                               for w in POSITIVE + NEGATIVE))
    config = build_config(load_recipe("sentclass-sru-tiny"), _overrides("mr") + [f"sentclass.word_vectors={vectors}"])
    result = train(config, tmp_path / "run", data_dir=sentence_root, progress=False)
    assert result is not None and result.valid_metric > 0.9 and result.test_metric > 0.8
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["accuracy"] == saved["test_metric"] and saved["set"] == "mr"
    evaluations = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert saved["valid_metric"] == max(r["valid_accuracy"] for r in evaluations if r["event"] == "eval")
    lines = (tmp_path / "run" / "test_predictions.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction\tlabel" and len(lines) == 1 + 67  # the test fold of 200 in 3
    from safetensors.torch import load_file

    table = load_file(str(tmp_path / "run" / "model.safetensors"))["embedding.weight"]
    words = json.loads((tmp_path / "run" / "vocab.json").read_text())["words"]
    assert table[words.index("good")].tolist() == [1.0] * 16  # pretrained and kept fixed
    assert (table[words.index("film")].abs() <= 0.25).all()

    # The run's recorded words, not the corpus's, index the evaluated split; the export needs no corpus at all.
    import gatedformer
    from gatedformer.runs import evaluate_run

    scores = evaluate_run(tmp_path / "run", "test", data_dir=sentence_root, device="cpu")
    assert scores["accuracy"] == pytest.approx(saved["test_metric"])
    exported = gatedformer.load(tmp_path / "run", device="cpu", data_dir=sentence_root).save_pretrained(
        tmp_path / "export")
    model = gatedformer.from_pretrained(exported, device="cpu")
    assert model.data.words == words

    # New text classified as the test split was scored: the same predictions, sentence by sentence
    test = sc.load_sentences("mr", sentence_root, folds=3, fold=0).test
    predicted = model.classify([" ".join(w) for w, _ in test], batch_size=5)
    assert model.labels == ("negative", "positive") and not model.reads_pairs
    right = sum(p == model.labels[y] for p, (_, y) in zip(predicted, test, strict=True))
    assert right / len(test) == pytest.approx(scores["accuracy"])
    assert model.classify("The film was GREAT!") == "positive" and model.classify("a very dull plot.") == "negative"
    chances = model.classify(["the plot was awful", ""], probabilities=True)  # "": one unknown word, as in training
    assert list(chances[0]) == ["negative", "positive"] and chances[0]["negative"] > 0.5
    assert sum(chances[1].values()) == pytest.approx(1.0)
    with pytest.raises(DataError, match=r"input 2 is tuple .* reads one sentence at a time"):
        model.classify(["good", ("good", "bad")])
    from gatedformer.cli import main

    (tmp_path / "lines.txt").write_text("The film was GREAT!\n\na very dull plot.\n")
    assert main(["classify", "--run", str(tmp_path / "run"), "--input", str(tmp_path / "lines.txt"),
                 "--probabilities", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in out] == ["positive", "", "negative"]
    assert 0.5 < float(out[0].split("\t")[1]) <= 1.0
    assert main(["classify", "--run", str(tmp_path / "run"), "--input", str(tmp_path / "lines.txt"),
                 "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "gatedformer: error: --batch-size must be at least 1, got 0"


def test_new_text_reads_as_each_sets_files_write_theirs() -> None:
    split_clitics = {"it", "'s", "does", "n't", "work", "great", "!", "(", ")", "...", "."}
    assert sc.words_of("It's GREAT!", sc.sentence_set("sst"), split_clitics) == ["it", "'s", "great", "!"]
    assert sc.words_of("It doesn't work...", sc.sentence_set("cr"), split_clitics) == \
        ["it", "does", "n't", "work", "..."]
    whole = {"it's", "doesn't", "work", "great", "."}  # MR writes "it's" and "doesn't" as one word
    assert sc.words_of("It's great. It doesn't (work)", sc.sentence_set("mr"), whole) == \
        ["it's", "great", ".", "it", "doesn't", "(", "work", ")"]
    assert sc.words_of("How many people", sc.sentence_set("trec"), {"How"}) == ["How", "many", "people"]  # cased
    assert sc.words_of(" \t ", sc.sentence_set("mr"), whole) == []
    assert [s.classes for s in sc.SENTCLASS_SETS.values()] == [2, 2, 2, 2, 6, 2]


@needs_shared("sentclass/MR/rt-polarity.all", "sentclass/CR/custrev.all", "sentclass/SUBJ/subj.all",
              "sentclass/MPQA/mpqa.all", "sentclass/TREC/TREC.train.all", "sentclass/TREC/TREC.test.all",
              "sentclass/SST/stsa.binary.phrases.train", "sentclass/SST/stsa.binary.dev",
              "sentclass/SST/stsa.binary.test")
def test_every_sentence_of_the_real_sets_reads_back_as_its_own_words() -> None:
    for s in sc.SENTCLASS_SETS.values():
        splits = sc.load_sentences(s.name, SHARED_DATA)
        examples = splits.train + splits.valid + splits.test
        known = {w for words, _ in examples for w in words}
        assert all(sc.words_of(" ".join(words), s, known) == words for words, _ in examples), s.name
        if s.name == "sst":  # SST writes clitics apart, MR keeps them on the word
            assert sc.words_of("It's a gripping, funny film!", s, known) == \
                ["it", "'s", "a", "gripping", ",", "funny", "film", "!"]
        if s.name == "mr":
            assert sc.words_of("It's a gripping, funny film!", s, known) == \
                ["it's", "a", "gripping", ",", "funny", "film", "!"]


def test_comparison_covers_every_set_and_fold(sentence_root: Path, tmp_path: Path) -> None:
    from gatedformer.analysis.sentclass import run_sentclass_comparison

    report = run_sentclass_comparison(load_recipe("sentclass-sru-tiny"), tmp_path / "cmp",
                                      overrides=_overrides("mr", 10)[1:] + ["sentclass.sets=mr trec"],
                                      data_dir=sentence_root, progress=False)
    text = report.report_path.read_text()
    assert "| MR (movie review polarity) | 3 folds |" in text and "| TREC (question type) | 1 seed(s) |" in text
    assert "83.1" in text and "94.8" in text
    assert sorted(p.name for p in (tmp_path / "cmp" / "SRU-2-layers" / "mr").iterdir()) == ["fold-0", "fold-1",
                                                                                            "fold-2"]
