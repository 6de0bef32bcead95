"""The binding of ``csrc/gru.cpp`` (its C API in ``csrc/gru.h``): one GRU step from precomputed projections as one
compiled pass, forward and backward, for float32 or float64 rows on the CPU.

:mod:`gatedformer.ops.rnn` says what the step computes and holds its autograd function, its PyTorch reference and
the choice between them (``GATEDFORMER_GRU_BACKEND``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.kernels.build import NativeKernel, kernel_threads

__all__ = ["DTYPES", "KERNEL", "backward", "forward", "rows_view"]


# -ffast-math lets exp() and tanh() vectorise; the sigmoid is written so that it never overflows.
KERNEL = NativeKernel(
    "gru", abi_version=1, env_var="GATEDFORMER_GRU_BACKEND",
    description="the compiled GRU step", fallback="PyTorch operations", fast_math=True, avx512=True,
)

DTYPES = {torch.float32: "f32", torch.float64: "f64"}
"""The dtypes the kernel takes, by the suffix of their functions."""


def rows_view(t: Tensor) -> Tensor:
    """``t`` (rows, width) with unit stride along the width and rows that do not overlap (or a broadcast row)."""
    if t.stride(-1) != 1 or (t.stride(0) != 0 and t.stride(0) < t.shape[-1]):
        return t.contiguous()
    return t


def forward(gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:
    """The step's output ``(rows, d)`` from ``gi`` and ``gh`` ``(rows, 3d)`` as :func:`rows_view` leaves them (``gh``
    may be one row broadcast) and ``h`` contiguous ``(rows, d)`` or ``None`` (the zero state)."""
    rows, d = gi.shape[0], gi.shape[1] // 3
    out = gi.new_empty(rows, d)
    getattr(KERNEL.library(), f"gru_forward_{DTYPES[gi.dtype]}")(
        gi.data_ptr(), gi.stride(0), gh.data_ptr(), gh.stride(0), None if h is None else h.data_ptr(),
        out.data_ptr(), rows, d, kernel_threads(out.numel()),
    )
    return out


def backward(gi: Tensor, gh: Tensor, h: Tensor | None, grad: Tensor,
             need_h_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of ``gi`` and ``gh`` (``(rows, 3d)`` each) and, with ``need_h_grad`` and an ``h``, of ``h``, from
    that of :func:`forward`'s output (contiguous); ``gi``, ``gh`` and ``h`` as given to it."""
    rows, d = gi.shape[0], gi.shape[1] // 3
    dgi = gi.new_empty(rows, 3 * d)
    dgh = gi.new_empty(rows, 3 * d)
    dh = None if h is None or not need_h_grad else torch.empty_like(h)
    getattr(KERNEL.library(), f"gru_backward_{DTYPES[gi.dtype]}")(
        gi.data_ptr(), gi.stride(0), gh.data_ptr(), gh.stride(0), None if h is None else h.data_ptr(),
        grad.data_ptr(), dgi.data_ptr(), dgh.data_ptr(), None if dh is None else dh.data_ptr(), rows, d,
        kernel_threads(grad.numel()),
    )
    return dgi, dgh, dh
