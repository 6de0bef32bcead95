"""The bench's four tables (models, transformer peers, RNN peers, memory) and :func:`run_bench`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gatedformer.analysis.bench.flops import FlopCount, count_flops, measured_flops
from gatedformer.analysis.bench.memory import measure_memory, memory_method, rss_peak
from gatedformer.analysis.bench.options import (
    DEFAULT_SECTIONS,
    GATE_TARGET_SLACK_PCT,
    GATE_VARIANTS,
    NOISY_SPREAD_PCT,
    BenchOptions,
    BenchSize,
    RNNSize,
    check_selection,
)
from gatedformer.analysis.bench.peers import TorchReferenceLM, XTransformersLM, import_quietly
from gatedformer.analysis.bench.report import BenchReport, describe_options, report_meta
from gatedformer.analysis.bench.runners import (
    LMRunner,
    bench_model,
    count_parameters,
    initialise_weights,
    memory_step,
)
from gatedformer.analysis.bench.timing import (
    Timing,
    bf16_mfu,
    measured_peaks,
    paired_ratio,
    peak_contenders,
    time_round_robin,
)
from gatedformer.config import backbone_names, get_backbone
from gatedformer.devices import resolve_device
from gatedformer.errors import ConfigError
from gatedformer.fused import fuse
from gatedformer.gates.spec import resolve_placement
from gatedformer.models import build_model
from gatedformer.train.compiling import compile_limits_fail, compile_model


def _variant_specs(variants: Sequence[str] | None) -> dict[str, str]:
    if not variants:
        return dict(GATE_VARIANTS)
    specs = {}
    for name in variants:
        specs[name] = GATE_VARIANTS.get(name, name)
    if "baseline" not in specs:
        specs = {"baseline": "", **specs}  # overheads are measured against the baseline, in the same loop
    return specs


def _check_variants_place(variants: Sequence[str] | None, backbones: Sequence[str] | None, n_layers: int) -> None:
    """Raise :class:`ConfigError` for a variant that no chosen backbone can take (e.g. a layer beyond
    ``--layers``)."""
    if not any(get_backbone(b).gated for b in backbones or backbone_names()):
        return
    for name, spec in _variant_specs(variants).items():
        try:
            resolve_placement(spec, n_layers)
        except ConfigError as err:
            raise ConfigError(f"--variants {name!r} with --layers {n_layers}: {err}") from None


def _time_steps(runners: Mapping[str, LMRunner], options: BenchOptions, device: torch.device
                ) -> tuple[dict[str, Timing], dict[str, str], float, dict[str, float]]:
    """Every runner's training and evaluation steps (``train:NAME``, ``eval:NAME``) and the peak products in one
    round-robin loop: the timings, the contenders that failed (with why), the float32 peak and every peak."""
    contenders, peak_flops = peak_contenders(device, options)
    for name, runner in runners.items():
        contenders[f"train:{name}"] = runner.train_step
        contenders[f"eval:{name}"] = runner.eval_step
        if options.compile:  # the eager step beside the compiled one, in the same rounds
            contenders[f"train-eager:{name}"] = functools.partial(runner.train_step, eager=True)
    failed: dict[str, str] = {}
    times = time_round_robin(contenders, options.repeats, options.warmup, device, failed=failed)
    peak, peaks = measured_peaks(times, peak_flops)
    return times, failed, peak, peaks


def _bench_models(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                  backbones: Sequence[str] | None, variants: Sequence[str] | None,
                  progress: Callable[[str], None]) -> None:
    method = memory_method(options.memory, device)
    specs = _variant_specs(variants)
    for backbone in backbones or list(backbone_names()):
        gated = get_backbone(backbone).gated
        chosen = specs if gated else {"baseline": ""}
        if not gated and len(specs) > 1:
            report.notes.append(f"models: {backbone} has no sublayers to gate; only its baseline is measured")
        progress(f"models: {backbone} ({len(chosen)} variant{'s' * (len(chosen) > 1)})")
        runners: dict[str, LMRunner] = {}
        flops: dict[str, FlopCount] = {}
        for name, spec in chosen.items():
            cfg = size.model_config(backbone, spec)
            try:
                torch.manual_seed(options.seed)
                model = bench_model(cfg, size.vocab, options.init)
            except Exception as err:  # noqa: BLE001 - one backbone that cannot be built must not stop the rest
                report.notes.append(f"models: {backbone} {name}: not built ({type(err).__name__}: {err})")
                continue
            memory_len = size.memory if backbone == "transformer-xl" else 0
            runners[name] = LMRunner(model, size, device, options, memory_len=memory_len)
            try:
                flops[name] = count_flops(cfg, size.vocab, size.batch, size.seq_len, memory_len=memory_len)
            except ValueError:
                flops[name] = measured_flops(model.eval(), runners[name].x)
        times, failed, peak, peaks = _time_steps(runners, options, device)
        base_time = times.get("train:baseline")
        base_flops = flops.get("baseline")
        for name, runner in runners.items():
            if f"train:{name}" not in times or f"eval:{name}" not in times:
                why = failed.get(f"train:{name}") or failed.get(f"eval:{name}")
                report.rows.append({"section": "models", "backbone": backbone, "variant": name,
                                    "status": f"failed: {why}"})
                continue
            train, evaluation = times[f"train:{name}"], times[f"eval:{name}"]
            count = flops[name]
            row: dict[str, Any] = {
                "section": "models", "backbone": backbone, "variant": name, "gates": chosen[name], "status": "ok",
                "params": count_parameters(runner.model),
                **train.as_dict("train"),
                "train_tokens_per_s": size.tokens / train.median,
                **evaluation.as_dict("eval"),
                "eval_tokens_per_s": size.tokens / evaluation.median,
                "train_gflop": count.train_total / 1e9,
                "eval_gflop": count.forward_total / 1e9,
                "flop_method": count.method,
                "peak_gflops": peak / 1e9,
                "train_mfu": count.train_total / train.median / peak,
                "eval_mfu": count.forward_total / evaluation.median / peak,
                **bf16_mfu(peaks, count.train_total / train.median, count.forward_total / evaluation.median),
            }
            eager = times.get(f"train-eager:{name}")
            if eager is not None:
                row.update(eager.as_dict("train_eager"))
                # > 1: the compiled step is the faster (the median over rounds of eager / compiled in one round)
                row["compiled_speedup"] = paired_ratio(eager, train)
            if base_time is not None and base_flops is not None and name != "baseline":
                row["extra_flops_pct"] = 100.0 * (count.train_total / base_flops.train_total - 1.0)
                row["extra_time_pct"] = 100.0 * (train.median / base_time.median - 1.0)
                row["extra_time_paired_pct"] = 100.0 * (paired_ratio(train, base_time) - 1.0)
                row["gate_target_met"] = (row["extra_time_paired_pct"]
                                          <= row["extra_flops_pct"] + GATE_TARGET_SLACK_PCT)
                row["noisy"] = max(train.spread_pct, base_time.spread_pct) > NOISY_SPREAD_PCT
            try:
                if method == "rss":
                    row["peak_mem_mb"] = rss_peak(size.model_config(backbone, chosen[name]), size, options, "train")
                elif method != "none":
                    row["peak_mem_mb"] = measure_memory(memory_step(runner, method), device, method)
            except Exception as err:  # noqa: BLE001 - a memory probe failure must not lose the timings
                report.notes.append(f"models: {backbone} {name}: memory not measured ({err})")
            row["mem_method"] = method
            report.rows.append(row)
        del runners
        gc.collect()


def _bench_transformer_peers(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                             progress: Callable[[str], None]) -> None:
    progress("transformer-peers: gatedformer vs torch.nn.TransformerEncoder vs x-transformers")
    method = memory_method(options.memory, device)
    if method == "rss":
        method = "tensors"
    cfg = size.model_config("transformer")
    flops = count_flops(cfg, size.vocab, size.batch, size.seq_len)
    builders: dict[str, Callable[[], nn.Module]] = {
        "gatedformer TransformerLM": lambda: fuse(build_model(cfg, size.vocab)),
        "torch.nn.TransformerEncoder": lambda: TorchReferenceLM(size.vocab, size.d_model, size.n_layers,
                                                                size.n_heads, size.ffn, size.dropout, size.seq_len,
                                                                cfg.attn_dropout),
        "x-transformers": lambda: XTransformersLM(size),
    }
    runners: dict[str, LMRunner] = {}
    skipped: dict[str, str] = {}
    for name, make in builders.items():
        try:
            torch.manual_seed(options.seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runners[name] = LMRunner(initialise_weights(make(), options.init), size, device, options)
        except ImportError as err:
            skipped[name] = f"skipped: not installed ({err.name or err}); pip install 'gatedformer[bench]'"
        except Exception as err:  # noqa: BLE001 - an optional peer that fails to build is reported
            skipped[name] = f"skipped: {type(err).__name__}: {err}"[:200]
    times, failed, peak, peaks = _time_steps(runners, options, device)
    ours = times.get("train:gatedformer TransformerLM")
    ours_eval = times.get("eval:gatedformer TransformerLM")
    for name in builders:
        if name in skipped or f"train:{name}" not in times or f"eval:{name}" not in times:
            why = skipped.get(name) or f"failed: {failed.get(f'train:{name}') or failed.get(f'eval:{name}')}"
            report.rows.append({"section": "transformer-peers", "name": name, "status": why})
            report.notes.append(f"transformer-peers: {name} {why}")
            continue
        runner = runners[name]
        train, evaluation = times[f"train:{name}"], times[f"eval:{name}"]
        row: dict[str, Any] = {
            "section": "transformer-peers", "name": name, "status": "ok", "params": count_parameters(runner.model),
            **train.as_dict("train"), "train_tokens_per_s": size.tokens / train.median,
            **evaluation.as_dict("eval"), "eval_tokens_per_s": size.tokens / evaluation.median,
            "train_mfu": flops.train_total / train.median / peak,
            "eval_mfu": flops.forward_total / evaluation.median / peak,
            **bf16_mfu(peaks, flops.train_total / train.median, flops.forward_total / evaluation.median),
            "peak_gflops": peak / 1e9,
        }
        if ours is not None:
            row["ours_train_speedup"] = train.median / ours.median
        if ours_eval is not None:
            row["ours_eval_speedup"] = evaluation.median / ours_eval.median
        with contextlib.suppress(Exception):
            if method != "none":
                row["peak_mem_mb"] = measure_memory(memory_step(runner, method), device, method)
                row["mem_method"] = method
        report.rows.append(row)


def _rnn_peer_models(rnn: RNNSize, options: BenchOptions, device: torch.device
                     ) -> tuple[list[str], dict[str, nn.Module], dict[str, str]]:
    """Our SRU and its peers (the official ``sru``, ``nn.LSTM``, ``nn.GRU``) at one size, each built from the same
    seed: every contender's name, the models built, and why each of the others is not there."""
    def ours() -> nn.Module:
        from gatedformer.nn.sru import SRU

        return fuse(SRU(rnn.hidden, rnn.hidden, num_layers=rnn.layers))

    def official() -> nn.Module:
        sru = import_quietly("sru")
        return sru.SRU(rnn.hidden, rnn.hidden, num_layers=rnn.layers)

    builders: dict[str, Callable[[], nn.Module]] = {
        "gatedformer SRU": ours,
        "sru (official)": official,
        "torch.nn.LSTM": lambda: nn.LSTM(rnn.hidden, rnn.hidden, num_layers=rnn.layers),
        "torch.nn.GRU": lambda: nn.GRU(rnn.hidden, rnn.hidden, num_layers=rnn.layers),
    }
    models: dict[str, nn.Module] = {}
    skipped: dict[str, str] = {}
    for name, make in builders.items():
        try:
            torch.manual_seed(options.seed)
            models[name] = make().to(device)
        except ImportError as err:
            skipped[name] = f"skipped: not installed ({err.name or err}); pip install 'gatedformer[bench]'"
        except Exception as err:  # noqa: BLE001 - an optional peer that fails to build is reported
            skipped[name] = f"skipped: {type(err).__name__}: {err}"[:200]

    return list(builders), models, skipped


def _bench_rnn_peers(report: BenchReport, rnn: RNNSize, options: BenchOptions, device: torch.device,
                     progress: Callable[[str], None]) -> None:
    progress(f"rnn-peers: SRU vs sru / LSTM / GRU (hidden {rnn.hidden}, length {rnn.length}, batch {rnn.batch})")
    method = memory_method(options.memory, device)
    if method == "rss":
        method = "tensors"

    generator = torch.Generator().manual_seed(options.seed)
    x = torch.randn(rnn.length, rnn.batch, rnn.hidden, generator=generator).to(device).requires_grad_(True)
    grad = torch.randn(rnn.length, rnn.batch, rnn.hidden, generator=generator).to(device)
    names, models, skipped = _rnn_peer_models(rnn, options, device)

    def autocast() -> contextlib.AbstractContextManager:
        if options.bf16:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), autocast():
                model(x)
        return run

    def forward_backward(model: nn.Module) -> Callable[[], None]:
        params = list(model.parameters())

        def run() -> None:
            for p in params:
                p.grad = None
            x.grad = None
            with autocast():
                out = model(x)[0]
            out.float().backward(grad)
        return run

    contenders: dict[str, Callable[[], object]] = {}
    for name, model in models.items():
        model.train()
        runnable = compile_model(model) if options.compile else model
        contenders[f"fwd:{name}"] = forward(runnable)
        contenders[f"fwdbwd:{name}"] = forward_backward(runnable)
    memory_steps = {name: forward_backward(model) if method == "tensors" else contenders[f"fwdbwd:{name}"]
                    for name, model in models.items()}
    failed: dict[str, str] = {}
    times = time_round_robin(contenders, options.repeats, options.warmup, device, failed=failed)
    ours_fwd, ours_fb = times.get("fwd:gatedformer SRU"), times.get("fwdbwd:gatedformer SRU")
    tokens = rnn.length * rnn.batch
    for name in names:
        if name in skipped or f"fwd:{name}" not in times or f"fwdbwd:{name}" not in times:
            why = skipped.get(name) or f"failed: {failed.get(f'fwd:{name}') or failed.get(f'fwdbwd:{name}')}"
            report.rows.append({"section": "rnn-peers", "name": name, "status": why})
            report.notes.append(f"rnn-peers: {name} {why}")
            continue
        fwd, fb = times[f"fwd:{name}"], times[f"fwdbwd:{name}"]
        row: dict[str, Any] = {
            "section": "rnn-peers", "name": name, "status": "ok", "params": count_parameters(models[name]),
            **fwd.as_dict("forward"), "forward_tokens_per_s": tokens / fwd.median,
            **fb.as_dict("fwd_bwd"), "fwd_bwd_tokens_per_s": tokens / fb.median,
        }
        if ours_fwd is not None and ours_fb is not None:
            row["ours_forward_speedup"] = fwd.median / ours_fwd.median
            row["ours_fwd_bwd_speedup"] = fb.median / ours_fb.median
        with contextlib.suppress(Exception):
            if method != "none":
                row["peak_mem_mb"] = measure_memory(memory_steps[name], device, method)
                row["mem_method"] = method
        report.rows.append(row)


def _bench_memory(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                  mem_lens: Sequence[int], windows: Sequence[int], progress: Callable[[str], None]) -> None:
    """Peak memory of Transformer-XL against ``mem_len`` and of the R-Transformer against its window."""
    method = memory_method(options.memory, device)
    if method == "none":
        report.notes.append("memory: skipped (--memory none)")
        return
    eager = dataclasses.replace(options, compile=False)
    sweeps: list[tuple[str, str, Sequence[int], dict[str, Any]]] = []
    if "transformer-xl" in backbone_names():
        sweeps.append(("transformer-xl", "mem_len", mem_lens, {}))
    if "rtransformer" in backbone_names():
        sweeps.append(("rtransformer", "rnn_window", windows, {}))
        sweeps.append(("rtransformer", "rnn_window", windows, {"rnn_recompute": True}))
    for backbone, knob, values, extra in sweeps:
        label = backbone + "".join(f" {key}" for key in extra)
        progress(f"memory: {label} against {knob} {list(values)}")
        for value in values:
            cfg = size.model_config(backbone, "", **{knob: value}, **extra)
            memory_len = value if knob == "mem_len" else 0
            row: dict[str, Any] = {"section": "memory", "backbone": label, "knob": knob, "value": value,
                                   "mem_method": method}
            if backbone == "rtransformer" and not extra:
                # What a LocalRNN that copied the sequence once per window position would hold, per layer.
                row["window_copy_mb"] = size.batch * size.seq_len * value * size.d_model * 4 / 2 ** 20
            for mode in ("train", "eval"):
                if method == "rss":
                    row[f"{mode}_peak_mb"] = rss_peak(cfg, size, eager, mode)
                    continue
                torch.manual_seed(options.seed)
                model = bench_model(cfg, size.vocab, options.init)
                runner = LMRunner(model, size, device, eager, memory_len=memory_len)
                step = runner.train_step if mode == "train" else runner.eval_step
                step()
                row[f"{mode}_peak_mb"] = measure_memory(step, device, method)
                del runner
            report.rows.append(row)
        rows = [r for r in report.section("memory") if r["backbone"] == label]
        for mode in ("train", "eval"):
            fit = _linear_fit([r["value"] for r in rows], [r[f"{mode}_peak_mb"] for r in rows])
            if fit is not None:
                slope, intercept, worst = fit
                report.notes.append(
                    f"memory: {label} {mode} peak ≈ {intercept:.2f} MB + {slope:.4f} MB × {knob} "
                    f"(largest deviation from that line {worst:.1f}% of the peak)"
                )


def _linear_fit(xs: Sequence[float], ys: Sequence[float | None]) -> tuple[float, float, float] | None:
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    worst = max(abs(y - (intercept + slope * x)) / max(abs(y), 1e-12) for x, y in points)
    return slope, intercept, 100.0 * worst


def run_bench(size: BenchSize | None = None, options: BenchOptions | None = None, *,
              sections: Sequence[str] = DEFAULT_SECTIONS, backbones: Sequence[str] | None = None,
              variants: Sequence[str] | None = None, rnn: RNNSize | None = None,
              mem_lens: Sequence[int] = (0, 64, 128, 256), windows: Sequence[int] = (1, 3, 7, 15),
              progress: Callable[[str], None] | None = None) -> BenchReport:
    """Run the chosen benchmark sections and return their rows (see the module docstring)."""
    size = size or BenchSize()
    options = options or BenchOptions()
    rnn = rnn or RNNSize()
    progress = progress or (lambda message: None)
    size.check()
    rnn.check()
    options.check()
    check_selection(sections, backbones, variants, mem_lens, windows)
    if "models" in sections:
        _check_variants_place(variants, backbones, size.n_layers)
    device = resolve_device(options.device, "--device")
    threads_were = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    report = BenchReport(report_meta(size, rnn, options, device))
    report.notes.append(describe_options(options, device))
    flushing = options.flush_denormal and torch.set_flush_denormal(True)
    # A model that dynamo would run eagerly past its recompile limit fails its row rather than being timed as compiled.
    strict = compile_limits_fail() if options.compile else contextlib.nullcontext()
    try:
        with strict:
            if "models" in sections:
                _bench_models(report, size, options, device, backbones, variants, progress)
            if "transformer-peers" in sections:
                _bench_transformer_peers(report, size, options, device, progress)
            if "rnn-peers" in sections:
                _bench_rnn_peers(report, rnn, options, device, progress)
            if "memory" in sections:
                _bench_memory(report, size, options, device, mem_lens, windows, progress)
            if "bert" in sections:
                from gatedformer.analysis.bench.bert import bench_bert

                bench_bert(report, size, options, device, progress)
            if "translation" in sections:
                from gatedformer.analysis.bench.translation import bench_translation

                bench_translation(report, size, options, device, progress)
            if "sampling" in sections:
                from gatedformer.analysis.bench.sampling import bench_sampling

                bench_sampling(report, size, options, device, backbones, progress)
            if "qa" in sections:
                from gatedformer.analysis.bench.qa import bench_qa

                bench_qa(report, options, device, progress)
    finally:
        if flushing:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads_were)
    return report
