"""MKL's packed single-precision matrix products, from the copy PyTorch links for its own CPU products.

The compiled kernels include no BLAS header and link no BLAS: where PyTorch is built with MKL (its x86 wheels),
:func:`packed_gemm` finds ``cblas_sgemm_pack``, ``cblas_sgemm_compute``, ``MKL_Set_Num_Threads_Local`` and the plain
``SGEMM`` among the symbols of ``libtorch_cpu`` and hands their addresses to a kernel, which then runs matrix products
on row blocks of its own choosing (a weight packed once, reused by every block) inside its own parallel region.
Elsewhere it returns ``None`` and the callers keep PyTorch's operations. ``GATEDFORMER_PACKED_GEMM=0`` turns it off.
The kernels' side (the function types, ``stream_blocks``) is ``csrc/packed_gemm.h``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["PackedGemm", "packed_gemm"]

_B_MATRIX = 162  # CBLAS_IDENTIFIER: the right-hand side


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
