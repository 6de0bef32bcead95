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

import json
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
from gatedformer.data.tokenize import require_utf8
from gatedformer.devices import autocast
from gatedformer.errors import CheckpointError, ConfigError
from gatedformer.fused import fuse
from gatedformer.io import read_limited
from gatedformer.models import build_model
from gatedformer.tasks.base import Task, TrainBatch, evaluating, register_task

__all__ = ["DecodingWindow", "LMData", "LanguageModelTask", "evaluate", "generate", "generate_stream", "metric_value",
           "sample_ids"]

VOCAB_FILE = "vocab.json"
"""An exported language model's vocabulary (with its corpus's name, level and metric)."""


def metric_value(metric: str, loss: float) -> float:
    """Perplexity ``exp(loss)`` or bits per character ``loss / ln 2``, from a loss in nats."""
    if metric == "ppl":
        return math.exp(min(loss, 700.0))
    return loss / math.log(2.0)


@torch.no_grad()
def evaluate(model: nn.Module, stream: LMStream, device: torch.device, precision: str = "fp32",
             max_windows: int = 0) -> float:
    """Mean negative log-likelihood (nats per token) over the stream's windows, in order."""
    total, count, state = 0.0, 0, None
    windows = len(stream) if max_windows <= 0 else min(max_windows, len(stream))
    with evaluating(model):
        for k in range(windows):
            x, y = stream.window(k)
            x, y = x.to(device), y.to(device)
            with autocast(device, precision):
                out = model(x, state, targets=y, reduction="sum")
            state = out.state
            total += out.loss.item()
            count += y.numel()
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


@register_task("lm")
class LanguageModelTask(Task[LMData, Corpus]):
    """Causal language modelling on a corpus of ``gatedformer data list`` or a ``text:`` file."""

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
        return fuse(build_model(config.model, len(corpus.vocab)))

    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        return build_model(config.model, vocab_size)

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
            # the model's loss: its fused output layer and the cross-entropy as one function (see fused.output)
            out = model(x, carry, targets=y)
        return out.loss, out.state

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
        """The corpus, or where ``run_dir`` is an exported model's folder its ``vocab.json`` alone (a corpus with
        empty splits: the vocabulary and the metric)."""
        vocab_file = run_dir / VOCAB_FILE
        if not vocab_file.is_file():
            return load_corpus(config.data.corpus, data_dir)
        try:
            record = json.loads(read_limited(vocab_file, 1 << 28))
            empty = torch.zeros(0, dtype=torch.long)
            return Corpus(str(record["corpus"]), str(record["level"]), str(record["metric"]),
                          Vocab.from_json(record["vocab"]), empty, empty, empty)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{vocab_file} is corrupt ({str(err)[:120]}); export the model again") from None

    def inference_files(self, data: Corpus) -> dict[str, str]:
        record = {"corpus": data.name, "level": data.level, "metric": data.metric, "vocab": data.vocab.to_json()}
        return {VOCAB_FILE: json.dumps(record, ensure_ascii=False)}

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: Corpus) -> dict[str, float]:
        tokens = data.valid if split == "valid" else data.test
        stream = LMStream(tokens, config.data.eval_batch_size, config.data.eval_seq_len or config.data.seq_len,
                          split=split)
        loss = evaluate(model, stream, device, config.train.precision)
        return {"loss": loss, data.metric: metric_value(data.metric, loss)}


MAX_SEED = 2**64 - 1
"""The largest sampling seed (what a generator's seed holds)."""


def generate(model: nn.Module, vocab: Vocab, prompt: str, max_tokens: int = 200, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, context: int = 512, cache: bool = True) -> str:
    """Continue ``prompt`` by ``max_tokens`` sampled tokens; returns prompt plus continuation as text (see
    :func:`generate_stream`)."""
    return "".join(generate_stream(model, vocab, prompt, max_tokens, temperature, top_k, seed, context, cache))


def generate_stream(model: nn.Module, vocab: Vocab, prompt: str, max_tokens: int = 200, temperature: float = 1.0,
                    top_k: int = 0, seed: int = 0, context: int = 512, cache: bool = True) -> Iterator[str]:
    """The prompt, then its continuation by ``max_tokens`` sampled tokens, as text pieces as they are sampled (a
    piece per token, less where bytes wait for the rest of their character), in memory that does not grow with
    ``max_tokens``.

    The model reads a window of at most ``context`` tokens (see :class:`DecodingWindow`). With ``cache`` each new
    token is one incremental step of the model (its ``new_cache`` / ``step``: a key/value cache, or the state a
    backbone carries); without, the model reads its whole window again for every token. Both compute the same
    logits (to float rounding), so with the same ``seed`` they sample the same text.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"--tokens must be a whole number of at least 1, got {max_tokens}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"--temperature must be a finite number above 0, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be 0 (sample among all tokens) or positive, got {top_k}")
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be a whole number from 0 to 2**64 - 1, got {str(seed)[:40]}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ConfigError(f"the context must be a whole number of at least 1 token, got {context}")
    require_utf8(prompt, "the prompt", "give it in UTF-8 (a UTF-8 locale in the shell, e.g. LANG=C.UTF-8)")
    ids = vocab.encode(prompt) if prompt else []  # a prompt the vocabulary cannot spell fails before any output
    return _sample(model, vocab, prompt, ids or [0], max_tokens, temperature, top_k, seed, context, cache)


class DecodingWindow:
    """What a language model reads while it samples, one token after another: a window of at most ``context``
    tokens, with the state its ``forward`` carries from window to window.

    A full window makes way for the next token as a model's evaluation windows do: a model that carries a state
    (Transformer-XL's memory, the SRU's cells) starts a new window after the state of the full one; a model that
    carries none keeps the last ``context // 2`` tokens (so it never reads fewer) and reads them again. With
    ``cached`` the window is read incrementally, one :meth:`step` of the model per token (``new_cache``, ``step``,
    ``cache_state``; re-read only when the window moves); without, the model's ``forward`` reads the whole window
    for every token, the full recomputation the cache is checked against.
    """

    def __init__(self, model: nn.Module, context: int, cached: bool = True) -> None:
        self.model = model
        self.context = context
        self.cached = cached and all(hasattr(model, name) for name in ("new_cache", "step", "cache_state"))
        self.device = next(model.parameters()).device
        self.window: list[int] = []
        self.state: Any = None  # carried into the window from the ones before
        self._after: Any = None  # the state after the window (the full recomputation's)
        self._cache: Any = None

    def _read(self, ids: list[int], fresh: bool) -> torch.Tensor:
        """The logits after ``ids``, the window's newest tokens (all of it where ``fresh``); without the cache the
        whole window is read whatever ``ids`` are."""
        if not self.cached:
            window = torch.tensor([self.window], dtype=torch.long, device=self.device)
            out = self.model(window, self.state)
            self._after = out.state
            return out.logits[0, -1]
        if fresh:
            self._cache = self.model.new_cache(self.state)
        return self.model.step(torch.tensor([ids], dtype=torch.long, device=self.device), self._cache)[0, -1]

    def _carried(self) -> Any:
        return self.model.cache_state(self._cache) if self.cached else self._after

    def start(self, ids: list[int]) -> torch.Tensor:
        """The next token's logits after ``ids`` (their last ``context``), from a fresh state."""
        self.window, self.state = list(ids[-self.context:]), None
        return self._read(self.window, fresh=True)

    def feed(self, token: int) -> torch.Tensor:
        """The next token's logits after ``token``."""
        if len(self.window) < self.context:
            self.window.append(token)
            return self._read([token], fresh=False)
        carried = self._carried()
        if carried is not None:
            self.state, self.window = carried, [token]
        else:
            self.window = self.window[len(self.window) - self.context // 2 :] + [token]
        return self._read(self.window, fresh=True)


def sample_ids(model: nn.Module, ids: list[int], max_tokens: int, temperature: float = 1.0, top_k: int = 0,
               seed: int = 0, context: int = 512, cache: bool = True) -> Iterator[int]:
    """The ids of ``max_tokens`` tokens sampled after ``ids`` (one at least), one at a time (see
    :func:`generate_stream`, which checks the arguments and turns them into text)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    window = DecodingWindow(model, context, cache)
    with torch.no_grad():
        logits = window.start(ids)
    for k in range(max_tokens):
        scores = logits.float().cpu() / temperature
        if top_k > 0:
            kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        token = int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
        yield token
        if k + 1 < max_tokens:
            with torch.no_grad():
                logits = window.feed(token)


def _sample(model: nn.Module, vocab: Vocab, prompt: str, ids: list[int], max_tokens: int, temperature: float,
            top_k: int, seed: int, context: int, cached: bool) -> Iterator[str]:
    if prompt:
        yield prompt
    yield from vocab.decode_stream(sample_ids(model, ids, max_tokens, temperature, top_k, seed, context, cached))
