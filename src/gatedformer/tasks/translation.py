"""Translation: training with teacher forcing, greedy and beam-search decoding, BLEU.

The translation task (:class:`TranslationTask`) is what the training loop runs when ``data.corpus`` is a parallel
corpus (``multi30k``). Its run folder holds, besides what every run keeps, ``vocab.json`` (both vocabularies, so a
run translates without the corpus) and ``test.hyp.txt`` (the test translations). The metric is ``bleu``: the
valid/test losses are the mean negative log-likelihood per target token (no label smoothing), the valid/test
metrics SacreBLEU on the valid set and on ``test_2016_flickr``.

Training: label-smoothed cross-entropy over the target tokens (``translation.label_smoothing``), batches by length
(:func:`~gatedformer.data.translation.length_batches`) re-drawn every epoch from the run seed; where the data
stands (epoch and batch) is kept in the checkpoint. Intermediate evaluations score BLEU on the first
``translation.bleu_sentences`` valid sentences (0: all); the final one on all of them.

Decoding: :func:`greedy_decode` and :func:`beam_search` (``translation.beam_size``, length penalty
``((5 + |y|) / 6) ** translation.length_penalty``), both batched and incremental (cached keys and
values). A hypothesis ends at ``<eos>`` or after ``min(n - 1, 2 · source length + 10)`` tokens.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.config import RunConfig, get_backbone
from gatedformer.data.translation import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ParallelSplit,
    TranslationData,
    collate,
    decode_ids,
    detokenize,
    encode,
    length_batches,
    load_translation_data,
    source_batch,
    tokenize,
)
from gatedformer.data.vocab import Vocab
from gatedformer.devices import autocast
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError
from gatedformer.io import atomic_write_text
from gatedformer.models.seq2seq import Seq2SeqTransformer
from gatedformer.tasks.base import Task, TrainBatch

METRIC = "bleu"


# ---------------------------------------------------------------------------------------------
# Model and data from a config


def build_seq2seq(config: RunConfig, src_vocab: int, tgt_vocab: int) -> nn.Module:
    """The encoder-decoder ``model.backbone`` names (l, k, f, heads, gates) with n = ``translation.max_len``."""
    backbone = get_backbone(config.model.backbone, "translation")
    return backbone.build(config.model, src_vocab=src_vocab, tgt_vocab=tgt_vocab, max_len=config.translation.max_len,
                          pad_id=PAD_ID)


def load_data(config: RunConfig, data_dir: str | Path | None = None) -> TranslationData:
    """The corpus, vocabularies and splits a translation config asks for."""
    tr = config.translation
    return load_translation_data(
        tr.src_lang, tr.tgt_lang, data_dir, min_freq=tr.min_freq, max_len=tr.max_len,
        src_vocab_size=tr.src_vocab, tgt_vocab_size=tr.tgt_vocab, train_sentences=tr.train_sentences,
        corpus=config.data.corpus,
    )


# ---------------------------------------------------------------------------------------------
# Decoding


def _step_limit(model: Seq2SeqTransformer, src_mask: torch.Tensor) -> int:
    longest_source = int(src_mask.sum(dim=1).max().item()) if src_mask.numel() else 0
    return max(1, min(model.max_len - 1, 2 * longest_source + 10))


@torch.no_grad()
def greedy_decode(model: Seq2SeqTransformer, src: torch.Tensor) -> list[list[int]]:
    """The likeliest next token at every step, for a batch ``src (B, S)``; ids without ``<eos>``."""
    memory, src_mask = model.encode(src)
    batch = src.shape[0]
    cache = model.new_cache()
    token = torch.full((batch,), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    steps = []
    for position in range(_step_limit(model, src_mask)):
        token = _next_logits(model, token, position, memory, src_mask, cache).argmax(dim=-1)
        steps.append(token)
        done |= token == EOS_ID
        if bool(done.all()):
            break
    rows = torch.stack(steps, dim=1).tolist()
    return [_until_eos(row) for row in rows]


def _next_logits(model: Seq2SeqTransformer, tokens: torch.Tensor, position: int, memory: torch.Tensor,
                 src_mask: torch.Tensor, cache: list) -> torch.Tensor:
    """Next-token logits in float32, with ``<pad>`` and ``<bos>`` ruled out (they are never outputs)."""
    logits = model.decode_step(tokens, position, memory, src_mask, cache).float()
    logits[:, PAD_ID] = -math.inf
    logits[:, BOS_ID] = -math.inf
    return logits


def _until_eos(ids: Sequence[int]) -> list[int]:
    return list(ids[: ids.index(EOS_ID)]) if EOS_ID in ids else list(ids)


def _length_penalty(length: int, alpha: float) -> float:
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model: Seq2SeqTransformer, src: torch.Tensor, beam: int = 4,
                length_penalty: float = 0.6) -> list[list[int]]:
    """Beam search over a batch ``src (B, S)``; the best hypothesis of each sentence, ids without ``<eos>``.

    At every step the ``2·beam`` best extensions of a sentence's beams are ranked; those among the
    first ``beam`` that end in ``<eos>`` are finished (scored by log-probability / length penalty,
    the length counting ``<eos>``), the best ``beam`` others go on. A sentence stops once ``beam``
    hypotheses are finished; at the step limit the unfinished ones are scored as they are. With
    ``beam=1`` this is exactly :func:`greedy_decode`.
    """
    if beam < 1:
        raise ConfigError(f"beam size must be at least 1, got {beam}")
    batch, k = src.shape[0], beam
    memory, src_mask = model.encode(src)
    limit = _step_limit(model, src_mask)
    memory, src_mask = memory.repeat_interleave(k, dim=0), src_mask.repeat_interleave(k, dim=0)
    device = src.device
    cache = model.new_cache()
    scores = torch.full((batch, k), -math.inf, device=device)
    scores[:, 0] = 0.0
    history = torch.full((batch * k, 1), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    done = [False] * batch
    for position in range(limit):
        log_probs = F.log_softmax(_next_logits(model, history[:, -1], position, memory, src_mask, cache), dim=-1)
        vocab = log_probs.shape[-1]
        candidates = (scores.view(-1, 1) + log_probs).view(batch, k * vocab)
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)
        top_scores_l, top_beam_l, top_token_l = (
            top_scores.tolist(), (top_index // vocab).tolist(), (top_index % vocab).tolist())
        rows, tokens, new_scores = [], [], []
        for b in range(batch):
            alive: list[tuple[int, int, float]] = []
            if not done[b]:
                for rank, (score, j, token) in enumerate(zip(top_scores_l[b], top_beam_l[b], top_token_l[b],
                                                             strict=True)):
                    if score == -math.inf:
                        break
                    if token == EOS_ID:
                        if rank < k:
                            hypothesis = history[b * k + j, 1:].tolist()
                            finished[b].append((score / _length_penalty(len(hypothesis) + 1, length_penalty),
                                                hypothesis))
                    else:
                        alive.append((b * k + j, token, score))
                        if len(alive) == k:
                            break
                if len(finished[b]) >= k or not alive:
                    done[b] = True
                    alive = []
            alive += [(b * k, PAD_ID, -math.inf)] * (k - len(alive))
            for row, token, score in alive:
                rows.append(row)
                tokens.append(token)
                new_scores.append(score)
        if all(done):
            break
        order = torch.tensor(rows, dtype=torch.long, device=device)
        history = torch.cat([history.index_select(0, order), torch.tensor(tokens, device=device)[:, None]], dim=1)
        scores = torch.tensor(new_scores, device=device).view(batch, k)
        model.reorder_cache(cache, order)
    for b in range(batch):
        if not done[b]:
            for j in range(k):
                score = float(scores[b, j])
                if score > -math.inf:
                    hypothesis = history[b * k + j, 1:].tolist()
                    finished[b].append((score / _length_penalty(len(hypothesis), length_penalty), hypothesis))
    return [max(options, key=lambda option: option[0])[1] if options else [] for options in finished]


@torch.no_grad()
def translate_ids(model: Seq2SeqTransformer, sources: Sequence[Sequence[int]], beam: int = 1,
                  length_penalty: float = 0.6, batch_size: int = 64) -> list[list[int]]:
    """Target ids for every source (ids without ``<eos>``), decoded in batches of similar length.

    ``beam=1`` decodes greedily, more runs beam search.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    outputs: list[list[int]] = [[] for _ in sources]
    step = max(1, batch_size)
    for start in range(0, len(order), step):
        chunk = order[start: start + step]
        src = source_batch([sources[i] for i in chunk]).to(device)
        decoded = greedy_decode(model, src) if beam == 1 else beam_search(model, src, beam, length_penalty)
        for i, ids in zip(chunk, decoded, strict=True):
            outputs[i] = ids
    model.train(was_training)
    return outputs


# ---------------------------------------------------------------------------------------------
# Scoring


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """SacreBLEU (13a tokenisation, case-insensitive) of detokenised ``hypotheses`` against ``references``."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return 0.0
    try:
        import sacrebleu
    except ImportError:
        raise GatedformerError("BLEU needs sacrebleu; install it with pip install 'gatedformer[translate]'") from None
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)], lowercase=True).score)


@torch.no_grad()
def evaluate_loss(model: nn.Module, split: ParallelSplit, batch_size: int, device: torch.device,
                  precision: str = "fp32") -> float:
    """Mean negative log-likelihood (nats) per target token, ``<eos>`` included, under teacher forcing."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for indices in length_batches(split, batch_size, shuffle=False):
        src, tgt_in, tgt_out = (t.to(device) for t in collate(split, indices))
        with autocast(device, precision):
            loss = model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID, reduction="sum")
        total += loss.item()
        count += int((tgt_out != PAD_ID).sum())
    model.train(was_training)
    return total / max(count, 1)


def evaluate_bleu(model: Seq2SeqTransformer, split: ParallelSplit, tgt_vocab: Vocab, tgt_lang: str, beam: int,
                  length_penalty: float, batch_size: int, sentences: int = 0) -> tuple[float, list[str]]:
    """BLEU of the model's translations of the first ``sentences`` of ``split`` (0: all), and the translations."""
    count = len(split) if sentences <= 0 else min(sentences, len(split))
    ids = translate_ids(model, split.src[:count], beam, length_penalty, batch_size)
    hypotheses = [detokenize(decode_ids(row, tgt_vocab), tgt_lang) for row in ids]
    return corpus_bleu(hypotheses, split.references[:count]), hypotheses


def _beam_of(config: RunConfig) -> int:
    return 1 if config.translation.decode == "greedy" else config.translation.beam_size


def _vocab_record(data: TranslationData) -> dict[str, Any]:
    return {"corpus": data.corpus, "src_lang": data.src_lang, "tgt_lang": data.tgt_lang,
            "src": list(data.src_vocab.itos), "tgt": list(data.tgt_vocab.itos)}




@dataclass
class Vocabularies:
    """What a trained translation model needs besides its weights."""

    src: Vocab
    tgt: Vocab


class TranslationTask(Task):
    """Translation on a parallel corpus (``multi30k``) with an encoder-decoder."""

    name = "translation"
    title = "translation"

    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: Any = None) -> TranslationData:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = load_data(config, data_dir)
        for warning in caught:
            if progress:
                print(f"gatedformer: {warning.message}", flush=True)
        if data.train.skipped and progress:
            print(f"gatedformer: skipped {data.train.skipped} training pair(s) that are empty or longer than "
                  f"translation.max_len={config.translation.max_len} allows", flush=True)
        return data

    def build_model(self, config: RunConfig, data: TranslationData | Vocabularies) -> nn.Module:
        if isinstance(data, Vocabularies):
            return build_seq2seq(config, len(data.src), len(data.tgt))
        return build_seq2seq(config, len(data.src_vocab), len(data.tgt_vocab))

    def metric(self, data: TranslationData) -> str:
        return METRIC

    def run_files(self, data: TranslationData) -> dict[str, Any]:
        return {"vocab.json": _vocab_record(data)}

    def start_records(self, data: TranslationData, params: int) -> list[dict[str, Any]]:
        return [{"event": "data", "step": 0, "corpus": data.corpus, "pair": f"{data.src_lang}-{data.tgt_lang}",
                 "src_vocab": len(data.src_vocab), "tgt_vocab": len(data.tgt_vocab), "train_pairs": len(data.train),
                 "skipped_train_pairs": data.train.skipped, "truncated_valid": data.valid.truncated,
                 "truncated_test": data.test.truncated, "params": params}]

    @staticmethod
    def _epoch_batches(data: TranslationData, config: RunConfig, epoch: int) -> list[list[int]]:
        return length_batches(data.train, config.data.batch_size, config.translation.max_tokens, config.train.seed,
                              epoch)

    def train_batches(self, data: TranslationData, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        epoch, position = (meta["epoch"], meta["batch_in_epoch"]) if meta is not None else (0, 0)
        batches = self._epoch_batches(data, config, epoch)
        while True:
            if position >= len(batches):
                epoch, position = epoch + 1, 0
                batches = self._epoch_batches(data, config, epoch)
            indices = batches[position]
            position += 1
            src, tgt_in, tgt_out = collate(data.train, indices)
            yield TrainBatch((src, tgt_in, tgt_out), int((tgt_out != PAD_ID).sum()),
                             position={"epoch": epoch, "batch_in_epoch": position})

    def steps_per_epoch(self, data: TranslationData, config: RunConfig, meta: dict[str, Any] | None) -> int:
        return len(self._epoch_batches(data, config, meta["epoch"] if meta is not None else 0))

    def log_fields(self, position: dict[str, int]) -> dict[str, Any]:
        return {"epoch": position["epoch"]} if position else {}

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        src, tgt_in, tgt_out = (t.to(device) for t in batch.inputs)
        with autocast(device, config.train.precision):
            # the decoder's output layer and the loss as one function (see ops.output_loss)
            return model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID,
                         label_smoothing=config.translation.label_smoothing), None

    def evaluate(self, model: nn.Module, data: TranslationData, config: RunConfig, device: torch.device,
                 final: bool, recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        tr, batch = config.translation, config.data.eval_batch_size
        with recording():
            valid_loss = evaluate_loss(model, data.valid, batch, device, config.train.precision)
        sentences = len(data.valid) if final or tr.bleu_sentences <= 0 else min(tr.bleu_sentences, len(data.valid))
        valid_bleu, _ = evaluate_bleu(model, data.valid, data.tgt_vocab, data.tgt_lang, _beam_of(config),
                                      tr.length_penalty, batch, 0 if final else tr.bleu_sentences)
        return {"valid_loss": valid_loss, f"valid_{METRIC}": valid_bleu, "bleu_sentences": sentences}

    def score(self, model: nn.Module, data: TranslationData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        tr, batch, precision = config.translation, config.data.eval_batch_size, config.train.precision
        if final_eval is None:  # resumed from the final checkpoint: score valid again
            valid_loss = evaluate_loss(model, data.valid, batch, device, precision)
            valid_bleu, _ = evaluate_bleu(model, data.valid, data.tgt_vocab, data.tgt_lang, _beam_of(config),
                                          tr.length_penalty, batch)
        else:
            valid_loss, valid_bleu = final_eval["valid_loss"], final_eval[f"valid_{METRIC}"]
        test_loss = evaluate_loss(model, data.test, batch, device, precision)
        test_bleu, hypotheses = evaluate_bleu(model, data.test, data.tgt_vocab, data.tgt_lang, _beam_of(config),
                                              tr.length_penalty, batch)
        atomic_write_text(out_dir / "test.hyp.txt", "".join(h + "\n" for h in hypotheses))
        return valid_loss, valid_bleu, test_loss, test_bleu

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> Vocabularies:
        vocab_file = run_dir / "vocab.json"
        if vocab_file.is_file():
            try:
                record = json.loads(vocab_file.read_text(encoding="utf-8"))
                return Vocabularies(Vocab(tuple(record["src"]), "word"), Vocab(tuple(record["tgt"]), "word"))
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{vocab_file} is corrupt ({err}); delete it to rebuild it from the "
                                      "corpus") from None
        data = load_data(config, data_dir)
        return Vocabularies(data.src_vocab, data.tgt_vocab)

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: Vocabularies) -> dict[str, float]:
        corpus = load_data(config, data_dir)
        part = corpus.valid if split == "valid" else corpus.test
        loss = evaluate_loss(model, part, config.data.eval_batch_size, device, config.train.precision)
        bleu, _ = evaluate_bleu(model, part, corpus.tgt_vocab, config.translation.tgt_lang, _beam_of(config),
                                config.translation.length_penalty, config.data.eval_batch_size)
        return {"loss": loss, "bleu": bleu}


def translate_lines(model: Seq2SeqTransformer, config: RunConfig, vocabularies: Vocabularies, lines: Sequence[str],
                    beam: int | None = None, length_penalty: float | None = None,
                    batch_size: int = 64) -> list[str]:
    """Translate raw sentences (one per item) with a trained model; one detokenised translation per line.

    Lines are tokenised like the training data (:func:`~gatedformer.data.translation.tokenize`). An
    empty (or blank) line translates to an empty line, so outputs stay aligned with inputs. A line
    longer than the model's n - 2 tokens raises a one-line :class:`DataError` naming it. ``beam``
    overrides the run's decoding (1: greedy); ``None`` uses ``translation.decode``/``beam_size``.
    """
    if beam is not None and beam < 1:
        raise ConfigError(f"--beam must be at least 1, got {beam}")
    if length_penalty is not None and not (math.isfinite(length_penalty) and length_penalty >= 0):
        raise ConfigError(f"--length-penalty must be a finite number >= 0 (0: none), got {length_penalty}")
    tr = config.translation
    longest = tr.max_len - 2
    sources: list[list[int]] = []
    wanted: list[int] = []
    for number, line in enumerate(lines, start=1):
        tokens = tokenize(line, tr.src_lang)
        if not tokens:
            continue
        if len(tokens) > longest:
            raise DataError(f"input line {number} has {len(tokens)} tokens, but this model takes at most {longest} "
                            f"(translation.max_len n={tr.max_len}, with <bos> and <eos>); split the sentence")
        sources.append(encode(tokens, vocabularies.src))
        wanted.append(number - 1)
    size = _beam_of(config) if beam is None else beam
    penalty = tr.length_penalty if length_penalty is None else length_penalty
    decoded = translate_ids(model, sources, size, penalty, batch_size)
    out = [""] * len(lines)
    for index, ids in zip(wanted, decoded, strict=True):
        out[index] = detokenize(decode_ids(ids, vocabularies.tgt), tr.tgt_lang)
    return out
