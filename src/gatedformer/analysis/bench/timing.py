"""Round-robin timing of contenders in one process, and the peak product that MFU is measured against."""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from gatedformer.analysis.bench.options import BenchOptions


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call of one contender over the measured rounds."""

    samples: list[float]
    first_call: float | None = None
    """Seconds of the very first (warm-up) call: includes compilation under ``torch.compile``."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    @property
    def spread_pct(self) -> float:
        """The IQR as a percentage of the median."""
        q1, q3 = self.quartiles
        return 100.0 * (q3 - q1) / self.median

    def as_dict(self, prefix: str) -> dict[str, float | None]:
        q1, q3 = self.quartiles
        return {f"{prefix}_ms": 1e3 * self.median, f"{prefix}_q1_ms": 1e3 * q1, f"{prefix}_q3_ms": 1e3 * q3,
                f"{prefix}_spread_pct": self.spread_pct, f"{prefix}_first_call_s": self.first_call}


def paired_ratio(timing: Timing, base: Timing) -> float:
    """The median over rounds of ``timing``'s call over ``base``'s in the same round of :func:`time_round_robin`:
    the machine's drift from one round to the next, which both share, cancels."""
    return statistics.median(t / b for t, b in zip(timing.samples, base.samples, strict=True))


def time_round_robin(contenders: Mapping[str, Callable[[], object]], repeats: int = 10, warmup: int = 3,
                     device: torch.device | str = "cpu",
                     failed: dict[str, str] | None = None) -> dict[str, Timing]:
    """Time every contender ``repeats`` times, interleaved: one call of each per round, in an order shuffled
    afresh every round (the same orders every run), after ``warmup`` rounds that are not timed.

    A contender that raises during warm-up is dropped; its error goes into ``failed`` when given (else the
    exception propagates).
    """
    device = torch.device(device)
    live = dict(contenders)
    first: dict[str, float] = {}
    for _ in range(max(warmup, 1) if failed is not None else warmup):
        for name, fn in list(live.items()):
            started = time.perf_counter()
            try:
                fn()
                _sync(device)
            except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                if failed is None:
                    raise
                failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
                del live[name]
                continue
            first.setdefault(name, time.perf_counter() - started)
    names = list(live)
    samples: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            order.shuffle(names)
            for name in names:
                _sync(device)
                started = time.perf_counter()
                live[name]()
                _sync(device)
                samples[name].append(time.perf_counter() - started)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(values, first.get(name)) for name, values in samples.items()}


def _matmul_contender(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[Callable[[], None], int]:
    """A large square matrix product and its FLOPs: the peak the models are measured against."""
    n = 1024 if device.type == "cpu" else 4096
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def run() -> None:
        torch.mm(a, b, out=out)

    return run, 2 * n ** 3


def peak_contenders(device: torch.device, options: BenchOptions) -> tuple[dict[str, Callable[[], object]],
                                                                         dict[str, int]]:
    """The float32 matmul peak (and, under ``bf16``, a bfloat16 one) as contenders of a round-robin loop."""
    run, flops = _matmul_contender(device)
    contenders: dict[str, Callable[[], object]] = {"peak": run}
    counts = {"peak": flops}
    if options.bf16:
        contenders["peak-bf16"], counts["peak-bf16"] = _matmul_contender(device, torch.bfloat16)
    return contenders, counts


def measured_peaks(times: Mapping[str, Timing], flops: Mapping[str, int]) -> tuple[float, dict[str, float]]:
    peaks = {name: flops[name] / times[name].median for name in flops if name in times}
    return peaks["peak"], peaks


def bf16_mfu(peaks: Mapping[str, float], train_flops_per_s: float, eval_flops_per_s: float) -> dict[str, float]:
    """Under ``--bf16``: the bfloat16 matmul peak and the MFU against it (``train_mfu`` stays float32-based)."""
    if "peak-bf16" not in peaks:
        return {}
    bf16 = peaks["peak-bf16"]
    return {"peak_bf16_gflops": bf16 / 1e9, "train_mfu_vs_bf16_peak": train_flops_per_s / bf16,
            "eval_mfu_vs_bf16_peak": eval_flops_per_s / bf16}
