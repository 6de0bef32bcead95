"""MKL's packed single-precision matrix products, from the copy PyTorch links for its own CPU products.

The compiled kernels include no BLAS header and link no BLAS: where PyTorch is built with MKL (its x86 wheels),
:func:`packed_gemm` finds ``cblas_sgemm_pack``, ``cblas_sgemm_compute``, ``MKL_Set_Num_Threads_Local`` and the plain
``SGEMM`` among the symbols of ``libtorch_cpu`` and hands their addresses to a kernel, which then runs matrix products
on row blocks of its own choosing (a weight packed once, reused by every block) inside its own parallel region.
Elsewhere it returns ``None`` and the callers keep PyTorch's operations. ``GATEDFORMER_PACKED_GEMM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["PACKED_GEMM_CPP", "PackedGemm", "packed_gemm"]

_B_MATRIX = 162  # CBLAS_IDENTIFIER: the right-hand side

PACKED_GEMM_CPP = r"""
// MKL's packed products, by address (see gatedformer/backbones/_blas.py): the pack and compute functions and the
// thread-local thread count, and stream_blocks, which runs a kernel's blocks of rows on OpenMP threads that each
// call MKL on one thread. Needs <cstdint> and, with OpenMP, <omp.h>.
typedef void (*PackFn)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                       int ld, float* dest);
typedef void (*ComputeFn)(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                          const float* b, int ldb, float beta, float* c, int ldc);
typedef int (*LocalThreadsFn)(int);
// The plain product through MKL's Fortran interface (column-major, arguments by pointer): PyTorch's copy of MKL
// exports no cblas_sgemm.
typedef void (*FortranGemmFn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                              const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                              const float* beta, float* c, const int* ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

struct Blas {
    PackFn pack;
    ComputeFn compute;
    LocalThreadsFn local_threads;
};

// c (m x n) += a^T b for a (k x m) and b (k x n), all row-major with leading dimensions lda, ldb and n: a weight's
// gradient from one block of rows. Row-major c is column-major c^T = b^T a, which is what the call computes.
inline void add_at_b(FortranGemmFn gemm, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                     int64_t ldb, float* c) {
    const int cm = (int)n, cn = (int)m, ck = (int)k, la = (int)ldb, lb = (int)lda, lc = (int)n;
    const float one = 1.0f;
    gemm("N", "T", &cm, &cn, &ck, &one, b, &la, a, &lb, &one, c, &lc);
}

// body(thread, threads, first_block, end_block) on `threads` OpenMP threads, each with MKL on one thread and a
// contiguous share of `blocks`.
template <typename Fn>
void stream_blocks(const Blas& blas, int64_t blocks, int64_t threads, Fn body) {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int saved = blas.local_threads(1);
        body(t, nt, t * blocks / nt, (t + 1) * blocks / nt);
        blas.local_threads(saved);
    }
#else
    (void)threads;
    const int saved = blas.local_threads(1);
    body(int64_t(0), int64_t(1), int64_t(0), blocks);
    blas.local_threads(saved);
#endif
}

inline void stream_barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}
"""
"""C++ for kernels that take :class:`PackedGemm`'s addresses (put inside the kernel's own namespace)."""


@dataclass(frozen=True)
class PackedGemm:
    """The addresses of MKL's packing and packed-product functions, and its packed-size query."""

    pack: int
    compute: int
    local_threads: int
    gemm: int
    """MKL's Fortran ``SGEMM`` (column-major), for products with neither side packed."""
    _size: ctypes._CFuncPtr
    _sizes: dict[tuple[int, int, int], int] = field(default_factory=dict, compare=False)

    def packed_floats(self, m: int, n: int, k: int) -> int:
        """Floats of the buffer that a packed ``k × n`` right-hand side of an ``m``-row product takes."""
        key = (m, n, k)
        if key not in self._sizes:  # asked four times per sublayer and step, always for the same few shapes
            self._sizes[key] = -(-int(self._size(_B_MATRIX, m, n, k)) // 4)
        return self._sizes[key]


def _torch_cpu_library() -> ctypes.CDLL | None:
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        if (lib_dir / name).exists():
            try:
                return ctypes.CDLL(str(lib_dir / name))
            except OSError:
                return None
    return None


@functools.cache
def _find() -> PackedGemm | None:
    if not torch.backends.mkl.is_available():
        return None
    lib = _torch_cpu_library()
    if lib is None:
        return None
    try:
        size = lib.cblas_sgemm_pack_get_size
        # MKL_Set_Num_Threads_Local is the C function (mkl_set_num_threads_local, a macro for it in mkl.h, is exported
        # as the Fortran one, which takes a pointer)
        pack, compute, local = lib.cblas_sgemm_pack, lib.cblas_sgemm_compute, lib.MKL_Set_Num_Threads_Local
        gemm = lib.SGEMM
    except AttributeError:  # a build that keeps MKL's symbols to itself
        return None
    size.restype, size.argtypes = ctypes.c_size_t, [ctypes.c_int] * 4

    def address(fn: ctypes._CFuncPtr) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value or 0

    return PackedGemm(address(pack), address(compute), address(local), address(gemm), size)


def packed_gemm() -> PackedGemm | None:
    """MKL's packed products where PyTorch links them and ``$GATEDFORMER_PACKED_GEMM`` is not ``0``, else ``None``."""
    if os.environ.get("GATEDFORMER_PACKED_GEMM", "1").strip() == "0":
        return None
    return _find()
