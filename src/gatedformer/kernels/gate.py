"""The element-wise tail every gate ends in, ``c + F(a) ⊙ (G(b) [- c])``, one pass each way on the CPU.

All gate units end the same way once their projections are computed:

* SDU: ``s + Ψ(a) ⊙ b`` (``a``, ``b`` the two halves of its ``Linear(d, 2d)``; Ψ = sigmoid or tanh);
* highway gate and gated MHDPA: ``carry + σ(a) ⊙ (b - carry)`` (``(1 - T) ⊙ carry + T ⊙ f``);
* GRC: ``r + σ(a) ⊙ s``;
* EAU: ``x + σ(a) ⊙ tanh(b)`` (``a`` the evaluator's, ``b`` the adjuster's pre-activation);
* and GRC's gate alone, ``σ(a) ⊙ s``, for a post-LN sublayer that adds it to the stream in the same pass as
  its dropout and LayerNorm.

Written with PyTorch operations each is three to five passes over the activations forward and as many
backward, plus a copy that joins the two halves' gradients. This kernel computes the tail in one pass and
its backward in another, writing the gradients of both halves of a projection straight into one buffer.
Its source is ``csrc/gate.cpp`` (C API: ``csrc/gate.h``), compiled like the other kernels
(:mod:`gatedformer.kernels.build`) with fast maths so that ``exp`` and ``tanh`` vectorise;
``GATEDFORMER_GATE_BACKEND`` picks ``native``, ``torch`` or ``auto``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.kernels.build import NativeKernel, kernel_threads

__all__ = ["KERNEL", "TAILS", "bias_sigmoid_", "tail_backward", "tail_forward"]

TAILS = {"sdu-sigmoid": 0, "sdu-tanh": 1, "lerp": 2, "eau": 3, "gate": 4}
"""The tails, by the code the kernel takes: (F, G, lerp) = (σ, id, no), (tanh, id, no), (σ, id, yes),
(σ, tanh, no); GRC is ``sdu-sigmoid``. ``gate`` is ``σ(a) ⊙ b`` alone, with no ``c``."""


# Fast maths vectorises exp() and tanh() (glibc's libmvec); the sigmoid's argument is clamped so that no
# infinity reaches a division (see apply<kSigmoid>).
KERNEL = NativeKernel(
    "gate", abi_version=4, env_var="GATEDFORMER_GATE_BACKEND",
    description="the compiled gate kernel", fallback="PyTorch's own operations", fast_math=True, avx512=True,
)


def tail_forward(tail: str, c: Tensor | None, a: Tensor, a_row: int, b: Tensor, b_row: int,
                 shape: tuple[int, int] | None = None) -> Tensor:
    """``c + F(a) ⊙ (G(b) [- c])`` for float32 CPU rows: ``c`` contiguous ``(rows, cols)``, ``a`` and ``b`` with
    rows ``a_row`` and ``b_row`` floats apart (e.g. the two halves of one projection). The ``gate`` tail has no
    ``c`` and takes the ``(rows, cols)`` of its result from ``shape``."""
    rows, cols = c.shape if c is not None else shape
    out = a.new_empty(rows, cols)
    failed = KERNEL.library().gate_tail_forward(TAILS[tail], None if c is None else c.data_ptr(), a.data_ptr(), a_row,
                                                b.data_ptr(), b_row, out.data_ptr(), rows, cols,
                                                kernel_threads(out.numel()))
    if failed:
        raise ValueError(f"unknown gate tail {tail!r}")
    return out


def tail_backward(tail: str, grad: Tensor, c: Tensor | None, a: Tensor, a_row: int, b: Tensor, b_row: int,
                  grad_a: Tensor, grad_a_row: int, grad_b: Tensor, grad_b_row: int) -> Tensor | None:
    """Writes the gradients of ``a`` and ``b`` into ``grad_a`` and ``grad_b`` (rows ``grad_*_row`` apart);
    returns that of ``c`` for the lerp tail (for the others it is ``grad`` itself)."""
    rows, cols = grad.shape
    grad_c = torch.empty_like(grad) if tail == "lerp" else None
    failed = KERNEL.library().gate_tail_backward(
        TAILS[tail], grad.data_ptr(), None if c is None else c.data_ptr(), a.data_ptr(), a_row, b.data_ptr(), b_row,
        None if grad_c is None else grad_c.data_ptr(), grad_a.data_ptr(), grad_a_row, grad_b.data_ptr(), grad_b_row,
        rows, cols, kernel_threads(grad.numel()))
    if failed:
        raise ValueError(f"unknown gate tail {tail!r}")
    return grad_c


def bias_sigmoid_(x: Tensor, bias: Tensor) -> Tensor:
    """``x <- sigmoid(x + bias)`` in place, for contiguous float32 CPU rows and one row of ``bias``."""
    KERNEL.library().gate_bias_sigmoid(x.data_ptr(), bias.data_ptr(), x.shape[0], x.shape[1],
                                       kernel_threads(x.numel()))
    return x
