"""The binding of ``csrc/local_rnn.cpp`` (its C API in ``csrc/local_rnn.h``): the R-Transformer's whole LocalRNN
recurrence as one compiled call each way, streamed by blocks of rows with MKL's packed products.

:mod:`gatedformer.ops.rnn` says what it computes and keeps, and holds its autograd function
(:func:`~gatedformer.ops.rnn.local_recurrence`). Float32 on the CPU where PyTorch links MKL; it follows the LocalRNN
steps' switch, ``GATEDFORMER_GRU_BACKEND``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.kernels.blas import PackedGemm, packed_gemm
from gatedformer.kernels.build import NativeKernel, constant_under_compile, kernel_threads

__all__ = ["BLOCK_ROWS", "CELLS", "GATES", "KERNEL", "backward", "forward", "streams"]

CELLS = {"rnn": 0, "gru": 1, "lstm": 2}
"""The cells the kernel runs, by LocalRNN ``rnn_type``; their gate widths are 1, 3 and 4 times ``d``."""

GATES = {"rnn": 1, "gru": 3, "lstm": 4}
"""The cells' gate widths, in multiples of ``d``."""
BLOCK_ROWS = 64
"""Windows (rows) per block that a thread takes through all the steps."""


KERNEL = NativeKernel(
    "local_rnn", abi_version=3, env_var="GATEDFORMER_GRU_BACKEND",
    description="the compiled LocalRNN recurrence", fallback="its steps one by one", avx512=True,
)


def streams(*tensors: Tensor) -> PackedGemm | None:
    """MKL's packed products where the kernel can run on these tensors, else ``None``: float32 on the CPU, the
    kernel built. Under ``torch.compile``, :data:`TRACED_STREAMS` in their place: the recurrence runs there as a
    custom operator, which looks them up itself when it runs."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    if torch.compiler.is_compiling():
        return TRACED_STREAMS if _streams_available() else None
    if KERNEL.pick_backend(tensors[0].device) != "native":
        return None
    return packed_gemm()


TRACED_STREAMS = PackedGemm(0, 0, 0, 0, 0)
"""What :func:`streams` gives under ``torch.compile`` where the kernel runs: no addresses (see there)."""


@constant_under_compile
def _streams_available() -> bool:
    """Whether :func:`streams` finds the products (taken once while dynamo traces, as a constant of the graph)."""
    return KERNEL.pick_backend(torch.device("cpu")) == "native" and packed_gemm() is not None


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the LocalRNN kernel could not allocate its scratch memory; free memory or set "
                          "GATEDFORMER_GRU_BACKEND=torch")


def _address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def forward(blas: PackedGemm, gates_in: Tensor, pad: Tensor, w_hh: Tensor, b_hh: Tensor, cell: str, window: int,
            keep: bool) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The last hidden state of every window ``(B, L, d)`` from contiguous ``gates_in`` ``(B, L, G)``, ``pad``
    ``(G,)``, ``w_hh`` ``(G, d)`` and ``b_hh`` ``(G,)``; with ``keep`` (and ``window > 1``) also what the backward
    pass reads, per window and step: the hidden states, the LSTM's cells and the steps' activations (else ``None``)."""
    batch, length, width = gates_in.shape
    d, rows, kept = w_hh.shape[1], batch * length, window - 1
    out = gates_in.new_empty(batch, length, d)
    # Each block's steps in turn (see the kernel), one row per window and step.
    hs = gates_in.new_empty(rows * kept, d) if keep else None
    cs = gates_in.new_empty(rows * kept, d) if keep and cell == "lstm" else None
    ghs = gates_in.new_empty(rows * kept, width) if keep else None
    threads = min(kernel_threads(rows * width * window), -(-rows // BLOCK_ROWS))
    _check(KERNEL.library().local_rnn_forward_f32(
        blas.pack, blas.compute, blas.local_threads, CELLS[cell], gates_in.data_ptr(), pad.data_ptr(),
        w_hh.data_ptr(), b_hh.data_ptr(), blas.packed_floats(BLOCK_ROWS, width, d), out.data_ptr(),
        _address(hs), _address(cs), _address(ghs), rows, length, d, window, BLOCK_ROWS, threads))
    return out, hs, cs, ghs


def backward(blas: PackedGemm, gates_in: Tensor, pad: Tensor, w_hh: Tensor, b_hh: Tensor, hs: Tensor | None,
             cs: Tensor | None, ghs: Tensor | None, grad_out: Tensor, cell: str,
             window: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``gates_in``, ``pad``, ``w_hh`` and ``b_hh`` from that of :func:`forward`'s output
    (contiguous), given its inputs and what it kept."""
    batch, length, width = gates_in.shape
    d, rows, kept = w_hh.shape[1], batch * length, window - 1
    grad_in, grad_pad, grad_bias = torch.zeros_like(gates_in), pad.new_empty(width), b_hh.new_empty(width)
    grad_weight = torch.empty_like(w_hh)
    threads = min(kernel_threads(rows * width * window), -(-rows // BLOCK_ROWS))
    _check(KERNEL.library().local_rnn_backward_f32(
        blas.pack, blas.compute, blas.local_threads, CELLS[cell], gates_in.data_ptr(), pad.data_ptr(),
        w_hh.data_ptr(), b_hh.data_ptr(), _address(hs), _address(cs), _address(ghs), grad_out.data_ptr(),
        blas.packed_floats(BLOCK_ROWS, d, width), blas.packed_floats(width, d, BLOCK_ROWS * kept) if kept else 0,
        grad_in.data_ptr(), grad_pad.data_ptr(), grad_weight.data_ptr(), grad_bias.data_ptr(), rows, length, d,
        window, BLOCK_ROWS, threads))
    return grad_in, grad_pad, grad_weight, grad_bias
