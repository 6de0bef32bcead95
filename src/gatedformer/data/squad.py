"""SQuAD v1.1 (Rajpurkar et al. 2016): Wikipedia paragraphs with questions whose answers are spans of them.

Two files in the v1.1 JSON format, ``{"version", "data": [{"title", "paragraphs": [{"context", "qas": [{"id",
"question", "answers": [{"text", "answer_start"}]}]}]}]}``: the registered corpus ``squad`` (the official
``train-v1.1.json`` and ``dev-v1.1.json``, ``gatedformer data fetch squad``), or a user's own data in the same format,
``squad-json:DIR`` with ``DIR/train.json`` and ``DIR/dev.json`` (another language's SQuAD, a domain set), read as
given. A file that does not read as that format is one :class:`DataError` naming the file and the entry.

Words are cut by the ``tokenizers`` library's BERT pre-tokenizer (whitespace, then every punctuation character a
token of its own), which keeps each word's character offsets into the text it was cut from: an answer is a span of
words, mapped back to the paragraph's own characters.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError
from .paths import find_file, locate
from .registry import CorpusSpec, FileSpec, get_spec
from .verify import verify_file

__all__ = ["SQUAD_CORPORA", "SQUAD_JSON_PREFIX", "Answer", "Paragraph", "Question", "SquadSplits", "is_squad_json",
           "load_squad", "read_squad_file", "tokenize_with_offsets"]

SQUAD_JSON_PREFIX = "squad-json:"
"""``squad-json:DIR``: a folder holding ``train.json`` and ``dev.json`` in the SQuAD v1.1 format."""

_BASE = "https://rajpurkar.github.io/SQuAD-explorer/dataset"
# The official files' SHA-256 and sizes. No network reaches the official address from the machines this was written
# on, so these were not hashed here: they are the values that several independent public loaders pin for the same
# two URLs (ParlAI's SQuAD task, Hugging Face's dataset metadata, which records the same byte counts, and others),
# and they agree. A download that does not match them is refused and nothing is saved.
_FILES = (
    ("train", "train-v1.1.json", "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955", 30_288_272),
    ("valid", "dev-v1.1.json", "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9", 4_854_279),
)

SQUAD_CORPORA: dict[str, CorpusSpec] = {
    "squad": CorpusSpec(
        "squad", "word", "f1",
        "SQuAD v1.1 (Rajpurkar et al. 2016): questions on Wikipedia paragraphs, answers spans of them; EM/F1 on dev "
        f"(your own data in its format: {SQUAD_JSON_PREFIX}DIR with train.json and dev.json)",
        "squad",
        tuple(FileSpec(f"squad/{name}", split, sha, f"{_BASE}/{name}", size) for split, name, sha, size in _FILES)),
}

MAX_FILE_BYTES = 1 << 31
"""A SQuAD file is read whole; past this it is refused rather than exhausting memory (the official train file is
30 MB)."""


@dataclass(frozen=True)
class Answer:
    text: str
    start: int
    """The answer's first character in its paragraph's context."""


@dataclass
class Question:
    id: str
    text: str
    answers: list[Answer]


@dataclass
class Paragraph:
    context: str
    questions: list[Question] = field(default_factory=list)
    article: int = 0
    """The index of its article in the file (``qa.max_articles`` keeps the first N)."""


@dataclass
class SquadSplits:
    train: list[Paragraph]
    dev: list[Paragraph]
    sources: dict[str, str]
    """Where each split was read from (``train``, ``dev``)."""


def is_squad_json(name: str) -> bool:
    return name.strip().lower().startswith(SQUAD_JSON_PREFIX)


def tokenize_with_offsets(text: str) -> list[tuple[str, int, int]]:
    """The words of ``text`` with their ``[start, end)`` character offsets: the ``tokenizers`` library's BERT
    pre-tokenizer (split at whitespace, and every punctuation character a word of its own)."""
    return [(word, start, end) for word, (start, end) in _pre_tokenizer().pre_tokenize_str(text)]


@functools.cache
def _pre_tokenizer() -> Any:
    # Imported where used: tokenizers is an optional dependency (the task checks for it before the first step).
    from tokenizers.pre_tokenizers import BertPreTokenizer

    return BertPreTokenizer()


def _bad(path: Path, where: str, what: str) -> DataError:
    return DataError(f"{path}: {where}: {what}; it is not a SQuAD v1.1 file (data: [{{title, paragraphs: [{{context, "
                     "qas: [{id, question, answers: [{text, answer_start}]}]}]}]), fix that entry")


def _text(value: Any, path: Path, where: str, key: str) -> str:
    if not isinstance(value, dict) or not isinstance(value.get(key), str):
        raise _bad(path, where, f"'{key}' is missing or not a string")
    return value[key]


def _list(value: Any, path: Path, where: str, key: str) -> list[Any]:
    if not isinstance(value, dict) or not isinstance(value.get(key), list):
        raise _bad(path, where, f"'{key}' is missing or not a list")
    return value[key]


def read_squad_file(path: Path, needs_answers: bool = True) -> list[Paragraph]:
    """The paragraphs of a SQuAD v1.1 file, checked entry by entry: every answer must lie inside its context (an
    answer's text that differs from the context at its start is kept as given: the official evaluation scores
    against the texts)."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DataError(f"{path} is {size / 2**30:.1f} GiB, more than a SQuAD file can be; check the file")
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror or err}); check that it exists and is readable") from None
    try:
        document = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 (byte {err.start}); a SQuAD file is UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not JSON ({err.msg} at line {err.lineno} column {err.colno}); a SQuAD file is "
                        "one JSON document") from None
    paragraphs: list[Paragraph] = []
    seen: set[str] = set()
    for a, article in enumerate(_list(document, path, "the document", "data")):
        for p, paragraph in enumerate(_list(article, path, f"data[{a}]", "paragraphs")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _text(paragraph, path, where, "context")
            kept = Paragraph(context, article=a)
            for q, qa in enumerate(_list(paragraph, path, where, "qas")):
                at = f"{where}.qas[{q}]"
                qid, question = _text(qa, path, at, "id"), _text(qa, path, at, "question")
                if qid in seen:
                    raise _bad(path, at, f"question id {qid!r} is used twice")
                seen.add(qid)
                answers = []
                for n, answer in enumerate(_list(qa, path, at, "answers")):
                    text = _text(answer, path, f"{at}.answers[{n}]", "text")
                    start = answer.get("answer_start")
                    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(context) - len(
                            text):
                        raise _bad(path, f"{at}.answers[{n}]", f"answer_start {start!r} does not place the answer "
                                   f"({len(text)} characters) inside the context ({len(context)} characters)")
                    answers.append(Answer(text, start))
                if needs_answers and not answers:
                    raise _bad(path, at, "a question without answers (SQuAD 2.0's unanswerable questions are not "
                               "read here)")
                kept.questions.append(Question(qid, question, answers))
            paragraphs.append(kept)
    if not any(p.questions for p in paragraphs):
        raise DataError(f"{path} holds no questions; give a SQuAD v1.1 file with some")
    return paragraphs


def _squad_json_files(name: str) -> dict[str, Path]:
    raw = name.strip()[len(SQUAD_JSON_PREFIX):]
    if not raw.strip():
        raise DataError(f"'{SQUAD_JSON_PREFIX}' needs a folder; use e.g. --data {SQUAD_JSON_PREFIX}my_squad "
                        "(holding train.json and dev.json)")
    folder = Path(os.path.abspath(Path(raw).expanduser()))
    if not folder.is_dir():
        raise DataError(f"{SQUAD_JSON_PREFIX}{raw}: {folder} is not a folder; point it at a folder holding train.json "
                        "and dev.json in the SQuAD v1.1 format")
    files = {"train": folder / "train.json", "dev": folder / "dev.json"}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise DataError(f"{SQUAD_JSON_PREFIX}{raw}: missing {', '.join(missing)}; the folder must hold train.json "
                        "and dev.json in the SQuAD v1.1 format")
    return files


def load_squad(name: str, data_dir: str | Path | None = None) -> SquadSplits:
    """The train and dev paragraphs of ``squad`` (verified against its checksums) or of ``squad-json:DIR``."""
    if is_squad_json(name):
        files = _squad_json_files(name)
    else:
        spec = get_spec("squad")  # the registry's entry (CORPORA holds SQUAD_CORPORA's)
        root = locate(spec, data_dir)
        files = {}
        for f in spec.files:
            path = find_file(root, f.candidates)
            assert path is not None  # locate() checked
            verify_file(path, f, root, spec.name)
            files["train" if f.split == "train" else "dev"] = path
    return SquadSplits(read_squad_file(files["train"]), read_squad_file(files["dev"]),
                       {split: str(path) for split, path in files.items()})
