"""Causal language modelling: next-token prediction over windows of a corpus, scored in bits per character or
perplexity, and sampling from a trained model.

Data: the corpus's token ids read as ``data.batch_size`` contiguous columns in windows of ``data.seq_len``
(:class:`~gatedformer.data.LMStream`); under data parallelism each rank reads its own block of the columns. The
training windows go in order, epoch after epoch; the position follows from the step alone. A model that carries a
state from window to window (Transformer-XL's memory, the SRU's cells) gets it back for the next window and starts
afresh with each epoch. Evaluation: the mean negative log-likelihood per token over the valid split's windows in
order (the first ``train.eval_windows`` at intermediate evaluations, all at the end), with the state carried.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gatedformer.config import RunConfig
from gatedformer.data import Corpus, LMStream, Vocab, load_corpus
from gatedformer.devices import autocast
from gatedformer.errors import ConfigError
from gatedformer.models import build_model
from gatedformer.tasks.base import Task, TrainBatch

__all__ = ["LMData", "LanguageModelTask", "evaluate", "generate", "metric_value"]


def metric_value(metric: str, loss: float) -> float:
    """Perplexity ``exp(loss)`` or bits per character ``loss / ln 2``, from a loss in nats."""
    if metric == "ppl":
        return math.exp(min(loss, 700.0))
    return loss / math.log(2.0)


@torch.no_grad()
def evaluate(model: nn.Module, stream: LMStream, device: torch.device, precision: str = "fp32",
             max_windows: int = 0) -> float:
    """Mean negative log-likelihood (nats per token) over the stream's windows, in order."""
    was_training = model.training
    model.eval()
    total, count, state = 0.0, 0, None
    windows = len(stream) if max_windows <= 0 else min(max_windows, len(stream))
    for k in range(windows):
        x, y = stream.window(k)
        x, y = x.to(device), y.to(device)
        with autocast(device, precision):
            loss, state = model(x, state, targets=y, reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1)


@dataclass
class LMData:
    """A corpus cut into windows: this rank's training stream and the whole valid and test streams."""

    corpus: Corpus
    train: LMStream
    valid: LMStream
    test: LMStream
    world: int = 1
    """Ranks sharing each training batch (each holds ``1 / world`` of its columns)."""


class LanguageModelTask(Task):
    """Causal language modelling on a corpus of ``gatedformer data list`` or a ``text:`` file."""

    name = "lm"
    title = "language-model"
    supports_ddp = True

    def shared_data(self, config: RunConfig, data_dir: str | Path | None) -> Corpus:
        return load_corpus(config.data.corpus, data_dir)

    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: Corpus | None = None) -> LMData:
        corpus = shared or load_corpus(config.data.corpus, data_dir)
        data = config.data
        eval_len = data.eval_seq_len or data.seq_len
        return LMData(
            corpus,
            LMStream(corpus.train, data.batch_size, data.seq_len, shard=shard, split="train"),
            LMStream(corpus.valid, data.eval_batch_size, eval_len, split="valid"),
            LMStream(corpus.test, data.eval_batch_size, eval_len, split="test"),
            world=shard[1],
        )

    def build_model(self, config: RunConfig, data: LMData | Corpus) -> nn.Module:
        corpus = data.corpus if isinstance(data, LMData) else data
        return build_model(config.model, len(corpus.vocab))

    def metric(self, data: LMData) -> str:
        return data.corpus.metric

    def train_batches(self, data: LMData, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        stream = data.train
        while True:
            k = step % len(stream)
            x, y = stream.window(k)
            yield TrainBatch((x, y), y.numel() * data.world, new_epoch=k == 0)
            step += 1

    def steps_per_epoch(self, data: LMData, config: RunConfig, meta: dict[str, Any] | None) -> int:
        return len(data.train)

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        x, y = (t.to(device) for t in batch.inputs)
        with autocast(device, config.train.precision):
            # the model's loss: its output layer and the cross-entropy as one function (see ops.output_loss)
            return model(x, carry, targets=y)

    def evaluate(self, model: nn.Module, data: LMData, config: RunConfig, device: torch.device, final: bool,
                 recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        windows = config.train.eval_windows
        scored = len(data.valid) if final or windows <= 0 else min(windows, len(data.valid))
        with recording():
            valid_loss = evaluate(model, data.valid, device, config.train.precision, scored)
        metric = self.metric(data)
        return {"valid_loss": valid_loss, "valid_windows": scored, f"valid_{metric}": metric_value(metric, valid_loss)}

    def score(self, model: nn.Module, data: LMData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        metric = self.metric(data)
        valid_loss = (final_eval["valid_loss"] if final_eval is not None
                      else evaluate(model, data.valid, device, config.train.precision))
        test_loss = evaluate(model, data.test, device, config.train.precision)
        return valid_loss, metric_value(metric, valid_loss), test_loss, metric_value(metric, test_loss)

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> Corpus:
        return load_corpus(config.data.corpus, data_dir)

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: Corpus) -> dict[str, float]:
        tokens = data.valid if split == "valid" else data.test
        stream = LMStream(tokens, config.data.eval_batch_size, config.data.eval_seq_len or config.data.seq_len,
                          split=split)
        loss = evaluate(model, stream, device, config.train.precision)
        return {"loss": loss, data.metric: metric_value(data.metric, loss)}


@torch.no_grad()
def generate(model: nn.Module, vocab: Vocab, prompt: str, max_tokens: int = 200, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, context: int = 512) -> str:
    """Continue ``prompt`` by ``max_tokens`` sampled tokens; returns prompt plus continuation as text.

    Stateful models (Transformer-XL memory, SRU) are fed one token at a time with their carried
    state; the others re-read the last ``context`` tokens at every step.
    """
    if max_tokens < 1:
        raise ConfigError(f"--tokens must be at least 1, got {max_tokens}")
    if temperature <= 0:
        raise ConfigError(f"--temperature must be positive, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be 0 (sample among all tokens) or positive, got {top_k}")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = vocab.encode(prompt) if prompt else []
    if not ids:
        ids = [0]
    history = torch.tensor(ids, dtype=torch.long)
    state = None
    logits, state = model(history[-context:].unsqueeze(0).to(device), None)
    stateful = state is not None
    new_ids: list[int] = []
    for _ in range(max_tokens):
        scores = logits[0, -1].float().cpu() / temperature
        if top_k > 0:
            kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        token = int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
        new_ids.append(token)
        history = torch.cat([history, torch.tensor([token])])
        if stateful:
            logits, state = model(torch.tensor([[token]], device=device), state)
        else:
            logits, _ = model(history[-context:].unsqueeze(0).to(device), None)
    return (prompt if prompt else "") + vocab.decode(new_ids)
