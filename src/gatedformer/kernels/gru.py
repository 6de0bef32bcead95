"""One GRU step of the R-Transformer's LocalRNN as one compiled pass, forward and backward.

With the input and hidden projections already computed (``gi = W_ih x + b_ih``, ``gh = W_hh h + b_hh``,
gate order r, z, n as in ``torch.nn.GRU``), a step is element-wise::

    r = σ(gi_r + gh_r),  z = σ(gi_z + gh_z),  n = tanh(gi_n + r ⊙ gh_n),  h' = (1 - z) ⊙ n + z ⊙ h

In PyTorch operations that is a dozen passes over ``(rows, d)`` tensors forward and more backward, plus
concatenations to put the three gates' gradients back together, and autograd keeps about seven tensors
per step. Here the forward is one pass and keeps nothing but its inputs; the backward recomputes the
gates and writes the gradients of ``gi`` and ``gh`` straight into ``(rows, 3d)`` buffers.

``GATEDFORMER_GRU_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the default).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from gatedformer.gates._product import add_product
from gatedformer.kernels.build import NativeKernel, kernel_threads
from gatedformer.kernels.simd import SIGMOID, SIMD_HELPERS

__all__ = ["KERNEL", "gru_step", "gru_step_reference", "rows_view"]

_CPP_SOURCE = r"""
// One GRU step from precomputed projections, forward and backward. Generated and compiled by gatedformer.
// gi, gh: rows of 3d (gate order r, z, n) with row strides sgi, sgh (sgh may be 0: one bias row for all);
// h, out, grad, dh: contiguous rows of d; h may be null (the zero state).
// The per-row loops take every stream as a restrict-qualified parameter: GCC vectorises them (exp and tanh
// included) only then.
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {
""" + SIMD_HELPERS + SIGMOID + r"""

template <typename T, bool HasH>
void forward_row(const T* __restrict ar, const T* __restrict az, const T* __restrict an,
                 const T* __restrict br, const T* __restrict bz, const T* __restrict bn,
                 const T* __restrict prev, T* __restrict y, int64_t d) {
    for (int64_t j = 0; j < d; ++j) {
        const T r = sigmoid(ar[j] + br[j]), z = sigmoid(az[j] + bz[j]);
        const T n = std::tanh(an[j] + r * bn[j]);
        const T p = HasH ? prev[j] : T(0);
        y[j] = n + z * (p - n);  // (1 - z) n + z h
    }
}

template <typename T, bool HasH, bool WithDh>
void backward_row(const T* __restrict ar, const T* __restrict az, const T* __restrict an,
                  const T* __restrict br, const T* __restrict bz, const T* __restrict bn,
                  const T* __restrict prev, const T* __restrict g, T* __restrict dar, T* __restrict daz,
                  T* __restrict dan, T* __restrict dbr, T* __restrict dbz, T* __restrict dbn, T* __restrict dp,
                  int64_t d) {
    for (int64_t j = 0; j < d; ++j) {
        const T r = sigmoid(ar[j] + br[j]), z = sigmoid(az[j] + bz[j]);
        const T n = std::tanh(an[j] + r * bn[j]);
        const T p = HasH ? prev[j] : T(0);
        const T dn = g[j] * (T(1) - z) * (T(1) - n * n);
        const T dr = dn * bn[j] * r * (T(1) - r);
        const T dz = g[j] * (p - n) * z * (T(1) - z);
        dar[j] = dr;
        dbr[j] = dr;
        daz[j] = dz;
        dbz[j] = dz;
        dan[j] = dn;
        dbn[j] = dn * r;
        if (WithDh) dp[j] = g[j] * z;
    }
}

// float32 rows of whole vectors: the sigmoids and tanh from the inline exp, 16 (or 8) lanes at a time.
template <bool HasH>
void forward_row_vec(const float* ar, const float* az, const float* an, const float* br, const float* bz,
                     const float* bn, const float* prev, float* y, int64_t d) {
    for (int64_t j = 0; j < d; j += kW) {
        const vec r = vsigmoid(load(ar + j) + load(br + j)), z = vsigmoid(load(az + j) + load(bz + j));
        const vec n = vtanh(load(an + j) + r * load(bn + j));
        const vec p = HasH ? load(prev + j) : splat(0);
        store(y + j, n + z * (p - n));
    }
}

template <bool HasH, bool WithDh>
void backward_row_vec(const float* ar, const float* az, const float* an, const float* br, const float* bz,
                      const float* bn, const float* prev, const float* g, float* dar, float* daz, float* dan,
                      float* dbr, float* dbz, float* dbn, float* dp, int64_t d) {
    for (int64_t j = 0; j < d; j += kW) {
        const vec r = vsigmoid(load(ar + j) + load(br + j)), z = vsigmoid(load(az + j) + load(bz + j));
        const vec hn = load(bn + j);
        const vec n = vtanh(load(an + j) + r * hn);
        const vec p = HasH ? load(prev + j) : splat(0), gj = load(g + j);
        const vec dn = gj * (1.0f - z) * (1.0f - n * n);
        const vec dr = dn * hn * r * (1.0f - r);
        const vec dz = gj * (p - n) * z * (1.0f - z);
        store(dar + j, dr);
        store(dbr + j, dr);
        store(daz + j, dz);
        store(dbz + j, dz);
        store(dan + j, dn);
        store(dbn + j, dn * r);
        if (WithDh) store(dp + j, gj * z);
    }
}

// One row each way: the vector code for float32 rows of whole vectors, the scalar loops for the rest.
template <typename T, bool HasH>
void forward_one(const T* ar, const T* az, const T* an, const T* br, const T* bz, const T* bn, const T* prev, T* y,
                 int64_t d) {
    forward_row<T, HasH>(ar, az, an, br, bz, bn, prev, y, d);
}
#define GRU_FORWARD_FLOAT(HAS_H)                                                                               \
    template <>                                                                                                \
    void forward_one<float, HAS_H>(const float* ar, const float* az, const float* an, const float* br,         \
                                   const float* bz, const float* bn, const float* prev, float* y, int64_t d) { \
        if (d % kW == 0) forward_row_vec<HAS_H>(ar, az, an, br, bz, bn, prev, y, d);                           \
        else forward_row<float, HAS_H>(ar, az, an, br, bz, bn, prev, y, d);                                    \
    }
GRU_FORWARD_FLOAT(true)
GRU_FORWARD_FLOAT(false)
#undef GRU_FORWARD_FLOAT
template <typename T, bool HasH, bool WithDh>
void backward_one(const T* ar, const T* az, const T* an, const T* br, const T* bz, const T* bn, const T* prev,
                  const T* g, T* dar, T* daz, T* dan, T* dbr, T* dbz, T* dbn, T* dp, int64_t d) {
    backward_row<T, HasH, WithDh>(ar, az, an, br, bz, bn, prev, g, dar, daz, dan, dbr, dbz, dbn, dp, d);
}
#define GRU_BACKWARD_FLOAT(HAS_H, WITH_DH)                                                                     \
    template <>                                                                                                \
    void backward_one<float, HAS_H, WITH_DH>(const float* ar, const float* az, const float* an,                \
                                             const float* br, const float* bz, const float* bn,                \
                                             const float* prev, const float* g, float* dar, float* daz,        \
                                             float* dan, float* dbr, float* dbz, float* dbn, float* dp,        \
                                             int64_t d) {                                                      \
        if (d % kW == 0)                                                                                       \
            backward_row_vec<HAS_H, WITH_DH>(ar, az, an, br, bz, bn, prev, g, dar, daz, dan, dbr, dbz, dbn,    \
                                             dp, d);                                                           \
        else                                                                                                   \
            backward_row<float, HAS_H, WITH_DH>(ar, az, an, br, bz, bn, prev, g, dar, daz, dan, dbr, dbz, dbn, \
                                                dp, d);                                                        \
    }
GRU_BACKWARD_FLOAT(true, true)
GRU_BACKWARD_FLOAT(true, false)
GRU_BACKWARD_FLOAT(false, false)
#undef GRU_BACKWARD_FLOAT

template <typename T>
void forward(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* h, T* out, int64_t rows, int64_t d,
             int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
            const T* a = gi + row * sgi;
            const T* b = gh + row * sgh;
            if (h != nullptr)
                forward_one<T, true>(a, a + d, a + 2 * d, b, b + d, b + 2 * d, h + row * d, out + row * d, d);
            else
                forward_one<T, false>(a, a + d, a + 2 * d, b, b + d, b + 2 * d, nullptr, out + row * d, d);
        }
    });
}

template <typename T>
void backward(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* h, const T* grad, T* dgi, T* dgh,
              T* dh, int64_t rows, int64_t d, int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
            const T* a = gi + row * sgi;
            const T* b = gh + row * sgh;
            const T* g = grad + row * d;
            T* da = dgi + row * 3 * d;
            T* db = dgh + row * 3 * d;
            if (h != nullptr && dh != nullptr)
                backward_one<T, true, true>(a, a + d, a + 2 * d, b, b + d, b + 2 * d, h + row * d, g, da, da + d,
                                            da + 2 * d, db, db + d, db + 2 * d, dh + row * d, d);
            else if (h != nullptr)
                backward_one<T, true, false>(a, a + d, a + 2 * d, b, b + d, b + 2 * d, h + row * d, g, da, da + d,
                                             da + 2 * d, db, db + d, db + 2 * d, nullptr, d);
            else
                backward_one<T, false, false>(a, a + d, a + 2 * d, b, b + d, b + 2 * d, nullptr, g, da, da + d,
                                              da + 2 * d, db, db + d, db + 2 * d, nullptr, d);
        }
    });
}

}  // namespace

#define GRU_DEFINE(T, SUFFIX)                                                                               \
    void gru_forward_##SUFFIX(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* h, T* out,       \
                              int64_t rows, int64_t d, int64_t threads) {                                   \
        forward<T>(gi, sgi, gh, sgh, h, out, rows, d, threads);                                             \
    }                                                                                                       \
    void gru_backward_##SUFFIX(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* h, const T* grad, \
                               T* dgi, T* dgh, T* dh, int64_t rows, int64_t d, int64_t threads) {           \
        backward<T>(gi, sgi, gh, sgh, h, grad, dgi, dgh, dh, rows, d, threads);                             \
    }

extern "C" {
GRU_DEFINE(float, f32)
GRU_DEFINE(double, f64)
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int64
    for suffix in ("f32", "f64"):
        getattr(lib, f"gru_forward_{suffix}").argtypes = [p, i, p, i, p, p, i, i, i]
        getattr(lib, f"gru_forward_{suffix}").restype = None
        getattr(lib, f"gru_backward_{suffix}").argtypes = [p, i, p, i, p, p, p, p, p, i, i, i]
        getattr(lib, f"gru_backward_{suffix}").restype = None


# -ffast-math lets exp() and tanh() vectorise; the sigmoid is written so that it never overflows.
KERNEL = NativeKernel(
    "gru", _CPP_SOURCE, _bind, abi_version=1, env_var="GATEDFORMER_GRU_BACKEND",
    description="the compiled GRU step", fallback="PyTorch operations", fast_math=True, avx512=True,
)

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def rows_view(t: Tensor) -> Tensor:
    """``t`` (rows, width) with unit stride along the width and rows that do not overlap (or a broadcast row)."""
    if t.stride(-1) != 1 or (t.stride(0) != 0 and t.stride(0) < t.shape[-1]):
        return t.contiguous()
    return t


class _GRUStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:  # type: ignore[override]
        gi, gh = rows_view(gi), rows_view(gh)
        h = None if h is None else h.contiguous()
        rows, d = gi.shape[0], gi.shape[1] // 3
        out = gi.new_empty(rows, d)
        getattr(KERNEL.library(), f"gru_forward_{_SUFFIX[gi.dtype]}")(
            gi.data_ptr(), gi.stride(0), gh.data_ptr(), gh.stride(0), None if h is None else h.data_ptr(),
            out.data_ptr(), rows, d, kernel_threads(out.numel()),
        )
        ctx.save_for_backward(gi, gh, h)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:  # type: ignore[override]
        gi, gh, h = ctx.saved_tensors
        rows, d = gi.shape[0], gi.shape[1] // 3
        grad = grad.contiguous()
        dgi = gi.new_empty(rows, 3 * d)
        dgh = gi.new_empty(rows, 3 * d)
        dh = None if h is None or not ctx.needs_input_grad[2] else torch.empty_like(h)
        getattr(KERNEL.library(), f"gru_backward_{_SUFFIX[gi.dtype]}")(
            gi.data_ptr(), gi.stride(0), gh.data_ptr(), gh.stride(0), None if h is None else h.data_ptr(),
            grad.data_ptr(), dgi.data_ptr(), dgh.data_ptr(), None if dh is None else dh.data_ptr(), rows, d,
            kernel_threads(grad.numel()),
        )
        return dgi, dgh, dh


def gru_step_reference(gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:
    """The step in PyTorch operations: ``nn.GRU``'s equations; ``h=None`` is the zero state."""
    d = gi.shape[-1] // 3
    in_rz, in_n = gi.split([2 * d, d], dim=-1)
    h_rz, h_n = gh.split([2 * d, d], dim=-1)
    reset, update = torch.sigmoid(in_rz + h_rz).chunk(2, dim=-1)
    new = torch.tanh(add_product(in_n, reset, h_n))
    if h is None:
        return new - update * new
    return torch.lerp(new, h, update)


def gru_step(gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:
    """One GRU step from ``gi`` ``(rows, 3d)``, ``gh`` ``(rows, 3d)`` or ``(3d,)`` (a bias for every row) and
    ``h`` ``(rows, d)`` or ``None``; the compiled pass on the CPU for float32/64, else PyTorch operations."""
    tensors = [t for t in (gi, gh, h) if t is not None]
    if (gi.dim() == 2 and gi.device.type == "cpu" and gi.dtype in _SUFFIX and not torch.compiler.is_compiling()
            and all(t.dtype == gi.dtype for t in tensors) and KERNEL.pick_backend(gi.device) == "native"):
        return _GRUStep.apply(gi, gh.expand(gi.shape[0], -1) if gh.dim() == 1 else gh, h)
    return gru_step_reference(gi, gh, h)
