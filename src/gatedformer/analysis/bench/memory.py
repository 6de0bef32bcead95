"""Peak memory of one step: live tensor storage, the resident set in a fresh process, or CUDA's allocator."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gatedformer.analysis.bench.options import BenchOptions, BenchSize
from gatedformer.analysis.bench.runners import LMRunner, bench_model
from gatedformer.config import ModelConfig
from gatedformer.errors import ConfigError


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


def memory_method(requested: str, device: torch.device) -> str:
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
    method = memory_method(method, device)
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


def rss_child(spec_json: str) -> None:
    """Subprocess entry: build one model, warm it up, report the RSS high-water rise over one step."""
    spec = json.loads(spec_json)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    size = BenchSize(**spec["size"])
    cfg = ModelConfig(**spec["cfg"])
    options = BenchOptions(optimizer=spec["optimizer"], bf16=spec["bf16"], device="cpu")
    torch.manual_seed(0)
    memory_len = cfg.mem_len if cfg.backbone == "transformer-xl" else 0
    model = bench_model(cfg, size.vocab, spec.get("init", "default"))
    runner = LMRunner(model, size, torch.device("cpu"), options, memory_len=memory_len)
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


def rss_peak(cfg: ModelConfig, size: BenchSize, options: BenchOptions, mode: str) -> float | None:
    spec = {"cfg": dataclasses.asdict(cfg), "size": dataclasses.asdict(size), "optimizer": options.optimizer,
            "bf16": options.bf16, "mode": mode, "threads": options.threads or torch.get_num_threads(),
            "init": options.init}
    code = "import sys; from gatedformer.analysis.bench.memory import rss_child; rss_child(sys.argv[1])"
    # glibc would keep the warm-up step's freed blocks in its heap and serve the measured step from them,
    # hiding its peak from the RSS: blocks of 64 KiB and more are mapped (and unmapped) one by one instead.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          timeout=1800, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory subprocess failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mb"]
