"""The ``qa`` section of the bench: the document reader's training step on SQuAD (the SRU paper's §4.2 and appendix
B.2) with SRU layers beside DrQA's bi-LSTM layers, timed side by side in one round-robin run, as the paper sets the
two readers' time per epoch side by side.

Each reader is built as the ``qa`` task builds it (the ``reader`` backbone, then :func:`gatedformer.fused.fuse`), so
its SRU layers run their recurrence on our SRU kernel (the compiled CPU kernel, or the Triton kernels on a GPU: each
row names the one :func:`gatedformer.ops.sru.kernel_backend` picks). The step is the trainer's: the start's and the
end's cross-entropy, backward, gradient clipping at norm 10 and an Adamax step (the squad recipes'), over one batch
of random word ids of SQuAD's shape; the embedding trains its first ``tuned`` rows only, as a reader with pretrained
vectors does. On a GPU the shape is the paper's (:data:`PAPER`); on a CPU a scaled one (:data:`CPU`), labelled so in
the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gatedformer.analysis.bench.options import BenchOptions
from gatedformer.analysis.bench.report import BenchReport
from gatedformer.analysis.bench.runners import count_parameters
from gatedformer.analysis.bench.timing import Timing, paired_ratio, time_round_robin
from gatedformer.config import ModelConfig, OptimConfig, get_backbone
from gatedformer.fused import fuse
from gatedformer.models.reader import FEATURES
from gatedformer.ops.sru import kernel_backend
from gatedformer.train.optim import build_optimizer, clip_gradients

__all__ = ["CPU", "PAPER", "READERS", "TRAIN_QUESTIONS", "QAShape", "bench_qa"]


@dataclass(frozen=True)
class QAShape:
    """One training batch of the reader and the reader's sizes."""

    name: str
    batch: int
    paragraph: int
    """Words of the longest paragraph; the others are from 90 % of it up (the trainer batches like lengths)."""
    question: int
    vocab: int
    tuned: int
    """Embedding rows that train (DrQA: the 1,000 most frequent question words, after ``<pad>`` and ``<unk>``)."""
    embedding: int = 300
    hidden: int = 128


PAPER = QAShape("the paper's", batch=32, paragraph=150, question=12, vocab=100_000, tuned=1002)
"""B.2 and DrQA: batch 32, 128 units, 300-d vectors, 1,000 tuned words; paragraphs of 150 words and questions of 12
(about SQuAD v1.1's longer and mean lengths), a vocabulary of 100,000 words (SQuAD's words with GloVe vectors are of
that order): the shape is the bench's, not measured from the data."""
CPU = dataclasses.replace(PAPER, name="scaled for the CPU", batch=8, vocab=20_000)
TRAIN_QUESTIONS = 87_599
"""SQuAD v1.1's training questions: one epoch's steps are this over the batch."""
READERS = (("bi-LSTM, 3 layers (DrQA)", "lstm", 3, 0.3, 0.3), ("SRU, 3 layers", "sru", 3, 0.2, 0.5),
           ("SRU, 6 layers (B.2)", "sru", 6, 0.2, 0.5))
"""Each reader's name, ``model.rnn``, layers, recurrent dropout and embedding dropout (the squad recipes'); the
first is the one the others are compared with."""


def _batch(shape: QAShape, seed: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Paragraphs, features, questions and targets as :func:`gatedformer.tasks.qa.collate` gives them."""
    generator = torch.Generator().manual_seed(seed)

    def ids(length: int, shortest: int) -> torch.Tensor:
        lengths = torch.randint(shortest, length + 1, (shape.batch,), generator=generator)
        words = torch.randint(2, shape.vocab, (shape.batch, length), generator=generator)
        return words * (torch.arange(length)[None, :] < lengths[:, None]), lengths

    paragraph, lengths = ids(shape.paragraph, max(1, math.ceil(0.9 * shape.paragraph)))
    question, _ = ids(shape.question, max(1, shape.question // 2))
    features = torch.rand((shape.batch, shape.paragraph, FEATURES), generator=generator) * (paragraph != 0)[..., None]
    start = (torch.rand(shape.batch, generator=generator) * (lengths - 1)).long()
    end = torch.minimum(start + torch.randint(0, 4, (shape.batch,), generator=generator), lengths - 1)
    return tuple(t.to(device) for t in (paragraph, features, question, torch.stack([start, end], 1)))


def _reader(shape: QAShape, rnn: str, layers: int, dropout: float, emb_dropout: float) -> nn.Module:
    cfg = ModelConfig(backbone="reader", rnn=rnn, n_layers=layers, d_model=shape.hidden, dropout=dropout,
                      emb_dropout=emb_dropout)
    return fuse(get_backbone("reader", "qa").build(cfg, shape.vocab, shape.embedding, shape.tuned))


def _step(model: nn.Module, batch: tuple[torch.Tensor, ...], optimizer: torch.optim.Optimizer | None,
          autocast: Callable[[], contextlib.AbstractContextManager[Any]]) -> Callable[[], None]:
    def run() -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        with autocast():
            loss = model(*batch).loss
        loss.float().backward()
        if optimizer is not None:
            clip_gradients(model, optimizer, 10.0)
            optimizer.step()
    return run


def bench_qa(report: BenchReport, options: BenchOptions, device: torch.device,
             progress: Callable[[str], None]) -> None:
    shape = PAPER if device.type == "cuda" else CPU
    progress(f"qa: the document reader's training step, SRU vs bi-LSTM (shape: {shape.name})")
    batch = _batch(shape, options.seed, device)
    models: dict[str, nn.Module] = {}
    steps: dict[str, Callable[[], None]] = {}

    def autocast() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if options.bf16 else contextlib.nullcontext()

    for name, rnn, layers, dropout, emb_dropout in READERS:
        torch.manual_seed(options.seed)
        model = _reader(shape, rnn, layers, dropout, emb_dropout).to(device).train()
        optimizer = None if options.optimizer == "none" else build_optimizer(
            model, OptimConfig(name="adamax", lr=2e-3))
        models[name], steps[name] = model, _step(model, batch, optimizer, autocast)
    failed: dict[str, str] = {}
    times = time_round_robin(steps, options.repeats, options.warmup, device, failed)
    lstm = times.get(READERS[0][0])
    kernel = kernel_backend(device)
    for name, rnn, layers, _, _ in READERS:
        base: dict[str, Any] = {"section": "qa", "name": name, "rnn": rnn, "layers": layers, "shape": shape.name}
        if name not in times:
            report.rows.append({**base, "status": f"failed: {failed.get(name, 'not timed')}"})
            continue
        timing: Timing = times[name]
        row = {**base, "status": "ok", "params": count_parameters(models[name]), **timing.as_dict("train"),
               "train_questions_per_s": shape.batch / timing.median,
               "epoch_s": TRAIN_QUESTIONS / shape.batch * timing.median,
               "recurrence": kernel if rnn == "sru" else "torch.nn.LSTM"}
        if lstm is not None:
            # > 1: this reader's step is the faster (the median over rounds of the LSTM's time over its own)
            row["speedup_vs_lstm"] = paired_ratio(lstm, timing)
        report.rows.append(row)
    step = "forward + loss + backward (no optimiser step)" if options.optimizer == "none" else (
        "forward + loss + backward + clipping + Adamax step (the squad recipes'; --optimizer does not apply)")
    report.notes.append(
        f"qa: shape {shape.name}: batch {shape.batch} of paragraphs of {math.ceil(0.9 * shape.paragraph)} to "
        f"{shape.paragraph} words and questions of {max(1, shape.question // 2)} to {shape.question}, "
        f"{shape.embedding}-d embeddings of {shape.vocab:,} words ({shape.tuned:,} trained), {shape.hidden} units "
        f"each way; step = {step}; epoch = {TRAIN_QUESTIONS:,} questions at this step's speed"
        + ("" if shape is PAPER else f" (the paper's shape: batch {PAPER.batch}, {PAPER.vocab:,} words, on a GPU)"))
    if options.compile:
        report.notes.append("qa: timed eager; --compile does not apply to this section")
