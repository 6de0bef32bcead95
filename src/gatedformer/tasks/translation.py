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

import itertools
import json
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
    bleu_is_lowercase,
    collate,
    decode_ids,
    encode,
    length_batches,
    load_translation_data,
    source_batch,
    text_of,
    text_tokens,
)
from gatedformer.data.translation import CORPORA as PARALLEL_CORPORA
from gatedformer.data.vocab import Vocab
from gatedformer.devices import autocast
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError
from gatedformer.fused import fuse
from gatedformer.io import atomic_write_text, input_lines, read_limited
from gatedformer.tasks.base import Task, TrainBatch, by_length, evaluating, register_task

METRIC = "bleu"
MAX_DECODE_ROWS = 4096
"""The most hypotheses decoded side by side (sentences × beam), which bounds a wide beam's memory."""


class TranslationModel(Protocol):
    """What decoding asks of a translation network (every ``translation`` backbone: the Transformer, the Transformer
    with SRU, ConvS2S): ``encode`` a source batch once, then ``decode_step`` one target position at a time with a
    cache from ``new_cache``, whose rows ``reorder_cache`` permutes for beam search; ``attention_maps`` gives every
    decoder layer's attention over the source under teacher forcing."""

    max_len: int

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(memory, src_mask)``: memory with one row per sentence, the mask True at real tokens."""

    def new_cache(self) -> Any:
        """An empty cache for :meth:`decode_step`."""

    def decode_step(self, tokens: torch.Tensor, position: int, memory: torch.Tensor, src_mask: torch.Tensor,
                    cache: Any) -> torch.Tensor:
        """Next-token logits ``(B, V)`` after feeding ``tokens (B,)`` at ``position``."""

    def reorder_cache(self, cache: Any, order: torch.Tensor) -> None:
        """Keep rows ``order`` of the cache."""

    def attention_maps(self, src: torch.Tensor, tgt_in: torch.Tensor) -> list[torch.Tensor]:
        """One ``(B, T, S)`` map of attention weights per decoder layer."""


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
        corpus=config.data.corpus, shared_vocab=tr.shared_vocab,
    )


# ---------------------------------------------------------------------------------------------
# Decoding


def _step_limit(model: TranslationModel, src_mask: torch.Tensor) -> int:
    longest_source = int(src_mask.sum(dim=1).max().item()) if src_mask.numel() else 0
    return max(1, min(model.max_len - 1, 2 * longest_source + 10))


@torch.no_grad()
def greedy_decode(model: TranslationModel, src: torch.Tensor) -> list[list[int]]:
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


def _next_logits(model: TranslationModel, tokens: torch.Tensor, position: int, memory: torch.Tensor,
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
def beam_search(model: TranslationModel, src: torch.Tensor, beam: int = 4,
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
def translate_ids(model: TranslationModel, sources: Sequence[Sequence[int]], beam: int = 1,
                  length_penalty: float = 0.6, batch_size: int = 64) -> list[list[int]]:
    """Target ids for every source (ids without ``<eos>``), decoded in batches of similar length.

    ``beam=1`` decodes greedily, more runs beam search.
    """
    device = next(model.parameters()).device
    outputs: list[list[int]] = [[] for _ in sources]
    # Sentences a decoding batch holds: beam search keeps `beam` rows of each, so a wide beam takes fewer at a time.
    step = max(1, min(batch_size, MAX_DECODE_ROWS // max(beam, 1)))
    with evaluating(model):
        for chunk in by_length([len(ids) for ids in sources], step):
            src = source_batch([sources[i] for i in chunk]).to(device)
            decoded = greedy_decode(model, src) if beam == 1 else beam_search(model, src, beam, length_penalty)
            for i, ids in zip(chunk, decoded, strict=True):
                outputs[i] = ids
    return outputs


# ---------------------------------------------------------------------------------------------
# Scoring


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = True) -> float:
    """SacreBLEU (13a tokenisation; case-insensitive with ``lowercase``) of detokenised ``hypotheses`` against
    ``references``."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return 0.0
    try:
        import sacrebleu
    except ImportError:
        raise GatedformerError("BLEU needs sacrebleu; install it with pip install 'gatedformer[translate]'") from None
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)], lowercase=lowercase).score)


@torch.no_grad()
def evaluate_loss(model: nn.Module, split: ParallelSplit, batch_size: int, device: torch.device,
                  precision: str = "fp32") -> float:
    """Mean negative log-likelihood (nats) per target token, ``<eos>`` included, under teacher forcing."""
    total, count = 0.0, 0
    with evaluating(model):
        for indices in length_batches(split, batch_size, shuffle=False):
            src, tgt_in, tgt_out = (t.to(device) for t in collate(split, indices))
            with autocast(device, precision):
                loss = model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID, reduction="sum").loss
            total += loss.item()
            count += int((tgt_out != PAD_ID).sum())
    return total / max(count, 1)


def evaluate_bleu(model: TranslationModel, split: ParallelSplit, tgt_vocab: Vocab, tgt_lang: str, beam: int,
                  length_penalty: float, batch_size: int, sentences: int = 0,
                  corpus: str = "multi30k") -> tuple[float, list[str]]:
    """BLEU of the model's translations of the first ``sentences`` of ``split`` (0: all), and the translations
    (detokenised as ``corpus``'s text is; case-sensitive where its models read cased text)."""
    count = len(split) if sentences <= 0 else min(sentences, len(split))
    ids = translate_ids(model, split.src[:count], beam, length_penalty, batch_size)
    hypotheses = [text_of(decode_ids(row, tgt_vocab), tgt_lang, corpus) for row in ids]
    return corpus_bleu(hypotheses, split.references[:count], bleu_is_lowercase(corpus)), hypotheses


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
    bpe_json: str | None = None
    """The subword model new text is split with (WMT'14's joint BPE); ``None`` for Multi30K's words."""


@register_task("translation", corpora=PARALLEL_CORPORA, sections=("translation",))
class TranslationTask(Task[TranslationData, Vocabularies]):
    """Translation on a parallel corpus (``multi30k``) with an encoder-decoder."""

    title = "translation"
    optional_modules = (("sacrebleu", "translate"),)  # BLEU, at every evaluation

    def modules_for(self, config: RunConfig) -> tuple[tuple[str, str], ...]:
        # WMT'14's hypotheses are Moses-detokenised before BLEU.
        return self.optional_modules + ((("sacremoses", "translate"),) if config.data.corpus == "wmt14" else ())

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
        if _beam_of(config) > len(data.tgt_vocab):  # beams beyond the vocabulary only cost memory
            raise ConfigError(f"translation.beam_size={config.translation.beam_size} is larger than the target "
                              f"vocabulary ({len(data.tgt_vocab)} tokens); set it at most that")
        return data

    def build_model(self, config: RunConfig, data: TranslationData | Vocabularies) -> nn.Module:
        if isinstance(data, Vocabularies):
            return fuse(build_seq2seq(config, len(data.src), len(data.tgt)))
        return fuse(build_seq2seq(config, len(data.src_vocab), len(data.tgt_vocab)))

    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        return build_seq2seq(config, vocab_size, vocab_size)

    def metric(self, data: TranslationData) -> str:
        return METRIC

    def run_files(self, data: TranslationData) -> dict[str, Any]:
        files: dict[str, Any] = {"vocab.json": _vocab_record(data)}
        if data.bpe_json is not None:  # so that the run translates new text without the corpus
            files["bpe.json"] = data.bpe_json
        return files

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

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        src, tgt_in, tgt_out = (t.to(device) for t in batch.inputs)
        with autocast(device, config.train.precision):
            # the decoder's fused output layer and the loss as one function (see fused.output)
            out = model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID,
                        label_smoothing=config.translation.label_smoothing)
        return out.loss, None

    def evaluate(self, model: nn.Module, data: TranslationData, config: RunConfig, device: torch.device,
                 final: bool, recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        tr, batch = config.translation, config.data.eval_batch_size
        with recording():
            valid_loss = evaluate_loss(model, data.valid, batch, device, config.train.precision)
        sentences = len(data.valid) if final or tr.bleu_sentences <= 0 else min(tr.bleu_sentences, len(data.valid))
        valid_bleu, _ = evaluate_bleu(model, data.valid, data.tgt_vocab, data.tgt_lang, _beam_of(config),
                                      tr.length_penalty, batch, 0 if final else tr.bleu_sentences, data.corpus)
        return {"valid_loss": valid_loss, f"valid_{METRIC}": valid_bleu, "bleu_sentences": sentences}

    def score(self, model: nn.Module, data: TranslationData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        tr, batch, precision = config.translation, config.data.eval_batch_size, config.train.precision
        if final_eval is None:  # resumed from the final checkpoint: score valid again
            valid_loss = evaluate_loss(model, data.valid, batch, device, precision)
            valid_bleu, _ = evaluate_bleu(model, data.valid, data.tgt_vocab, data.tgt_lang, _beam_of(config),
                                          tr.length_penalty, batch, corpus=data.corpus)
        else:
            valid_loss, valid_bleu = final_eval["valid_loss"], final_eval[f"valid_{METRIC}"]
        test_loss = evaluate_loss(model, data.test, batch, device, precision)
        test_bleu, hypotheses = evaluate_bleu(model, data.test, data.tgt_vocab, data.tgt_lang, _beam_of(config),
                                              tr.length_penalty, batch, corpus=data.corpus)
        atomic_write_text(out_dir / "test.hyp.txt", "".join(h + "\n" for h in hypotheses))
        return valid_loss, valid_bleu, test_loss, test_bleu

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> Vocabularies:
        vocab_file = run_dir / "vocab.json"
        if vocab_file.is_file():
            try:
                record = json.loads(read_limited(vocab_file, 1 << 28))  # vocabularies of a million words fit
                bpe_file = run_dir / "bpe.json"
                bpe = read_limited(bpe_file, 1 << 28).decode("utf-8") if bpe_file.is_file() else None
                return Vocabularies(Vocab(tuple(record["src"]), "word"), Vocab(tuple(record["tgt"]), "word"), bpe)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{vocab_file} is corrupt ({err}); delete it to rebuild it from the "
                                      "corpus") from None
        data = load_data(config, data_dir)
        return Vocabularies(data.src_vocab, data.tgt_vocab, data.bpe_json)

    def inference_files(self, data: Vocabularies) -> dict[str, str]:
        files = {"vocab.json": json.dumps({"src": list(data.src.itos), "tgt": list(data.tgt.itos)}, ensure_ascii=False)}
        if data.bpe_json is not None:
            files["bpe.json"] = data.bpe_json
        return files

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: Vocabularies) -> dict[str, float]:
        corpus = load_data(config, data_dir)
        part = corpus.valid if split == "valid" else corpus.test
        loss = evaluate_loss(model, part, config.data.eval_batch_size, device, config.train.precision)
        bleu, _ = evaluate_bleu(model, part, corpus.tgt_vocab, config.translation.tgt_lang, _beam_of(config),
                                config.translation.length_penalty, config.data.eval_batch_size,
                                corpus=corpus.corpus)
        return {"loss": loss, "bleu": bleu}


def _check_decoding(vocabularies: Vocabularies, beam: int | None, length_penalty: float | None) -> None:
    if beam is not None and not 1 <= beam <= len(vocabularies.tgt):
        raise ConfigError(f"--beam must be from 1 (greedy) to the target vocabulary's {len(vocabularies.tgt)} tokens, "
                          f"got {beam}")
    if length_penalty is not None and not (math.isfinite(length_penalty) and length_penalty >= 0):
        raise ConfigError(f"--length-penalty must be a finite number >= 0 (0: none), got {length_penalty}")


def translate_lines(model: TranslationModel, config: RunConfig, vocabularies: Vocabularies, lines: Sequence[str],
                    beam: int | None = None, length_penalty: float | None = None,
                    batch_size: int = 64, first_line: int = 1) -> list[str]:
    """Translate raw sentences (one per item) with a trained model; one detokenised translation per line.

    Lines are tokenised like the training data (:func:`~gatedformer.data.translation.tokenize`). An
    empty (or blank) line translates to an empty line, so outputs stay aligned with inputs. A line
    longer than the model's n - 2 tokens raises a one-line :class:`DataError` naming it. ``beam``
    overrides the run's decoding (1: greedy; at most the target vocabulary's size); ``None`` uses
    ``translation.decode``/``beam_size``. Errors number the lines from ``first_line``.
    """
    _check_decoding(vocabularies, beam, length_penalty)
    tr = config.translation
    longest = tr.max_len - 2
    sources: list[list[int]] = []
    wanted: list[int] = []
    for number, line in enumerate(lines, start=first_line):
        tokens = text_tokens(line, tr.src_lang, config.data.corpus, vocabularies.bpe_json)
        if not tokens:
            continue
        if len(tokens) > longest:
            raise DataError(f"input line {number} has {len(tokens)} tokens, but this model takes at most {longest} "
                            f"(translation.max_len n={tr.max_len}, with <bos> and <eos>); split the sentence")
        sources.append(encode(tokens, vocabularies.src))
        wanted.append(number - first_line)
    size = _beam_of(config) if beam is None else beam
    penalty = tr.length_penalty if length_penalty is None else length_penalty
    decoded = translate_ids(model, sources, size, penalty, batch_size)
    out = [""] * len(lines)
    for index, ids in zip(wanted, decoded, strict=True):
        out[index] = text_of(decode_ids(ids, vocabularies.tgt), tr.tgt_lang, config.data.corpus)
    return out


def source_lines(path: str | Path | None) -> Iterator[str]:
    """The source sentences ``translate`` reads, one a line, from the file ``path`` (``None``: standard input), as
    they come (:func:`~gatedformer.io.input_lines`)."""
    return input_lines(path, "give UTF-8 text, one source sentence a line")


def translate_stream(model: TranslationModel, config: RunConfig, vocabularies: Vocabularies, lines: Iterable[str],
                     beam: int | None = None, length_penalty: float | None = None, batch_size: int = 64
                     ) -> Iterator[str]:
    """:func:`translate_lines` over ``lines`` as they come, ``batch_size`` lines at a time: one translation per line,
    in order, each batch's as soon as it is decoded, in memory that does not grow with the input. Bad options fail
    here, before a line is read."""
    _check_decoding(vocabularies, beam, length_penalty)

    def translations() -> Iterator[str]:
        chunk: list[str] = []
        done = 0
        for line in itertools.chain(lines, [None]):
            if line is not None:
                chunk.append(line)
            if chunk and (line is None or len(chunk) >= batch_size):
                yield from translate_lines(model, config, vocabularies, chunk, beam, length_penalty, batch_size,
                                           first_line=done + 1)
                done += len(chunk)
                chunk = []

    return translations()


# ---------------------------------------------------------------------------------------------
# Attention figures


@dataclass
class AttentionMaps:
    """One sentence's translation and every decoder layer's attention over its source (ConvS2S's Figure 3)."""

    source: list[str]
    """The source tokens as the model read them, ``<eos>`` last."""
    output: list[str]
    """The translation's tokens, ``<eos>`` last."""
    layers: list[torch.Tensor]
    """One ``(len(output), len(source))`` map per decoder layer: output position ``t``'s attention weights over the
    source (averaged over the heads of a multi-head attention)."""


@torch.no_grad()
def attention_maps(model: TranslationModel, src_ids: Sequence[int], source: Sequence[str], tgt_vocab: Vocab,
                   beam: int = 1, length_penalty: float = 0.6) -> AttentionMaps:
    """Translate one source sentence (ids without ``<eos>``, ``source`` their tokens) and read every decoder layer's
    attention as the decoder reads that translation with teacher forcing: the attention incremental decoding had at
    each step, since the decoders are causal."""
    device = next(model.parameters()).device
    with evaluating(model):
        ids = translate_ids(model, [list(src_ids)], beam, length_penalty)[0]
        src = source_batch([list(src_ids)]).to(device)
        tgt_in = torch.tensor([[BOS_ID, *ids]], dtype=torch.long, device=device)
        layers = [weights[0].float().cpu() for weights in model.attention_maps(src, tgt_in)]
    output = [tgt_vocab.itos[i] for i in ids]
    return AttentionMaps([*source, "<eos>"], [*output, "<eos>"], layers)


def attention_for_line(model: TranslationModel, config: RunConfig, vocabularies: Vocabularies, line: str,
                       beam: int | None = None, length_penalty: float | None = None) -> AttentionMaps:
    """:func:`attention_maps` of a raw sentence, tokenised as ``translate`` tokenises it (a :class:`DataError` for an
    empty line or one longer than the model takes)."""
    _check_decoding(vocabularies, beam, length_penalty)
    tr = config.translation
    tokens = text_tokens(line, tr.src_lang, config.data.corpus, vocabularies.bpe_json)
    if not tokens:
        raise DataError("the attention figure needs a sentence, but the input has no non-empty line")
    if len(tokens) > tr.max_len - 2:
        raise DataError(f"the attention figure's sentence has {len(tokens)} tokens, but this model takes at most "
                        f"{tr.max_len - 2}; give a shorter first line")
    return attention_maps(model, encode(tokens, vocabularies.src), tokens, vocabularies.tgt,
                          _beam_of(config) if beam is None else beam,
                          tr.length_penalty if length_penalty is None else length_penalty)
