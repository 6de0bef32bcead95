"""Extractive question answering on SQuAD v1.1 with DrQA's document reader (:mod:`gatedformer.models.reader`), its
recurrent layers SRUs (the SRU paper's §4.2 and appendix B.2) or bi-LSTMs (DrQA's).

Data (:mod:`gatedformer.data.squad`): ``squad`` or ``squad-json:DIR``, the train and dev files, the first
``qa.max_articles`` articles of each where that is set. Words are the ``tokenizers`` library's BERT pre-tokenizer's
(each with its character offsets). The vocabulary is ``<pad>``, ``<unk>``, the training questions' words by
frequency, then the training paragraphs' other words; with ``qa.word_vectors`` (GloVe or word2vec text) also the dev
words that have a vector, the words it has start from their vectors and only the ``qa.tune_top_k`` most frequent
question words' vectors train (DrQA's). A training question whose answer covers no whole word is left out (DrQA
does the same); the first answer is the target.

Batches: ``data.batch_size`` questions of paragraphs of like lengths (each epoch, a fresh random order, sorted by
paragraph length and cut into batches, whose order is shuffled too), so little is padding; the loss is the start's
plus the end's cross-entropy, a mean over the batch. Under data parallelism (``torchrun``) rank ``r`` of ``W`` takes
the batch's questions ``r, r + W, ...`` and weighs each by ``W / batch``, so that the ranks' gradients, averaged,
are the whole batch's (a rank left without a question by the epoch's last, shorter batch reads one at weight 0).
Every evaluation decodes the whole dev set — the best span with
``start <= end <= start + qa.max_span`` words, mapped back to the paragraph's own characters — and scores it with the
official v1.1 exact match and F1 (:mod:`gatedformer.tasks.squad_eval`, in percent). The best evaluation by F1 is
kept: ``predictions.json`` (the official format, ``{question id: answer}``) and ``best_model.safetensors``, its
weights. SQuAD's test set is hidden, so the run reports the dev set as the papers do: ``results.json`` holds the best
evaluation's ``exact_match`` and ``f1``, and its ``valid_*`` and ``test_*`` are both that evaluation's dev scores.

A trained reader answers users' questions (:func:`answer_questions`, which ``Pretrained.answer`` and
``gatedformer answer`` call): each a span of its paragraph of at most ``qa.max_span + 1`` words, with its characters
in the paragraph and its probability.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.config import RunConfig
from gatedformer.data.squad import (
    SQUAD_CORPORA,
    SQUAD_JSON_PREFIX,
    Paragraph,
    Question,
    load_squad,
    tokenize_with_offsets,
)
from gatedformer.devices import autocast
from gatedformer.errors import CheckpointError, ConfigError, DataError
from gatedformer.fused import fuse
from gatedformer.io import atomic_write, input_lines, read_limited
from gatedformer.models import build_backbone
from gatedformer.models.reader import FEATURES
from gatedformer.tasks.base import Task, TrainBatch, by_length, evaluating, register_task, rng
from gatedformer.tasks.best import BestEvaluation
from gatedformer.tasks.sentclass import read_word_vectors
from gatedformer.tasks.squad_eval import best_spans, score_predictions

__all__ = ["MAX_CONTEXT_CHARS", "MAX_QUESTION_CHARS", "PREDICTIONS_FILE", "QAData", "QASplit",
           "QuestionAnsweringTask", "answer_lines", "answer_questions", "check_question", "encode_split",
           "question_lines", "read_context"]

PAD, UNK = "<pad>", "<unk>"
VOCAB_FILE = "vocab.json"
"""A run's (and an export's) words, in the order of the embedding's rows, with the embedding size."""
PREDICTIONS_FILE = "predictions.json"
BEST_WEIGHTS_FILE = "best_model.safetensors"
_ORDER_STREAM = 7
MAX_CONTEXT_CHARS = 1 << 16
"""The longest paragraph a reader answers about at once (SQuAD's are under 4,000 characters): a whole book would
take minutes and answer nothing a paragraph would not."""
MAX_QUESTION_CHARS = 1 << 12
_INPUT_FIX = ('give one JSON object a line, {"context": "the paragraph", "question": "the question"} (an "id" is '
              "copied to the answer)")


@dataclass
class EncodedParagraph:
    context: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    words: list[str]
    tf: list[float]
    """Each word's lower-cased count in the paragraph over the paragraph's length."""


@dataclass
class Example:
    qid: str
    paragraph: int
    question: list[int]
    question_words: frozenset[str]
    question_lower: frozenset[str]
    target: tuple[int, int] | None
    """The first answer's first and last word, ``None`` where it covers no whole word."""
    answers: list[str]


@dataclass
class QASplit:
    paragraphs: list[EncodedParagraph] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)


@dataclass
class QAData:
    words: list[str]
    train: QASplit
    dev: QASplit
    embedding_dim: int
    fixed_from: int | None
    """The first embedding row that does not train (``None``: all train)."""
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    shard: tuple[int, int] = (0, 1)
    """``(rank, world)`` of a data-parallel run: this rank trains on its share of each batch."""
    best: BestEvaluation = field(default_factory=lambda: BestEvaluation("valid_f1"))
    _index: dict[str, int] | None = field(default=None, repr=False)

    @property
    def vocab(self) -> list[str]:
        """The words, in the order of the embedding's rows."""
        return self.words

    def index(self) -> dict[str, int]:
        """Each word's row (built once: answering reads it for every question)."""
        if self._index is None or len(self._index) != len(self.words):
            self._index = {w: i for i, w in enumerate(self.words)}
        return self._index


def _words(text: str) -> list[tuple[str, int, int]]:
    # An empty text reads as one unknown word, so that every paragraph and question has a state to attend to.
    return tokenize_with_offsets(text) or [("", 0, 0)]


def _span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """The first and last word that the characters ``[start, end)`` cover part of, ``None`` if none."""
    covered = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
    return (covered[0], covered[-1]) if covered else None


def encode_split(paragraphs: Sequence[Paragraph], index: dict[str, int]) -> QASplit:
    """Every question of ``paragraphs`` as word ids of ``index`` (unknown words: ``<unk>``)."""
    unk = index[UNK]
    split = QASplit()
    for paragraph in paragraphs:
        words = _words(paragraph.context)
        lower = [w.lower() for w, _, _ in words]
        counts = Counter(lower)
        offsets = [(s, e) for _, s, e in words]
        split.paragraphs.append(EncodedParagraph(
            paragraph.context, [index.get(w, unk) for w, _, _ in words], offsets, [w for w, _, _ in words],
            [counts[w] / len(words) for w in lower]))
        for question in paragraph.questions:
            q = [w for w, _, _ in _words(question.text)]
            first = question.answers[0] if question.answers else None
            target = None if first is None else _span(offsets, first.start, first.start + len(first.text))
            split.examples.append(Example(question.id, len(split.paragraphs) - 1, [index.get(w, unk) for w in q],
                                          frozenset(q), frozenset(w.lower() for w in q), target,
                                          [a.text for a in question.answers]))
    return split


def collate(split: QASplit, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``(paragraph (B, M), features (B, M, 3), question (B, N), targets (B, 2))`` padded with id 0; a target is
    ``(-1, -1)`` where the example has none."""
    examples = [split.examples[i] for i in indices]
    paragraphs = [split.paragraphs[e.paragraph] for e in examples]
    longest = max(len(p.ids) for p in paragraphs)
    paragraph = torch.zeros((len(examples), longest), dtype=torch.long)
    features = torch.zeros((len(examples), longest, FEATURES))
    question = torch.zeros((len(examples), max(len(e.question) for e in examples)), dtype=torch.long)
    targets = torch.full((len(examples), 2), -1, dtype=torch.long)
    for row, (example, p) in enumerate(zip(examples, paragraphs, strict=True)):
        paragraph[row, : len(p.ids)] = torch.tensor(p.ids)
        question[row, : len(example.question)] = torch.tensor(example.question)
        features[row, : len(p.ids)] = torch.tensor(
            [(w in example.question_words, w.lower() in example.question_lower, tf) for w, tf in zip(p.words, p.tf,
                                                                                                    strict=True)])
        if example.target is not None:
            targets[row] = torch.tensor(example.target)
    return paragraph, features, question, targets


def predict(model: nn.Module, split: QASplit, config: RunConfig, device: torch.device, batch_size: int
            ) -> tuple[dict[str, str], float]:
    """Every question's answer (the text of the paragraph its best span covers) and the mean loss over the questions
    whose first answer covers whole words."""
    answers: dict[str, str] = {}
    total, counted = 0.0, 0
    lengths = [len(split.paragraphs[e.paragraph].ids) for e in split.examples]
    with evaluating(model):
        for chosen in by_length(lengths, batch_size):
            paragraph, features, question, targets = (t.to(device) for t in collate(split, chosen))
            with torch.no_grad(), autocast(device, config.train.precision):
                logits = model(paragraph, features, question).logits.float()
            has = targets[:, 0] >= 0
            if bool(has.any()):
                total += (F.cross_entropy(logits[has, 0], targets[has, 0], reduction="sum")
                          + F.cross_entropy(logits[has, 1], targets[has, 1], reduction="sum")).item()
                counted += int(has.sum())
            starts, ends, _ = best_spans(logits, config.qa.max_span)
            for i, start, end in zip(chosen, starts.tolist(), ends.tolist(), strict=True):
                example = split.examples[i]
                first, last = _characters(split.paragraphs[example.paragraph], start, end)
                answers[example.qid] = split.paragraphs[example.paragraph].context[first:last]
    return answers, total / counted if counted else math.nan


def _characters(paragraph: EncodedParagraph, start: int, end: int) -> tuple[int, int]:
    """The characters ``[first, last)`` of the paragraph that its words ``start`` to ``end`` cover."""
    return paragraph.offsets[start][0], paragraph.offsets[end][1]


def check_question(context: Any, question: Any, where: str = "") -> tuple[str, str]:
    """``(context, question)`` if a reader can answer them: both text (no unpaired surrogates, the mark of bytes
    that were not UTF-8), neither empty, the context at most :data:`MAX_CONTEXT_CHARS` and the question
    :data:`MAX_QUESTION_CHARS` characters; else one :class:`DataError` saying which and what to give, ``where``
    (``input line 3: ``) before it. A question longer than its context is answered: with a span of the context."""
    for name, text, limit, fix in (
            ("context", context, MAX_CONTEXT_CHARS, "split it into paragraphs and ask each"),
            ("question", question, MAX_QUESTION_CHARS, "ask it in fewer words")):
        if not isinstance(text, str):
            raise DataError(f"{where}the {name} is {type(text).__name__}, not text; give the {name} as a string")
        if not text.strip():
            raise DataError(f"{where}the {name} is empty; give the "
                            + ("paragraph the answer is in" if name == "context" else "question to answer"))
        if len(text) > limit:
            raise DataError(f"{where}the {name} is {len(text):,} characters, more than the {limit:,} a reader "
                            f"reads at once; {fix}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"{where}the {name} is not UTF-8 text (character {err.start} is an unpaired surrogate, "
                            "what undecodable bytes become); give it as UTF-8") from None
    return context, question


def answer_questions(model: nn.Module, config: RunConfig, data: QAData, pairs: Sequence[tuple[str, str]],
                     device: torch.device, batch_size: int = 32) -> list[dict[str, Any]]:
    """The answer to each ``(context, question)`` of ``pairs`` (each checked by :func:`check_question`): the span
    of the context with the best score, of at most ``qa.max_span + 1`` words, as ``{"answer": text, "start": first
    character, "end": last character + 1, "score": the span's probability}`` (``context[start:end]`` is the
    answer; the probability, to 6 digits, is the start's times the end's, as DrQA scores spans). Paragraphs of like
    lengths are read together, ``batch_size`` at a time; padding changes no answer."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    pairs = [check_question(context, question) for context, question in pairs]
    split = encode_split([Paragraph(context, [Question(str(i), question, [])])
                          for i, (context, question) in enumerate(pairs)], data.index())
    answers: list[dict[str, Any]] = [{} for _ in pairs]
    with evaluating(model):
        for chosen in by_length([len(p.ids) for p in split.paragraphs], batch_size):
            paragraph, features, question, _ = (t.to(device) for t in collate(split, chosen))
            with torch.no_grad(), autocast(device, config.train.precision):
                logits = model(paragraph, features, question).logits.float()
            starts, ends, scores = best_spans(logits, config.qa.max_span)
            for i, start, end, score in zip(chosen, starts.tolist(), ends.tolist(), scores.tolist(), strict=True):
                first, last = _characters(split.paragraphs[i], start, end)  # one paragraph a question
                answers[i] = {"answer": pairs[i][0][first:last], "start": first, "end": last,
                              "score": float(f"{math.exp(score):.6g}")}
    return answers


def read_context(value: str) -> str:
    """``gatedformer answer --context``'s paragraph: the UTF-8 text of the file ``value`` names, else ``value``
    itself. A value that looks like a file's path (one word with a ``/`` or a ``.txt``) but names none is refused,
    not answered about."""
    path = Path(value).expanduser()
    try:
        kind = "file" if path.is_file() else "folder" if path.is_dir() else None
    except (OSError, ValueError):  # a text too long for a file's name, or with a NUL: no file
        kind = None
    if kind == "file":
        try:
            return read_limited(path, 4 * MAX_CONTEXT_CHARS).decode("utf-8")
        except ValueError as err:  # over the bound, or not UTF-8 (UnicodeDecodeError is a ValueError)
            reason = (f"byte {err.start} is not UTF-8" if isinstance(err, UnicodeDecodeError)
                      else f"it is {str(err)}")
            raise DataError(f"--context {value}: {reason}; give a UTF-8 file of one paragraph (at most "
                            f"{MAX_CONTEXT_CHARS:,} characters)") from None
        except OSError as err:
            raise DataError(f"--context {value}: cannot read it ({err.strerror or err}); give a readable file or "
                            "the paragraph's text") from None
    if kind == "folder" or (len(value.split()) == 1 and ("/" in value or value.endswith((".txt", ".json")))):
        raise DataError(f"--context {value}: no such file; give an existing file, or the paragraph's text itself")
    return value


def question_lines(path: str | Path | None) -> Iterator[str]:
    """The JSON lines ``gatedformer answer --input`` reads, from the file ``path`` (``None``: standard input), as
    they come, each at most :data:`~gatedformer.io.MAX_INPUT_LINE_BYTES` long."""
    return input_lines(path, _INPUT_FIX)


def answer_lines(model: nn.Module, config: RunConfig, data: QAData, lines: Iterable[str], device: torch.device,
                 batch_size: int = 32) -> Iterator[str]:
    """``gatedformer answer --input``: a JSON line of :func:`answer_questions`'s answer (after the input's ``id``,
    where it has one) for each line ``{"context": ..., "question": ...}`` of ``lines``, ``batch_size`` lines at a
    time, and an empty line for an empty one. A line that is not such an object is one :class:`DataError` naming
    it (the answers before it are out by then)."""

    def parsed(number: int, line: str) -> tuple[dict[str, Any], tuple[str, str]]:
        where = f"input line {number}: "
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{where}not JSON ({str(err)[:80]}); {_INPUT_FIX}") from None
        if not isinstance(record, dict) or not {"context", "question"} <= record.keys():
            raise DataError(f"{where}not an object with \"context\" and \"question\"; {_INPUT_FIX}")
        head = {"id": record["id"]} if "id" in record else {}
        return head, check_question(record["context"], record["question"], where)

    chunk: list[tuple[int, str]] = []
    for number, line in enumerate(itertools.chain(lines, [None]), start=1):
        if line is not None:
            chunk.append((number, line))
        if chunk and (line is None or len(chunk) >= batch_size):
            wanted = {n: parsed(n, text) for n, text in chunk if text.strip()}
            found = iter(answer_questions(model, config, data, [pair for _, pair in wanted.values()], device,
                                          batch_size) if wanted else [])
            for n, _ in chunk:
                yield json.dumps({**wanted[n][0], **next(found)}, ensure_ascii=False) if n in wanted else ""
            chunk = []


def _references(split: QASplit) -> list[tuple[str, list[str]]]:
    return [(e.qid, e.answers) for e in split.examples]


def _vocab_record(data: QAData) -> dict[str, Any]:
    return {"words": data.words, "embedding_dim": data.embedding_dim, "fixed_from": data.fixed_from}


def _vocabulary(train: Sequence[Paragraph], dev: Sequence[Paragraph], word_vectors: str, progress: bool
                ) -> tuple[list[str], int, dict[str, np.ndarray], int]:
    """The words (question words first, by frequency), how many are question words, and the vectors and their
    size where ``word_vectors`` names a file."""
    questions: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for paragraph in train:
        others.update(w for w, _, _ in _words(paragraph.context))
        for question in paragraph.questions:
            questions.update(w for w, _, _ in _words(question.text))
    questions.pop("", None)
    others.pop("", None)
    asked = sorted(questions, key=lambda w: (-questions[w], w))
    rest = sorted((w for w in others if w not in questions), key=lambda w: (-others[w], w))
    if not word_vectors:
        return [PAD, UNK, *asked, *rest], len(asked), {}, 0
    if not Path(word_vectors).expanduser().is_file():
        raise DataError(f"qa.word_vectors={word_vectors}: no such file; give a GloVe or word2vec text file (e.g. "
                        "glove.840B.300d.txt), or leave qa.word_vectors empty to learn the vectors")
    dev_words = {w for p in dev for text in (p.context, *(q.text for q in p.questions)) for w, _, _ in _words(text)}
    known = set(asked) | set(rest)
    vectors, size = read_word_vectors(word_vectors, known | dev_words)
    extra = sorted(w for w in dev_words - known if w in vectors)
    if progress:
        print(f"gatedformer: {len(vectors):,} of {len(known) + len(extra):,} words have a pretrained vector",
              flush=True)
    return [PAD, UNK, *asked, *rest, *extra], len(asked), vectors, size


@register_task("qa", corpora=(*SQUAD_CORPORA, f"{SQUAD_JSON_PREFIX}*"), sections=("qa",))
class QuestionAnsweringTask(Task[QAData, QAData]):
    """Extractive question answering on SQuAD v1.1 (``squad``) or a user's SQuAD-format data (``squad-json:DIR``)."""

    title = "question-answering"
    supports_ddp = True
    optional_modules = (("tokenizers", "bert"),)

    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: Any = None) -> QAData:
        qa = config.qa
        splits = load_squad(config.data.corpus, data_dir)
        train, dev = splits.train, splits.dev
        if qa.max_articles:
            train = [p for p in train if p.article < qa.max_articles]
            dev = [p for p in dev if p.article < qa.max_articles]
        words, asked, vectors, size = _vocabulary(train, dev, qa.word_vectors, progress)
        fixed_from = None
        if vectors and qa.tune_top_k >= 0:
            fixed_from = 2 + min(qa.tune_top_k, asked)
        index = {w: i for i, w in enumerate(words)}
        encoded = encode_split(train, index)
        encoded.examples = [e for e in encoded.examples if e.target is not None]
        if not encoded.examples:
            raise ConfigError(f"{splits.sources['train']}: no training question has an answer that covers whole "
                              "words; check the file (or raise qa.max_articles)")
        return QAData(words, encoded, encode_split(dev, index), size or qa.embedding_dim, fixed_from, vectors,
                      splits.sources, shard)

    def build_model(self, config: RunConfig, data: QAData) -> nn.Module:
        return fuse(self._build(config, len(data.words), data.embedding_dim, data.fixed_from))

    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        return self._build(config, vocab_size, config.qa.embedding_dim, None)

    @staticmethod
    def _build(config: RunConfig, vocab_size: int, embedding_dim: int, fixed_from: int | None) -> nn.Module:
        return build_backbone(config.model, "qa", vocab_size, embedding_dim, fixed_from)

    def metric(self, data: QAData) -> str:
        return "f1"

    def run_files(self, data: QAData) -> dict[str, Any]:
        return {VOCAB_FILE: _vocab_record(data)}

    def start_records(self, data: QAData, params: int) -> list[dict[str, Any]]:
        return [{"event": "data", "step": 0, "train_questions": len(data.train), "dev_questions": len(data.dev),
                 "train_paragraphs": len(data.train.paragraphs), "dev_paragraphs": len(data.dev.paragraphs),
                 "vocab": len(data.words), "pretrained_vectors": len(data.vectors),
                 "tuned_words": len(data.words) if data.fixed_from is None else data.fixed_from, "params": params}]

    def start_weights(self, model: nn.Module, config: RunConfig, data: QAData) -> None:
        super().start_weights(model, config, data)
        if data.vectors:
            table = model.embedding.weight  # type: ignore[union-attr]
            rows = [i for i, w in enumerate(data.words) if w in data.vectors]
            with torch.no_grad():
                table[rows] = torch.from_numpy(np.stack([data.vectors[data.words[i]] for i in rows]))

    def open_run(self, data: QAData, out_dir: Path, resumed: bool) -> None:
        data.best.open(out_dir, resumed)

    def _order(self, data: QAData, config: RunConfig, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s batches, drawn from ``(train.seed, epoch)`` alone: a random order, sorted by paragraph
        length (ties keep the random order), cut into batches, the batches shuffled."""
        generator = rng(config.train.seed, epoch, _ORDER_STREAM)
        order = generator.permutation(len(data.train))
        lengths = np.array([len(data.train.paragraphs[e.paragraph].ids) for e in data.train.examples])
        order = order[np.argsort(lengths[order], kind="stable")]
        size = config.data.batch_size
        batches = [order[i: i + size].tolist() for i in range(0, len(order), size)]
        return [batches[i] for i in generator.permutation(len(batches))]

    def train_batches(self, data: QAData, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        per_epoch = self.steps_per_epoch(data, config, meta)
        epoch, batches = -1, []
        while True:
            if step // per_epoch != epoch:
                epoch = step // per_epoch
                batches = self._order(data, config, epoch)
            chosen = batches[step % per_epoch]
            tokens = sum(len(data.train.paragraphs[data.train.examples[i].paragraph].ids)
                         + len(data.train.examples[i].question) for i in chosen)
            yield TrainBatch(self._share(data, chosen), tokens, new_epoch=step % per_epoch == 0,
                             position={"epoch": epoch})
            step += 1

    @staticmethod
    def _share(data: QAData, chosen: list[int]) -> tuple[torch.Tensor, ...]:
        """This rank's part of the batch ``chosen``: the whole batch in one process; else its questions and the
        weight of each (see the module docstring)."""
        rank, world = data.shard
        if world == 1:
            return collate(data.train, chosen)
        mine = chosen[rank::world]
        weights = torch.full((len(mine),), world / len(chosen))
        if not mine:  # every rank runs the step (DDP's gradient exchange): one question that counts for nothing
            mine, weights = chosen[:1], torch.zeros(1)
        return (*collate(data.train, mine), weights)

    def steps_per_epoch(self, data: QAData, config: RunConfig, meta: dict[str, Any] | None) -> int:
        return math.ceil(len(data.train) / config.data.batch_size)

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        paragraph, features, question, targets = (t.to(device) for t in batch.inputs[:4])
        if len(batch.inputs) == 4:
            with autocast(device, config.train.precision):
                out = model(paragraph, features, question, targets)
            return out.loss.float(), None
        with autocast(device, config.train.precision):
            logits = model(paragraph, features, question).logits.float()
        rows = (F.cross_entropy(logits[:, 0], targets[:, 0], reduction="none")
                + F.cross_entropy(logits[:, 1], targets[:, 1], reduction="none"))
        return (rows * batch.inputs[4].to(device)).sum(), None

    def _scores(self, model: nn.Module, data: QAData, config: RunConfig, device: torch.device
                ) -> tuple[dict[str, Any], dict[str, str]]:
        answers, loss = predict(model, data.dev, config, device, config.data.eval_batch_size)
        scores = score_predictions(_references(data.dev), answers)
        return {"valid_loss": loss, "valid_f1": scores["f1"], "valid_exact_match": scores["exact_match"]}, answers

    def _keep(self, model: nn.Module, data: QAData, fields: dict[str, Any], answers: dict[str, str]) -> None:
        if data.best.folder is not None:
            from safetensors.torch import save_file

            state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
            atomic_write(data.best.folder / BEST_WEIGHTS_FILE, lambda tmp: save_file(state, str(tmp)))
        data.best.keep(fields, {PREDICTIONS_FILE: json.dumps(answers, ensure_ascii=False)})

    def evaluate(self, model: nn.Module, data: QAData, config: RunConfig, device: torch.device, final: bool,
                 recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        with recording():
            fields, answers = self._scores(model, data, config, device)
        if data.best.beats(fields):
            self._keep(model, data, fields, answers)
        return {**fields, "best_valid_f1": data.best.value(data.best.fields)}

    def score(self, model: nn.Module, data: QAData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        if data.best.fields is None:
            fields, answers = self._scores(model, data, config, device)
            self._keep(model, data, fields, answers)
        best = data.best.fields
        assert best is not None
        return (float(best["valid_loss"]), float(best["valid_f1"]), float(best["valid_loss"]),
                float(best["valid_f1"]))

    def result_fields(self, data: QAData) -> dict[str, Any]:
        best = data.best.fields or {}
        return {"exact_match": best.get("valid_exact_match"), "f1": best.get("valid_f1"),
                "predictions": PREDICTIONS_FILE, "best_weights": BEST_WEIGHTS_FILE, "dev_file": data.sources.get("dev")}

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> QAData:
        """The words ``run_dir`` recorded (a run, or an exported model's folder), with empty splits; the corpus
        where it holds none."""
        vocab_file = run_dir / VOCAB_FILE
        if not vocab_file.is_file():
            return self.load_data(config, data_dir)
        try:
            record = json.loads(read_limited(vocab_file, 1 << 28))
            words, dim = [str(w) for w in record["words"]], int(record["embedding_dim"])
            fixed = record.get("fixed_from")
            if words[:2] != [PAD, UNK] or dim <= 0 or not (fixed is None or isinstance(fixed, int)):
                raise ValueError(f"its words must begin {PAD}, {UNK} and its embedding_dim be positive")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{vocab_file} is corrupt ({str(err)[:120]}); export the model again, or train "
                                  "the run again") from None
        return QAData(words, QASplit(), QASplit(), dim, fixed)

    def inference_files(self, data: QAData) -> dict[str, str]:
        return {VOCAB_FILE: json.dumps(_vocab_record(data), ensure_ascii=False)}

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: QAData) -> dict[str, float]:
        part = data.dev
        if not len(part):  # words read back from a folder: encode the dev set with them
            dev = load_squad(config.data.corpus, data_dir).dev
            if config.qa.max_articles:
                dev = [p for p in dev if p.article < config.qa.max_articles]
            part = encode_split(dev, {w: i for i, w in enumerate(data.words)})
        answers, loss = predict(model, part, config, device, config.data.eval_batch_size)
        return {"loss": loss, **score_predictions(_references(part), answers)}
