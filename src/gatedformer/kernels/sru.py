"""The element-wise SRU recurrence: a fast path and a pure-PyTorch reference.

Everything an SRU layer computes with matrices happens before this module is called, in one matrix
product over all time steps. What is left is the element-wise recurrence

.. math::

    f_t &= \\sigma(\\tilde f_t + v_f \\odot c_{t-1} + b_f) \\\\
    r_t &= \\sigma(\\tilde r_t + v_r \\odot c_{t-1} + b_r) \\\\
    c_t &= f_t \\odot c_{t-1} + (1 - f_t) \\odot \\tilde x_t \\\\
    h_t &= r_t \\odot c_t + (1 - r_t) \\odot \\alpha\\, s_t

with :math:`\\tilde x_t = W x_t`, :math:`\\tilde f_t = W_f x_t`, :math:`\\tilde r_t = W_r x_t` and
:math:`s_t` the skip input (``x_t`` itself, or :math:`W_s x_t`). Every (batch, direction, unit)
column is an independent scalar recurrence, so the cost is a few flops per element and per step: the
time loop must not run in Python.

:func:`sru_recurrence` runs it as a :class:`torch.autograd.Function` with a hand-written backward
(back-propagation through time over the element-wise recurrence). Its loops run in a small C++
library whose source is below, built on first use and never at import (see
:mod:`gatedformer.kernels.build`). The batch rows are split between ``torch.get_num_threads()``
threads. If no compiler is found or the build fails, a warning is given once and the same forward and
backward run as vectorised PyTorch loops over time (slower, same results). The environment variable
``GATEDFORMER_SRU_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the default).

On a CUDA GPU the same recurrence runs as two Triton kernels (:mod:`gatedformer.kernels.triton.sru`),
one launch for the forward pass and one for the backward; without Triton, and on other devices, it
runs as the PyTorch loops. Half-precision inputs are computed in float32
and cast back; float64 inputs are computed in float64 (for ``gradcheck``).

:func:`sru_recurrence_reference` is a plain PyTorch implementation differentiated by autograd; it is
the oracle the tests check the fast path against.
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from torch import Tensor

from gatedformer.kernels.build import BACKENDS, NativeKernel, kernel_threads
from gatedformer.kernels.simd import SIGMOID, SIMD_HELPERS
from gatedformer.kernels.triton import sru as _sru_triton

__all__ = ["kernel_backend", "sru_recurrence", "sru_recurrence_reference"]

_CPP_SOURCE = r"""
// Element-wise SRU recurrence, forward and backward (BPTT). Generated and compiled by gatedformer.
// Layout: every stream is indexed [t][b][d][j] with j (the hidden unit) contiguous. Input streams
// come with their own (t, b, d) strides; outputs and saved cells are contiguous (L, B, D, H).
// Direction d == 1 runs from t = L - 1 down to 0. The B * D rows are independent and split between
// threads. Over j, float rows run whole vectors with the inline exp (forward_vectors, backward_vectors);
// the rest, and double rows, a loop that -ffast-math vectorises with glibc's libmvec.
#include <cmath>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {
""" + SIMD_HELPERS + SIGMOID + r"""

template <typename T>
struct Args {
    const T *u, *f, *r;
    int64_t st, sb, sd;  // strides of u, f, r (and of gu, gf, gr)
    const T* xs;
    int64_t xt, xb, xd;
    const T *vf, *vr, *bf, *br, *c0;
    T alpha;
    int64_t L, B, D, H;
};

// One time step of one row, units [0, returned) in whole vectors of floats with the inline exp of the SIMD helpers
// (a call into the vector maths library per vector would make the loop save and restore its registers); the
// scalar loops do the rest, and all of a double row.
template <typename T>
inline int64_t forward_vectors(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*,
                               const T*, T, T*, T*, int64_t) {
    return 0;
}
inline int64_t forward_vectors(const float* cp, const float* ut, const float* ft_in, const float* rt_in,
                               const float* xst, const float* vfd, const float* vrd, const float* bfd,
                               const float* brd, float alpha, float* ct, float* ht, int64_t H) {
    int64_t j = 0;
    for (; j + kW <= H; j += kW) {
        const vec c_prev = load(cp + j), u = load(ut + j);
        const vec ft = vsigmoid(load(ft_in + j) + load(vfd + j) * c_prev + load(bfd + j));
        const vec rt = vsigmoid(load(rt_in + j) + load(vrd + j) * c_prev + load(brd + j));
        const vec c = u + ft * (c_prev - u);
        const vec ax = alpha * load(xst + j);
        store(ct + j, c);
        store(ht + j, ax + rt * (c - ax));
    }
    return j;
}

template <typename T>
void forward_rows(const Args<T>& a, T* __restrict__ h, T* __restrict__ c_all, int64_t row0, int64_t row1) {
    const int64_t L = a.L, D = a.D, H = a.H, ot = a.B * D * H;
    const T alpha = a.alpha;
    // Time steps outside, rows inside: a step's rows lie side by side in every stream, so each step reads and writes
    // contiguous memory (row by row through all the steps, every step was a jump of a whole time slice).
    for (int64_t s = 0; s < L; ++s) {
        for (int64_t row = row0; row < row1; ++row) {
            const int64_t b = row / D, d = row % D, col = row * H;
            const T* vfd = a.vf + d * H;
            const T* vrd = a.vr + d * H;
            const T* bfd = a.bf + d * H;
            const T* brd = a.br + d * H;
            const int64_t t = d == 0 ? s : L - 1 - s;
            const int64_t tp = d == 0 ? t - 1 : t + 1;
            const T* cp = s == 0 ? a.c0 + col : c_all + tp * ot + col;
            const int64_t iu = t * a.st + b * a.sb + d * a.sd, ix = t * a.xt + b * a.xb + d * a.xd;
            const T* ut = a.u + iu;
            const T* ft_in = a.f + iu;
            const T* rt_in = a.r + iu;
            const T* xst = a.xs + ix;
            T* ct = c_all + t * ot + col;
            T* ht = h + t * ot + col;
#pragma GCC ivdep
            for (int64_t j = forward_vectors(cp, ut, ft_in, rt_in, xst, vfd, vrd, bfd, brd, alpha, ct, ht, H); j < H;
                 ++j) {
                const T c_prev = cp[j];
                const T ft = sigmoid(ft_in[j] + vfd[j] * c_prev + bfd[j]);
                const T rt = sigmoid(rt_in[j] + vrd[j] * c_prev + brd[j]);
                const T c = ut[j] + ft * (c_prev - ut[j]);
                const T ax = alpha * xst[j];
                ct[j] = c;
                ht[j] = ax + rt * (c - ax);
            }
        }
    }
}

template <typename T>
struct Grads {
    const T *c_all, *grad_h, *grad_c_last;
    T *gu, *gf, *gr;  // strides of u, f, r
    T* gxs;
    int64_t gxt, gxb, gxd;
    T *gvf, *gvr, *gbf, *gbr;  // per-row partial sums (B, D, H), reduced over b by the caller
    T* gc;                     // dL/dc, carried back in time; ends as dL/dc0
};

// The backward step's whole vectors of floats, as forward_vectors (the row's pointers in the order backward_rows
// names them).
template <typename T>
inline int64_t backward_vectors(const T*, const T*, const T*, const T*, const T*, const T*, const T*, const T*,
                                const T*, const T*, const T*, T, T*, T*, T*, T*, T*, T*, T*, T*, T*, int64_t) {
    return 0;
}
inline int64_t backward_vectors(const float* cp, const float* ct, const float* ght, const float* ut,
                                const float* ft_in, const float* rt_in, const float* xst, const float* vfd,
                                const float* vrd, const float* bfd, const float* brd, float alpha, float* gcc,
                                float* gvfc, float* gvrc, float* gbfc, float* gbrc, float* gut, float* gft, float* grt,
                                float* gxst, int64_t H) {
    int64_t j = 0;
    for (; j + kW <= H; j += kW) {
        const vec c_prev = load(cp + j), u = load(ut + j), vf = load(vfd + j), vr = load(vrd + j);
        const vec ft = vsigmoid(load(ft_in + j) + vf * c_prev + load(bfd + j));
        const vec rt = vsigmoid(load(rt_in + j) + vr * c_prev + load(brd + j));
        const vec gh = load(ght + j);
        const vec g_c = load(gcc + j) + gh * rt;
        const vec g_pr = gh * (load(ct + j) - alpha * load(xst + j)) * rt * (1.0f - rt);
        const vec g_pf = g_c * (c_prev - u) * ft * (1.0f - ft);
        store(gut + j, g_c * (1.0f - ft));
        store(gft + j, g_pf);
        store(grt + j, g_pr);
        store(gxst + j, gh * (1.0f - rt) * alpha);
        store(gvfc + j, load(gvfc + j) + g_pf * c_prev);
        store(gvrc + j, load(gvrc + j) + g_pr * c_prev);
        store(gbfc + j, load(gbfc + j) + g_pf);
        store(gbrc + j, load(gbrc + j) + g_pr);
        store(gcc + j, g_c * ft + g_pf * vf + g_pr * vr);
    }
    return j;
}

template <typename T>
void backward_rows(const Args<T>& a, const Grads<T>& g, int64_t row0, int64_t row1) {
    const int64_t L = a.L, D = a.D, H = a.H, ot = a.B * D * H;
    const T alpha = a.alpha;
    for (int64_t col = row0 * H; col < row1 * H; ++col) {
        g.gc[col] = g.grad_c_last ? g.grad_c_last[col] : T(0);
        g.gvf[col] = g.gvr[col] = g.gbf[col] = g.gbr[col] = T(0);
    }
    for (int64_t s = L - 1; s >= 0; --s) {  // steps outside, rows inside, as in forward_rows
        for (int64_t row = row0; row < row1; ++row) {
            const int64_t b = row / D, d = row % D, col = row * H;
            const T* vfd = a.vf + d * H;
            const T* vrd = a.vr + d * H;
            const T* bfd = a.bf + d * H;
            const T* brd = a.br + d * H;
            T* gcc = g.gc + col;
            T* gvfc = g.gvf + col;
            T* gvrc = g.gvr + col;
            T* gbfc = g.gbf + col;
            T* gbrc = g.gbr + col;
            const int64_t t = d == 0 ? s : L - 1 - s;
            const int64_t tp = d == 0 ? t - 1 : t + 1;
            const T* cp = s == 0 ? a.c0 + col : g.c_all + tp * ot + col;
            const T* ct = g.c_all + t * ot + col;
            const T* ght = g.grad_h + t * ot + col;
            const int64_t iu = t * a.st + b * a.sb + d * a.sd, ix = t * a.xt + b * a.xb + d * a.xd;
            const T* ut = a.u + iu;
            const T* ft_in = a.f + iu;
            const T* rt_in = a.r + iu;
            const T* xst = a.xs + ix;
            T* __restrict__ gut = g.gu + iu;
            T* __restrict__ gft = g.gf + iu;
            T* __restrict__ grt = g.gr + iu;
            T* __restrict__ gxst = g.gxs + t * g.gxt + b * g.gxb + d * g.gxd;
            const int64_t vectors = backward_vectors(cp, ct, ght, ut, ft_in, rt_in, xst, vfd, vrd, bfd, brd, alpha, gcc,
                                                     gvfc, gvrc, gbfc, gbrc, gut, gft, grt, gxst, H);
#pragma GCC ivdep
            for (int64_t j = vectors; j < H; ++j) {
                const T c_prev = cp[j];
                const T ft = sigmoid(ft_in[j] + vfd[j] * c_prev + bfd[j]);
                const T rt = sigmoid(rt_in[j] + vrd[j] * c_prev + brd[j]);
                const T gh = ght[j];
                const T g_c = gcc[j] + gh * rt;                                  // dL/dc_t
                const T g_pr = gh * (ct[j] - alpha * xst[j]) * rt * (T(1) - rt);  // dL/d(pre-act of r)
                const T g_pf = g_c * (c_prev - ut[j]) * ft * (T(1) - ft);         // dL/d(pre-act of f)
                gut[j] = g_c * (T(1) - ft);
                gft[j] = g_pf;
                grt[j] = g_pr;
                gxst[j] = gh * (T(1) - rt) * alpha;
                gvfc[j] += g_pf * c_prev;
                gvrc[j] += g_pr * c_prev;
                gbfc[j] += g_pf;
                gbrc[j] += g_pr;
                gcc[j] = g_c * ft + g_pf * vfd[j] + g_pr * vrd[j];  // dL/dc_{t-1}
            }
        }
    }
}

}  // namespace

#define SRU_ARGS(T)                                                                                    \
    const T *u, const T *f, const T *r, int64_t st, int64_t sb, int64_t sd, const T *xs, int64_t xt,  \
        int64_t xb, int64_t xd, const T *vf, const T *vr, const T *bf, const T *br, const T *c0,      \
        double alpha, int64_t L, int64_t B, int64_t D, int64_t H, int64_t threads
#define SRU_MAKE_ARGS(T) \
    Args<T>{u, f, r, st, sb, sd, xs, xt, xb, xd, vf, vr, bf, br, c0, static_cast<T>(alpha), L, B, D, H}
#define SRU_GRAD_ARGS(T)                                                                                \
    const T *c_all, const T *grad_h, const T *grad_c_last, T *gu, T *gf, T *gr, T *gxs, int64_t gxt,  \
        int64_t gxb, int64_t gxd, T *gvf, T *gvr, T *gbf, T *gbr, T *gc
#define SRU_MAKE_GRADS(T) \
    Grads<T>{c_all, grad_h, grad_c_last, gu, gf, gr, gxs, gxt, gxb, gxd, gvf, gvr, gbf, gbr, gc}

#define SRU_DEFINE(T, SUFFIX)                                                                      \
    void sru_forward_##SUFFIX(SRU_ARGS(T), T* h, T* c_all) {                                       \
        const Args<T> a = SRU_MAKE_ARGS(T);                                                        \
        gatedformer::parallel_chunks(B * D, threads, 1,                                              \
                                     [&](int64_t lo, int64_t hi) { forward_rows(a, h, c_all, lo, hi); }); \
    }                                                                                              \
    void sru_backward_##SUFFIX(SRU_ARGS(T), SRU_GRAD_ARGS(T)) {                                    \
        const Args<T> a = SRU_MAKE_ARGS(T);                                                        \
        const Grads<T> g = SRU_MAKE_GRADS(T);                                                      \
        gatedformer::parallel_chunks(B * D, threads, 1,                                              \
                                     [&](int64_t lo, int64_t hi) { backward_rows(a, g, lo, hi); }); \
    }

extern "C" {
SRU_DEFINE(float, f32)
SRU_DEFINE(double, f64)
}
"""

def _bind(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    fwd = [p, p, p, i, i, i, p, i, i, i, p, p, p, p, p, f, i, i, i, i, i]
    for suffix in ("f32", "f64"):
        getattr(lib, f"sru_forward_{suffix}").argtypes = [*fwd, p, p]
        getattr(lib, f"sru_forward_{suffix}").restype = None
        getattr(lib, f"sru_backward_{suffix}").argtypes = [*fwd, p, p, p, p, p, p, p, i, i, i, p, p, p, p, p]
        getattr(lib, f"sru_backward_{suffix}").restype = None


# -ffast-math is safe for this code: its sigmoid never overflows, and NaNs still propagate.
KERNEL = NativeKernel(
    "sru", _CPP_SOURCE, _bind, abi_version=3, env_var="GATEDFORMER_SRU_BACKEND",
    description="the compiled SRU recurrence", fallback="PyTorch loops over time, which are several times slower",
    fast_math=True, avx512=True,
)


def _native_library() -> ctypes.CDLL | None:
    return KERNEL.library()


def kernel_backend(device: torch.device | str = "cpu") -> str:
    """Which implementation :func:`sru_recurrence` uses on ``device``: ``"native"`` (the C++ kernel, on
    the CPU), ``"triton"`` (the Triton kernels, on a GPU) or ``"torch"``.

    Building the native kernel, if that has not happened yet, happens here.
    """
    return _pick_backend(torch.device(device))


_warned_no_triton = False


def _pick_backend(device: torch.device, backend: str | None = None) -> str:
    if device.type == "cpu":
        return KERNEL.pick_backend(device, backend)
    requested = backend or KERNEL.requested_backend()
    if requested not in BACKENDS:
        raise ValueError(f"backend must be auto, native or torch, got {requested!r}")
    if requested == "torch" or device.type != "cuda":
        return "torch"
    if _sru_triton.available():
        return "triton"
    if requested == "native":
        raise RuntimeError("the SRU recurrence on a GPU needs Triton (pip install triton); "
                           "or set GATEDFORMER_SRU_BACKEND=torch")
    global _warned_no_triton
    if not _warned_no_triton:
        _warned_no_triton = True
        warnings.warn("Triton is not installed, so the SRU recurrence runs on the GPU as PyTorch loops over time, "
                      "which are many times slower; pip install triton", stacklevel=3)
    return "torch"


# --------------------------------------------------------------------------------------------------
# Shapes used below: U (L, B, D, K, H) with K = 3 streams [x~, f~, r~] or K = 4 with the skip stream
# W_s x last; skip (L, B, D, H) when K = 3; v_f, v_r, b_f, b_r (D, H); c0 (B, D, H).


def _streams(U: Tensor, skip: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return U[:, :, :, 0], U[:, :, :, 1], U[:, :, :, 2], (U[:, :, :, 3] if skip is None else skip)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native_forward(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor,
    alpha: float,
) -> tuple[Tensor, Tensor]:
    lib = _native_library()
    assert lib is not None
    L, B, D, _, H = U.shape
    u, f, r, xs = _streams(U, skip)
    h = torch.empty((L, B, D, H), dtype=U.dtype)
    c_all = torch.empty_like(h)
    fn = lib.sru_forward_f64 if U.dtype == torch.float64 else lib.sru_forward_f32
    fn(
        u.data_ptr(), f.data_ptr(), r.data_ptr(), *u.stride()[:3], xs.data_ptr(), *xs.stride()[:3],
        v_f.data_ptr(), v_r.data_ptr(), b_f.data_ptr(), b_r.data_ptr(), c0.data_ptr(), float(alpha),
        L, B, D, H, kernel_threads(h.numel()), h.data_ptr(), c_all.data_ptr(),
    )  # fmt: skip
    return h, c_all


def _native_backward(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
    alpha: float, c_all: Tensor, grad_h: Tensor, grad_c_last: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    lib = _native_library()
    assert lib is not None
    L, B, D, _, H = U.shape
    u, f, r, xs = _streams(U, skip)
    grad_U = torch.empty_like(U)
    gu, gf, gr, _ = _streams(grad_U, skip)
    grad_skip = None if skip is None else torch.empty_like(skip)
    gxs = grad_U[:, :, :, 3] if skip is None else grad_skip
    partial = torch.empty((4, B, D, H), dtype=U.dtype)
    grad_c0 = torch.empty((B, D, H), dtype=U.dtype)
    fn = lib.sru_backward_f64 if U.dtype == torch.float64 else lib.sru_backward_f32
    fn(
        u.data_ptr(), f.data_ptr(), r.data_ptr(), *u.stride()[:3], xs.data_ptr(), *xs.stride()[:3],
        v_f.data_ptr(), v_r.data_ptr(), b_f.data_ptr(), b_r.data_ptr(), c0.data_ptr(), float(alpha),
        L, B, D, H, kernel_threads(c_all.numel()), c_all.data_ptr(), grad_h.data_ptr(), _ptr(grad_c_last),
        gu.data_ptr(), gf.data_ptr(), gr.data_ptr(), gxs.data_ptr(), *gxs.stride()[:3],
        partial[0].data_ptr(), partial[1].data_ptr(), partial[2].data_ptr(), partial[3].data_ptr(),
        grad_c0.data_ptr(),
    )  # fmt: skip
    g_vf, g_vr, g_bf, g_br = partial.sum(dim=1).unbind(0)
    return grad_U, grad_skip, g_vf, g_vr, g_bf, g_br, grad_c0


def _time_major_per_direction(t: Tensor) -> Tensor:
    """Reverse time for direction 1 of a (L, B, D, ...) tensor, so that every column runs t = 0, 1, ..."""
    if t.shape[2] == 1:
        return t
    return torch.stack((t[:, :, 0], t[:, :, 1].flip(0)), dim=2)


def _torch_forward(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor,
    alpha: float,
) -> tuple[Tensor, Tensor]:
    u, f, r, xs = (_time_major_per_direction(s) for s in _streams(U, skip))
    f = f + b_f
    r = r + b_r
    hs, cs = [], []
    c = c0
    for t in range(U.shape[0]):
        ft = torch.sigmoid(torch.addcmul(f[t], v_f, c))
        rt = torch.sigmoid(torch.addcmul(r[t], v_r, c))
        c = torch.lerp(u[t], c, ft)
        ax = alpha * xs[t]
        hs.append(torch.lerp(ax, c, rt))
        cs.append(c)
    return _time_major_per_direction(torch.stack(hs)), _time_major_per_direction(torch.stack(cs))


def _torch_backward(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
    alpha: float, c_all: Tensor, grad_h: Tensor, grad_c_last: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    flip = _time_major_per_direction
    u, f, r, xs = (flip(s) for s in _streams(U, skip))
    cs, gh = flip(c_all), flip(grad_h)
    f = f + b_f
    r = r + b_r
    L = U.shape[0]
    g_u, g_f, g_r, g_x = (torch.empty_like(cs) for _ in range(4))
    g_vf, g_vr, g_bf, g_br = (torch.zeros_like(c0) for _ in range(4))
    gc = torch.zeros_like(c0) if grad_c_last is None else grad_c_last.clone()
    for t in range(L - 1, -1, -1):
        c_prev = cs[t - 1] if t > 0 else c0
        ft = torch.sigmoid(torch.addcmul(f[t], v_f, c_prev))
        rt = torch.sigmoid(torch.addcmul(r[t], v_r, c_prev))
        g_c = torch.addcmul(gc, gh[t], rt)
        g_pr = gh[t] * (cs[t] - alpha * xs[t]) * rt * (1 - rt)
        g_pf = g_c * (c_prev - u[t]) * ft * (1 - ft)
        g_u[t] = g_c * (1 - ft)
        g_f[t] = g_pf
        g_r[t] = g_pr
        g_x[t] = gh[t] * (1 - rt) * alpha
        g_vf += g_pf * c_prev
        g_vr += g_pr * c_prev
        g_bf += g_pf
        g_br += g_pr
        gc = g_c * ft + g_pf * v_f + g_pr * v_r
    streams = [flip(g_u), flip(g_f), flip(g_r)]
    if skip is None:
        streams.append(flip(g_x))
    grad_U = torch.stack(streams, dim=3)
    grad_skip = None if skip is None else flip(g_x)
    return grad_U, grad_skip, g_vf.sum(0), g_vr.sum(0), g_bf.sum(0), g_br.sum(0), gc


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def _last_cell(c_all: Tensor) -> Tensor:
    """c after the last step of every direction: t = L - 1 forwards, t = 0 backwards. (B, D, H)."""
    if c_all.shape[2] == 1:
        return c_all[-1]
    return torch.stack((c_all[-1, :, 0], c_all[0, :, 1]), dim=1)


def _triton_forward(*args):  # noqa: ANN002, ANN202
    return _sru_triton.triton_forward(*args)


def _triton_backward(*args):  # noqa: ANN002, ANN202
    return _sru_triton.triton_backward(*args)


_FORWARD = {"native": _native_forward, "torch": _torch_forward, "triton": _triton_forward}
_BACKWARD = {"native": _native_backward, "torch": _torch_backward, "triton": _triton_backward}


class _SRURecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, U, skip, v_f, v_r, b_f, b_r, c0, alpha, backend):  # type: ignore[override]
        dtype = _compute_dtype(U, skip, v_f, v_r, b_f, b_r, c0)
        args = [None if t is None else t.to(dtype).contiguous() for t in (U, skip, v_f, v_r, b_f, b_r, c0)]
        h, c_all = _FORWARD[backend](*args, alpha)
        ctx.save_for_backward(*args, c_all)
        ctx.alpha, ctx.backend = alpha, backend
        ctx.dtypes = [None if t is None else t.dtype for t in (U, skip, v_f, v_r, b_f, b_r, c0)]
        c_last = _last_cell(c_all)
        return h.to(U.dtype), c_last.to(U.dtype)

    @staticmethod
    def backward(ctx, grad_h, grad_c_last):  # type: ignore[override]
        U, skip, v_f, v_r, b_f, b_r, c0, c_all = ctx.saved_tensors
        dtype = c_all.dtype
        grad_h = torch.zeros_like(c_all) if grad_h is None else grad_h.to(dtype).contiguous()
        grad_c_last = None if grad_c_last is None else grad_c_last.to(dtype).contiguous()
        grads = _BACKWARD[ctx.backend](U, skip, v_f, v_r, b_f, b_r, c0, ctx.alpha, c_all, grad_h, grad_c_last)
        out = [
            None if g is None or not need else g.to(dt)
            for g, need, dt in zip(grads, ctx.needs_input_grad[:7], ctx.dtypes, strict=True)
        ]
        return (*out, None, None)


# Under torch.compile the recurrence is one opaque operator each way, so that dynamo neither traces into the kernels'
# Python (which it cannot: a ctypes call, the build's lock) nor splits the graph around them. Eager calls keep the
# autograd Function above: the operators' dispatch would only add to every step.
_SCHEMA_ARGS = ("Tensor U, Tensor? skip, Tensor v_f, Tensor v_r, Tensor b_f, Tensor b_r, Tensor c0, float alpha, "
                "str backend")


def _in_compute_dtype(*tensors: Tensor | None) -> list[Tensor | None]:
    dtype = _compute_dtype(*tensors)
    return [None if t is None else t.to(dtype).contiguous() for t in tensors]


@torch.library.custom_op("gatedformer::sru_recurrence", mutates_args=(),
                         schema=f"({_SCHEMA_ARGS}) -> (Tensor, Tensor, Tensor)")
def _recurrence_op(U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
                   alpha: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """``h``, the last cell and every step's cell (in the compute dtype, for the backward operator)."""
    args = _in_compute_dtype(U, skip, v_f, v_r, b_f, b_r, c0)
    h, c_all = _FORWARD[_pick_backend(U.device, backend or None)](*args, alpha)
    return h.to(U.dtype), _last_cell(c_all).to(U.dtype).clone(), c_all


@_recurrence_op.register_fake
def _(U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
      alpha: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    L, B, D, _, H = U.shape
    dtype = _compute_dtype(U, skip, v_f, v_r, b_f, b_r, c0)
    return U.new_empty((L, B, D, H)), U.new_empty((B, D, H)), U.new_empty((L, B, D, H), dtype=dtype)


@torch.library.custom_op("gatedformer::sru_recurrence_backward", mutates_args=(),
                         schema=f"({_SCHEMA_ARGS}, Tensor c_all, Tensor grad_h, Tensor? grad_c_last) "
                                "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def _recurrence_backward_op(U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor,
                            c0: Tensor, alpha: float, backend: str, c_all: Tensor, grad_h: Tensor,
                            grad_c_last: Tensor | None) -> tuple[Tensor, ...]:
    """The gradients of ``U, skip, v_f, v_r, b_f, b_r, c0`` in their dtypes; ``skip``'s is empty without a skip."""
    inputs = (U, skip, v_f, v_r, b_f, b_r, c0)
    args = _in_compute_dtype(*inputs)
    dtype = c_all.dtype
    grad_c_last = None if grad_c_last is None else grad_c_last.to(dtype).contiguous()
    grads = _BACKWARD[_pick_backend(U.device, backend or None)](*args, alpha, c_all, grad_h.to(dtype).contiguous(),
                                                                 grad_c_last)
    # an operator's outputs may not share memory (the native backward's parameter gradients are rows of one tensor)
    return tuple(U.new_empty(0) if g is None else g.to(t.dtype) if g._base is None else g.to(t.dtype).clone()
                 for g, t in zip(grads, inputs, strict=True))


@_recurrence_backward_op.register_fake
def _(U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor, alpha: float,
      backend: str, c_all: Tensor, grad_h: Tensor, grad_c_last: Tensor | None) -> tuple[Tensor, ...]:
    # contiguous, as the kernels write them, whatever the inputs' strides
    return tuple(U.new_empty(0 if t is None else t.shape, dtype=U.dtype if t is None else t.dtype)
                 for t in (U, skip, v_f, v_r, b_f, b_r, c0))


def _setup_recurrence(ctx, inputs, output) -> None:  # noqa: ANN001
    U, skip, v_f, v_r, b_f, b_r, c0, alpha, backend = inputs
    ctx.save_for_backward(U, skip, v_f, v_r, b_f, b_r, c0, output[2])
    ctx.alpha, ctx.backend = alpha, backend


def _recurrence_op_backward(ctx, grad_h, grad_c_last, _grad_c_all):  # noqa: ANN001, ANN202
    U, skip, v_f, v_r, b_f, b_r, c0, c_all = ctx.saved_tensors
    grad_h = torch.zeros(c_all.shape, dtype=U.dtype, device=U.device) if grad_h is None else grad_h
    grads = _recurrence_backward_op(U, skip, v_f, v_r, b_f, b_r, c0, ctx.alpha, ctx.backend, c_all, grad_h,
                                    grad_c_last)
    out = [g if need and not (name == "skip" and skip is None) else None
           for g, need, name in zip(grads, ctx.needs_input_grad[:7], ("U", "skip", "v_f", "v_r", "b_f", "b_r", "c0"),
                                    strict=True)]
    return (*out, None, None)


_recurrence_op.register_autograd(_recurrence_op_backward, setup_context=_setup_recurrence)


def _check_shapes(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor | None
) -> Tensor:
    if U.dim() != 5 or U.shape[3] not in (3, 4):
        raise ValueError(f"U must have shape (L, B, D, 3 or 4, H), got {tuple(U.shape)}")
    L, B, D, K, H = U.shape
    # two tests, not `(K == 3) != (skip is not None)`: dynamo fails on that for a symbolic K
    if (skip is None and K == 3) or (skip is not None and K == 4):
        raise ValueError("pass skip (L, B, D, H) exactly when U has 3 streams; with 4 the last is the skip")
    if skip is not None and tuple(skip.shape) != (L, B, D, H):
        raise ValueError(f"skip must have shape {(L, B, D, H)}, got {tuple(skip.shape)}")
    for name, p in (("v_f", v_f), ("v_r", v_r), ("b_f", b_f), ("b_r", b_r)):
        if tuple(p.shape) != (D, H):
            raise ValueError(f"{name} must have shape {(D, H)}, got {tuple(p.shape)}")
    if c0 is None:
        return U.new_zeros((B, D, H))
    if tuple(c0.shape) != (B, D, H):
        raise ValueError(f"c0 must have shape {(B, D, H)}, got {tuple(c0.shape)}")
    return c0


def sru_recurrence(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor | None = None,
    alpha: float = 1.0,
    *,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the element-wise SRU recurrence over all time steps and directions.

    ``U`` is the fused input projection, shape ``(L, B, D, K, H)`` (``D`` directions of ``H`` units):
    streams ``[W x, W_f x, W_r x]`` and, when ``K == 4``, the projected skip ``W_s x``; when ``K == 3`` the
    skip input comes as ``skip`` of shape ``(L, B, D, H)``. ``v_f, v_r, b_f, b_r`` have shape ``(D, H)``
    and ``c0`` ``(B, D, H)`` (zeros if ``None``). Direction 1 runs backwards in time. ``alpha`` scales the
    skip input. ``backend`` overrides ``$GATEDFORMER_SRU_BACKEND`` (``auto``, ``native`` or ``torch``).

    Returns ``h`` of shape ``(L, B, D, H)`` and the last cell ``c`` of every direction, ``(B, D, H)``,
    both in the dtype of ``U``. Differentiable in every tensor argument.
    """
    c0 = _check_shapes(U, skip, v_f, v_r, b_f, b_r, c0)
    if torch.compiler.is_compiling():
        h, c_last, _ = _recurrence_op(U, skip, v_f, v_r, b_f, b_r, c0, float(alpha), backend or "")
        return h, c_last
    chosen = _pick_backend(U.device, backend)
    return _SRURecurrence.apply(U, skip, v_f, v_r, b_f, b_r, c0, float(alpha), chosen)


def sru_recurrence_reference(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor | None = None,
    alpha: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Plain PyTorch version of :func:`sru_recurrence` (same arguments and results), one step at a time
    and differentiated by autograd. Slow; it is the oracle that the fast path is tested against."""
    c0 = _check_shapes(U, skip, v_f, v_r, b_f, b_r, c0)
    L, _, D, _, _ = U.shape
    x_tilde, f_tilde, r_tilde, s = _streams(U, skip)
    h_dirs, c_dirs = [], []
    for d in range(D):
        c = c0[:, d]
        hs: list[Tensor] = [U.new_empty(0)] * L
        for t in range(L) if d == 0 else range(L - 1, -1, -1):
            f = torch.sigmoid(f_tilde[t, :, d] + v_f[d] * c + b_f[d])
            r = torch.sigmoid(r_tilde[t, :, d] + v_r[d] * c + b_r[d])
            c = f * c + (1 - f) * x_tilde[t, :, d]
            hs[t] = r * c + (1 - r) * s[t, :, d] * alpha
        h_dirs.append(torch.stack(hs))
        c_dirs.append(c)
    return torch.stack(h_dirs, dim=2), torch.stack(c_dirs, dim=1)
