"""The bench's translation table: every translation backbone's training and evaluation steps (ms, tokens/s, MFU)
and its beam-search decoding (sentences/s), side by side in one loop with the matrix product that gives the peak.

The models are the ``-tiny`` recipes' (the bench's ``--d-model``, ``--layers``, ``--heads``, ``--d-ffn``,
``--dropout``; ConvS2S with ``--layers`` GLU blocks of ``--d-model`` channels and width 3 in each stack) on
Multi30K-like batches: :data:`SENTENCES` sentence pairs of :data:`LENGTH` tokens a side (Multi30K's mean is 13),
vocabularies of :data:`VOCAB` tokens, label smoothing 0.1. A training step is the loss (output layer and
cross-entropy as one function), its backward pass and the optimiser; an evaluation step the loss alone. FLOPs are
counted by ``torch.utils.flop_counter`` on one forward pass with PyTorch's operations in place of the compiled
kernels (the counter cannot see inside them; the arithmetic is the same), three times that for a training step.
Decoding is beam search (beam 5, length penalty 0.6) over :data:`DECODE_SENTENCES` sources, ``<eos>`` ruled out so
that every model decodes the same number of steps, the step limit (``2 · length + 10``), whatever its untrained
weights would end on.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gatedformer.analysis.bench.options import BenchOptions, BenchSize
from gatedformer.analysis.bench.report import BenchReport
from gatedformer.analysis.bench.runners import (
    _make_optimizer,
    backward_and_step,
    count_parameters,
    initialise_weights,
)
from gatedformer.analysis.bench.timing import bf16_mfu, measured_peaks, peak_contenders, time_round_robin
from gatedformer.config import RunConfig, apply_overrides, backbone_names
from gatedformer.data.translation import EOS_ID, PAD_ID
from gatedformer.fused import fuse
from gatedformer.kernels.build import pytorch_operations
from gatedformer.tasks.base import evaluating
from gatedformer.tasks.translation import beam_search, build_seq2seq

__all__ = ["DECODE_SENTENCES", "LENGTH", "SENTENCES", "VOCAB", "bench_translation"]

SENTENCES, LENGTH, VOCAB, DECODE_SENTENCES, BEAM = 128, 14, 5000, 32, 5


def _config(size: BenchSize, backbone: str) -> RunConfig:
    return apply_overrides(RunConfig(), [
        "data.corpus=multi30k", f"model.backbone={backbone}", f"model.d_model={size.d_model}",
        f"model.n_layers={size.n_layers}", f"model.n_heads={size.n_heads}", f"model.d_ffn={size.ffn}",
        f"model.dropout={size.dropout}", f"model.attn_dropout={size.dropout}", "model.kernel_size=3",
        f"model.weight_norm={backbone == 'convs2s'}", f"translation.max_len={2 * LENGTH + 12}"])


def _forward_flops(model: nn.Module, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with evaluating(model), pytorch_operations(), torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID)
    return int(counter.get_total_flops())


class _NoEnd(nn.Module):
    """A translation model that never ends a hypothesis: its ``<eos>`` logit is ``-inf``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.max_len = model.max_len

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.encode(src)

    def new_cache(self) -> Any:
        return self.model.new_cache()

    def reorder_cache(self, cache: Any, order: torch.Tensor) -> None:
        self.model.reorder_cache(cache, order)

    def decode_step(self, tokens: torch.Tensor, position: int, memory: torch.Tensor, src_mask: torch.Tensor,
                    cache: Any) -> torch.Tensor:
        logits = self.model.decode_step(tokens, position, memory, src_mask, cache)
        logits[:, EOS_ID] = -math.inf
        return logits


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer | None, src: torch.Tensor, tgt_in: torch.Tensor,
           tgt_out: torch.Tensor, decode_src: torch.Tensor) -> dict[str, Callable[[], object]]:
    def train() -> None:
        if not model.training:
            model.train()
        backward_and_step(model, model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID, label_smoothing=0.1).loss,
                          optimizer)

    def evaluate() -> None:
        if model.training:
            model.eval()
        with torch.no_grad():
            model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID)

    endless = _NoEnd(model)

    def decode() -> None:
        model.eval()
        beam_search(endless, decode_src, beam=BEAM, length_penalty=0.6)

    return {"train": train, "eval": evaluate, "decode": decode}


def bench_translation(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                      progress: Callable[[str], None]) -> None:
    """Time every translation backbone (see the module docstring) into ``report``'s ``translation`` rows."""
    names = backbone_names("translation")
    progress(f"translation: {', '.join(names)} training, evaluation and beam-{BEAM} decoding")
    generator = torch.Generator().manual_seed(options.seed)
    src = torch.randint(4, VOCAB, (SENTENCES, LENGTH + 1), generator=generator)
    src[:, -1] = 3  # <eos>
    tgt = torch.randint(4, VOCAB, (SENTENCES, LENGTH + 1), generator=generator)
    tgt_in, tgt_out = tgt.clone(), tgt.clone()
    tgt_in[:, 0] = 2  # <bos> tokens
    tgt_in, tgt_out = tgt_in[:, :-1], torch.cat([tgt_out[:, 1:-1], torch.full((SENTENCES, 1), 3)], dim=1)
    src, tgt_in, tgt_out = (t.to(device) for t in (src, tgt_in, tgt_out))
    decode_src = src[:DECODE_SENTENCES]
    contenders, peak_flops = peak_contenders(device, options)
    models: dict[str, nn.Module] = {}
    flops: dict[str, int] = {}
    for name in names:
        try:
            torch.manual_seed(options.seed)
            config = _config(size, name)
            model = fuse(build_seq2seq(config, VOCAB, VOCAB))
            if name != "convs2s":  # ConvS2S initialises itself, by its paper's appendix
                initialise_weights(model, options.init)
            model.to(device)
            flops[name] = _forward_flops(model, src, tgt_in, tgt_out)
        except Exception as err:  # noqa: BLE001 - one model that cannot be built must not stop the others
            report.rows.append({"section": "translation", "backbone": name, "status": f"not built: {err}"})
            continue
        models[name] = model
        for step, run in _steps(model, _make_optimizer(model, options.optimizer, device), src, tgt_in, tgt_out,
                                decode_src).items():
            contenders[f"{step}:{name}"] = run
    failed: dict[str, str] = {}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if options.bf16 else contextlib.nullcontext()
    with autocast:
        times = time_round_robin(contenders, options.repeats, options.warmup, device, failed)
    peak, peaks = measured_peaks(times, peak_flops)
    tokens = SENTENCES * LENGTH  # target tokens a step predicts
    for name, model in models.items():
        keys = [f"{step}:{name}" for step in ("train", "eval", "decode")]
        missing = [key for key in keys if key not in times]
        if missing:
            report.rows.append({"section": "translation", "backbone": name,
                                "status": f"failed: {failed.get(missing[0], 'not timed')}"})
            continue
        train, evaluation, decode = (times[key] for key in keys)
        forward = flops[name]
        row: dict[str, Any] = {
            "section": "translation", "backbone": name, "status": "ok", "params": count_parameters(model),
            "sentences": SENTENCES, "length": LENGTH, "vocab": VOCAB, "beam": BEAM,
            "decode_sentences": DECODE_SENTENCES,
            **train.as_dict("train"), "train_tokens_per_s": tokens / train.median,
            **evaluation.as_dict("eval"), "eval_tokens_per_s": tokens / evaluation.median,
            "train_gflop": 3 * forward / 1e9, "eval_gflop": forward / 1e9, "peak_gflops": peak / 1e9,
            "train_mfu": 3 * forward / train.median / peak, "eval_mfu": forward / evaluation.median / peak,
            **decode.as_dict("decode"), "decode_sentences_per_s": DECODE_SENTENCES / decode.median,
            **bf16_mfu(peaks, 3 * forward / train.median, forward / evaluation.median),
        }
        report.rows.append(row)
