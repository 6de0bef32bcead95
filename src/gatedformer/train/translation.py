"""Translation: training with teacher forcing, greedy and beam-search decoding, BLEU.

``train_translation(config, out_dir)`` is what :func:`gatedformer.train.loop.train` runs when
``data.corpus`` is a translation corpus (``multi30k``). It writes the same run directory as the
language-model loop — ``config.json``, ``log.jsonl``, ``ckpt/``, ``model.safetensors``, ``results.json``,
all atomically, with exact resume — plus ``vocab.json`` (both vocabularies, so a run translates
without the corpus) and ``test.hyp.txt`` (the test translations). The metric is ``bleu``: the
valid/test losses are the mean negative log-likelihood per target token (no label smoothing), the
valid/test metrics SacreBLEU on the valid set and on ``test_2016_flickr``.

Training: label-smoothed cross-entropy over the target tokens (``translation.label_smoothing``),
the optimisers and learning-rate schedules of :mod:`gatedformer.train.optim` (``optim.schedule=noam``
is the warm-up of Vaswani et al.), batches by length (:func:`~gatedformer.data.translation.length_batches`)
re-drawn every epoch from the run seed. Intermediate evaluations score BLEU on the first
``translation.bleu_sentences`` valid sentences (0: all); the final one on all of them.

Decoding: :func:`greedy_decode` and :func:`beam_search` (``translation.beam_size``, length penalty
``((5 + |y|) / 6) ** translation.length_penalty``), both batched and incremental (cached keys and
values). A hypothesis ends at ``<eos>`` or after ``min(n - 1, 2 · source length + 10)`` tokens.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.config import TRANSLATION_CORPORA, RunConfig, validate
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
from gatedformer.devices import resolve_device
from gatedformer.errors import CheckpointError, ConfigError, DataError, GatedformerError
from gatedformer.io import atomic_write_json, atomic_write_text, make_folder
from gatedformer.models.seq2seq import Seq2SeqTransformer
from gatedformer.train.checkpoint import (
    load_checkpoint,
    load_model_weights,
    load_run_weights,
    read_run_config,
    restoring,
    save_checkpoint,
    save_model_weights,
    save_tensors_atomically,
    weights_metadata,
)
from gatedformer.train.clock import TrainingClock
from gatedformer.train.compiling import compile_model
from gatedformer.train.gate_stats import GateStatistics, gate_biases
from gatedformer.train.init import initialise
from gatedformer.train.loop import (
    RunResult,
    _autocast,
    _progress_bar,
    _StopSignal,
    _truncate_log,
    count_parameters,
    optimise,
    prepare_run_dir,
    stop_here,
)
from gatedformer.train.optim import build_optimizer, build_scheduler, follow_changed_lr

METRIC = "bleu"


# ---------------------------------------------------------------------------------------------
# Model and data from a config


def build_seq2seq(config: RunConfig, src_vocab: int, tgt_vocab: int) -> Seq2SeqTransformer:
    """The encoder-decoder of ``config.model`` (l, k, f, heads, gates) with n = ``translation.max_len``."""
    m = config.model
    return Seq2SeqTransformer(
        src_vocab, tgt_vocab, layers=m.n_layers, d_model=m.d_model, ffn=m.d_ffn, heads=m.n_heads,
        max_len=config.translation.max_len, dropout=m.dropout, gates=m.gates, tie_embeddings=m.tie_embeddings,
        pad_id=PAD_ID, attn_dropout=m.attn_dropout, norm=m.norm, ffn_kind=m.ffn, emb_dropout=m.emb_dropout,
    )


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
        with _autocast(device, precision):
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


# ---------------------------------------------------------------------------------------------
# Training


def train_translation(config: RunConfig, out_dir: str | Path, data_dir: str | Path | None = None,
                      resume: bool = False, progress: bool = True, stop_after: int | None = None,
                      on_record: Callable[[dict[str, Any]], None] | None = None) -> RunResult | None:
    """Train the encoder-decoder of ``config`` into ``out_dir``; return the final results, or ``None``
    if ``stop_after`` ended the run early (it can then be resumed). ``on_record`` sees every log record
    as it is written."""
    validate(config)
    if config.data.corpus not in TRANSLATION_CORPORA:
        raise ConfigError(f"data.corpus={config.data.corpus} is not a translation corpus; use one of "
                          f"{', '.join(TRANSLATION_CORPORA)}")
    out_dir = Path(out_dir)
    checkpoint_path = prepare_run_dir(out_dir, config, resume)
    tcfg, tr = config.train, config.translation
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = resolve_device(tcfg.device, "train.device")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_data(config, data_dir)
    for warning in caught:
        if progress:
            print(f"gatedformer: {warning.message}", flush=True)
    if data.train.skipped and progress:
        print(f"gatedformer: skipped {data.train.skipped} training pair(s) that are empty or longer than "
              f"translation.max_len={tr.max_len} allows", flush=True)

    torch.manual_seed(tcfg.seed)
    model = build_seq2seq(config, len(data.src_vocab), len(data.tgt_vocab))
    initialise(model, config.init)
    model.to(device)
    params = count_parameters(model)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, tcfg.steps, config.model.d_model)

    make_folder(out_dir, "run folder")
    atomic_write_json(out_dir / "config.json", config.to_dict())
    atomic_write_json(out_dir / "vocab.json", _vocab_record(data))
    log_path = out_dir / "log.jsonl"
    step, epoch, position, tokens_seen = 0, 0, 0, 0
    clock = TrainingClock()
    loss_sum, loss_count, skipped = 0.0, 0, 0
    if checkpoint_path is not None:
        ckpt = load_checkpoint(checkpoint_path)
        load_model_weights(model, ckpt.model_state, str(checkpoint_path))
        with restoring(checkpoint_path):
            optimizer.load_state_dict(ckpt.trainer_state["optimizer"])
            scheduler.load_state_dict(ckpt.trainer_state["scheduler"])
            follow_changed_lr(optimizer, scheduler, config.optim.lr)
            torch.set_rng_state(ckpt.trainer_state["rng_cpu"])
            if device.type == "cuda" and "rng_cuda" in ckpt.trainer_state:
                torch.cuda.set_rng_state(ckpt.trainer_state["rng_cuda"], device)
            meta = ckpt.meta
            step, epoch, position = meta["step"], meta["epoch"], meta["batch_in_epoch"]
            tokens_seen = meta["tokens_seen"]
            clock = TrainingClock(meta, step, tokens_seen)
            loss_sum, loss_count, skipped = meta["loss_sum"], meta["loss_count"], meta.get("skipped", 0)
        _truncate_log(log_path, step)
    else:
        log_path.unlink(missing_ok=True)

    def log(record: dict[str, Any]) -> None:
        with open(log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        if on_record is not None:
            on_record(record)

    if checkpoint_path is None:
        log({"event": "data", "step": 0, "corpus": data.corpus, "pair": f"{data.src_lang}-{data.tgt_lang}",
             "src_vocab": len(data.src_vocab), "tgt_vocab": len(data.tgt_vocab), "train_pairs": len(data.train),
             "skipped_train_pairs": data.train.skipped, "truncated_valid": data.valid.truncated,
             "truncated_test": data.test.truncated, "params": params})

    compiled = compile_model(model) if tcfg.compile else model
    stats = GateStatistics(model)
    batches = length_batches(data.train, config.data.batch_size, tr.max_tokens, tcfg.seed, epoch)
    steps_per_epoch = len(batches)
    beam, eval_batch = _beam_of(config), config.data.eval_batch_size

    def checkpoint_now() -> None:
        trainer_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                         "rng_cpu": torch.get_rng_state()}
        if device.type == "cuda":
            trainer_state["rng_cuda"] = torch.cuda.get_rng_state(device)
        meta = {"epoch": epoch, "batch_in_epoch": position, "tokens_seen": tokens_seen,
                **clock.state(), "loss_sum": loss_sum, "loss_count": loss_count, "skipped": skipped,
                "config": config.to_dict()}
        save_checkpoint(out_dir, step, model, trainer_state, meta)

    bar = _progress_bar(progress, tcfg.steps, step, out_dir.name)
    model.train()
    valid_loss, valid_bleu = math.nan, math.nan
    with _StopSignal() as stop_signal:
        while step < tcfg.steps:
            if position >= len(batches):
                epoch, position = epoch + 1, 0
                batches = length_batches(data.train, config.data.batch_size, tr.max_tokens, tcfg.seed, epoch)
            indices = batches[position]
            position += 1
            started = time.perf_counter()
            src, tgt_in, tgt_out = (t.to(device) for t in collate(data.train, indices))
            with _autocast(device, tcfg.precision):
                # the decoder's output layer and the loss as one function (see backbones.output_loss)
                loss = compiled(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID,
                                label_smoothing=tr.label_smoothing)
            loss_value, stepped = optimise(loss, model, optimizer, scheduler, config, step, out_dir)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step += 1
            tokens = int((tgt_out != PAD_ID).sum())
            tokens_seen += tokens
            clock.add_step(time.perf_counter() - started, tokens)
            if not stepped:
                skipped += 1
            if math.isfinite(loss_value):
                loss_sum += loss_value
                loss_count += 1
            bar.update(1)

            if step % tcfg.log_every == 0 and loss_count:
                record = {"event": "train", "step": step, "epoch": epoch, "train_loss": loss_sum / loss_count,
                          "lr": scheduler.get_last_lr()[0], "tokens": tokens_seen, "time": clock.step_seconds,
                          "tokens_per_s": clock.tokens_per_second}
                if skipped:
                    record["skipped_steps"] = skipped
                log(record)
                bar.set_postfix(loss=f"{loss_sum / loss_count:.3f}")
                loss_sum, loss_count = 0.0, 0

            final = step == tcfg.steps
            if step % tcfg.eval_every == 0 or final:
                with stats.recording():
                    valid_loss = evaluate_loss(model, data.valid, eval_batch, device, tcfg.precision)
                valid_bleu, _ = evaluate_bleu(model, data.valid, data.tgt_vocab, data.tgt_lang, beam,
                                              tr.length_penalty, eval_batch, 0 if final else tr.bleu_sentences)
                log({"event": "eval", "step": step, "tokens": tokens_seen, "time": clock.step_seconds,
                     "tokens_per_s": clock.tokens_per_second, "valid_loss": valid_loss,
                     f"valid_{METRIC}": valid_bleu, "bleu_sentences": len(data.valid) if final or
                     tr.bleu_sentences <= 0 else min(tr.bleu_sentences, len(data.valid)), "gates": stats.summary()})
                bar.set_postfix(valid=f"{valid_bleu:.2f} {METRIC}")
                checkpoint_now()
            if stop_here(step, final, stop_signal.received, stop_after, out_dir, checkpoint_now, bar):
                return None
    bar.close()

    # The last checkpoint is on disk: a signal while the run is scored stops at once, and --resume scores it.
    with _StopSignal(interrupt=(step, out_dir)):
        if not math.isfinite(valid_loss):  # resumed from the final checkpoint: score valid again
            valid_loss = evaluate_loss(model, data.valid, eval_batch, device, tcfg.precision)
            valid_bleu, _ = evaluate_bleu(model, data.valid, data.tgt_vocab, data.tgt_lang, beam, tr.length_penalty,
                                          eval_batch)
        test_loss = evaluate_loss(model, data.test, eval_batch, device, tcfg.precision)
        test_bleu, hypotheses = evaluate_bleu(model, data.test, data.tgt_vocab, data.tgt_lang, beam, tr.length_penalty,
                                              eval_batch)
        atomic_write_text(out_dir / "test.hyp.txt", "".join(h + "\n" for h in hypotheses))
        save_model_weights(model, out_dir / "model.safetensors", weights_metadata(config.to_dict()))
        biases = gate_biases(model)
        if biases:
            save_tensors_atomically(biases, out_dir / "gate_biases.safetensors")
        result = RunResult(
            run_dir=str(out_dir), corpus=config.data.corpus, metric=METRIC, valid_loss=valid_loss,
            valid_metric=valid_bleu, test_loss=test_loss, test_metric=test_bleu, params=params, steps=step,
            seconds_per_step=clock.seconds_per_step(step), train_seconds=clock.step_seconds,
            tokens_per_second=clock.tokens_per_second, setup_seconds=clock.setup_seconds,
            wall_seconds=clock.wall_seconds, steps_per_epoch=steps_per_epoch,
        )
        log({"event": "test", "step": step, "test_loss": test_loss, f"test_{METRIC}": test_bleu})
        atomic_write_json(out_dir / "results.json", result.__dict__)
    return result


def _vocab_record(data: TranslationData) -> dict[str, Any]:
    return {"corpus": data.corpus, "src_lang": data.src_lang, "tgt_lang": data.tgt_lang,
            "src": list(data.src_vocab.itos), "tgt": list(data.tgt_vocab.itos)}


# ---------------------------------------------------------------------------------------------
# Using a trained run


def load_translation_run(run_dir: str | Path, data_dir: str | Path | None = None,
                         device: str = "auto") -> tuple[RunConfig, Seq2SeqTransformer, Vocab, Vocab]:
    """The config, model (final weights, else the latest checkpoint) and both vocabularies of a run."""
    run_dir = Path(run_dir)
    target = resolve_device(device)
    config = read_run_config(run_dir)
    if config.data.corpus not in TRANSLATION_CORPORA:
        raise ConfigError(f"{run_dir} is a {config.data.corpus} language-model run, not a translation run; "
                          "translate needs a run trained on multi30k")
    vocab_file = run_dir / "vocab.json"
    if vocab_file.is_file():
        try:
            record = json.loads(vocab_file.read_text(encoding="utf-8"))
            src_vocab, tgt_vocab = Vocab(tuple(record["src"]), "word"), Vocab(tuple(record["tgt"]), "word")
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{vocab_file} is corrupt ({err}); delete it to rebuild it from the corpus") from None
    else:
        data = load_data(config, data_dir)
        src_vocab, tgt_vocab = data.src_vocab, data.tgt_vocab
    model = build_seq2seq(config, len(src_vocab), len(tgt_vocab))
    load_run_weights(model, run_dir, config.to_dict())
    model.to(target).eval()
    return config, model, src_vocab, tgt_vocab


def translate_lines(run_dir: str | Path, lines: Sequence[str], beam: int | None = None,
                    data_dir: str | Path | None = None, device: str = "auto", length_penalty: float | None = None,
                    batch_size: int = 64) -> list[str]:
    """Translate raw sentences (one per item) with a trained run; one detokenised translation per line.

    Lines are tokenised like the training data (:func:`~gatedformer.data.translation.tokenize`). An
    empty (or blank) line translates to an empty line, so outputs stay aligned with inputs. A line
    longer than the model's n - 2 tokens raises a one-line :class:`DataError` naming it. ``beam``
    overrides the run's decoding (1: greedy); ``None`` uses ``translation.decode``/``beam_size``.
    """
    if beam is not None and beam < 1:
        raise ConfigError(f"--beam must be at least 1, got {beam}")
    if length_penalty is not None and not (math.isfinite(length_penalty) and length_penalty >= 0):
        raise ConfigError(f"--length-penalty must be a finite number >= 0 (0: none), got {length_penalty}")
    config, model, src_vocab, tgt_vocab = load_translation_run(run_dir, data_dir, device)
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
        sources.append(encode(tokens, src_vocab))
        wanted.append(number - 1)
    size = _beam_of(config) if beam is None else beam
    penalty = tr.length_penalty if length_penalty is None else length_penalty
    decoded = translate_ids(model, sources, size, penalty, batch_size)
    out = [""] * len(lines)
    for index, ids in zip(wanted, decoded, strict=True):
        out[index] = detokenize(decode_ids(ids, tgt_vocab), tr.tgt_lang)
    return out


def evaluate_translation_run(run_dir: str | Path, split: str = "valid", data_dir: str | Path | None = None,
                             device: str = "auto") -> dict[str, Any]:
    """Loss (nats per target token) and BLEU of a trained translation run on ``split``, whole."""
    config, model, _, _ = load_translation_run(run_dir, data_dir, device)
    data = load_data(config, data_dir)
    part = data.valid if split == "valid" else data.test
    target = resolve_device(device)
    loss = evaluate_loss(model, part, config.data.eval_batch_size, target, config.train.precision)
    bleu, _ = evaluate_bleu(model, part, data.tgt_vocab, config.translation.tgt_lang, _beam_of(config),
                            config.translation.length_penalty, config.data.eval_batch_size)
    return {"loss": loss, "bleu": bleu}
