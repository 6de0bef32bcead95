"""Small C++ kernels built from the package's own source on first use and loaded with :mod:`ctypes`.

A :class:`NativeKernel` holds one C++ source that includes no Torch header, so it builds in about a
second and does not depend on the Torch version. It is compiled with the system C++ compiler (``$CXX``,
else ``c++``) the first time it is needed, never at import, into ``$GATEDFORMER_CACHE/kernels`` (else
``~/.cache/gatedformer/kernels``), under a name hashed from the source and the flags, so a changed
source is rebuilt and concurrent processes never load half a file. On CPUs with AVX2 and FMA a second
build for those instructions is preferred, and kernels written for 512-bit vectors add a third for CPUs
with AVX-512 (``GATEDFORMER_KERNEL_ISA=avx2`` or ``baseline`` caps the choice, e.g. to compare them).
Kernels split their work with OpenMP when the compiler has it, on the same thread pool as PyTorch (see
``parallel_chunks`` below). If no compiler is found or the build fails, a warning is given once and the
caller falls back to its PyTorch implementation.

Each kernel has an environment variable that picks ``native``, ``torch`` or ``auto`` (the default).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["BACKENDS", "ISAS", "NativeKernel", "kernel_threads"]

BACKENDS = ("auto", "native", "torch")
ISAS = ("baseline", "avx2", "avx512")
"""Instruction sets a kernel may be built for, in order of preference from last to first."""
_ISA_FLAGS = {
    "baseline": (),
    "avx2": ("-mavx2", "-mfma"),
    # GCC tunes most AVX-512 CPUs for 256-bit vectors unless told otherwise.
    "avx512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
               "-mprefer-vector-width=512"),
}

_ELEMENTS_PER_THREAD = 1 << 15

# Put before every source: the helper that splits work between threads.
_PRELUDE = r"""
#include <cstdint>
#include <thread>
#include <vector>

namespace gatedformer {
// Calls fn(lo, hi) in parallel on at most `threads` contiguous chunks of [0, n) whose bounds are multiples of
// `grain`. Built with OpenMP, the chunks run on the OpenMP thread pool that PyTorch itself uses (the process
// loads one libgomp.so.1), so the kernel adds no threads that would compete with PyTorch's for the cores.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t threads, int64_t grain, Fn fn) {
    const int64_t units = (n + grain - 1) / grain;
    if (threads > units) threads = units;
    if (threads <= 1) {
        fn(int64_t(0), n);
        return;
    }
    const int64_t per = (units + threads - 1) / threads * grain;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < threads; ++k) {
        const int64_t lo = k * per, hi = lo + per < n ? lo + per : n;
        // A private copy of the closure: through the shared one the compiler must assume that every store
        // may change the captured pointers, which stops vectorisation (measured 10x slower).
        Fn local = fn;
        if (lo < hi) local(lo, hi);
    }
#else
    std::vector<std::thread> pool;
    for (int64_t lo = per; lo < n; lo += per) pool.emplace_back(fn, lo, lo + per < n ? lo + per : n);
    fn(int64_t(0), per < n ? per : n);
    for (auto& th : pool) th.join();
#endif
}
}  // namespace gatedformer
"""

# Put after every source: the ABI check and the CPU probe that decides whether the AVX2 build may load.
_COMMON_SOURCE = r"""
extern "C" {
int %(name)s_abi_version() { return %(abi)d; }
int %(name)s_cpu_has_avx2_fma() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}
int %(name)s_cpu_has_avx512() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}
}
"""


HEAVY_ELEMENT = 8
"""The ``cost`` of an element for kernels that draw a Philox-4x32-10 mask word per element or normalise rows
(dropout, dropout + residual + LayerNorm): about eight plain element-wise passes. Split from 4k elements
instead of 32k, 1024 × 48 rows of dropout, residual and LayerNorm took 84 µs on two threads against 156 µs on
one (Transformer-XL's attention sublayer at ``enwik8-xl12-tiny``'s width)."""


def kernel_threads(numel: int, elements_per_thread: int | None = None, *, cost: int = 1) -> int:
    """Threads for a kernel call: Torch's intra-op count, but none with less than ``elements_per_thread``
    elements of work (default ~32k), each element counting ``cost`` times (see :data:`HEAVY_ELEMENT`)."""
    return max(1, min(torch.get_num_threads(), numel * cost // (elements_per_thread or _ELEMENTS_PER_THREAD)))


def isa_cap() -> str:
    """The most capable instruction set kernels may be built for: ``$GATEDFORMER_KERNEL_ISA``, by default
    ``avx512`` (each kernel still takes only what this CPU has)."""
    cap = os.environ.get("GATEDFORMER_KERNEL_ISA", "").strip().lower() or "avx512"
    if cap not in ISAS:
        raise ValueError(f"GATEDFORMER_KERNEL_ISA must be one of {', '.join(ISAS)}, got {cap!r}")
    return cap


def cache_dir() -> Path:
    """``$GATEDFORMER_CACHE/kernels``, else ``~/.cache/gatedformer/kernels`` (as the data caches)."""
    env = os.environ.get("GATEDFORMER_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "gatedformer") / "kernels"


class NativeKernel:
    """One C++ library: its source, how to bind its functions, and the backend switch that selects it.

    ``bind(lib)`` sets the ``argtypes`` of the library's functions. With ``fast_math`` the first build
    tries ``-ffast-math`` and glibc's vector maths library (``exp()`` vectorised); it is compiled and linked
    in two steps on purpose, because linking a shared object with ``-ffast-math`` makes GCC < 13 add
    ``crtfastmath.o``, which turns on flush-to-zero for the whole process as soon as the library is loaded.
    ``extra_cflags`` go to every build. ``avx512`` marks a source with 512-bit code paths (``#if
    defined(__AVX512F__)``) worth a build of its own on CPUs that have AVX-512.
    """

    def __init__(self, name: str, source: str, bind: Callable[[ctypes.CDLL], None], *, abi_version: int,
                 env_var: str, description: str, fallback: str, fast_math: bool = False,
                 extra_cflags: tuple[str, ...] = (), avx512: bool = False) -> None:
        self.name = name
        self.source = _PRELUDE + source + _COMMON_SOURCE % {"name": name, "abi": abi_version}
        self.abi_version = abi_version
        self.env_var = env_var
        self.description = description
        self.fallback = fallback
        self._bind = bind
        optimise = ("-O3", "-ffast-math", *extra_cflags) if fast_math else ("-O3", *extra_cflags)
        maths = ("-lmvec", "-lm") if fast_math else ()
        # Flag sets tried in order: with OpenMP (see parallel_chunks), then without, then without fast maths.
        openmp = ((*optimise, "-fopenmp", "-pthread"), ("-fopenmp", "-pthread", *maths))
        self._builds = (openmp, ((*optimise, "-pthread"), ("-pthread", *maths)))
        if fast_math:
            self._builds += ((("-O3", *extra_cflags, "-pthread"), ("-pthread",)),)
        self._vector_isas = ("avx512", "avx2") if avx512 else ("avx2",)
        self.isa: str | None = None
        """The instruction set of the loaded library, once it is built."""
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._warned = False

    # ---- backend selection -------------------------------------------------------------------------

    def requested_backend(self) -> str:
        backend = os.environ.get(self.env_var, "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{self.env_var} must be auto, native or torch, got {backend!r}")
        return backend

    def pick_backend(self, device: torch.device, backend: str | None = None) -> str:
        """``"native"`` or ``"torch"`` for tensors on ``device``; ``backend`` overrides the environment."""
        if backend is None and self._lib is not None and device.type == "cpu" \
                and os.environ.get(self.env_var, "auto") in ("auto", "native"):
            return "native"  # the common case, asked several times per layer and step: no more checks needed
        backend = backend or self.requested_backend()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be auto, native or torch, got {backend!r}")
        if backend == "torch":
            return "torch"
        if device.type != "cpu":
            if backend == "native":
                raise RuntimeError(f"{self.description} runs on the CPU only, not on {device}")
            return "torch"
        if self.library(warn=backend == "auto") is None:
            if backend == "native":
                raise RuntimeError(f"{self.description} is unavailable: {self.error}")
            return "torch"
        return "native"

    # ---- building and loading ----------------------------------------------------------------------

    def library(self, warn: bool = True) -> ctypes.CDLL | None:
        """The compiled library, built on first use; ``None`` (after one warning) if it cannot be built."""
        if self._lib is None and self.error is None:
            isa_cap()  # a misspelt cap is an error, not a reason to fall back
            with self._lock:
                if self._lib is None and self.error is None:
                    try:
                        self._lib = self._build_and_load()
                    except RuntimeError as err:
                        self.error = str(err)
        if self._lib is None and warn and not self._warned:
            self._warned = True
            warnings.warn(f"gatedformer: {self.description} is unavailable ({self.error}); falling back to "
                          f"{self.fallback}", RuntimeWarning, stacklevel=4)
        return self._lib

    def _build_and_load(self) -> ctypes.CDLL:
        cxx = shlex.split(os.environ.get("CXX") or "c++")
        if not cxx or shutil.which(cxx[0]) is None:
            raise RuntimeError(f"no C++ compiler found (looked for {' '.join(cxx) or 'c++'!r}; set $CXX)")
        cap = isa_cap()
        errors = []
        for cflags, ldflags in self._builds:
            try:
                lib = self._build_one(cxx, cflags, ldflags)
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                errors.append(str(err))
                continue
            for isa in self._vector_isas:
                if ISAS.index(isa) > ISAS.index(cap) or not self._cpu_has(lib, isa):
                    continue
                try:
                    vector_lib = self._build_one(cxx, (*cflags, *_ISA_FLAGS[isa]), ldflags)
                except (OSError, RuntimeError, subprocess.SubprocessError):
                    continue  # an assembler without these instructions: the next set, else the baseline build
                self.isa = isa
                return vector_lib
            self.isa = "baseline"
            return lib
        raise RuntimeError("; ".join(errors))

    def _cpu_has(self, lib: ctypes.CDLL, isa: str) -> bool:
        probe = {"baseline": None, "avx2": "cpu_has_avx2_fma", "avx512": "cpu_has_avx512"}[isa]
        return probe is None or bool(getattr(lib, f"{self.name}_{probe}")())

    def library_for(self, isa: str) -> ctypes.CDLL:
        """A build for the instruction set ``isa`` (one of :data:`ISAS`) whatever the library in use, e.g. to
        test each code path against the others; raises ``RuntimeError`` if this CPU or compiler lacks it."""
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
        cxx = shlex.split(os.environ.get("CXX") or "c++")
        cflags, ldflags = self._builds[0]
        try:
            lib = self._build_one(cxx, cflags, ldflags)
            if not self._cpu_has(lib, isa):
                raise RuntimeError(f"this CPU has no {isa}")
            return lib if isa == "baseline" else self._build_one(cxx, (*cflags, *_ISA_FLAGS[isa]), ldflags)
        except (OSError, subprocess.SubprocessError) as err:
            raise RuntimeError(f"cannot build the {isa} {self.name} kernel: {err}") from err

    def _build_one(self, cxx: list[str], cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> ctypes.CDLL:
        key = "\n".join([self.source, *cxx, *cflags, *ldflags, platform.machine(), platform.system()])
        out = cache_dir() / f"{self.name}_kernel_{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"
        if out.exists():
            try:
                return self._load(out)
            except (OSError, RuntimeError):
                out.unlink(missing_ok=True)  # damaged or stale: build it again
        self._compile(cxx, out, cflags, ldflags)
        return self._load(out)

    def _load(self, path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        getattr(lib, f"{self.name}_abi_version").restype = ctypes.c_int
        getattr(lib, f"{self.name}_cpu_has_avx2_fma").restype = ctypes.c_int
        getattr(lib, f"{self.name}_cpu_has_avx512").restype = ctypes.c_int
        if getattr(lib, f"{self.name}_abi_version")() != self.abi_version:
            raise RuntimeError(f"stale {self.name} kernel library in the cache")
        self._bind(lib)
        return lib

    def _compile(self, cxx: list[str], out: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> None:
        """Build the library at ``out`` atomically, so that concurrent processes never load half a file."""
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
            src, obj, lib = Path(tmp) / f"{self.name}.cpp", Path(tmp) / f"{self.name}.o", Path(tmp) / out.name
            src.write_text(self.source)
            for cmd in (
                [*cxx, *cflags, "-std=c++14", "-fPIC", "-c", str(src), "-o", str(obj)],
                [*cxx, "-shared", str(obj), "-o", str(lib), *ldflags],
            ):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(lib, out)
