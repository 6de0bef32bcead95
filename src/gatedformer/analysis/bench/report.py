"""The bench's report: its rows and notes, as JSON or as plain-text tables."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gatedformer.analysis.bench.memory import memory_method
from gatedformer.analysis.bench.options import NOISY_SPREAD_PCT, BenchOptions, BenchSize, RNNSize

_OVERHEAD_BOUND_MFU = 0.10
"""A baseline training step below this MFU spends its time on per-call overhead (kernel launches, Python), not
arithmetic: there a gate costs its extra calls, not its extra FLOPs."""


@dataclass
class BenchReport:
    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, "notes": self.notes}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False, default=str)

    def section(self, name: str) -> list[dict[str, Any]]:
        return [row for row in self.rows if row["section"] == name]


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def report_meta(size: BenchSize, rnn: RNNSize, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "size": dataclasses.asdict(size) | {"d_ffn": size.ffn, "mem_len": size.memory},
        "rnn_size": dataclasses.asdict(rnn),
        "options": dataclasses.asdict(options),
    }
    with contextlib.suppress(OSError):
        meta["load_average"] = os.getloadavg()
    return meta


def describe_options(options: BenchOptions, device: torch.device) -> str:
    step = {"adamw-grouped": "forward + loss + backward + AdamW step, one fused call (the trainer's)",
            "adamw-fused": "forward + loss + backward + fused AdamW step",
            "adamw": "forward + loss + backward + AdamW step (torch's default implementation)",
            "none": "forward + loss + backward (no optimiser step)"}[options.optimizer]
    method = memory_method(options.memory, device)
    memory = {"tensors": "peak live tensor storage created during one step (dispatch-level tracker)",
              "rss": "rise of the RSS high-water mark over one step, fresh subprocess per model",
              "cuda": "torch.cuda.max_memory_allocated over one step, minus what was allocated before",
              "none": "not measured"}[method]
    extras = [name for name, on in (("torch.compile", options.compile), ("bf16 autocast", options.bf16),
                                     ("denormals flushed to zero", options.flush_denormal)) if on]
    init = ("each library's own initialisation" if options.init == "default" else
            f"every language model (ours and peers) initialised by the trainer's {options.init!r} scheme")
    return (f"training step = {step}; median of {options.repeats} interleaved rounds after {options.warmup} "
            f"warm-up rounds, IQR in brackets; MFU = analytic model FLOPs/s over a float32 n×n matmul timed in "
            f"the same loop; memory = {memory}; {init}{'; ' + ', '.join(extras) if extras else ''}")


def _ms(row: dict[str, Any], prefix: str) -> str:
    return f"{row[f'{prefix}_ms']:.1f} ({row[f'{prefix}_q1_ms']:.1f}-{row[f'{prefix}_q3_ms']:.1f})"


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1f}%"


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(line[i])) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def _overhead_bound_note(models: Sequence[dict[str, Any]]) -> str:
    """A note for the gate rows that miss the target behind a baseline too small for the device to be busy."""
    baseline_mfu = {r["backbone"]: r["train_mfu"] for r in models
                    if r.get("variant") == "baseline" and r.get("status") == "ok"}
    bound = sorted({r["backbone"] for r in models if r.get("gate_target_met") is False
                    and baseline_mfu.get(r["backbone"], 1.0) < _OVERHEAD_BOUND_MFU})
    if not bound:
        return ""
    figures = ", ".join(f"{b} {100 * baseline_mfu[b]:.1f}%" for b in bound)
    return (f"models: NO behind a baseline under {100 * _OVERHEAD_BOUND_MFU:.0f}% MFU ({figures}): at this size "
            "the step is bound by per-call overhead (kernel launches, Python), so a gate costs its extra calls, not "
            "its FLOPs. --compile fuses a gate's element-wise work; a larger --d-model or --batch lets the FLOPs count")


def _models_part(models: list[dict[str, Any]], size: dict[str, Any], extra_notes: list[str]) -> str:
    """The models table (and its notes, added to ``extra_notes``)."""
    lines = []
    for r in models:
        if r.get("status") != "ok":
            lines.append([r["backbone"], r["variant"], r["status"], *[""] * 11])
            continue
        lines.append([r["backbone"], r["variant"], f"{r['params']:,}", _ms(r, "train"),
                      f"{r['train_tokens_per_s']:,.0f}", f"{100 * r['train_mfu']:.1f}%", _ms(r, "eval"),
                      f"{r['eval_tokens_per_s']:,.0f}", f"{100 * r['eval_mfu']:.1f}%",
                      _mb(r.get("peak_mem_mb")), _pct(r.get("extra_flops_pct")),
                      _pct(r.get("extra_time_pct")), _pct(r.get("extra_time_paired_pct")),
                      {True: "yes", False: "NO"}.get(r.get("gate_target_met"), "") + "*" * bool(r.get("noisy"))])
    if any("extra_time_paired_pct" in r for r in models):
        extra_notes.append("models: +time = the variant's median over its baseline's; +time/round = the median "
                           "over rounds of the two calls in the same round, which the gate target "
                           "(≤ +FLOPs + 10 points) is judged on")
    if any(r.get("noisy") for r in models):
        extra_notes.append(f"models: * = the IQR of the variant or its baseline exceeds {NOISY_SPREAD_PCT:.0f}% "
                           "of the median (a busy machine): rerun with more --repeats, or --threads 1")
    overhead_note = _overhead_bound_note(models)
    if overhead_note:
        extra_notes.append(overhead_note)
    return (f"\n== models: d {size['d_model']}, {size['n_layers']} layers, {size['n_heads']} heads, "
            f"ffn {size['d_ffn']}, batch {size['batch']} x seq {size['seq_len']}, vocab {size['vocab']}\n"
            + _table(["backbone", "variant", "params", "train ms (IQR)", "tok/s", "MFU", "eval ms (IQR)",
                      "tok/s", "MFU", "peak MB", "+FLOPs", "+time", "+time/round",
                      "≤+FLOPs+10"], lines))


def _compiled_part(compiled: list[dict[str, Any]]) -> str:
    """The eager and compiled training steps side by side."""
    lines = [[r["backbone"], r["variant"], _ms(r, "train_eager"), _ms(r, "train"),
              f"{r['compiled_speedup']:.2f}x", f"{r.get('train_first_call_s') or float('nan'):.1f}"]
             for r in compiled]
    return ("\n== torch.compile: the training step eager and compiled, interleaved in the same rounds "
            "(speed-up = the median over rounds of eager / compiled, >1: the compiled step is faster)\n"
            + _table(["backbone", "variant", "eager ms (IQR)", "compiled ms (IQR)", "speed-up",
                      "first call s"], lines))


def _peers_part(peers: list[dict[str, Any]]) -> str:
    """The Transformer peers' table."""
    lines = []
    for r in peers:
        if r.get("status") != "ok":
            lines.append([r["name"], r["status"], *[""] * 8])
            continue
        lines.append([r["name"], f"{r['params']:,}", _ms(r, "train"), f"{r['train_tokens_per_s']:,.0f}",
                      f"{100 * r['train_mfu']:.1f}%", _ms(r, "eval"), f"{r['eval_tokens_per_s']:,.0f}",
                      _mb(r.get("peak_mem_mb")), f"{r.get('ours_train_speedup', float('nan')):.2f}x",
                      f"{r.get('ours_eval_speedup', float('nan')):.2f}x"])
    return ("\n== transformer peers (same size; speed-up = their median / ours, >1: ours is faster)\n"
            + _table(["model", "params", "train ms (IQR)", "tok/s", "MFU", "eval ms (IQR)", "tok/s",
                      "peak MB", "train speed-up", "eval speed-up"], lines))


def _rnn_part(rnn_rows: list[dict[str, Any]], rs: dict[str, Any]) -> str:
    """The recurrent peers' table."""
    lines = []
    for r in rnn_rows:
        if r.get("status") != "ok":
            lines.append([r["name"], r["status"], *[""] * 6])
            continue
        lines.append([r["name"], f"{r['params']:,}", _ms(r, "forward"), _ms(r, "fwd_bwd"),
                      f"{r['fwd_bwd_tokens_per_s']:,.0f}", _mb(r.get("peak_mem_mb")),
                      f"{r.get('ours_forward_speedup', float('nan')):.2f}x",
                      f"{r.get('ours_fwd_bwd_speedup', float('nan')):.2f}x"])
    return (f"\n== recurrent peers: hidden {rs['hidden']}, {rs['layers']} layers, length {rs['length']}, "
            f"batch {rs['batch']} (speed-up = their median / ours)\n"
            + _table(["model", "params", "forward ms (IQR)", "fwd+bwd ms (IQR)", "fwd+bwd tok/s",
                      "fwd+bwd peak MB", "fwd speed-up", "fwd+bwd speed-up"], lines))


def _memory_part(memory: list[dict[str, Any]]) -> str:
    """Peak memory against Transformer-XL's mem_len and the R-Transformer's window."""
    lines = [[r["backbone"], r["knob"], str(r["value"]),
              "" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.1f}",
              "" if r.get("eval_peak_mb") is None else f"{r['eval_peak_mb']:.1f}",
              f"{r['window_copy_mb']:.1f}" if "window_copy_mb" in r else ""] for r in memory]
    return ("\n== memory against Transformer-XL mem_len and R-Transformer window (MB)\n"
            + _table(["backbone", "knob", "value", "train peak", "eval peak", "per-window copy would add"],
                     lines))


def _bert_part(bert: list[dict[str, Any]], size: dict[str, Any]) -> str:
    """BERT against Hugging Face's."""
    lines = [[r.get("step", ""), r["name"], r["status"], *[""] * 4] if r.get("status") != "ok" else
             [r["step"], r["name"], f"{r['params']:,}", _ms(r, "train"), f"{r['train_tokens_per_s']:,.0f}",
              f"{r.get('ours_train_speedup', float('nan')):.2f}x", ""] for r in bert]
    return (f"\n== BERT against Hugging Face transformers: d {size['d_model']}, {size['n_layers']} layers, "
            f"{size['n_heads']} heads, ffn {size['d_ffn']}, batch {size['batch']} x seq {size['seq_len']} "
            "(speed-up = their median / ours)\n"
            + _table(["step", "model", "params", "train ms (IQR)", "tok/s", "speed-up", ""], lines))


def _translation_part(translation: list[dict[str, Any]], size: dict[str, Any]) -> str:
    """The translation models' training, evaluation and decoding."""
    shape = next((r for r in translation if r.get("status") == "ok"), {})
    lines = [[r["backbone"], r["status"], *[""] * 7] if r.get("status") != "ok" else
             [r["backbone"], f"{r['params']:,}", _ms(r, "train"), f"{r['train_tokens_per_s']:,.0f}",
              f"{100 * r['train_mfu']:.1f}%", _ms(r, "eval"), f"{100 * r['eval_mfu']:.1f}%", _ms(r, "decode"),
              f"{r['decode_sentences_per_s']:,.1f}"] for r in translation]
    return (f"\n== translation: d {size['d_model']}, {size['n_layers']} layers, {size['n_heads']} heads, "
            f"ffn {size['d_ffn'] or 4 * size['d_model']}; {shape.get('sentences')} pairs of "
            f"{shape.get('length')} tokens, vocabularies of {shape.get('vocab')}; beam {shape.get('beam')} "
            f"over {shape.get('decode_sentences')} sentences\n"
            + _table(["backbone", "params", "train ms (IQR)", "tok/s", "train MFU", "eval ms (IQR)",
                      "eval MFU", "decode ms (IQR)", "sent/s"], lines))


def _sampling_part(sampling: list[dict[str, Any]]) -> str:
    """Sampling with the incremental cache and without."""
    lines = [[r["backbone"], f"{r['params']:,}", _ms(r, "cached"), f"{r['cached_tokens_per_s']:,.0f}",
              _ms(r, "full"), f"{r['full_tokens_per_s']:,.0f}", f"{r['cache_speedup']:.1f}x",
              "yes" if r["same_tokens"] else "NO"] for r in sampling]
    return (f"\n== sampling {sampling[0]['tokens']} tokens (window {sampling[0]['context']}) with the "
            "incremental cache and with the full recomputation (generate --no-cache); speed-up = full / "
            "cached, paired by round\n"
            + _table(["backbone", "params", "cached ms (IQR)", "tok/s", "full ms (IQR)", "tok/s",
                      "speed-up", "same tokens"], lines))


def _qa_part(qa: list[dict[str, Any]]) -> str:
    """The document readers' training steps, SRU beside the bi-LSTM."""
    lines = [[r["name"], r["status"], *[""] * 6] if r.get("status") != "ok" else
             [r["name"], r["recurrence"], f"{r['params']:,}", _ms(r, "train"), f"{r['train_questions_per_s']:,.1f}",
              f"{r['epoch_s'] / 60:,.1f}", f"{r['speedup_vs_lstm']:.2f}x" if "speedup_vs_lstm" in r else ""]
             for r in qa]
    return (f"\n== question answering: the document reader's training step, SRU vs bi-LSTM (shape: {qa[0]['shape']}; "
            "speed-up = the LSTM's time over the reader's, paired by round, >1: faster than the LSTM)\n"
            + _table(["reader", "recurrence", "params", "train ms (IQR)", "questions/s", "epoch min",
                      "vs bi-LSTM"], lines))


def format_report(report: BenchReport) -> str:
    """The report as plain-text tables, one a section."""
    meta = report.meta
    size = meta["size"]
    parts = [f"gatedformer bench  {meta['date']}  {meta['device_name']} ({meta['device']}, {meta['threads']} "
             f"threads)  torch {meta['torch']}"]
    extra_notes: list[str] = []
    models = report.section("models")
    compiled = [r for r in models if "compiled_speedup" in r]
    tables = [
        models and _models_part(models, size, extra_notes),
        compiled and _compiled_part(compiled),
        report.section("transformer-peers") and _peers_part(report.section("transformer-peers")),
        report.section("rnn-peers") and _rnn_part(report.section("rnn-peers"), meta.get("rnn_size", {})),
        report.section("memory") and _memory_part(report.section("memory")),
        report.section("bert") and _bert_part(report.section("bert"), size),
        report.section("translation") and _translation_part(report.section("translation"), size),
        report.section("sampling") and _sampling_part(report.section("sampling")),
        report.section("qa") and _qa_part(report.section("qa")),
    ]
    parts.extend(table for table in tables if table)
    notes = report.notes + extra_notes
    if notes:
        parts.append("\nnotes:\n" + "\n".join(f"- {note}" for note in notes))
    return "\n".join(parts)
