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
It is compiled like the other kernels (:mod:`gatedformer.kernels.build`), with fast maths so that
``exp`` and ``tanh`` vectorise; ``GATEDFORMER_GATE_BACKEND`` picks ``native``, ``torch`` or ``auto``.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from gatedformer.kernels.build import NativeKernel, kernel_threads

__all__ = ["KERNEL", "TAILS", "bias_sigmoid_", "tail_backward", "tail_forward"]

TAILS = {"sdu-sigmoid": 0, "sdu-tanh": 1, "lerp": 2, "eau": 3, "gate": 4}
"""The tails, by the code the kernel takes: (F, G, lerp) = (σ, id, no), (tanh, id, no), (σ, id, yes),
(σ, tanh, no); GRC is ``sdu-sigmoid``. ``gate`` is ``σ(a) ⊙ b`` alone, with no ``c``."""

_CPP_SOURCE = r"""
// out = c + F(a) * (G(b) [- c]) row by row, and its backward pass. Generated and compiled by gatedformer.
#include <cmath>
#include <cstdint>

namespace {

enum Fn { kSigmoid, kTanh, kIdentity };

template <int F>
inline float apply(float x) {
    // The argument is clamped so that exp() stays finite: with fast maths the division may be computed as
    // an approximate reciprocal, which turns 1 / inf into NaN. Beyond +-80 the sigmoid is 0 or 1 in float32
    // anyway (to 2e-35).
    if (F == kSigmoid) return 1.0f / (1.0f + std::exp(std::fmin(std::fmax(-x, -80.0f), 80.0f)));
    if (F == kTanh) return std::tanh(x);
    return x;
}

// The derivative from the function's value y = F(x).
template <int F>
inline float slope(float y) {
    if (F == kSigmoid) return y * (1.0f - y);
    if (F == kTanh) return 1.0f - y * y;
    return 1.0f;
}

// Without a c (nullptr), out = F(a) * G(b).
template <int F, int G, bool Lerp>
void forward(const float* c, const float* a, int64_t a_row, const float* b, int64_t b_row, float* out, int64_t rows,
             int64_t cols, int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
            if (c == nullptr) {
                const float* __restrict ar = a + r * a_row;
                const float* __restrict br = b + r * b_row;
                float* __restrict o = out + r * cols;
                for (int64_t j = 0; j < cols; ++j) o[j] = apply<F>(ar[j]) * apply<G>(br[j]);
                continue;
            }
            const float* __restrict cr = c + r * cols;
            const float* __restrict ar = a + r * a_row;
            const float* __restrict br = b + r * b_row;
            float* __restrict o = out + r * cols;
            for (int64_t j = 0; j < cols; ++j) {
                const float g = apply<G>(br[j]);
                o[j] = cr[j] + apply<F>(ar[j]) * (Lerp ? g - cr[j] : g);
            }
        }
    });
}

// One row of the backward pass. The rows are parameters of their own function: GCC honours `__restrict` on
// parameters, but not on pointers computed inside the threads' lambda, and without it the lerp tail's loop
// (with the carry's two rows) was left scalar.
template <int F, int G, bool Lerp>
inline void backward_row(const float* __restrict d, const float* __restrict cr, const float* __restrict ar,
                         const float* __restrict br, float* __restrict dcr, float* __restrict dar,
                         float* __restrict dbr, int64_t cols) {
    for (int64_t j = 0; j < cols; ++j) {
        const float fa = apply<F>(ar[j]), gb = apply<G>(br[j]);
        dar[j] = d[j] * (Lerp ? gb - cr[j] : gb) * slope<F>(fa);
        dbr[j] = d[j] * fa * slope<G>(gb);
        if (Lerp) dcr[j] = d[j] * (1.0f - fa);
    }
}

template <int F, int G, bool Lerp>
void backward(const float* dout, const float* c, const float* a, int64_t a_row, const float* b, int64_t b_row,
              float* dc, float* da, int64_t da_row, float* db, int64_t db_row, int64_t rows, int64_t cols,
              int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r)
            backward_row<F, G, Lerp>(dout + r * cols, Lerp ? c + r * cols : nullptr, a + r * a_row, b + r * b_row,
                                     Lerp ? dc + r * cols : nullptr, da + r * da_row, db + r * db_row, cols);
    });
}

inline void bias_sigmoid_row(float* __restrict x, const float* __restrict bias, int64_t cols) {
    for (int64_t j = 0; j < cols; ++j) x[j] = apply<kSigmoid>(x[j] + bias[j]);
}

}  // namespace

extern "C" {
// x <- sigmoid(x + bias) row by row, in place: a gate from its linear layer's product without the bias.
void gate_bias_sigmoid(float* x, const float* bias, int64_t rows, int64_t cols, int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) bias_sigmoid_row(x + r * cols, bias, cols);
    });
}
int gate_tail_forward(int tail, const float* c, const float* a, int64_t a_row, const float* b, int64_t b_row,
                      float* out, int64_t rows, int64_t cols, int64_t threads) {
    switch (tail) {
        case 0: forward<kSigmoid, kIdentity, false>(c, a, a_row, b, b_row, out, rows, cols, threads); return 0;
        case 1: forward<kTanh, kIdentity, false>(c, a, a_row, b, b_row, out, rows, cols, threads); return 0;
        case 2: forward<kSigmoid, kIdentity, true>(c, a, a_row, b, b_row, out, rows, cols, threads); return 0;
        case 3: forward<kSigmoid, kTanh, false>(c, a, a_row, b, b_row, out, rows, cols, threads); return 0;
        case 4: forward<kSigmoid, kIdentity, false>(nullptr, a, a_row, b, b_row, out, rows, cols, threads); return 0;
        default: return 1;
    }
}
int gate_tail_backward(int tail, const float* dout, const float* c, const float* a, int64_t a_row, const float* b,
                       int64_t b_row, float* dc, float* da, int64_t da_row, float* db, int64_t db_row, int64_t rows,
                       int64_t cols, int64_t threads) {
    switch (tail) {
        case 0: backward<kSigmoid, kIdentity, false>(dout, c, a, a_row, b, b_row, dc, da, da_row, db, db_row, rows,
                                                     cols, threads); return 0;
        case 1: backward<kTanh, kIdentity, false>(dout, c, a, a_row, b, b_row, dc, da, da_row, db, db_row, rows,
                                                  cols, threads); return 0;
        case 2: backward<kSigmoid, kIdentity, true>(dout, c, a, a_row, b, b_row, dc, da, da_row, db, db_row, rows,
                                                    cols, threads); return 0;
        case 3: backward<kSigmoid, kTanh, false>(dout, c, a, a_row, b, b_row, dc, da, da_row, db, db_row, rows,
                                                 cols, threads); return 0;
        case 4: backward<kSigmoid, kIdentity, false>(dout, c, a, a_row, b, b_row, dc, da, da_row, db, db_row, rows,
                                                     cols, threads); return 0;
        default: return 1;
    }
}
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    p, i, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gate_tail_forward.argtypes = [n, p, p, i, p, i, p, i, i, i]
    lib.gate_tail_forward.restype = ctypes.c_int
    lib.gate_tail_backward.argtypes = [n, p, p, p, i, p, i, p, p, i, p, i, i, i, i]
    lib.gate_tail_backward.restype = ctypes.c_int
    lib.gate_bias_sigmoid.argtypes = [p, p, i, i, i]
    lib.gate_bias_sigmoid.restype = None


# Fast maths vectorises exp() and tanh() (glibc's libmvec); the sigmoid's argument is clamped so that no
# infinity reaches a division (see apply<kSigmoid>).
KERNEL = NativeKernel(
    "gate", _CPP_SOURCE, _bind, abi_version=4, env_var="GATEDFORMER_GATE_BACKEND",
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
