"""GLUE fine-tuning: a pretrained BERT (a masked-LM run, or a Hugging Face checkpoint) with a classification or
regression head on its pooled output, trained on one GLUE task and scored as GLUE scores it.

Inputs are ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]`` (token types 0 then 1), at most ``data.seq_len`` tokens
(longer pairs lose pieces from the longer side), padded per batch. The head is a linear layer on the pooler's output
after dropout: ``num_labels`` logits trained with cross-entropy, or one score trained with the squared error (STS-B).
The training examples go in a fresh random order every epoch (from ``train.seed`` and the epoch).

Metrics (scikit-learn and SciPy): accuracy; MRPC's F1 of the paraphrase class; CoLA's Matthews correlation; STS-B's
Pearson and Spearman correlations and their mean (``pearson_spearman``, the paper's "Pearson-Spearman Corr"); a
correlation left undefined by a constant prediction counts as 0. Every evaluation scores the whole (or the capped)
validation split; the run reports the best one (``finetune`` and the EAU/GRC paper's Table 2 report "the best
validation score"), by the paper's metric: ``results.json`` holds its ``valid_loss``, ``valid_metric`` and every
metric by name (``accuracy``, ``f1``, ``matthews``, ``pearson``, ``spearman``), ``dev_predictions.tsv`` its
predictions (``index``, ``prediction``, ``label``; the index is the example's row in ``dev.tsv``) and
``<TASK>.tsv`` (``CoLA.tsv``, ``SST-2.tsv``...) the test predictions of the same weights in GLUE's submission
format. GLUE's test labels are not public: the test loss and metric are ``NaN``.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.config import MaskedLMConfig, RunConfig, apply_overrides, config_from_dict, validate
from gatedformer.data.glue import SCORE_RANGE, GlueSplit, GlueTask, glue_task, load_glue
from gatedformer.data.wordpiece import WordPiece
from gatedformer.devices import autocast
from gatedformer.errors import ConfigError, DataError, GatedformerError
from gatedformer.fused import fuse
from gatedformer.models import build_backbone
from gatedformer.models.bert import load_hf_checkpoint
from gatedformer.tasks.base import Task, TrainBatch, by_length, evaluating, register_task, rng, shuffled_epochs
from gatedformer.tasks.best import BestEvaluation
from gatedformer.tasks.mlm import resolve_tokenizer, saved_tokenizer, tokenizer_files
from gatedformer.tasks.weights import load_matching, read_start_weights, start_weights_file

__all__ = ["GlueData", "GlueFinetuneTask", "finetune_config", "glue_metrics", "paper_epochs"]

_ORDER_STREAM, _SAMPLE_STREAM = 3, 4
METRIC_NAMES = ("accuracy", "f1", "matthews", "pearson", "spearman", "pearson_spearman")


def glue_metrics(task: GlueTask, predictions: Sequence[float], labels: Sequence[float]) -> dict[str, float]:
    """The task's GLUE metrics of ``predictions`` (label positions, or STS-B scores) against ``labels``."""
    try:
        from scipy.stats import pearsonr, spearmanr
        from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    except ImportError:
        raise GatedformerError("GLUE's metrics need scikit-learn and scipy; install them with pip install "
                               "'gatedformer[bert]'") from None
    if task.regression:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a constant prediction: the correlation is undefined (NaN)
            pearson = float(pearsonr(predictions, labels)[0]) if len(labels) > 1 else math.nan
            spearman = float(spearmanr(predictions, labels)[0]) if len(labels) > 1 else math.nan
        pearson, spearman = (0.0 if math.isnan(v) else v for v in (pearson, spearman))
        return {"pearson": pearson, "spearman": spearman, "pearson_spearman": (pearson + spearman) / 2}
    out = {"accuracy": float(accuracy_score(labels, predictions))}
    if task.name == "mrpc":
        out["f1"] = float(f1_score(labels, predictions, pos_label=1, zero_division=0.0))
    if task.name == "cola":
        out["matthews"] = float(matthews_corrcoef(labels, predictions))
    return out


def paper_epochs(task: GlueTask, config: RunConfig) -> float:
    """``finetune.epochs``, or where it is 0 the paper's (3; CoLA 5, RTE 8)."""
    return config.finetune.epochs or float(task.epochs)


@dataclass
class Encoded:
    """A split as model inputs: the examples' ids and token types, their labels and their rows in the file."""

    ids: list[list[int]]
    types: list[list[int]]
    labels: torch.Tensor | None
    rows: list[int]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class GlueData:
    task: GlueTask
    tokenizer: WordPiece
    train: Encoded
    valid: Encoded
    test: Encoded
    best: BestEvaluation = field(default_factory=lambda: BestEvaluation("valid_metric"))


def _sample(split: GlueSplit, limit: int, seed_words: tuple[int, ...]) -> list:
    examples = list(split.examples)
    if 0 < limit < len(examples):
        keep = np.sort(rng(*seed_words).choice(len(examples), size=limit, replace=False))
        examples = [examples[i] for i in keep]
    return examples


def _encode(tokenizer: WordPiece, task: GlueTask, examples: list, seq_len: int) -> Encoded:
    first = [e.text_a for e in examples]
    second = None if examples and examples[0].text_b is None else [e.text_b for e in examples]
    ids, types = tokenizer.encode_pairs(first, second, seq_len)
    labels = None
    if examples and examples[0].label is not None:
        labels = torch.tensor([e.label for e in examples], dtype=torch.float32 if task.regression else torch.long)
    return Encoded(ids, types, labels, [e.index for e in examples])


def collate(split: Encoded, indices: Sequence[int], pad_id: int) -> tuple[torch.Tensor, ...]:
    """``(tokens, token_types, attention_mask)`` of the examples ``indices``, padded to the longest, and their labels
    (where the split has them)."""
    longest = max(len(split.ids[i]) for i in indices)
    tokens = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    types = torch.zeros((len(indices), longest), dtype=torch.long)
    mask = torch.zeros((len(indices), longest), dtype=torch.bool)
    for row, i in enumerate(indices):
        n = len(split.ids[i])
        tokens[row, :n] = torch.tensor(split.ids[i])
        types[row, :n] = torch.tensor(split.types[i])
        mask[row, :n] = True
    out: tuple[torch.Tensor, ...] = (tokens, types, mask)
    if split.labels is not None:
        out += (split.labels[list(indices)],)
    return out


def _loss(task: GlueTask, outputs: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if task.regression:
        return F.mse_loss(outputs[:, 0].float(), labels, reduction=reduction)
    return F.cross_entropy(outputs.float(), labels, reduction=reduction)


def _batches(model: nn.Module, split: Encoded, pad_id: int, size: int, precision: str, device: torch.device
             ) -> Iterator[tuple[list[int], torch.Tensor | None, torch.Tensor]]:
    """The model's outputs for ``split``, ``size`` examples at a time in order of length: ``(their indices, their
    labels or None, their outputs)`` a batch, in eval mode (the model's own mode back after the last)."""
    with evaluating(model):
        for chosen in by_length([len(ids) for ids in split.ids], size):
            batch = collate(split, chosen, pad_id)
            tokens, types, mask = (t.to(device) for t in batch[:3])
            with torch.no_grad(), autocast(device, precision):
                outputs = model(tokens, types, None if bool(mask.all()) else mask).logits.float()
            yield chosen, (batch[3].to(device) if len(batch) > 3 else None), outputs


def predict(model: nn.Module, data: GlueData, split: Encoded, config: RunConfig, device: torch.device
            ) -> tuple[list[float], float]:
    """Every example's prediction (a label position, or a score) and the mean loss where the split has labels."""
    predictions: list[float] = [0.0] * len(split)
    total = 0.0
    for chosen, labels, outputs in _batches(model, split, data.tokenizer.pad_id, config.data.eval_batch_size,
                                            config.train.precision, device):
        if labels is not None:
            total += _loss(data.task, outputs, labels, "sum").item()
        for i, value in zip(chosen, (outputs[:, 0] if data.task.regression else outputs.argmax(-1)).tolist(),
                            strict=True):
            predictions[i] = value
    return predictions, total / max(len(split), 1)


def _label_text(task: GlueTask, value: float) -> str:
    if task.regression:
        return f"{min(SCORE_RANGE[1], max(SCORE_RANGE[0], value)):.3f}"
    return task.labels[int(value)]  # type: ignore[index]


def _scored_text(task: GlueTask, value: float) -> str:
    """A prediction or label as the metric read it: an STS-B score's shortest text that reads back as the same float
    (neither rounded nor clipped to 0-5), so the metric in ``results.json`` can be recomputed from the file."""
    return repr(float(value)) if task.regression else _label_text(task, value)


def prediction_files(task: GlueTask, valid: Encoded, valid_predictions: list[float], test: Encoded,
                     test_predictions: list[float]) -> dict[str, str]:
    """``dev_predictions.tsv`` (the values the metric scored, exactly) and the submission file of the test set (STS-B
    scores clipped to 0-5 and rounded to three decimals, as GLUE takes them)."""
    labels = valid.labels.tolist() if valid.labels is not None else [None] * len(valid)
    dev = ["index\tprediction\tlabel\n"] + [
        f"{row}\t{_scored_text(task, p)}\t{'' if y is None else _scored_text(task, y)}\n"
        for row, p, y in zip(valid.rows, valid_predictions, labels, strict=True)]
    submission = ["index\tprediction\n"] + [f"{row}\t{_label_text(task, p)}\n"
                                            for row, p in zip(test.rows, test_predictions, strict=True)]
    return {"dev_predictions.tsv": "".join(dev), task.submission: "".join(submission)}


@register_task("glue", corpora=("glue-*",), sections=("tokenizer", "finetune"))  # glue-*: every GlueTask.corpus
class GlueFinetuneTask(Task[GlueData, tuple[GlueTask, WordPiece]]):
    """Fine-tuning (or training) a BERT on a GLUE task (``data.corpus=glue-<task>``)."""

    title = "GLUE fine-tuning"
    optional_modules = (("tokenizers", "bert"), ("sklearn", "bert"), ("scipy", "bert"))  # WordPiece; the metrics

    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: Any = None) -> GlueData:
        task = glue_task(config.data.corpus)
        tokenizer, _ = resolve_tokenizer(config)
        if tokenizer is None:
            raise ConfigError(f"{task.corpus} needs the pretrained model's tokenizer: fine-tune a pretraining run with "
                              "`gatedformer finetune --run RUN`, or set train.init_from, model.init_from_hf or "
                              "tokenizer.vocab_file")
        splits = load_glue(task.name, data_dir)
        ft, seq_len = config.finetune, config.data.seq_len
        train = _sample(splits["train"], ft.max_train_examples, (_SAMPLE_STREAM, 0))
        valid = _sample(splits["valid"], ft.max_eval_examples, (_SAMPLE_STREAM, 1))
        return GlueData(task, tokenizer, _encode(tokenizer, task, train, seq_len),
                        _encode(tokenizer, task, valid, seq_len),
                        _encode(tokenizer, task, list(splits["test"].examples), seq_len))

    def build_model(self, config: RunConfig, data: GlueData | tuple[GlueTask, WordPiece]) -> nn.Module:
        task, tokenizer = (data.task, data.tokenizer) if isinstance(data, GlueData) else data
        return fuse(self._build(config, len(tokenizer), 1 if task.regression else len(task.labels or ())))

    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        task = glue_task(config.data.corpus)
        return self._build(config, vocab_size, 1 if task.regression else len(task.labels or ()))

    @staticmethod
    def _build(config: RunConfig, vocab_size: int, num_labels: int) -> nn.Module:
        return build_backbone(config.model, "glue", vocab_size, num_labels)

    def metric(self, data: GlueData) -> str:
        return data.task.metric

    def run_files(self, data: GlueData) -> dict[str, Any]:
        return tokenizer_files(data.tokenizer)

    def start_records(self, data: GlueData, params: int) -> list[dict[str, Any]]:
        return [{"event": "data", "step": 0, "task": data.task.name, "train_examples": len(data.train),
                 "valid_examples": len(data.valid), "test_examples": len(data.test), "vocab": len(data.tokenizer),
                 "params": params}]

    def start_weights(self, model: nn.Module, config: RunConfig, data: GlueData) -> None:
        if config.train.init_from:
            # The pretrained encoder; the pooler (where the pretraining had none) and the classifier start fresh.
            state, where = read_start_weights(config.train.init_from, config)
            load_matching(model, state, where, "bert.")
        if config.model.init_from_hf:
            load_hf_checkpoint(model, config.model.init_from_hf, config.model)

    def open_run(self, data: GlueData, out_dir: Path, resumed: bool) -> None:
        data.best.open(out_dir, resumed)

    def train_batches(self, data: GlueData, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        for epoch, start, indices in shuffled_epochs(len(data.train), config.data.batch_size,
                                                     self.steps_per_epoch(data, config, meta), config.train.seed,
                                                     _ORDER_STREAM, step):
            batch = collate(data.train, indices, data.tokenizer.pad_id)
            yield TrainBatch(batch, int(batch[2].sum()), new_epoch=start == 0, position={"epoch": epoch})

    def steps_per_epoch(self, data: GlueData, config: RunConfig, meta: dict[str, Any] | None) -> int:
        return math.ceil(len(data.train) / config.data.batch_size)

    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        tokens, types, mask, labels = (t.to(device) for t in batch.inputs)
        task = glue_task(config.data.corpus)
        with autocast(device, config.train.precision):
            outputs = model(tokens, types, None if bool(mask.all()) else mask).logits
        return _loss(task, outputs, labels), None

    def evaluate(self, model: nn.Module, data: GlueData, config: RunConfig, device: torch.device, final: bool,
                 recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        task = data.task
        with recording():
            predictions, loss = predict(model, data, data.valid, config, device)
        metrics = glue_metrics(task, predictions, data.valid.labels.tolist())  # type: ignore[union-attr]
        fields = {"valid_loss": loss, f"valid_{task.metric}": metrics[task.metric],
                  **{f"valid_{k}": v for k, v in metrics.items()}}

        best = {"valid_loss": loss, "valid_metric": metrics[task.metric], **metrics}
        if data.best.beats(best):  # the submission file is of the best weights: predict the test set now
            test_predictions, _ = predict(model, data, data.test, config, device)
            data.best.keep(best, prediction_files(task, data.valid, predictions, data.test, test_predictions))
        return {**fields, "best_valid_metric": data.best.value(data.best.fields)}

    def score(self, model: nn.Module, data: GlueData, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        if data.best.fields is None:  # the run ended before any evaluation: score it now
            self.evaluate(model, data, config, device, True, _nothing)
        best = data.best.fields or {}
        return float(best["valid_loss"]), float(best["valid_metric"]), math.nan, math.nan

    def result_fields(self, data: GlueData) -> dict[str, Any]:
        best = data.best.fields or {}
        return {"task": data.task.name, **{k: best[k] for k in METRIC_NAMES if k in best}}

    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None
                       ) -> tuple[GlueTask, WordPiece]:
        return glue_task(config.data.corpus), saved_tokenizer(run_dir)

    def inference_files(self, data: tuple[GlueTask, WordPiece]) -> dict[str, str]:
        return {"tokenizer.json": data[1].to_json(), "vocab.txt": data[1].vocab_txt()}

    def class_names(self, data: tuple[GlueTask, WordPiece]) -> tuple[str, ...] | None:
        return data[0].labels

    def reads_pairs(self, data: tuple[GlueTask, WordPiece]) -> bool:
        return data[0].columns[1] is not None

    def classify(self, model: nn.Module, config: RunConfig, data: tuple[GlueTask, WordPiece],
                 inputs: Sequence[str | tuple[str, str]], device: torch.device, batch_size: int = 64) -> torch.Tensor:
        task, tokenizer = data
        pairs = self.reads_pairs(data)
        for number, item in enumerate(inputs, start=1):
            if pairs:
                fits = isinstance(item, tuple | list) and len(item) == 2 and all(isinstance(t, str) for t in item)
            else:
                fits = isinstance(item, str)
            if not fits:
                wanted = "a pair of sentences (a tuple of two strings)" if pairs else "one sentence (a string)"
                raise DataError(f"input {number} is {type(item).__name__} {str(item)[:60]!r}, but {task.title} "
                                f"reads {wanted} an example")
        first = [item[0] if pairs else item for item in inputs]
        second = [item[1] for item in inputs] if pairs else None
        ids, types = tokenizer.encode_pairs(first, second, config.data.seq_len)  # type: ignore[arg-type]
        split = Encoded(ids, types, None, list(range(len(ids))))
        out = torch.empty((len(split),) if task.regression else (len(split), len(task.labels or ())))
        for chosen, _, outputs in _batches(model, split, tokenizer.pad_id, batch_size, config.train.precision,
                                           device):
            out[chosen] = (outputs[:, 0].clamp(*SCORE_RANGE) if task.regression else outputs.softmax(-1)).cpu()
        return out

    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: tuple[GlueTask, WordPiece]) -> dict[str, float]:
        task, tokenizer = data
        if split == "test":
            raise DataError(f"GLUE's test labels are not public; score {task.corpus} on --split valid, or submit the "
                            f"run's {task.submission} to gluebenchmark.com")
        examples = _sample(load_glue(task.name, data_dir)["valid"], config.finetune.max_eval_examples,
                           (_SAMPLE_STREAM, 1))
        valid = _encode(tokenizer, task, examples, config.data.seq_len)
        glue = GlueData(task, tokenizer, valid, valid, valid)
        predictions, loss = predict(model, glue, valid, config, device)
        return {"loss": loss, **glue_metrics(task, predictions, valid.labels.tolist())}  # type: ignore[union-attr]


class _nothing(AbstractContextManager):  # noqa: N801 - used like a function: no gate statistics recorded
    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# A fine-tuning run's config


def _explicit(overrides: list[str]) -> set[str]:
    return {text.partition("=")[0].strip() for text in overrides}


def finetune_config(pretrained: str | Path, task_name: str, overrides: list[str] | None = None,
                    data_dir: str | Path | None = None) -> RunConfig:
    """The config of fine-tuning the pretraining run ``pretrained`` on the GLUE task ``task_name``.

    It keeps the pretrained run's model and tokenizer settings and takes the rest from its ``[finetune]`` section:
    ``data.batch_size`` and ``data.seq_len``, AdamW with ``finetune.lr``, β = (0.9, ``finetune.beta2``) and
    ``finetune.weight_decay``, a linear decay to 0 with no warm-up and gradients clipped to norm 1 (as Hugging
    Face's Trainer, which the paper used), ``train.steps`` for ``finetune.epochs`` epochs (0: the paper's, 3; CoLA 5,
    RTE 8) and ``finetune.evals_per_epoch`` evaluations per epoch; ``train.init_from`` is the pretrained run. The
    ``overrides`` (``--set``) apply first to the ``[finetune]`` section and win over every field derived from it.
    """
    pretrained = Path(pretrained).expanduser().resolve()
    start_weights_file(str(pretrained))  # one clear line if it is not a finished run
    try:
        saved = (pretrained / "config.json").read_text(encoding="utf-8")
        config = config_from_dict(json.loads(saved), where=str(pretrained / "config.json"), check=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {pretrained / 'config.json'} ({err}); give a finished pretraining run") \
            from None
    if config.model.backbone != "bert":
        raise ConfigError(f"{pretrained} trained model.backbone={config.model.backbone}; GLUE fine-tuning takes a BERT "
                          "pretraining run (e.g. gatedformer train --recipe bert-mlm-tiny)")
    task = glue_task(task_name)
    overrides = list(overrides or [])
    apply_overrides(config, overrides)
    # A bad [finetune] value is named as such, before it is copied into the optimiser's and data's fields.
    validate(config)
    config.mlm = MaskedLMConfig()  # the pretraining's masking, which fine-tuning never reads
    ft = config.finetune
    examples = len(load_glue(task.name, data_dir)["train"].examples)
    if ft.max_train_examples:
        examples = min(examples, ft.max_train_examples)
    per_epoch = math.ceil(examples / ft.batch_size)
    steps = max(1, math.ceil(paper_epochs(task, config) * per_epoch))
    derived = [f"data.corpus={task.corpus}", "data.task=", f"data.batch_size={ft.batch_size}",
               f"data.seq_len={ft.seq_len}", "data.eval_seq_len=0",
               f"data.eval_batch_size={max(ft.batch_size, config.data.eval_batch_size)}",
               "optim.name=adamw", f"optim.lr={ft.lr}", "optim.beta1=0.9", f"optim.beta2={ft.beta2}",
               f"optim.weight_decay={ft.weight_decay}", "optim.schedule=linear", "optim.warmup_steps=0",
               "optim.min_lr_ratio=0", "optim.clip=1.0", f"train.steps={steps}",
               f"train.eval_every={max(1, per_epoch // ft.evals_per_epoch)}",
               f"train.log_every={max(1, min(50, per_epoch // 4))}", "train.eval_windows=0",
               f"train.init_from={pretrained}", "model.init_from_hf=", "tokenizer.vocab_file="]
    explicit = _explicit(overrides)
    apply_overrides(config, [d for d in derived if d.partition("=")[0] not in explicit])
    apply_overrides(config, overrides)
    return validate(config)

