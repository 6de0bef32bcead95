"""The binding of ``csrc/lstm.cpp`` (its C API in ``csrc/lstm.h``): one LSTM step from precomputed projections as
one compiled pass, forward and backward, for float32 or float64 rows on the CPU.

:mod:`gatedformer.ops.rnn` says what the step computes and holds its autograd function, its PyTorch reference and
the choice between them (the GRU step's switch, ``GATEDFORMER_GRU_BACKEND``: both are the LocalRNN's step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.kernels.build import NativeKernel, kernel_threads
from gatedformer.kernels.gru import DTYPES

__all__ = ["DTYPES", "KERNEL", "backward", "forward"]


# -ffast-math lets exp() and tanh() vectorise; the sigmoid is written so that it never overflows.
KERNEL = NativeKernel(
    "lstm", abi_version=1, env_var="GATEDFORMER_GRU_BACKEND",
    description="the compiled LSTM step", fallback="PyTorch operations", fast_math=True, avx512=True,
)


def forward(gi: Tensor, gh: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor]:
    """The step's ``(h', c')``, ``(rows, d)`` each, from ``gi`` and ``gh`` ``(rows, 4d)`` as
    :func:`~gatedformer.kernels.gru.rows_view` leaves them (``gh`` may be one row broadcast) and the cell ``c``
    contiguous ``(rows, d)`` or ``None`` (the zero state)."""
    rows, d = gi.shape[0], gi.shape[1] // 4
    h_out, c_out = gi.new_empty(rows, d), gi.new_empty(rows, d)
    getattr(KERNEL.library(), f"lstm_forward_{DTYPES[gi.dtype]}")(
        gi.data_ptr(), gi.stride(0), gh.data_ptr(), gh.stride(0), None if c is None else c.data_ptr(),
        h_out.data_ptr(), c_out.data_ptr(), rows, d, kernel_threads(h_out.numel()),
    )
    return h_out, c_out


def backward(gi: Tensor, gh: Tensor, c: Tensor | None, grad_h: Tensor, grad_c: Tensor | None,
             need_c_grad: bool) -> tuple[Tensor, Tensor | None]:
    """The gradient of the pre-activations ``gi + gh`` (``(rows, 4d)``, that of ``gi`` and of ``gh`` alike) and, with
    ``need_c_grad`` and a ``c``, of ``c``, from those of :func:`forward`'s ``h'`` and ``c'`` (contiguous; ``grad_c``
    may be ``None``); ``gi``, ``gh`` and ``c`` as given to it."""
    rows, d = gi.shape[0], gi.shape[1] // 4
    grad_a = gi.new_empty(rows, 4 * d)
    # the kernel writes c's gradient whenever it reads a c: scratch for it where none is wanted
    dc = None if c is None else torch.empty_like(c)
    getattr(KERNEL.library(), f"lstm_backward_{DTYPES[gi.dtype]}")(
        gi.data_ptr(), gi.stride(0), gh.data_ptr(), gh.stride(0), None if c is None else c.data_ptr(),
        grad_h.data_ptr(), None if grad_c is None else grad_c.data_ptr(), grad_a.data_ptr(),
        None if dc is None else dc.data_ptr(), rows, d, kernel_threads(grad_h.numel()),
    )
    return grad_a, dc if need_c_grad else None
