"""Causal multi-head attention for short windows on the CPU, read straight from the fused QKV projection.

``torch.nn.functional.scaled_dot_product_attention`` on the CPU runs a flash-attention kernel built from
small matrix products: at the sizes of the ``-tiny`` recipes (windows of 128, heads of 32) it reaches
15-20 % of the float32 matrix-product peak, and its inputs and gradients need transposed copies between
the ``(B, L, 3, H, D)`` layout of the projection and its ``(B, H, L, D)`` one. This kernel computes

.. math::

    P = \\operatorname{softmax}\\big(\\mathrm{mask}(s\\, Q K^\\top)\\big), \\qquad O = P V

for each (sequence, head) with register-blocked loops over the whole window at once (the window's keys
and values fit in the L1/L2 cache), reading Q, K and V from the projection's output and writing O in the
``(B, L, H·D)`` layout the output projection reads. While it runs, denormal floats are flushed to zero
(a peaked softmax produces them, and x86 computes on them dozens of times slower). The backward pass
recomputes ``P`` from the saved log-sum-exp of every row (as flash attention does), so nothing of size
``L × L`` is kept, and writes the three gradients into the projection's layout. Only the causal (query,
key) pairs are computed.

It applies to float32 CPU tensors, head sizes 8, 16, 32, 64 or 128, and no attention dropout; everything
else takes ``scaled_dot_product_attention``. ``GATEDFORMER_ATTENTION_BACKEND`` picks ``native``,
``torch`` (always ``scaled_dot_product_attention``) or ``auto`` (the default).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor
from torch.nn import functional as F

from gatedformer.backbones._native import NativeKernel, kernel_threads

__all__ = ["KERNEL", "SUPPORTED_HEAD_SIZES", "causal_attention_packed", "causal_attention_reference"]

SUPPORTED_HEAD_SIZES = (8, 16, 32, 64, 128)

_CPP_SOURCE = r"""
// Causal attention over packed QKV rows, forward and backward. Generated and compiled by gatedformer.
// qkv: (B, L, 3, H, D) contiguous; out, grad_out: (B, L, H, D); lse: (B, H, L); grad_qkv like qkv.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {

constexpr int kW = 8;  // floats per vector: one AVX2 register
typedef float vec __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int64_t kRows = 4;    // query rows per block
constexpr int64_t kPanel = 2 * kW;  // keys per panel of the packed K (and V) used for Q K^T (and dO V^T)

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec x) { *reinterpret_cast<vec*>(p) = x; }
inline vec splat(float x) { return vec{} + x; }  // a scalar operand is broadcast to every lane
// Flush denormal floats to zero while a thread runs the kernel (restored after). A peaked softmax gives
// probabilities below 2^-126, and arithmetic on them is dozens of times slower on x86; they contribute
// nothing a float32 sum of probabilities that add up to 1 could hold.
struct FlushDenormals {
#if defined(__SSE__) || defined(__x86_64__)
    unsigned int saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // flush-to-zero and denormals-are-zero
    ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

inline int64_t round_panel(int64_t n) { return (n + kPanel - 1) / kPanel * kPanel; }

struct Head {
    const float* q;  // row i of Q at q + i * row, of K at q + i * row + kv, of V at + 2 * kv
    int64_t row, kv;
};

// S[r][j] = sum_d A_r[d] * X_j[d] for r < kRows and j < n (a multiple of kPanel), with the keys X packed in
// panels of kPanel (see pack_panels). Eight independent accumulators keep both FMA units busy.
template <int D>
void row_products(const float* const a[kRows], const float* panels, int64_t n, float* s, int64_t lds) {
    for (int64_t j = 0; j < n; j += kPanel) {
        const float* panel = panels + j * D;
        vec acc[kRows][2];
        for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = splat(0);
        for (int d = 0; d < D; ++d) {
            const vec b0 = load(panel + d * kPanel), b1 = load(panel + d * kPanel + kW);
            for (int r = 0; r < kRows; ++r) {
                const vec ar = splat(a[r][d]);
                acc[r][0] += ar * b0;
                acc[r][1] += ar * b1;
            }
        }
        for (int r = 0; r < kRows; ++r) {
            store(s + r * lds + j, acc[r][0]);
            store(s + r * lds + j + kW, acc[r][1]);
        }
    }
}

// out_r = sum_{j < n} W[r][j] * X_j for r < kRows (X_j = x + j * stride, D floats each).
template <int D>
void weighted_rows(const float* w, int64_t ldw, int64_t n, const float* x, int64_t stride, float* const out[kRows]) {
    constexpr int NV = D / kW;
    constexpr int R = NV <= 2 ? 4 : (NV == 4 ? 2 : 1);  // rows at once: keep the accumulators in registers
    for (int r0 = 0; r0 < kRows; r0 += R) {
        vec acc[R][NV];
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v) acc[r][v] = splat(0);
        for (int64_t j = 0; j < n; ++j) {
            const float* xj = x + j * stride;
            for (int v = 0; v < NV; ++v) {
                const vec xv = load(xj + kW * v);
                for (int r = 0; r < R; ++r) acc[r][v] += splat(w[(r0 + r) * ldw + j]) * xv;
            }
        }
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v) store(out[r0 + r] + kW * v, acc[r][v]);
    }
}

// Y_j += sum_r W[r][j] * Z_r for j < n (Y rows of D floats, contiguous): a rank-kRows update.
template <int D>
void rank_update(const float* w, int64_t ldw, int64_t n, const float* const z[kRows], float* y) {
    constexpr int NV = D / kW;
    for (int v = 0; v < NV; ++v) {
        const vec z0 = load(z[0] + kW * v), z1 = load(z[1] + kW * v), z2 = load(z[2] + kW * v),
                  z3 = load(z[3] + kW * v);
        for (int64_t j = 0; j < n; ++j) {
            float* yj = y + j * D + kW * v;
            store(yj, load(yj) + splat(w[j]) * z0 + splat(w[ldw + j]) * z1 + splat(w[2 * ldw + j]) * z2
                          + splat(w[3 * ldw + j]) * z3);
        }
    }
}

// The rows X_j (j < L) in panels of kPanel rows, each stored transposed: element d of row j lands at
// panels[(j / kPanel) * D * kPanel + d * kPanel + j % kPanel]; rows past L are zero.
template <int D>
void pack_panels(const float* x, int64_t stride, int64_t L, float* panels) {
    const int64_t padded = round_panel(L);
    std::memset(panels + (L / kPanel) * kPanel * D, 0, sizeof(float) * (padded - L / kPanel * kPanel) * D);
    for (int64_t j = 0; j < L; ++j) {
        float* column = panels + (j / kPanel) * D * kPanel + j % kPanel;
        const float* row = x + j * stride;
        for (int d = 0; d < D; ++d) column[d * kPanel] = row[d];
    }
}

// The rows X_j (j < L) copied next to each other: strided rows of the projection would keep evicting each
// other from the L1 cache (their stride is a multiple of its set size).
template <int D>
void pack_rows(const float* x, int64_t stride, int64_t L, float* rows) {
    for (int64_t j = 0; j < L; ++j) std::memcpy(rows + j * D, x + j * stride, sizeof(float) * D);
}

// Rows i0 .. i0 + rows - 1 of the block; rows past the end repeat the last one (their results are unused).
inline void block_rows(const float* base, int64_t stride, int64_t i0, int64_t rows, const float* out[kRows]) {
    for (int64_t r = 0; r < kRows; ++r) out[r] = base + (i0 + (r < rows ? r : rows - 1)) * stride;
}

template <int D>
void forward_head(const Head& h, int64_t L, float scale, float* o, int64_t o_row, float* lse,
                  std::vector<float>& work) {
    const int64_t ld = round_panel(L);
    work.resize(D * ld + kRows * ld + L * D);
    float* kt = work.data();
    float* s = kt + D * ld;
    float* v = s + kRows * ld;
    pack_panels<D>(h.q + h.kv, h.row, L, kt);
    pack_rows<D>(h.q + 2 * h.kv, h.row, L, v);
    for (int64_t i0 = 0; i0 < L; i0 += kRows) {
        const int64_t rows = L - i0 < kRows ? L - i0 : kRows, n = i0 + rows;
        const float* q[kRows];
        block_rows(h.q, h.row, i0, rows, q);
        row_products<D>(q, kt, round_panel(n), s, ld);
        for (int64_t r = 0; r < kRows; ++r) {
            float* p = s + r * ld;
            const int64_t valid = r < rows ? i0 + r + 1 : 0;  // keys 0 .. i
            float m = valid ? p[0] * scale : 0.0f;
            for (int64_t j = 1; j < valid; ++j) m = p[j] * scale > m ? p[j] * scale : m;
            float sum = 0.0f;
            for (int64_t j = 0; j < valid; ++j) {
                p[j] = std::exp(p[j] * scale - m);
                sum += p[j];
            }
            const float inv = valid ? 1.0f / sum : 0.0f;
            for (int64_t j = 0; j < valid; ++j) p[j] *= inv;
            for (int64_t j = valid; j < n; ++j) p[j] = 0.0f;
            if (valid && lse != nullptr) lse[i0 + r] = m + std::log(sum);
        }
        float* out[kRows];
        float scratch[kRows][D];
        for (int64_t r = 0; r < kRows; ++r) out[r] = r < rows ? o + (i0 + r) * o_row : scratch[r];
        weighted_rows<D>(s, ld, n, v, D, out);
    }
}

template <int D>
void backward_head(const Head& h, int64_t L, float scale, const float* o, const float* go, int64_t o_row,
                   const float* lse, float* g, std::vector<float>& work) {
    const int64_t ld = round_panel(L);
    work.resize(2 * D * ld + 2 * kRows * ld + 3 * L * D + L);
    float* kt = work.data();
    float* vt = kt + D * ld;
    float* p = vt + D * ld;
    float* ds = p + kRows * ld;
    float* gk = ds + kRows * ld;
    float* gv = gk + L * D;
    float* k = gv + L * D;
    float* delta = k + L * D;
    pack_panels<D>(h.q + h.kv, h.row, L, kt);
    pack_panels<D>(h.q + 2 * h.kv, h.row, L, vt);
    pack_rows<D>(h.q + h.kv, h.row, L, k);
    std::memset(gk, 0, sizeof(float) * 2 * L * D);
    for (int64_t i = 0; i < L; ++i) {
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc += go[i * o_row + d] * o[i * o_row + d];
        delta[i] = acc;
    }
    for (int64_t i0 = 0; i0 < L; i0 += kRows) {
        const int64_t rows = L - i0 < kRows ? L - i0 : kRows, n = i0 + rows;
        const float *q[kRows], *dout[kRows];
        block_rows(h.q, h.row, i0, rows, q);
        block_rows(go, o_row, i0, rows, dout);
        row_products<D>(q, kt, round_panel(n), p, ld);
        row_products<D>(dout, vt, round_panel(n), ds, ld);
        for (int64_t r = 0; r < kRows; ++r) {
            float* pr = p + r * ld;
            float* dr = ds + r * ld;
            const int64_t valid = r < rows ? i0 + r + 1 : 0;
            const float l = valid ? lse[i0 + r] : 0.0f, dl = valid ? delta[i0 + r] : 0.0f;
            for (int64_t j = 0; j < valid; ++j) {
                pr[j] = std::exp(pr[j] * scale - l);
                dr[j] = pr[j] * (dr[j] - dl) * scale;
            }
            for (int64_t j = valid; j < n; ++j) pr[j] = dr[j] = 0.0f;
        }
        rank_update<D>(p, ld, n, dout, gv);
        rank_update<D>(ds, ld, n, q, gk);
        float* gq[kRows];
        float scratch[kRows][D];
        for (int64_t r = 0; r < kRows; ++r) gq[r] = r < rows ? g + (i0 + r) * h.row : scratch[r];
        weighted_rows<D>(ds, ld, n, k, D, gq);
    }
    for (int64_t j = 0; j < L; ++j) {
        std::memcpy(g + j * h.row + h.kv, gk + j * D, sizeof(float) * D);
        std::memcpy(g + j * h.row + 2 * h.kv, gv + j * D, sizeof(float) * D);
    }
}

template <int D>
void forward(const float* qkv, float* out, float* lse, int64_t B, int64_t L, int64_t H, float scale, int64_t threads) {
    gatedformer::parallel_chunks(B * H, threads, 1, [=](int64_t lo, int64_t hi) {
        const FlushDenormals flush;
        std::vector<float> work;
        for (int64_t bh = lo; bh < hi; ++bh) {
            const int64_t b = bh / H, hd = bh % H;
            const Head head{qkv + b * L * 3 * H * D + hd * D, 3 * H * D, H * D};
            forward_head<D>(head, L, scale, out + b * L * H * D + hd * D, H * D, lse ? lse + bh * L : nullptr, work);
        }
    });
}

template <int D>
void backward(const float* qkv, const float* out, const float* grad_out, const float* lse, float* grad_qkv,
              int64_t B, int64_t L, int64_t H, float scale, int64_t threads) {
    gatedformer::parallel_chunks(B * H, threads, 1, [=](int64_t lo, int64_t hi) {
        const FlushDenormals flush;
        std::vector<float> work;
        for (int64_t bh = lo; bh < hi; ++bh) {
            const int64_t b = bh / H, hd = bh % H;
            const int64_t at = b * L * 3 * H * D + hd * D, o_at = b * L * H * D + hd * D;
            const Head head{qkv + at, 3 * H * D, H * D};
            backward_head<D>(head, L, scale, out + o_at, grad_out + o_at, H * D, lse + bh * L, grad_qkv + at, work);
        }
    });
}

}  // namespace

extern "C" {
int attention_forward_f32(const float* qkv, float* out, float* lse, int64_t B, int64_t L, int64_t H, int64_t D,
                          double scale, int64_t threads) {
    if (D % kW) return 1;
    switch (D) {
        case 8: forward<8>(qkv, out, lse, B, L, H, (float)scale, threads); return 0;
        case 16: forward<16>(qkv, out, lse, B, L, H, (float)scale, threads); return 0;
        case 32: forward<32>(qkv, out, lse, B, L, H, (float)scale, threads); return 0;
        case 64: forward<64>(qkv, out, lse, B, L, H, (float)scale, threads); return 0;
        case 128: forward<128>(qkv, out, lse, B, L, H, (float)scale, threads); return 0;
        default: return 1;
    }
}
int attention_backward_f32(const float* qkv, const float* out, const float* grad_out, const float* lse,
                           float* grad_qkv, int64_t B, int64_t L, int64_t H, int64_t D, double scale, int64_t threads) {
    if (D % kW) return 1;
    switch (D) {
        case 8: backward<8>(qkv, out, grad_out, lse, grad_qkv, B, L, H, (float)scale, threads); return 0;
        case 16: backward<16>(qkv, out, grad_out, lse, grad_qkv, B, L, H, (float)scale, threads); return 0;
        case 32: backward<32>(qkv, out, grad_out, lse, grad_qkv, B, L, H, (float)scale, threads); return 0;
        case 64: backward<64>(qkv, out, grad_out, lse, grad_qkv, B, L, H, (float)scale, threads); return 0;
        case 128: backward<128>(qkv, out, grad_out, lse, grad_qkv, B, L, H, (float)scale, threads); return 0;
        default: return 1;
    }
}
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.attention_forward_f32.argtypes = [p, p, p, i, i, i, i, f, i]
    lib.attention_forward_f32.restype = ctypes.c_int
    lib.attention_backward_f32.argtypes = [p, p, p, p, p, i, i, i, i, f, i]
    lib.attention_backward_f32.restype = ctypes.c_int


# -ffast-math is safe here: no infinity or NaN is ever produced on purpose (masked keys are skipped, not
# set to -inf), and it lets exp() vectorise.
KERNEL = NativeKernel(
    "attention", _CPP_SOURCE, _bind, abi_version=1, env_var="GATEDFORMER_ATTENTION_BACKEND",
    description="the compiled causal attention kernel", fallback="scaled_dot_product_attention",
    fast_math=True,
)


def kernel_applies(qkv: Tensor, n_heads: int, dropout: float) -> bool:
    """Whether :func:`causal_attention_packed` runs the compiled kernel for this input."""
    if qkv.device.type != "cpu" or qkv.dtype != torch.float32 or dropout > 0.0 or qkv.dim() != 3:
        return False
    head, rest = divmod(qkv.shape[-1], 3 * n_heads)
    if rest or head not in SUPPORTED_HEAD_SIZES or torch.compiler.is_compiling():
        return False
    return KERNEL.pick_backend(qkv.device) == "native"


class _PackedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, n_heads: int) -> Tensor:  # type: ignore[override]
        batch, length, width = qkv.shape
        head = width // (3 * n_heads)
        qkv = qkv.contiguous()
        out = qkv.new_empty(batch, length, n_heads * head)
        lse = qkv.new_empty(batch, n_heads, length) if ctx.needs_input_grad[0] else None
        failed = KERNEL.library().attention_forward_f32(
            qkv.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(), batch, length, n_heads, head,
            1.0 / math.sqrt(head), kernel_threads(qkv.numel()),
        )
        if failed:
            raise RuntimeError(f"the attention kernel does not take heads of {head}")
        if lse is not None:
            ctx.save_for_backward(qkv, out, lse)
        ctx.n_heads = n_heads
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        qkv, out, lse = ctx.saved_tensors
        batch, length, width = qkv.shape
        head = width // (3 * ctx.n_heads)
        grad_out = grad_out.contiguous()
        grad_qkv = torch.empty_like(qkv)
        failed = KERNEL.library().attention_backward_f32(
            qkv.data_ptr(), out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(), grad_qkv.data_ptr(),
            batch, length, ctx.n_heads, head, 1.0 / math.sqrt(head), kernel_threads(qkv.numel()),
        )
        if failed:
            raise RuntimeError(f"the attention kernel does not take heads of {head}")
        return grad_qkv, None


def causal_attention_reference(qkv: Tensor, n_heads: int, dropout: float = 0.0) -> Tensor:
    """``(B, L, 3·H·D)`` packed projections -> ``(B, L, H·D)`` causal attention, by
    ``scaled_dot_product_attention``."""
    batch, length, width = qkv.shape
    # (B, L, 3, H, D) split on dim 2, heads moved by transposed views: the backward pass then writes the
    # three gradients straight into the (B, L, 3d) layout of the projection, with no permuted copy.
    q, k, v = (t.transpose(1, 2) for t in qkv.view(batch, length, 3, n_heads, -1).unbind(2))
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
    return attended.transpose(1, 2).reshape(batch, length, width // 3)


def causal_attention_packed(qkv: Tensor, n_heads: int, dropout: float = 0.0) -> Tensor:
    """Causal attention of packed ``(B, L, 3·H·D)`` projections (Q, K, V in that order), ``(B, L, H·D)`` out.

    The compiled kernel where :func:`kernel_applies`, else :func:`causal_attention_reference`.
    """
    if kernel_applies(qkv, n_heads, dropout):
        return _PackedCausalAttention.apply(qkv, n_heads)
    return causal_attention_reference(qkv, n_heads, dropout)
