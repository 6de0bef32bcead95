"""Masked language modelling: BERT's pretraining objective (without next-sentence prediction), scored by the MLM loss.

Data: a corpus's text as one stream of WordPiece ids per split (:mod:`gatedformer.data.wordpiece`; the vocabulary
learned from the training split, or given), cut into windows of ``data.seq_len - 2`` pieces, each read as
``[CLS] window [SEP]`` with token type 0; the last, shorter window of the validation and test splits is padded. The
training windows go in a fresh random order every epoch (from ``train.seed`` and the epoch).

Masking, per batch (:func:`mask_tokens`, as BERT's own pretraining data does it): of each sequence's ``n`` tokens
other than the special ones, ``max(1, round(mlm.mask_prob · n))`` are chosen uniformly at random; of those, 80 %
become ``[MASK]``, 10 % a token drawn uniformly from the vocabulary and 10 % stay as they are. The loss is the
cross-entropy of the chosen tokens alone (the model's last layer and head compute their rows only). The masks of a
training step follow from ``train.seed`` and the step, so a resumed run masks exactly as the uninterrupted one; the
masks of validation and test are fixed (the same at every evaluation, for every variant and seed).

Metric: the MLM loss in nats (the EAU/GRC paper's, its Figure 2) with its perplexity ``exp(loss)`` as the metric,
and the accuracy of the chosen tokens' predictions (``valid_accuracy`` / ``test_accuracy``). The run folder keeps the
tokenizer (``tokenizer.json``, the ``tokenizers`` library's format, and BERT's ``vocab.txt``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.config import RunConfig
from gatedformer.data.tokenize import require_utf8
from gatedformer.data.verify import FILES_KEY, check_files
from gatedformer.data.wordpiece import WordPiece, encode_corpus
from gatedformer.devices import autocast
from gatedformer.errors import ConfigError, DataError
from gatedformer.fused import fuse
from gatedformer.models import build_backbone
from gatedformer.models.bert import load_hf_checkpoint
from gatedformer.tasks.base import Task, TrainBatch, evaluating, register_task, rng
from gatedformer.tasks.weights import recorded_metadata, start_weights_file

__all__ = ["MASK", "MLMData", "MaskedLMTask", "fill_mask", "mask_tokens", "resolve_tokenizer", "windows"]

IGNORE = -100
"""The target of a padding row of the chosen positions."""
MASK = "[MASK]"
"""Where :func:`fill_mask` is to predict a piece, as a user writes it in the text."""
_EVAL_STREAM, _MASK_STREAM, _ORDER_STREAM = 0x5EED, 1, 2


def resolve_tokenizer(config: RunConfig) -> tuple[WordPiece | None, str]:
    """The tokenizer a run is given, and what identifies it: ``tokenizer.vocab_file``, else the tokenizer of the run
    ``train.init_from`` names, else ``model.init_from_hf``'s ``vocab.txt``; ``(None, "")`` where none is given (the
    vocabulary is then learned)."""
    tk = config.tokenizer
    if tk.vocab_file:
        return WordPiece.from_vocab_file(tk.vocab_file, tk.lowercase), f"vocab:{Path(tk.vocab_file).resolve()}"
    if config.train.init_from:
        weights = start_weights_file(config.train.init_from)
        folder = weights.parent
        saved = folder / "tokenizer.json"
        if not saved.is_file():
            raise DataError(f"train.init_from={config.train.init_from}: no tokenizer.json beside its weights in "
                            f"{folder}; start from a masked-LM or GLUE run, or give tokenizer.vocab_file")
        check_files(folder, recorded_metadata(weights).get(FILES_KEY), str(weights),
                    f"restore it from a copy of the run train.init_from={config.train.init_from} names")
        try:
            text = saved.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read {saved} ({getattr(err, 'strerror', None) or err})") from None
        return WordPiece.from_json(text, str(saved)), ""
    if config.model.init_from_hf:
        folder = Path(config.model.init_from_hf).expanduser()
        if not folder.is_dir():
            raise DataError(f"model.init_from_hf={config.model.init_from_hf}: no such folder; give a local Hugging "
                            "Face BERT checkpoint folder (config.json, model.safetensors or pytorch_model.bin, "
                            "vocab.txt)")
        vocab = folder / "vocab.txt"
        return WordPiece.from_vocab_file(vocab, tk.lowercase), f"vocab:{vocab.resolve()}"
    return None, ""


def tokenizer_files(tokenizer: WordPiece) -> dict[str, str]:
    """What a run folder keeps of its tokenizer."""
    return {"tokenizer.json": tokenizer.to_json(), "vocab.txt": tokenizer.vocab_txt()}


def saved_tokenizer(run_dir: Path) -> WordPiece:
    """The tokenizer a BERT run keeps in its folder."""
    path = run_dir / "tokenizer.json"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{run_dir} keeps no readable tokenizer.json ({getattr(err, 'strerror', None) or err}); it "
                        "is not a finished BERT run") from None
    return WordPiece.from_json(text, str(path))


def windows(stream: np.ndarray, seq_len: int, cls_id: int, sep_id: int, pad_id: int, keep_last: bool
            ) -> torch.Tensor:
    """``[CLS] pieces [SEP]`` windows of ``seq_len`` tokens over ``stream``; the shorter last one padded
    (``keep_last``) or dropped."""
    width = seq_len - 2
    full = len(stream) // width
    rest = len(stream) - full * width
    count = full + (1 if keep_last and rest else 0)
    out = np.full((count, seq_len), pad_id, dtype=np.int64)
    out[:, 0] = cls_id
    if full:
        out[:full, 1:-1] = stream[: full * width].reshape(full, width)
        out[:full, -1] = sep_id
    if count > full:
        out[full, 1: 1 + rest] = stream[full * width:]
        out[full, 1 + rest] = sep_id
    return torch.from_numpy(out)


def mask_tokens(tokens: torch.Tensor, generator: np.random.Generator, mask_prob: float, vocab_size: int,
                mask_id: int, special_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERT's masking of a batch ``tokens (B, L)``: ``(inputs, positions (B, M), targets (B, M))``.

    In each sequence, ``max(1, round(mask_prob · n))`` of its ``n`` non-special tokens are chosen; ``positions``
    holds them (ascending), ``targets`` their tokens; a sequence with fewer than ``M`` chosen has padding rows at
    the end (position 0, target ``-100``). Of the chosen, 80 % become ``mask_id``, 10 % a token drawn uniformly from
    ``[0, vocab_size)``, 10 % stay.
    """
    ids = tokens.numpy()
    batch, length = ids.shape
    candidate = ~np.isin(ids, np.asarray(special_ids))
    counts = candidate.sum(axis=1)
    chosen = np.where(counts > 0, np.maximum(1, np.rint(mask_prob * counts)), 0).astype(np.int64)
    chosen = np.minimum(chosen, counts)
    width = max(1, int(chosen.max()))
    keys = generator.random((batch, length))
    keys[~candidate] = 2.0  # after every candidate
    picked = np.argsort(keys, axis=1, kind="stable")[:, :width]  # each row's first `chosen` are its choice
    real = np.arange(width)[None, :] < chosen[:, None]
    positions = np.where(real, np.sort(np.where(real, picked, length), axis=1), 0)  # ascending, padding last
    rows = np.arange(batch)[:, None]
    original = ids[rows, positions]
    targets = np.where(real, original, IGNORE)
    draw = generator.random((batch, width))
    replaced = generator.integers(0, vocab_size, (batch, width))
    new = np.where(draw < 0.8, mask_id, np.where(draw < 0.9, replaced, original))
    inputs = ids.copy()
    r, c = np.nonzero(real)
    inputs[r, positions[r, c]] = new[r, c]
    return (torch.from_numpy(inputs), torch.from_numpy(positions.astype(np.int64)),
            torch.from_numpy(targets.astype(np.int64)))


@dataclass
class MLMData:
    tokenizer: WordPiece
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    scores: dict[str, float] = field(default_factory=dict)
    """The accuracies :meth:`MaskedLMTask.score` found, for ``results.json``."""


def _batches(windows_: torch.Tensor, size: int, limit: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    count = len(windows_) if limit <= 0 else min(limit, len(windows_))
    for start in range(0, count, size):
        yield start, windows_[start: min(start + size, count)]


@torch.no_grad()
def evaluate(model: nn.Module, windows_: torch.Tensor, data: MLMData, config: RunConfig, device: torch.device,
             limit: int = 0) -> tuple[float, float]:
    """The MLM loss (nats per chosen token) and accuracy over the first ``limit`` windows (0: all), with the split's
    fixed masks."""
    tk = data.tokenizer
    total, correct, count = 0.0, 0, 0
    with evaluating(model):
        for start, batch in _batches(windows_, config.data.eval_batch_size, limit):
            inputs, positions, targets = mask_tokens(batch, rng(_EVAL_STREAM, start), config.mlm.mask_prob, len(tk),
                                                     tk.mask_id, tk.special_ids)
            mask = inputs != tk.pad_id
            inputs, positions, targets, mask = (t.to(device) for t in (inputs, positions, targets, mask))
            with autocast(device, config.train.precision):
                logits = model(inputs, None, None if bool(mask.all()) else mask, positions=positions).logits
            logits = logits.float().flatten(0, 1)
            flat = targets.flatten()
            total += F.cross_entropy(logits, flat, ignore_index=IGNORE, reduction="sum").item()
            real = flat != IGNORE
            correct += int((logits.argmax(-1)[real] == flat[real]).sum())
            count += int(real.sum())
    return total / max(count, 1), correct / max(count, 1)


@torch.no_grad()
def fill_mask(model: nn.Module, tokenizer: WordPiece, text: str, top_k: int = 5, max_len: int = 512
              ) -> list[list[tuple[str, float]]]:
    """For every ``[MASK]`` of ``text``, in order, the ``top_k`` likeliest pieces of the vocabulary with their
    probabilities, likeliest first. The text is read as the training windows were, ``[CLS] text [SEP]`` (the text
    between the masks through the tokenizer, each ``[MASK]``, written so, one masked position); special tokens are
    never proposed. At most ``max_len`` pieces (the model's positions)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a whole number of at least 1, got {top_k!r}")
    require_utf8(text, "the text", "give it in UTF-8 (a UTF-8 locale in the shell, e.g. LANG=C.UTF-8)")
    parts = text.split(MASK)
    if len(parts) < 2:
        raise DataError(f"the text has no {MASK}; write {MASK} where a piece is to be predicted, e.g. "
                        f"'the cat sat on the {MASK} .'")
    ids, positions = [tokenizer.cls_id], []
    for i, pieces in enumerate(tokenizer.encode_texts(parts)):
        if i:
            positions.append(len(ids))
            ids.append(tokenizer.mask_id)
        ids += pieces
    ids.append(tokenizer.sep_id)
    if len(ids) > max_len:
        raise DataError(f"the text is {len(ids)} pieces with [CLS] and [SEP], but the model reads at most {max_len} "
                        "(model.max_positions); shorten it")
    device = next(model.parameters()).device
    with evaluating(model):
        logits = model(torch.tensor([ids], device=device), positions=torch.tensor([positions], device=device)).logits
    logits = logits[0].float()
    logits[:, list(tokenizer.special_ids)] = -math.inf
    chances, best = logits.softmax(-1).topk(min(top_k, logits.shape[-1] - len(tokenizer.special_ids)), dim=-1)
    return [[(tokenizer.piece(i), p) for i, p in zip(row_ids, row_p, strict=True)]
            for row_ids, row_p in zip(best.tolist(), chances.tolist(), strict=True)]


# A pretraining run keeps the settings of its fine-tuning (``gatedformer finetune --run``, the GLUE comparison).
@register_task("mlm", sections=("tokenizer", "mlm", "finetune"))
class MaskedLMTask(Task[MLMData, WordPiece]):
    """Masked language modelling on a word-level corpus (``data.task=mlm``), with a BERT backbone."""

    title = "masked-language-model"
    optional_modules = (("tokenizers", "bert"),)  # WordPiece

    def shared_data(self, config: RunConfig, data_dir: str | Path | None,
                    progress: bool = False) -> tuple[WordPiece, dict[str, np.ndarray]]:
        """The tokenizer and the corpus's ids, which runs with the same corpus and tokenizer settings share."""
        tk = config.tokenizer
        given, identity = resolve_tokenizer(config)
        if progress and given is None:
            print(f"gatedformer: WordPiece vocabulary of {tk.vocab_size} from {config.data.corpus}'s training split "
                  "(cached after the first run)", flush=True)
        return encode_corpus(config.data.corpus, data_dir, given, tk.vocab_size, tk.lowercase, tk.min_frequency,
                             config.mlm.valid_fraction, identity)

    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: tuple[WordPiece, dict[str, np.ndarray]] | None = None) -> MLMData:
        tokenizer, ids = shared if shared is not None else self.shared_data(config, data_dir, progress)
        seq_len, eval_len = config.data.seq_len, config.data.eval_seq_len or config.data.seq_len
        specials = (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
        train = windows(ids["train"], seq_len, *specials, keep_last=False)
        if len(train) < config.data.batch_size:
            raise DataError(f"{config.data.corpus}'s training split makes {len(train)} windows of {seq_len} tokens, "
                            f"fewer than one batch of data.batch_size={config.data.batch_size}; lower them")
        return MLMData(tokenizer, train, windows(ids["valid"], eval_len, *specials, keep_last=True),
                       windows(ids["test"], eval_len, *specials, keep_last=True))

    def build_model(self, config: RunConfig, data: MLMData | WordPiece) -> nn.Module:
        tokenizer = data.tokenizer if isinstance(data, MLMData) else data
        return fuse(self.nominal_model(config, len(tokenizer)))

    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        return build_backbone(config.model, self.name, vocab_size)

    def metric(self, data: MLMData) -> str:
        return "ppl"

    def run_files(self, data: MLMData) -> dict[str, Any]:
        return tokenizer_files(data.tokenizer)

    def start_records(self, data: MLMData, params: int) -> list[dict[str, Any]]:
        return [{"event": "data", "step": 0, "vocab": len(data.tokenizer), "train_windows": len(data.train),
                 "valid_windows": len(data.valid), "test_windows": len(data.test), "params": params}]

    def start_weights(self, model: nn.Module, config: RunConfig, data: MLMData) -> None:
        super().start_weights(model, config, data)
        if config.model.init_from_hf:
            load_hf_checkpoint(model, config.model.init_from_hf, config.model)

    def train_batches(self, data: MLMData, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        size, seed, tk = config.data.batch_size, config.train.seed, data.tokenizer
        per_epoch = len(data.train) // size
        epoch, order = -1, None
        while True:
            if step // per_epoch != epoch:
                epoch = step // per_epoch
                order = torch.from_numpy(rng(seed, epoch, _ORDER_STREAM).permutation(len(data.train)))
            start = (step % per_epoch) * size
            batch = data.train[order[start: start + size]]
            inputs, positions, targets = mask_tokens(batch, rng(seed, step, _MASK_STREAM), config.mlm.mask_prob,
                                                     len(tk), tk.mask_id, tk.special_ids)
            yield TrainBatch((inputs, positions, targets), batch.numel(), new_epoch=start == 0,
                             position={"epoch": epoch})
            step += 1

    def steps_per_epoch(self, data: MLMData, config: RunConfig, meta: dict[str, Any] | None) -> int:
        return len(data.train) // config.data.batch_size

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        inputs, positions, targets = (t.to(device) for t in batch.inputs)
        with autocast(device, config.train.precision):
            return model(inputs, positions=positions, targets=targets, ignore_index=IGNORE).loss, None

    def evaluate(self, model: nn.Module, data: MLMData, config: RunConfig, device: torch.device, final: bool,
                 recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        limit = 0 if final else config.train.eval_windows
        with recording():
            loss, accuracy = evaluate(model, data.valid, data, config, device, limit)
        scored = len(data.valid) if limit <= 0 else min(limit, len(data.valid))
        return {"valid_loss": loss, "valid_ppl": _ppl(loss), "valid_accuracy": accuracy, "valid_windows": scored}

    def score(self, model: nn.Module, data: MLMData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        if final_eval is not None:
            valid_loss, valid_accuracy = final_eval["valid_loss"], final_eval["valid_accuracy"]
        else:
            valid_loss, valid_accuracy = evaluate(model, data.valid, data, config, device)
        test_loss, test_accuracy = evaluate(model, data.test, data, config, device)
        data.scores = {"valid_accuracy": valid_accuracy, "test_accuracy": test_accuracy}
        return valid_loss, _ppl(valid_loss), test_loss, _ppl(test_loss)

    def result_fields(self, data: MLMData) -> dict[str, Any]:
        return dict(data.scores)

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> WordPiece:
        return saved_tokenizer(run_dir)

    def inference_files(self, data: WordPiece) -> dict[str, str]:
        return {"tokenizer.json": data.to_json(), "vocab.txt": data.vocab_txt()}

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: WordPiece) -> dict[str, float]:
        _, ids = encode_corpus(config.data.corpus, data_dir, data, config.tokenizer.vocab_size,
                               config.tokenizer.lowercase, config.tokenizer.min_frequency, config.mlm.valid_fraction)
        eval_len = config.data.eval_seq_len or config.data.seq_len
        part = windows(ids[split], eval_len, data.cls_id, data.sep_id, data.pad_id, keep_last=True)
        loss, accuracy = evaluate(model, part, MLMData(data, part[:0], part, part), config, device)
        return {"loss": loss, "ppl": _ppl(loss), "accuracy": accuracy}


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))
