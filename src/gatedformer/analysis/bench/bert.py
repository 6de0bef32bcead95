"""The ``bert`` section of the bench: our BERT's masked-LM training step and GLUE fine-tuning step against Hugging
Face's ``BertForMaskedLM`` and ``BertForSequenceClassification`` of the same size, timed side by side in one run.

Both sides get the same weights' scheme (BERT's N(0, 0.02)), the same batch and the same optimiser: for the MLM
step the same masked positions (BERT's 15 %; Hugging Face's labels are -100 elsewhere), for the fine-tuning step the
same pairs with the same padding and token types. The width, layers, heads, feed-forward, batch, sequence length and
dropout are the bench's (``--d-model`` ...); the vocabulary is ``bert-mlm-tiny``'s WordPiece size. Ours computes the
last layer and the MLM head at the masked positions only (the fine-tuning step at ``[CLS]`` only), and its sublayers'
output projections with their dropout, residual add and LayerNorm in one pass each way.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gatedformer.analysis.bench.options import BenchOptions, BenchSize
from gatedformer.analysis.bench.report import BenchReport
from gatedformer.analysis.bench.runners import _make_optimizer, backward_and_step
from gatedformer.analysis.bench.timing import time_round_robin
from gatedformer.config import InitConfig
from gatedformer.fused import fuse
from gatedformer.models.bert import BertForMaskedLM, BertForSequenceClassification
from gatedformer.tasks.base import rng
from gatedformer.tasks.mlm import IGNORE, mask_tokens
from gatedformer.train.init import initialise

__all__ = ["BERT_VOCAB", "bench_bert"]

BERT_VOCAB = 8000
"""The vocabulary of the -tiny BERT recipes' learned WordPiece."""
_SPECIALS = (0, 1, 2, 3, 4)


def _bert_init(model: nn.Module) -> nn.Module:
    initialise(model, InitConfig(scheme="normal", scale=0.02))
    return model


def _step(model: nn.Module, loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer | None
          ) -> Callable[[], None]:
    def run() -> None:
        backward_and_step(model, loss(), optimizer)
    return run


def bench_bert(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
               progress: Callable[[str], None]) -> None:
    progress("bert: masked-LM and fine-tuning steps, gatedformer vs Hugging Face transformers")
    try:
        import transformers
    except ImportError as err:
        why = f"skipped: not installed ({err.name or err}); pip install 'gatedformer[bench]'"
        report.rows.append({"section": "bert", "name": "Hugging Face BERT", "status": why})
        report.notes.append(f"bert: {why}")
        return
    d, vocab = size.d_model, BERT_VOCAB
    hf_config = transformers.BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=size.n_layers,
                                        num_attention_heads=size.n_heads, intermediate_size=size.ffn,
                                        hidden_dropout_prob=size.dropout, attention_probs_dropout_prob=size.dropout,
                                        max_position_embeddings=max(512, size.seq_len), num_labels=2)
    ours_args = {"d_model": d, "n_layers": size.n_layers, "n_heads": size.n_heads, "d_ffn": size.ffn,
                 "attn_dropout": size.dropout, "max_positions": max(512, size.seq_len)}
    generator = torch.Generator().manual_seed(options.seed)
    tokens = torch.randint(len(_SPECIALS), vocab, (size.batch, size.seq_len), generator=generator)
    tokens[:, 0], tokens[:, -1] = 2, 3  # [CLS] ... [SEP]
    inputs, positions, targets = mask_tokens(tokens, rng(options.seed), 0.15, vocab, 4, _SPECIALS)
    labels = torch.full_like(tokens, IGNORE).scatter(1, positions, targets)
    lengths = torch.randint(size.seq_len // 2, size.seq_len + 1, (size.batch,), generator=generator)
    mask = torch.arange(size.seq_len)[None, :] < lengths[:, None]
    pairs = torch.where(mask, tokens, torch.zeros_like(tokens))
    types = (torch.arange(size.seq_len)[None, :] >= (lengths // 2)[:, None]).long() * mask
    classes = torch.randint(0, 2, (size.batch,), generator=generator)
    inputs, positions, targets, labels, pairs, types, mask, classes = (
        t.to(device) for t in (inputs, positions, targets, labels, pairs, types, mask, classes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(options.seed)
        models: dict[str, nn.Module] = {
            "gatedformer BERT MLM": _bert_init(fuse(BertForMaskedLM(vocab, dropout=size.dropout, **ours_args))),
            "transformers BertForMaskedLM": _bert_init(transformers.BertForMaskedLM(hf_config)),
            "gatedformer BERT classifier": _bert_init(fuse(BertForSequenceClassification(
                vocab, 2, dropout=size.dropout, **ours_args))),
            "transformers BertForSequenceClassification": _bert_init(
                transformers.BertForSequenceClassification(hf_config)),
        }
    for model in models.values():
        model.to(device).train()
    losses: dict[str, Callable[[], torch.Tensor]] = {
        "gatedformer BERT MLM": lambda: models["gatedformer BERT MLM"](inputs, positions=positions,
                                                                        targets=targets).loss,
        "transformers BertForMaskedLM": lambda: models["transformers BertForMaskedLM"](
            input_ids=inputs, labels=labels).loss,
        "gatedformer BERT classifier": lambda: F.cross_entropy(
            models["gatedformer BERT classifier"](pairs, types, mask).logits, classes),
        "transformers BertForSequenceClassification": lambda: models["transformers BertForSequenceClassification"](
            input_ids=pairs, token_type_ids=types, attention_mask=mask.long(), labels=classes).loss,
    }
    steps = {name: _step(model, losses[name], _make_optimizer(model, options.optimizer, device))
             for name, model in models.items()}
    failed: dict[str, str] = {}
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if options.bf16 else contextlib.nullcontext())
    with autocast:
        times = time_round_robin(steps, options.repeats, options.warmup, device, failed)
    pairs_of = {"masked LM": ("gatedformer BERT MLM", "transformers BertForMaskedLM"),
                "fine-tuning": ("gatedformer BERT classifier", "transformers BertForSequenceClassification")}
    for step, (ours, theirs) in pairs_of.items():
        for name in (ours, theirs):
            if name not in times:
                report.rows.append({"section": "bert", "step": step, "name": name,
                                    "status": f"failed: {failed.get(name, 'not timed')}"})
                continue
            timing = times[name]
            row: dict[str, Any] = {"section": "bert", "step": step, "name": name, "status": "ok",
                                   "params": sum(p.numel() for p in {id(p): p for p in
                                                                     models[name].parameters()}.values()),
                                   **timing.as_dict("train"),
                                   "train_tokens_per_s": size.batch * size.seq_len / timing.median}
            if ours in times and theirs in times:
                row["ours_train_speedup"] = timing.median / times[ours].median
            report.rows.append(row)
    report.notes.append(f"bert: vocabulary {vocab:,} (bert-mlm-tiny's WordPiece), 15 % of the tokens masked; the "
                        "fine-tuning batch holds pairs of random lengths from half to the whole --seq-len, padded; "
                        "both sides' weights BERT's N(0, 0.02) whatever --init says")
