"""Speed and memory benchmarks behind ``gatedformer bench``.

What a row measures
-------------------
* **training step**: forward, cross-entropy (on float32 logits, as the trainer), ``zero_grad``, backward and one
  optimiser step (by default the trainer's AdamW, :class:`~gatedformer.train.grouped_adam.GroupedAdam`, one fused
  call per parameter group; ``optimizer="adamw-fused"`` is torch's fused AdamW, ``"adamw"`` torch's default
  implementation, ``"none"`` leaves the step out) on one ``(batch, seq_len)``
  window of random tokens. **Evaluation step**: forward and loss in eval mode under ``torch.no_grad``.
* **timing**: every contender of a table runs in the same process, round-robin. After ``warmup`` rounds, each of
  ``repeats`` rounds calls every contender once, in an order shuffled afresh every round (seeded), so the slow
  phases of a shared machine fall on all of them alike, and so does the cold cache the peak product leaves behind
  (in a fixed order the contender after it would pay for that in every other round). Rows give the median and the
  interquartile range (IQR); ratios are taken between medians of the same run. A gate's extra time is also taken
  round by round (:func:`paired_ratio`, the median of each round's variant over its baseline), which cancels the
  drift both calls of a round share; the gate target is judged on that one.
* **FLOPs** are counted analytically per layer by :func:`count_flops`: every matrix product ``m×k @ k×n`` is
  ``2·m·k·n`` FLOPs; attention scores (QK) and weighted values (AV) are counted over the (query, key) pairs a
  causal query can see (``T(T+1)/2`` per head and sequence, plus ``T·M`` memory pairs for Transformer-XL),
  so kernels that compute the full square do work that is not counted. Element-wise work (norms, softmax,
  activations, gates' sigmoids, dropout, the optimiser) and embedding look-ups are not counted. A training
  step is 3× the forward FLOPs (the backward pass computes two products per forward product).
* **MFU** (model FLOPs utilisation) = the model's FLOPs per second divided by the FLOPs per second of a large
  float32 matrix product (``n×n @ n×n``; n = 1024 on CPU, 4096 on CUDA) timed as one more contender in the
  same round-robin loop: the peak is measured under the same load as the model, never a datasheet figure.
* **memory**: on CUDA, ``torch.cuda.max_memory_allocated`` over one step minus what was allocated before it.
  On CPU (``"tensors"``, the default) the peak of the bytes of tensor storage created by PyTorch operators
  during one step and still alive, tracked by a dispatch mode with weak references: activations saved for
  backward, gradients, temporaries; not the parameters, optimiser state or inputs that existed before the
  step, nor scratch memory a kernel frees before it returns. ``"rss"`` runs each model in a fresh
  subprocess and reports the rise of the resident set's high-water mark over one step (after a warm-up
  step, with the mark reset through ``/proc/self/clear_refs``, and glibc told to map blocks of 64 KiB or more
  one by one so that freed memory leaves the RSS): page rounding and library buffers included.
* **initialisation**: every language model, ours and the peers, gets the same weights scheme (``init``, by
  default the ``xavier`` of the ``-tiny`` recipes, through the trainer's own initialiser). Speed depends on it
  on the CPU: with PyTorch's default ``N(0, 1)`` embeddings scaled by ``sqrt(d)`` the first attention layer's
  softmax is so peaked that its backward pass computes on denormal floats, several times slower.
* **peers**: :class:`TorchReferenceLM` (``torch.nn.TransformerEncoder``, exactly our parameter count),
  x-transformers' ``TransformerWrapper(Decoder)`` of the same size, the official ``sru`` package,
  ``torch.nn.LSTM`` and ``torch.nn.GRU``. The optional ones (``pip install 'gatedformer[bench]'``) are reported
  as skipped when they cannot be imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import inspect
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gatedformer.backbones import BUILDERS, build_model
from gatedformer.backbones.attention import sinusoidal_positions
from gatedformer.backbones.placement import SublayerGates, resolve_placement
from gatedformer.config import INIT_SCHEMES, InitConfig, ModelConfig
from gatedformer.errors import ConfigError
from gatedformer.train.compiling import compile_limits_fail, compile_model
from gatedformer.train.grouped_adam import GroupedAdam, groupable
from gatedformer.train.init import initialise

__all__ = [
    "GATE_VARIANTS",
    "SECTIONS",
    "BenchOptions",
    "BenchReport",
    "BenchSize",
    "FlopCount",
    "RNNSize",
    "Timing",
    "TorchReferenceLM",
    "count_flops",
    "format_report",
    "main",
    "measure_memory",
    "run_bench",
    "time_round_robin",
    "training_step",
]

GATE_VARIANTS: dict[str, str] = {
    "baseline": "",
    "+σ SDU": "+σ SDU",
    "+tanh SDU": "+tanh SDU",
    "+highway gate": "+highway gate",
    "+gated MHDPA": "+gated MHDPA",
    "+EAU": "+EAU",
    "+GRC": "+GRC",
    "+EAU+GRC": "+EAU+GRC",
}
"""Variant name -> gate placement spec; any other spec string is accepted as a variant of its own."""

SECTIONS = ("models", "transformer-peers", "rnn-peers", "memory")
OPTIMIZERS = ("adamw-grouped", "adamw-fused", "adamw", "none")
MEMORY_METHODS = ("auto", "tensors", "rss", "cuda", "none")

_RNN_GATES = {"gru": 3, "lstm": 4, "rnn": 1}
_GATE_TARGET_SLACK_PCT = 10.0
_NOISY_SPREAD_PCT = 25.0
"""An IQR wider than this share of the median marks a comparison as noisy (the machine was busy)."""
_OVERHEAD_BOUND_MFU = 0.10
"""A baseline training step below this MFU spends its time on per-call overhead (kernel launches, Python), not
arithmetic: there a gate costs its extra calls, not its extra FLOPs."""


# --------------------------------------------------------------------------------------------------
# Sizes and options


@dataclass
class BenchSize:
    """The language models' size; the defaults are those of the ``-tiny`` recipes (``ptb-char-tiny``)."""

    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    d_ffn: int = 0
    """0: ``4 * d_model``."""
    seq_len: int = 128
    batch: int = 16
    vocab: int = 50
    dropout: float = 0.1
    mem_len: int = -1
    """Transformer-XL memory length; -1: ``seq_len``."""
    rnn_window: int = 7
    rnn_type: str = "gru"
    """R-Transformer LocalRNN cell: ``gru``, ``lstm`` or ``rnn``."""
    kernel_size: int = 4

    @property
    def ffn(self) -> int:
        return self.d_ffn or 4 * self.d_model

    @property
    def memory(self) -> int:
        return self.seq_len if self.mem_len < 0 else self.mem_len

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def model_config(self, backbone: str, gates: str = "", **changes: Any) -> ModelConfig:
        cfg = ModelConfig(backbone=backbone, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                          d_ffn=self.ffn, dropout=self.dropout, gates=gates, mem_len=self.memory,
                          rnn_window=self.rnn_window, rnn_type=self.rnn_type, kernel_size=self.kernel_size)
        return dataclasses.replace(cfg, **changes)


@dataclass
class RNNSize:
    """The recurrent peers' size (time-major input ``(length, batch, hidden)``)."""

    hidden: int = 256
    length: int = 128
    batch: int = 16
    layers: int = 2


@dataclass
class BenchOptions:
    repeats: int = 10
    warmup: int = 3
    device: str = "auto"
    compile: bool = False
    bf16: bool = False
    optimizer: str = "adamw-grouped"
    memory: str = "auto"
    threads: int = 0
    seed: int = 0
    init: str = "xavier"
    """Weight initialisation of every language model, ours and the peers alike (see :func:`_initialise`)."""
    flush_denormal: bool = False
    """Flush denormal floats to zero on the CPU for the run (``torch.set_flush_denormal``)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} but no CUDA device is available; use --device cpu or auto")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# Timing


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

    def as_dict(self, prefix: str) -> dict[str, float]:
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


def _peak_contenders(device: torch.device, options: BenchOptions) -> tuple[dict[str, Callable[[], object]],
                                                                         dict[str, int]]:
    """The float32 matmul peak (and, under ``bf16``, a bfloat16 one) as contenders of a round-robin loop."""
    run, flops = _matmul_contender(device)
    contenders: dict[str, Callable[[], object]] = {"peak": run}
    counts = {"peak": flops}
    if options.bf16:
        contenders["peak-bf16"], counts["peak-bf16"] = _matmul_contender(device, torch.bfloat16)
    return contenders, counts


def _peaks(times: Mapping[str, Timing], flops: Mapping[str, int]) -> tuple[float, dict[str, float]]:
    peaks = {name: flops[name] / times[name].median for name in flops if name in times}
    return peaks["peak"], peaks


def _bf16_mfu(peaks: Mapping[str, float], train_flops_per_s: float, eval_flops_per_s: float) -> dict[str, float]:
    """Under ``--bf16``: the bfloat16 matmul peak and the MFU against it (``train_mfu`` stays float32-based)."""
    if "peak-bf16" not in peaks:
        return {}
    bf16 = peaks["peak-bf16"]
    return {"peak_bf16_gflops": bf16 / 1e9, "train_mfu_vs_bf16_peak": train_flops_per_s / bf16,
            "eval_mfu_vs_bf16_peak": eval_flops_per_s / bf16}


# --------------------------------------------------------------------------------------------------
# FLOPs


@dataclass
class FlopCount:
    """FLOPs of one forward pass over a batch, by component."""

    forward: dict[str, int]
    method: str = "analytic"

    @property
    def forward_total(self) -> int:
        return sum(self.forward.values())

    @property
    def train_total(self) -> int:
        """Forward + backward: every product of the forward pass is followed by two of the same size."""
        return 3 * self.forward_total


def _mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def _gate_flops(site: SublayerGates, tokens: int, d: int) -> int:
    flops = 0
    if site.unit in ("sdu", "highway", "gated_mhdpa"):
        flops += _mm(tokens, d, 2 * d)  # gate and transform halves in one product
    if site.eau:
        h = d // 2
        flops += _mm(tokens, d, h) + _mm(tokens, h, d) + _mm(tokens, d, d)
    if site.grc:
        flops += _mm(tokens, d, d)
    return flops


def count_flops(cfg: ModelConfig, vocab: int, batch: int, seq_len: int, memory_len: int | None = None) -> FlopCount:
    """Forward FLOPs of the language model ``cfg`` on one ``(batch, seq_len)`` window, counted per layer.

    See the module docstring for what is counted. ``memory_len`` is the Transformer-XL memory in use
    (default ``cfg.mem_len``, the steady state). Backbones without a formula here raise ``ValueError``.
    """
    b, t, d = batch, seq_len, cfg.d_model
    n = b * t
    parts: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        parts[key] = parts.get(key, 0) + value

    if cfg.backbone in ("transformer", "rtransformer", "transformer-xl", "sru-transformer"):
        placement = resolve_placement(cfg.gates, cfg.n_layers, backbone=cfg.backbone)
        f = cfg.d_ffn
        for i in range(cfg.n_layers):
            if cfg.backbone == "rtransformer":
                width = _RNN_GATES[cfg.rnn_type] * d
                # Input projection once per position, then window - 1 hidden-to-hidden products.
                add("local_rnn", cfg.rnn_window * _mm(n, d, width))
            if cfg.backbone == "sru-transformer":
                add("sru.proj", _mm(n, d, 3 * d))  # the SRU sublayer: [W x, W_f x, W_r x] in one product
            if cfg.backbone == "transformer-xl":
                mem = cfg.mem_len if memory_len is None else memory_len
                keys = mem + t
                pairs = t * mem + t * (t + 1) // 2
                add("attn.proj", _mm(n, d, d) + _mm(b * keys, d, 2 * d) + _mm(keys, d, d) + _mm(n, d, d))
                add("attn.scores", 2 * (2 * b * pairs * d))  # content (a + c) and position (b + d) terms
                add("attn.values", 2 * b * pairs * d)
            else:
                pairs = t * (t + 1) // 2
                add("attn.proj", _mm(n, d, 3 * d) + _mm(n, d, d))
                add("attn.scores", 2 * b * pairs * d)
                add("attn.values", 2 * b * pairs * d)
            add("ffn", _mm(n, d, 2 * f) + _mm(n, f, d) if cfg.ffn == "glu" else _mm(n, d, f) + _mm(n, f, d))
            gates = _gate_flops(placement.at(i, "attn"), n, d) + _gate_flops(placement.at(i, "ffn"), n, d)
            if gates:
                add("gates", gates)
    elif cfg.backbone == "gcnn":
        k, bott = cfg.kernel_size, cfg.bottleneck
        for _ in range(cfg.n_layers):
            if bott > 0:
                add("conv", _mm(n, d, 2 * bott) + _mm(n, bott * k, 2 * bott) + _mm(n, bott, 2 * d))
            else:
                add("conv", _mm(n, d * k, 2 * d))
    elif cfg.backbone == "sru":
        p = cfg.projection_size
        for _ in range(cfg.n_layers):
            add("sru.proj", _mm(n, d, p) + _mm(n, p, 3 * d) if p else _mm(n, d, 3 * d))
    else:
        raise ValueError(f"no FLOP formula for backbone {cfg.backbone!r}")
    add("output", _mm(n, d, vocab))
    return FlopCount(parts)


def _measured_flops(model: nn.Module, tokens: Tensor) -> FlopCount:
    """Fallback for backbones without a formula: torch's operator-level counter on one forward pass."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens)
    return FlopCount({"all": int(counter.get_total_flops())}, method="torch.utils.flop_counter")


# --------------------------------------------------------------------------------------------------
# Memory


class _TensorPeak(TorchDispatchMode):
    """Peak bytes of tensor storage created by operators inside the context and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, weakref.finalize] = {}

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for item in tree_flatten((args, kwargs))[0]:
            if isinstance(item, Tensor):
                with contextlib.suppress(Exception):
                    inputs.add(item.untyped_storage()._cdata)
        for item in tree_flatten(out)[0]:
            if not isinstance(item, Tensor):
                continue
            try:
                storage = item.untyped_storage()
            except Exception:  # noqa: BLE001 - tensors without storage hold no memory of their own
                continue
            key = storage._cdata
            if key in inputs or key in self._tracked:
                continue  # a view or an in-place result: no new memory
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self._tracked[key] = weakref.finalize(storage, self._release, key, nbytes)
        return out


def _memory_step(runner: _LMRunner, method: str) -> Callable[[], object]:
    """The training step the memory probe runs: eager under the CPU tensor tracker (a dispatch mode and
    compiled graphs do not mix), as timed otherwise."""
    return (lambda: runner.train_step(eager=True)) if method == "tensors" else runner.train_step


def _memory_method(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "cuda" if device.type == "cuda" else "tensors"
    if requested == "cuda" and device.type != "cuda":
        raise ConfigError("--memory cuda needs a CUDA device; use --memory tensors or rss on CPU")
    if requested == "rss" and device.type != "cpu":
        raise ConfigError("--memory rss measures the CPU process; use --memory cuda (or auto) on a GPU")
    return requested


def measure_memory(step: Callable[[], object], device: torch.device | str, method: str = "auto") -> float | None:
    """Peak MB one call of ``step`` adds (``"cuda"`` or ``"tensors"``; see the module docstring).

    Call ``step`` once beforehand, so that lazily created state (optimiser moments) is not counted.
    """
    device = torch.device(device)
    method = _memory_method(method, device)
    if method == "none":
        return None
    gc.collect()
    if method == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    if method == "tensors":
        with _TensorPeak() as tracker:
            step()
        return tracker.peak / 2 ** 20
    raise ValueError(f"measure_memory cannot use method {method!r} in process; rss runs in a subprocess")


def _proc_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_child(spec_json: str) -> None:
    """Subprocess entry: build one model, warm it up, report the RSS high-water rise over one step."""
    spec = json.loads(spec_json)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    size = BenchSize(**spec["size"])
    cfg = ModelConfig(**spec["cfg"])
    options = BenchOptions(optimizer=spec["optimizer"], bf16=spec["bf16"], device="cpu")
    torch.manual_seed(0)
    memory_len = cfg.mem_len if cfg.backbone == "transformer-xl" else 0
    model = _initialise(build_model(cfg, size.vocab), spec.get("init", "default"))
    runner = _LMRunner(model, size, torch.device("cpu"), options, memory_len=memory_len)
    step = runner.train_step if spec["mode"] == "train" else runner.eval_step
    step()
    gc.collect()
    note = ""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # reset the high-water mark to the current RSS
        before = _proc_status_kb("VmRSS")
        step()
        after = _proc_status_kb("VmHWM")
    except OSError:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        note = "ru_maxrss rise (no /proc/self/clear_refs): 0 if the step stayed under the warm-up's mark"
    if before is None or after is None:
        print(json.dumps({"peak_mb": None, "note": "no /proc/self/status"}))
        return
    print(json.dumps({"peak_mb": max(after - before, 0) / 1024, "note": note}))


def _rss_peak(cfg: ModelConfig, size: BenchSize, options: BenchOptions, mode: str) -> float | None:
    spec = {"cfg": dataclasses.asdict(cfg), "size": dataclasses.asdict(size), "optimizer": options.optimizer,
            "bf16": options.bf16, "mode": mode, "threads": options.threads or torch.get_num_threads(),
            "init": options.init}
    code = "import sys; from gatedformer.analysis.bench import _rss_child; _rss_child(sys.argv[1])"
    # glibc would keep the warm-up step's freed blocks in its heap and serve the measured step from them,
    # hiding its peak from the RSS: blocks of 64 KiB and more are mapped (and unmapped) one by one instead.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          timeout=1800, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory subprocess failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mb"]


# --------------------------------------------------------------------------------------------------
# Runners: one training step and one evaluation step of a language model


def _initialise(model: nn.Module, scheme: str) -> nn.Module:
    """The trainer's initialisation (:func:`gatedformer.train.init.initialise`): every Linear, Embedding and
    Conv1d weight by ``scheme``, biases zero; ``default`` keeps each library's own initialisation.

    It matters for speed on the CPU: PyTorch's default ``N(0, 1)`` embeddings times ``sqrt(d)`` give the first
    attention such peaked softmaxes that its backward pass runs on denormal floats, several times slower."""
    if scheme != "default":
        initialise(model, InitConfig(scheme=scheme))
    return model


def _make_optimizer(model: nn.Module, kind: str, device: torch.device) -> torch.optim.Optimizer | None:
    if kind == "none":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw-grouped" and groupable(params):
        return GroupedAdam(params, lr=1e-4, decoupled_weight_decay=True)
    if kind in ("adamw-grouped", "adamw-fused"):
        try:
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
        except (RuntimeError, ValueError, TypeError):
            return torch.optim.AdamW(params, lr=1e-4)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    raise ConfigError(f"unknown optimizer {kind!r}; choose one of {', '.join(OPTIMIZERS)}")


def _detach(state: Any) -> Any:
    if state is None:
        return None
    if isinstance(state, Tensor):
        return state.detach()
    return type(state)(_detach(item) for item in state)


class _LMRunner:
    """Random tokens, the model (compiled if asked), its optimiser and the two steps the bench times."""

    def __init__(self, model: nn.Module, size: BenchSize, device: torch.device, options: BenchOptions,
                 memory_len: int = 0) -> None:
        generator = torch.Generator().manual_seed(options.seed)
        tokens = torch.randint(0, size.vocab, (size.batch, size.seq_len + 1), generator=generator)
        self.x = tokens[:, :-1].contiguous().to(device)
        self.y = tokens[:, 1:].contiguous().to(device)
        self.vocab = size.vocab
        self.device = device
        self.model = model.to(device)
        self.forward = compile_model(model) if options.compile else model
        self.optimizer = _make_optimizer(model, options.optimizer, device)
        self.bf16 = options.bf16
        # gatedformer's language models compute their loss with the output layer (output_loss); the peers as usual
        self.takes_targets = "targets" in inspect.signature(model.forward).parameters
        self.state = None
        # Carried state (Transformer-XL memories) in its steady state: fill the memory up to memory_len.
        if memory_len > 0:
            with torch.no_grad():
                for _ in range(math.ceil(memory_len / size.seq_len)):
                    _, self.state = model.eval()(self.x, self.state)
            self.state = _detach(self.state)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits_loss(self, forward: Callable[..., tuple[Tensor, object]]) -> Tensor:
        if self.takes_targets:
            return forward(self.x, self.state, targets=self.y)[0]
        logits, _ = forward(self.x, self.state)
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), self.y.reshape(-1))

    def train_step(self, eager: bool = False) -> None:
        """One training step; ``eager=True`` bypasses ``torch.compile`` (for the memory probe)."""
        if not self.model.training:  # as a training loop, which does not walk every module each step
            self.model.train()
        with self._autocast():
            loss = self._logits_loss(self.model if eager else self.forward)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()

    def eval_step(self) -> None:
        if self.model.training:
            self.model.eval()
        with torch.no_grad(), self._autocast():
            self._logits_loss(self.forward)


def training_step(size: BenchSize, backbone: str, options: BenchOptions, gates: str = "") -> Callable[[], None]:
    """One training step of the models table's model for ``backbone`` (with ``gates``) at ``size``, built, seeded,
    initialised and stepped as that table does (Transformer-XL with its memory full): for scripts that look inside
    the step (``benchmarks/xl_step.py``)."""
    device = resolve_device(options.device)
    torch.manual_seed(options.seed)
    model = _initialise(build_model(size.model_config(backbone, gates), size.vocab), options.init)
    runner = _LMRunner(model, size, device, options, memory_len=size.memory if backbone == "transformer-xl" else 0)
    return runner.train_step


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --------------------------------------------------------------------------------------------------
# Peers


class TorchReferenceLM(nn.Module):
    """The baseline Transformer LM written with ``torch.nn.TransformerEncoder`` only, as a speed reference.

    Same sizes, post-LN, ReLU, the same dropout sites and rates (attention-weight dropout = ``attn_dropout``),
    scaled embeddings plus a fixed sinusoidal table, a causal mask (``is_causal=True``) and an output layer
    with a bias: exactly the parameter count of :class:`~gatedformer.backbones.transformer.TransformerLM`.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ffn: int, dropout: float,
                 max_len: int, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.emb_dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ffn, dropout, activation="relu", batch_first=True,
                                           norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        for block in self.encoder.layers:
            block.self_attn.dropout = attn_dropout
        self.output = nn.Linear(d_model, vocab_size)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(max_len), persistent=False)

    def forward(self, tokens: Tensor, state: object = None) -> tuple[Tensor, None]:
        length = tokens.shape[1]
        x = self.emb_dropout(self.embedding(tokens) * math.sqrt(self.d_model) + self.positions[:length])
        h = self.encoder(x, mask=self.mask[:length, :length], is_causal=True)
        return self.output(h), None


class _XTransformersLM(nn.Module):
    """x-transformers' ``TransformerWrapper`` + ``Decoder`` of the same size, as close to ours as it allows:
    post-LN, ReLU FFN, sinusoidal positions (with its learned scale), the same dropout sites, flash attention.
    It has no biases in the attention projections or the output layer and LayerNorms without bias."""

    def __init__(self, size: BenchSize) -> None:
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        self.net = TransformerWrapper(
            num_tokens=size.vocab, max_seq_len=size.seq_len, emb_dropout=size.dropout, scaled_sinu_pos_emb=True,
            attn_layers=Decoder(dim=size.d_model, depth=size.n_layers, heads=size.n_heads,
                                attn_dim_head=size.d_model // size.n_heads, pre_norm=False,
                                ff_mult=size.ffn / size.d_model, ff_custom_activation=nn.ReLU(),
                                ff_dropout=size.dropout, ff_sublayer_dropout=size.dropout,
                                attn_sublayer_dropout=size.dropout, attn_flash=True),
        )

    def forward(self, tokens: Tensor, state: object = None) -> tuple[Tensor, None]:
        return self.net(tokens), None


def _import_quietly(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(name)


# --------------------------------------------------------------------------------------------------
# The report


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


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _meta(size: BenchSize, rnn: RNNSize, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
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


def _variant_specs(variants: Sequence[str] | None) -> dict[str, str]:
    if not variants:
        return dict(GATE_VARIANTS)
    specs = {}
    for name in variants:
        specs[name] = GATE_VARIANTS.get(name, name)
    if "baseline" not in specs:
        specs = {"baseline": "", **specs}  # overheads are measured against the baseline, in the same loop
    return specs


def _gate_capable(backbone: str, n_layers: int) -> bool:
    try:
        resolve_placement("+σ SDU", n_layers, backbone=backbone)
    except ConfigError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Sections


def _bench_models(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                  backbones: Sequence[str] | None, variants: Sequence[str] | None,
                  progress: Callable[[str], None]) -> None:
    method = _memory_method(options.memory, device)
    specs = _variant_specs(variants)
    for backbone in backbones or list(BUILDERS):
        if backbone not in BUILDERS:
            report.notes.append(f"models: backbone {backbone!r} is not available (have {', '.join(BUILDERS)})")
            continue
        gated = _gate_capable(backbone, size.n_layers)
        chosen = specs if gated else {"baseline": ""}
        if not gated and len(specs) > 1:
            report.notes.append(f"models: {backbone} has no sublayers to gate; only its baseline is measured")
        progress(f"models: {backbone} ({len(chosen)} variant{'s' * (len(chosen) > 1)})")
        runners: dict[str, _LMRunner] = {}
        flops: dict[str, FlopCount] = {}
        for name, spec in chosen.items():
            cfg = size.model_config(backbone, spec)
            try:
                torch.manual_seed(options.seed)
                model = _initialise(build_model(cfg, size.vocab), options.init)
            except Exception as err:  # noqa: BLE001 - one backbone that cannot be built must not stop the rest
                report.notes.append(f"models: {backbone} {name}: not built ({type(err).__name__}: {err})")
                continue
            memory_len = size.memory if backbone == "transformer-xl" else 0
            runners[name] = _LMRunner(model, size, device, options, memory_len=memory_len)
            try:
                flops[name] = count_flops(cfg, size.vocab, size.batch, size.seq_len, memory_len=memory_len)
            except ValueError:
                flops[name] = _measured_flops(model.eval(), runners[name].x)
        contenders, peak_flops = _peak_contenders(device, options)
        for name, runner in runners.items():
            contenders[f"train:{name}"] = runner.train_step
            contenders[f"eval:{name}"] = runner.eval_step
        failed: dict[str, str] = {}
        times = time_round_robin(contenders, options.repeats, options.warmup, device, failed=failed)
        peak, peaks = _peaks(times, peak_flops)
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
                **_bf16_mfu(peaks, count.train_total / train.median, count.forward_total / evaluation.median),
            }
            if base_time is not None and base_flops is not None and name != "baseline":
                row["extra_flops_pct"] = 100.0 * (count.train_total / base_flops.train_total - 1.0)
                row["extra_time_pct"] = 100.0 * (train.median / base_time.median - 1.0)
                row["extra_time_paired_pct"] = 100.0 * (paired_ratio(train, base_time) - 1.0)
                row["gate_target_met"] = (row["extra_time_paired_pct"]
                                          <= row["extra_flops_pct"] + _GATE_TARGET_SLACK_PCT)
                row["noisy"] = max(train.spread_pct, base_time.spread_pct) > _NOISY_SPREAD_PCT
            try:
                if method == "rss":
                    row["peak_mem_mb"] = _rss_peak(size.model_config(backbone, chosen[name]), size, options, "train")
                elif method != "none":
                    row["peak_mem_mb"] = measure_memory(_memory_step(runner, method), device, method)
            except Exception as err:  # noqa: BLE001 - a memory probe failure must not lose the timings
                report.notes.append(f"models: {backbone} {name}: memory not measured ({err})")
            row["mem_method"] = method
            report.rows.append(row)
        del runners
        gc.collect()


def _bench_transformer_peers(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                             progress: Callable[[str], None]) -> None:
    progress("transformer-peers: gatedformer vs torch.nn.TransformerEncoder vs x-transformers")
    method = _memory_method(options.memory, device)
    if method == "rss":
        method = "tensors"
    cfg = size.model_config("transformer")
    flops = count_flops(cfg, size.vocab, size.batch, size.seq_len)
    builders: dict[str, Callable[[], nn.Module]] = {
        "gatedformer TransformerLM": lambda: build_model(cfg, size.vocab),
        "torch.nn.TransformerEncoder": lambda: TorchReferenceLM(size.vocab, size.d_model, size.n_layers,
                                                                size.n_heads, size.ffn, size.dropout, size.seq_len,
                                                                cfg.attn_dropout),
        "x-transformers": lambda: _XTransformersLM(size),
    }
    runners: dict[str, _LMRunner] = {}
    skipped: dict[str, str] = {}
    for name, make in builders.items():
        try:
            torch.manual_seed(options.seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runners[name] = _LMRunner(_initialise(make(), options.init), size, device, options)
        except ImportError as err:
            skipped[name] = f"skipped: not installed ({err.name or err}); pip install 'gatedformer[bench]'"
        except Exception as err:  # noqa: BLE001 - an optional peer that fails to build is reported
            skipped[name] = f"skipped: {type(err).__name__}: {err}"[:200]
    contenders, peak_flops = _peak_contenders(device, options)
    for name, runner in runners.items():
        contenders[f"train:{name}"] = runner.train_step
        contenders[f"eval:{name}"] = runner.eval_step
    failed: dict[str, str] = {}
    times = time_round_robin(contenders, options.repeats, options.warmup, device, failed=failed)
    peak, peaks = _peaks(times, peak_flops)
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
            **_bf16_mfu(peaks, flops.train_total / train.median, flops.forward_total / evaluation.median),
            "peak_gflops": peak / 1e9,
        }
        if ours is not None:
            row["ours_train_speedup"] = train.median / ours.median
        if ours_eval is not None:
            row["ours_eval_speedup"] = evaluation.median / ours_eval.median
        with contextlib.suppress(Exception):
            if method != "none":
                row["peak_mem_mb"] = measure_memory(_memory_step(runner, method), device, method)
                row["mem_method"] = method
        report.rows.append(row)


def _bench_rnn_peers(report: BenchReport, rnn: RNNSize, options: BenchOptions, device: torch.device,
                     progress: Callable[[str], None]) -> None:
    progress(f"rnn-peers: SRU vs sru / LSTM / GRU (hidden {rnn.hidden}, length {rnn.length}, batch {rnn.batch})")
    method = _memory_method(options.memory, device)
    if method == "rss":
        method = "tensors"

    def ours() -> nn.Module:
        from gatedformer.backbones.sru import SRU

        return SRU(rnn.hidden, rnn.hidden, num_layers=rnn.layers)

    def official() -> nn.Module:
        sru = _import_quietly("sru")
        return sru.SRU(rnn.hidden, rnn.hidden, num_layers=rnn.layers)

    builders: dict[str, Callable[[], nn.Module]] = {
        "gatedformer SRU": ours,
        "sru (official)": official,
        "torch.nn.LSTM": lambda: nn.LSTM(rnn.hidden, rnn.hidden, num_layers=rnn.layers),
        "torch.nn.GRU": lambda: nn.GRU(rnn.hidden, rnn.hidden, num_layers=rnn.layers),
    }
    generator = torch.Generator().manual_seed(options.seed)
    x = torch.randn(rnn.length, rnn.batch, rnn.hidden, generator=generator).to(device).requires_grad_(True)
    grad = torch.randn(rnn.length, rnn.batch, rnn.hidden, generator=generator).to(device)
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
    for name in builders:
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
    method = _memory_method(options.memory, device)
    if method == "none":
        report.notes.append("memory: skipped (--memory none)")
        return
    eager = dataclasses.replace(options, compile=False)
    sweeps: list[tuple[str, str, Sequence[int], dict[str, Any]]] = []
    if "transformer-xl" in BUILDERS:
        sweeps.append(("transformer-xl", "mem_len", mem_lens, {}))
    if "rtransformer" in BUILDERS:
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
                    row[f"{mode}_peak_mb"] = _rss_peak(cfg, size, eager, mode)
                    continue
                torch.manual_seed(options.seed)
                model = _initialise(build_model(cfg, size.vocab), options.init)
                runner = _LMRunner(model, size, device, eager, memory_len=memory_len)
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


# --------------------------------------------------------------------------------------------------
# Entry points


def run_bench(size: BenchSize | None = None, options: BenchOptions | None = None, *,
              sections: Sequence[str] = SECTIONS, backbones: Sequence[str] | None = None,
              variants: Sequence[str] | None = None, rnn: RNNSize | None = None,
              mem_lens: Sequence[int] = (0, 64, 128, 256), windows: Sequence[int] = (1, 3, 7, 15),
              progress: Callable[[str], None] | None = None) -> BenchReport:
    """Run the chosen benchmark sections and return their rows (see the module docstring)."""
    size = size or BenchSize()
    options = options or BenchOptions()
    rnn = rnn or RNNSize()
    progress = progress or (lambda message: None)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown bench section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if options.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {options.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if options.init not in INIT_SCHEMES:
        raise ConfigError(f"unknown init scheme {options.init!r}; choose one of {', '.join(INIT_SCHEMES)}")
    if options.memory not in MEMORY_METHODS:
        raise ConfigError(f"unknown memory method {options.memory!r}; choose one of {', '.join(MEMORY_METHODS)}")
    if options.repeats < 1 or options.warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    if size.d_model % size.n_heads:
        raise ConfigError(f"--d-model {size.d_model} is not divisible by --heads {size.n_heads}")
    device = resolve_device(options.device)
    threads_were = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    report = BenchReport(_meta(size, rnn, options, device))
    report.notes.append(_describe(options, device))
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
    finally:
        if flushing:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads_were)
    return report


def _describe(options: BenchOptions, device: torch.device) -> str:
    step = {"adamw-grouped": "forward + loss + backward + AdamW step, one fused call (the trainer's)",
            "adamw-fused": "forward + loss + backward + fused AdamW step",
            "adamw": "forward + loss + backward + AdamW step (torch's default implementation)",
            "none": "forward + loss + backward (no optimiser step)"}[options.optimizer]
    method = _memory_method(options.memory, device)
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


def format_report(report: BenchReport) -> str:
    """The report as plain-text tables."""
    meta = report.meta
    size = meta["size"]
    parts = [f"gatedformer bench  {meta['date']}  {meta['device_name']} ({meta['device']}, {meta['threads']} "
             f"threads)  torch {meta['torch']}"]
    extra_notes: list[str] = []
    models = report.section("models")
    if models:
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
            extra_notes.append(f"models: * = the IQR of the variant or its baseline exceeds {_NOISY_SPREAD_PCT:.0f}% "
                               "of the median (a busy machine): rerun with more --repeats, or --threads 1")
        overhead_note = _overhead_bound_note(models)
        if overhead_note:
            extra_notes.append(overhead_note)
        parts.append(f"\n== models: d {size['d_model']}, {size['n_layers']} layers, {size['n_heads']} heads, "
                     f"ffn {size['d_ffn']}, batch {size['batch']} x seq {size['seq_len']}, vocab {size['vocab']}\n"
                     + _table(["backbone", "variant", "params", "train ms (IQR)", "tok/s", "MFU", "eval ms (IQR)",
                               "tok/s", "MFU", "peak MB", "+FLOPs", "+time", "+time/round",
                               "≤+FLOPs+10"], lines))
    peers = report.section("transformer-peers")
    if peers:
        lines = []
        for r in peers:
            if r.get("status") != "ok":
                lines.append([r["name"], r["status"], *[""] * 8])
                continue
            lines.append([r["name"], f"{r['params']:,}", _ms(r, "train"), f"{r['train_tokens_per_s']:,.0f}",
                          f"{100 * r['train_mfu']:.1f}%", _ms(r, "eval"), f"{r['eval_tokens_per_s']:,.0f}",
                          _mb(r.get("peak_mem_mb")), f"{r.get('ours_train_speedup', float('nan')):.2f}x",
                          f"{r.get('ours_eval_speedup', float('nan')):.2f}x"])
        parts.append("\n== transformer peers (same size; speed-up = their median / ours, >1: ours is faster)\n"
                     + _table(["model", "params", "train ms (IQR)", "tok/s", "MFU", "eval ms (IQR)", "tok/s",
                               "peak MB", "train speed-up", "eval speed-up"], lines))
    rnn_rows = report.section("rnn-peers")
    if rnn_rows:
        rs = meta["rnn_size"]
        lines = []
        for r in rnn_rows:
            if r.get("status") != "ok":
                lines.append([r["name"], r["status"], *[""] * 6])
                continue
            lines.append([r["name"], f"{r['params']:,}", _ms(r, "forward"), _ms(r, "fwd_bwd"),
                          f"{r['fwd_bwd_tokens_per_s']:,.0f}", _mb(r.get("peak_mem_mb")),
                          f"{r.get('ours_forward_speedup', float('nan')):.2f}x",
                          f"{r.get('ours_fwd_bwd_speedup', float('nan')):.2f}x"])
        parts.append(f"\n== recurrent peers: hidden {rs['hidden']}, {rs['layers']} layers, length {rs['length']}, "
                     f"batch {rs['batch']} (speed-up = their median / ours)\n"
                     + _table(["model", "params", "forward ms (IQR)", "fwd+bwd ms (IQR)", "fwd+bwd tok/s",
                               "fwd+bwd peak MB", "fwd speed-up", "fwd+bwd speed-up"], lines))
    memory = report.section("memory")
    if memory:
        lines = [[r["backbone"], r["knob"], str(r["value"]),
                  "" if r.get("train_peak_mb") is None else f"{r['train_peak_mb']:.1f}",
                  "" if r.get("eval_peak_mb") is None else f"{r['eval_peak_mb']:.1f}",
                  f"{r['window_copy_mb']:.1f}" if "window_copy_mb" in r else ""] for r in memory]
        parts.append("\n== memory against Transformer-XL mem_len and R-Transformer window (MB)\n"
                     + _table(["backbone", "knob", "value", "train peak", "eval peak", "per-window copy would add"],
                              lines))
    notes = report.notes + extra_notes
    if notes:
        parts.append("\nnotes:\n" + "\n".join(f"- {note}" for note in notes))
    return "\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gatedformer bench`` options (shared by the CLI and the scripts in ``benchmarks/``)."""
    size, rnn, options = BenchSize(), RNNSize(), BenchOptions()
    group = parser.add_argument_group("model size")
    group.add_argument("--d-model", type=int, default=size.d_model)
    group.add_argument("--layers", type=int, default=size.n_layers)
    group.add_argument("--heads", type=int, default=size.n_heads)
    group.add_argument("--d-ffn", type=int, default=size.d_ffn, help="0: 4 x d-model")
    group.add_argument("--seq-len", type=int, default=size.seq_len)
    group.add_argument("--batch", type=int, default=size.batch)
    group.add_argument("--vocab", type=int, default=size.vocab)
    group.add_argument("--dropout", type=float, default=size.dropout)
    group.add_argument("--mem-len", type=int, default=size.mem_len, help="Transformer-XL memory (-1: seq-len)")
    group.add_argument("--rnn-window", type=int, default=size.rnn_window, help="R-Transformer LocalRNN window")
    group.add_argument("--rnn-type", choices=("gru", "lstm", "rnn"), default=size.rnn_type,
                       help="R-Transformer LocalRNN cell")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--backbones", nargs="+", help=f"default: all ({', '.join(BUILDERS)})")
    parser.add_argument("--variants", nargs="+",
                        help=f"gate variants by name ({', '.join(GATE_VARIANTS)}) or any gate spec; default: all")
    parser.add_argument("--repeats", type=int, default=options.repeats, help="timed rounds (median + IQR)")
    parser.add_argument("--warmup", type=int, default=options.warmup, help="untimed rounds first")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--device", default=options.device)
    parser.add_argument("--threads", type=int, default=options.threads, help="torch CPU threads (0: default)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=options.optimizer)
    parser.add_argument("--memory", choices=MEMORY_METHODS, default=options.memory)
    parser.add_argument("--init", choices=INIT_SCHEMES, default=options.init,
                        help="weight init of every LM, ours and peers (default: xavier, as the -tiny recipes; "
                             "'default' keeps each library's own)")
    parser.add_argument("--flush-denormal", action="store_true", help="flush denormal floats to zero (CPU)")
    parser.add_argument("--rnn-hidden", type=int, default=rnn.hidden)
    parser.add_argument("--rnn-len", type=int, default=rnn.length)
    parser.add_argument("--rnn-batch", type=int, default=rnn.batch)
    parser.add_argument("--rnn-layers", type=int, default=rnn.layers)
    parser.add_argument("--mem-lens", type=int, nargs="+", default=[0, 64, 128, 256])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 3, 7, 15])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run_from_args(args: argparse.Namespace) -> int:
    size = BenchSize(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, d_ffn=args.d_ffn,
                     seq_len=args.seq_len, batch=args.batch, vocab=args.vocab, dropout=args.dropout,
                     mem_len=args.mem_len, rnn_window=args.rnn_window, rnn_type=args.rnn_type)
    options = BenchOptions(repeats=args.repeats, warmup=args.warmup, device=args.device, compile=args.compile,
                           bf16=args.bf16, optimizer=args.optimizer, memory=args.memory, threads=args.threads,
                           init=args.init, flush_denormal=args.flush_denormal)
    rnn = RNNSize(hidden=args.rnn_hidden, length=args.rnn_len, batch=args.rnn_batch, layers=args.rnn_layers)

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"[bench] {message}", file=sys.stderr, flush=True)

    report = run_bench(size, options, sections=args.sections, backbones=args.backbones, variants=args.variants,
                       rnn=rnn, mem_lens=args.mem_lens, windows=args.windows, progress=progress)
    print(report.to_json() if args.json else format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m gatedformer.analysis.bench``, the ``benchmarks/`` scripts)."""
    parser = argparse.ArgumentParser(prog="gatedformer bench", description=__doc__.split("\n", 1)[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except ConfigError as err:
        print(f"gatedformer bench: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
