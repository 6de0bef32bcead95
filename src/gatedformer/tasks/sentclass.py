"""Sentence classification (the SRU paper's §4.1 and appendix B.1): MR, CR, SUBJ, MPQA, TREC and SST with a stack of
SRUs over word vectors, scored by accuracy.

Data (:mod:`gatedformer.data.sentclass`): TREC and SST with their own splits, the other four by ``sentclass.folds``-
fold cross-validation (``sentclass.fold`` is the test fold). The vocabulary is every word of the set, as in Kim's and
the SRU paper's code; with ``sentclass.word_vectors`` (a word2vec or GloVe text file) the words it has start from
their vectors, the others uniform in [-0.25, 0.25], and ``sentclass.freeze_vectors`` keeps them fixed. Batches of
``data.batch_size`` sentences in a fresh random order every epoch, padded per batch; cross-entropy.

Every evaluation scores the whole validation split; the run reports the best one and the test accuracy of the same
weights (``results.json``: ``valid_metric`` and ``test_metric``, ``accuracy`` the test one), as the SRU paper
reports test accuracy at the best validation accuracy; ``test_predictions.tsv`` holds those test predictions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.config import RunConfig
from gatedformer.data.sentclass import SENTCLASS_SETS, SentenceSet, load_sentences, sentence_set, words_of
from gatedformer.devices import autocast
from gatedformer.errors import CheckpointError, DataError
from gatedformer.fused import fuse
from gatedformer.io import read_limited
from gatedformer.models import build_backbone
from gatedformer.tasks.base import Task, TrainBatch, by_length, evaluating, register_task, rng, shuffled_epochs
from gatedformer.tasks.best import BestEvaluation

__all__ = ["SentenceClassificationTask", "SentenceData", "read_word_vectors"]

PAD, UNK = "<pad>", "<unk>"
VOCAB_FILE = "vocab.json"
"""A run's (and an export's) words, in the order of the embedding's rows, with the set and the embedding size."""
_ORDER_STREAM, _SAMPLE_STREAM = 5, 6


def read_word_vectors(path: str | Path, words: set[str]) -> tuple[dict[str, np.ndarray], int]:
    """The vectors of ``words`` in a word2vec or GloVe text file (``word v1 ... vd`` a line; word2vec's first line
    ``count dim`` is skipped), and their size. The first vector of a word wins."""
    path = Path(path).expanduser()
    found: dict[str, np.ndarray] = {}
    size = 0
    try:
        with open(path, encoding="utf-8", errors="replace", newline="\n") as handle:
            for number, line in enumerate(handle, start=1):
                parts = line.rstrip().split(" ")
                if number == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                    continue  # word2vec's header
                if len(parts) < 2:
                    if not line.strip():
                        continue
                    raise DataError(f"{path} line {number}: a word without a vector; give a word2vec or GloVe text "
                                    "file (a word and its numbers a line)")
                size = size or len(parts) - 1
                if len(parts) - 1 != size:
                    raise DataError(f"{path} line {number}: {len(parts) - 1} numbers where the file's vectors have "
                                    f"{size}; the file is damaged")
                if parts[0] in words and parts[0] not in found:
                    try:
                        found[parts[0]] = np.asarray(parts[1:], dtype=np.float32)
                    except ValueError:
                        raise DataError(f"{path} line {number}: a vector that is not numbers; the file is "
                                        "damaged") from None
    except OSError as err:
        raise DataError(f"cannot read the word vectors {path} ({err.strerror or err}); check "
                        "sentclass.word_vectors") from None
    if not size:
        raise DataError(f"{path} holds no word vectors; give a word2vec or GloVe text file")
    return found, size


@dataclass
class Encoded:
    ids: list[list[int]]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class SentenceData:
    set: SentenceSet
    words: list[str]
    train: Encoded
    valid: Encoded
    test: Encoded
    embedding_dim: int
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    best: BestEvaluation = field(default_factory=lambda: BestEvaluation("valid_accuracy"))


def _vocab_record(data: SentenceData) -> dict[str, Any]:
    return {"set": data.set.name, "words": data.words, "embedding_dim": data.embedding_dim}


def _encode(examples: Sequence[tuple[list[str], int]], index: dict[str, int]) -> Encoded:
    unk = index[UNK]
    # A sentence without words reads as one unknown word, so that it has a last state.
    return Encoded([[index.get(w, unk) for w in words] or [unk] for words, _ in examples],
                   torch.tensor([label for _, label in examples], dtype=torch.long))


def collate(split: Encoded, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens (B, L), lengths (B,), labels (B,))``, padded with id 0."""
    lengths = torch.tensor([len(split.ids[i]) for i in indices], dtype=torch.long)
    tokens = torch.zeros((len(indices), int(lengths.max())), dtype=torch.long)
    for row, i in enumerate(indices):
        tokens[row, : lengths[row]] = torch.tensor(split.ids[i])
    return tokens, lengths, split.labels[list(indices)]


def _batches(model: nn.Module, split: Encoded, size: int, precision: str, device: torch.device
             ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """The model's logits for ``split``, ``size`` sentences at a time in order of length: ``(their indices, their
    labels, their logits)`` a batch, in eval mode (the model's own mode back after the last)."""
    with evaluating(model):
        for chosen in by_length([len(ids) for ids in split.ids], size):
            tokens, lengths, labels = (t.to(device) for t in collate(split, chosen))
            with torch.no_grad(), autocast(device, precision):
                logits = model(tokens, lengths).logits.float()
            yield chosen, labels, logits


def predict(model: nn.Module, split: Encoded, config: RunConfig, device: torch.device) -> tuple[list[int], float]:
    """Every sentence's predicted class and the mean loss."""
    predictions: list[int] = [0] * len(split)
    total = 0.0
    for chosen, labels, logits in _batches(model, split, config.data.eval_batch_size, config.train.precision, device):
        total += F.cross_entropy(logits, labels, reduction="sum").item()
        for i, value in zip(chosen, logits.argmax(-1).tolist(), strict=True):
            predictions[i] = value
    return predictions, total / max(len(split), 1)


def _accuracy(predictions: list[int], labels: torch.Tensor) -> float:
    return float((torch.tensor(predictions) == labels).float().mean()) if len(predictions) else 0.0


@register_task("sentclass", corpora=tuple(SENTCLASS_SETS), sections=("sentclass",))
class SentenceClassificationTask(Task[SentenceData, SentenceData]):
    """Sentence classification on MR, CR, SUBJ, MPQA, TREC or SST (``data.corpus``)."""

    title = "sentence-classification"

    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: Any = None) -> SentenceData:
        sc = config.sentclass
        s = sentence_set(config.data.corpus)
        splits = load_sentences(s.name, data_dir, sc.folds, sc.fold)
        train = splits.train
        if 0 < sc.max_train_examples < len(train):
            keep = np.sort(rng(_SAMPLE_STREAM, 0).choice(len(train), size=sc.max_train_examples, replace=False))
            train = [train[i] for i in keep]
        words = [PAD, UNK, *sorted({w for part in (train, splits.valid, splits.test) for ws, _ in part for w in ws})]
        vectors, size = ({}, sc.embedding_dim)
        if sc.word_vectors:
            vectors, size = read_word_vectors(sc.word_vectors, set(words[2:]))
            if progress:
                print(f"gatedformer: {len(vectors):,} of {len(words) - 2:,} words have a pretrained vector", flush=True)
        index = {w: i for i, w in enumerate(words)}
        return SentenceData(s, words, _encode(train, index), _encode(splits.valid, index), _encode(splits.test, index),
                            size, vectors)

    def build_model(self, config: RunConfig, data: SentenceData | tuple[int, int, int]) -> nn.Module:
        sizes = (len(data.words), data.set.classes, data.embedding_dim) if isinstance(data, SentenceData) else data
        return fuse(self._build(config, *sizes))

    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        s = sentence_set(config.data.corpus)
        return self._build(config, vocab_size, s.classes, config.sentclass.embedding_dim)

    @staticmethod
    def _build(config: RunConfig, vocab_size: int, classes: int, embedding_dim: int) -> nn.Module:
        freeze = config.sentclass.freeze_vectors and bool(config.sentclass.word_vectors)
        return build_backbone(config.model, "sentclass", vocab_size, classes, embedding_dim, freeze)

    def metric(self, data: SentenceData) -> str:
        return "accuracy"

    def run_files(self, data: SentenceData) -> dict[str, Any]:
        return {VOCAB_FILE: _vocab_record(data)}

    def start_records(self, data: SentenceData, params: int) -> list[dict[str, Any]]:
        return [{"event": "data", "step": 0, "set": data.set.name, "train_examples": len(data.train),
                 "valid_examples": len(data.valid), "test_examples": len(data.test), "vocab": len(data.words),
                 "pretrained_vectors": len(data.vectors), "params": params}]

    def start_weights(self, model: nn.Module, config: RunConfig, data: SentenceData) -> None:
        super().start_weights(model, config, data)
        if data.vectors:
            table = model.embedding.weight  # type: ignore[union-attr]
            rows = [i for i, w in enumerate(data.words) if w in data.vectors]
            with torch.no_grad():
                table[rows] = torch.from_numpy(np.stack([data.vectors[data.words[i]] for i in rows]))

    def open_run(self, data: SentenceData, out_dir: Path, resumed: bool) -> None:
        data.best.open(out_dir, resumed)

    def train_batches(self, data: SentenceData, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        for epoch, start, indices in shuffled_epochs(len(data.train), config.data.batch_size,
                                                     self.steps_per_epoch(data, config, meta), config.train.seed,
                                                     _ORDER_STREAM, step):
            batch = collate(data.train, indices)
            yield TrainBatch(batch, int(batch[1].sum()), new_epoch=start == 0, position={"epoch": epoch})

    def steps_per_epoch(self, data: SentenceData, config: RunConfig, meta: dict[str, Any] | None) -> int:
        return math.ceil(len(data.train) / config.data.batch_size)

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        tokens, lengths, labels = (t.to(device) for t in batch.inputs)
        with autocast(device, config.train.precision):
            logits = model(tokens, lengths).logits
        return F.cross_entropy(logits.float(), labels), None

    def evaluate(self, model: nn.Module, data: SentenceData, config: RunConfig, device: torch.device, final: bool,
                 recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        with recording():
            predictions, loss = predict(model, data.valid, config, device)
        accuracy = _accuracy(predictions, data.valid.labels)
        fields = {"valid_loss": loss, "valid_accuracy": accuracy}
        if data.best.beats(fields):  # the test accuracy reported is that of the best validation accuracy's weights
            test_predictions, test_loss = predict(model, data.test, config, device)
            lines = ["index\tprediction\tlabel\n"] + [
                f"{i}\t{p}\t{y}\n" for i, (p, y) in enumerate(zip(test_predictions, data.test.labels.tolist(),
                                                                   strict=True))]
            data.best.keep({**fields, "test_loss": test_loss,
                            "test_accuracy": _accuracy(test_predictions, data.test.labels)},
                           {"test_predictions.tsv": "".join(lines)})
        return {**fields, "best_valid_accuracy": data.best.value(data.best.fields)}

    def score(self, model: nn.Module, data: SentenceData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        if data.best.fields is None or "test_accuracy" not in data.best.fields:
            predictions, loss = predict(model, data.valid, config, device)
            test_predictions, test_loss = predict(model, data.test, config, device)
            data.best.fields = {"valid_loss": loss, "valid_accuracy": _accuracy(predictions, data.valid.labels),
                                "test_loss": test_loss,
                                "test_accuracy": _accuracy(test_predictions, data.test.labels)}
        best = data.best.fields
        return (float(best["valid_loss"]), float(best["valid_accuracy"]), float(best["test_loss"]),
                float(best["test_accuracy"]))

    def result_fields(self, data: SentenceData) -> dict[str, Any]:
        best = data.best.fields or {}
        return {"set": data.set.name, **({"accuracy": best["test_accuracy"]} if "test_accuracy" in best else {})}

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> SentenceData:
        """The corpus, or where ``run_dir`` holds the words its training recorded (a run of this version, or an
        exported model's folder) those alone, with empty splits: a model needs its words, not its corpus."""
        vocab_file = run_dir / VOCAB_FILE
        if not vocab_file.is_file():
            return self.load_data(config, data_dir)
        try:
            record = json.loads(read_limited(vocab_file, 1 << 28))
            words, dim = [str(w) for w in record["words"]], int(record["embedding_dim"])
            if words[:2] != [PAD, UNK] or dim <= 0:
                raise ValueError(f"its words must begin {PAD}, {UNK} and its embedding_dim be positive")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{vocab_file} is corrupt ({str(err)[:120]}); export the model again, or train "
                                  "the run again") from None
        empty = Encoded([], torch.zeros(0, dtype=torch.long))
        return SentenceData(sentence_set(config.data.corpus), words, empty, empty, empty, dim)

    def inference_files(self, data: SentenceData) -> dict[str, str]:
        return {VOCAB_FILE: json.dumps(_vocab_record(data), ensure_ascii=False)}

    def class_names(self, data: SentenceData) -> tuple[str, ...]:
        return data.set.labels

    def classify(self, model: nn.Module, config: RunConfig, data: SentenceData,
                 inputs: Sequence[str | tuple[str, str]], device: torch.device, batch_size: int = 64) -> torch.Tensor:
        index = {w: i for i, w in enumerate(data.words)}
        sentences = []
        for number, text in enumerate(inputs, start=1):
            if not isinstance(text, str):
                raise DataError(f"input {number} is {type(text).__name__} {str(text)[:60]!r}, but a "
                                f"{data.set.title} model reads one sentence at a time; give it a string (several: "
                                "a list of strings)")
            sentences.append((words_of(text, data.set, index), 0))
        split = _encode(sentences, index)
        probabilities = torch.empty((len(split), len(data.set.labels)))
        for chosen, _, logits in _batches(model, split, batch_size, config.train.precision, device):
            probabilities[chosen] = logits.softmax(-1).cpu()
        return probabilities

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: SentenceData) -> dict[str, float]:
        part = data.valid if split == "valid" else data.test
        if not len(part):  # data read back from a folder's words: encode the split with those words
            sc = config.sentclass
            splits = load_sentences(data.set.name, data_dir, sc.folds, sc.fold)
            index = {w: i for i, w in enumerate(data.words)}
            part = _encode(splits.valid if split == "valid" else splits.test, index)
        predictions, loss = predict(model, part, config, device)
        return {"loss": loss, "accuracy": _accuracy(predictions, part.labels)}

