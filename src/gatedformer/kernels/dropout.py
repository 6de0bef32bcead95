"""Dropout masks from a counter-based generator, drawn and applied in one pass by a small C++ kernel.

Every mask element is a 32-bit uniform word of Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
random numbers: as easy as 1, 2, 3", SC 2011; the generator behind cuRAND and PyTorch's CUDA dropout)
under a 64-bit key, the *seed*: element ``i`` lies in tile ``t = i // 32`` at ``j = i % 32`` and reads
word ``j // 8`` of the block whose counter is ``(8t + j % 8, 0, 0)`` (the 64-bit block number in the first
two words). An element is kept when its word is below ``keep_below`` (``2**32`` times the keep
probability), so a mask is a pure function of the seed and the element's index:

* the backward pass regenerates the mask instead of storing it (plain dropout saves nothing);
* the threads of a call may split the elements any way they like and still draw the same mask;
* the vectorised kernel (AVX2: eight blocks at once, AVX-512: sixteen) and :func:`philox_words`, the NumPy
  reference the tests check it against, give identical masks;
* other kernels that include :data:`PHILOX_CPP` (the fused linear epilogues of
  :mod:`gatedformer.kernels.epilogue`) draw the very same masks.

``GATEDFORMER_DROPOUT_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the default). Without the kernel
the functions here compute the same masks with the NumPy reference (several times slower), and
:mod:`gatedformer.ops.dropout` uses PyTorch's own dropout instead.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor

from gatedformer.kernels.build import HEAVY_ELEMENT, NativeKernel, kernel_threads

__all__ = ["KERNEL", "PHILOX_CPP", "apply_dropout", "apply_dropout_add", "apply_relu_dropout", "keep_word",
           "philox4x32_10", "philox_words", "scale_where_positive"]

_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_LANES = 8
_TILE = 4 * _LANES

PHILOX_CPP = r"""
// Philox4x32-10 mask words; see gatedformer/backbones/_dropout_kernel.py for the layout. It opens an
// anonymous namespace that the source after it closes. Generated and compiled by gatedformer.
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kStep0 = 0x9E3779B9u, kStep1 = 0xBB67AE85u;
constexpr int64_t kLanes = 8, kTile = 4 * kLanes;

// An element is kept where its mask word is below keep_below (the number of the 2^32 words that keep it), that is
// where word <= keep_below - 1: in 32 bits a keep_below of 0 stands for 2^32, every element kept (p = 0).
inline uint32_t last_kept(uint32_t keep_below) { return keep_below - 1u; }

// The 32 words of tile `tile`: words[e * 8 + l] is word e of Philox4x32-10 at counter (8 tile + l, 0, 0).
#if defined(__AVX2__)
inline void mulhilo(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
    const __m256i even = _mm256_mul_epu32(a, m);                        // 64-bit products of lanes 0, 2, 4, 6
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // and of lanes 1, 3, 5, 7
    lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

inline void tile_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    const uint64_t first = tile * kLanes;  // a multiple of 8: the tile's blocks share their high word
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i c1 = _mm256_set1_epi32((int)(uint32_t)(first >> 32));
    __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
    const __m256i m0 = _mm256_set1_epi32((int)kM0), m1 = _mm256_set1_epi32((int)kM1);
    for (int round = 0; round < 10; ++round) {
        __m256i hi0, lo0, hi1, lo1;
        mulhilo(c0, m0, hi0, lo0);
        mulhilo(c2, m1, hi1, lo1);
        const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c1 = lo1; c3 = lo0; c0 = n0; c2 = n2;
        k0 += kStep0; k1 += kStep1;
    }
    _mm256_storeu_si256((__m256i*)(words + 0), c0);
    _mm256_storeu_si256((__m256i*)(words + 8), c1);
    _mm256_storeu_si256((__m256i*)(words + 16), c2);
    _mm256_storeu_si256((__m256i*)(words + 24), c3);
}
#else
inline void tile_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    for (int64_t l = 0; l < kLanes; ++l) {
        const uint64_t block = tile * kLanes + l;
        uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32), c2 = 0, c3 = 0, a = k0, b = k1;
        for (int round = 0; round < 10; ++round) {
            const uint64_t p0 = (uint64_t)kM0 * c0, p1 = (uint64_t)kM1 * c2;
            const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ a, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ b;
            c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
            a += kStep0; b += kStep1;
        }
        words[l] = c0; words[8 + l] = c1; words[16 + l] = c2; words[24 + l] = c3;
    }
}
#endif

#if defined(__AVX512F__)
// Sixteen blocks at once: the words of tiles `tile` (even) and `tile + 1`, one after the other.
constexpr int64_t kTilesPerDraw = 2;

inline void mulhilo(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
    const __m512i even = _mm512_mul_epu32(a, m);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// Chains x 16 blocks: tiles tile .. tile + 2 Chains - 1 (tile even), words[32 t + 8 e + l] word e of block l of
// tile + t. The chains are independent, so their rounds overlap: one chain alone waits on its multiplies.
template <int Chains>
inline void draw_chains(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    __m512i c0[Chains], c1[Chains], c2[Chains], c3[Chains];
    for (int q = 0; q < Chains; ++q) {
        const uint64_t first = (tile + 2 * q) * kLanes;  // a multiple of 16: the sixteen blocks share their high word
        c0[q] = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)first),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        c1[q] = _mm512_set1_epi32((int)(uint32_t)(first >> 32));
        c2[q] = c3[q] = _mm512_setzero_si512();
    }
    const __m512i m0 = _mm512_set1_epi32((int)kM0), m1 = _mm512_set1_epi32((int)kM1);
    for (int round = 0; round < 10; ++round) {
        const __m512i a = _mm512_set1_epi32((int)k0), b = _mm512_set1_epi32((int)k1);
        for (int q = 0; q < Chains; ++q) {
            __m512i hi0, lo0, hi1, lo1;
            mulhilo(c0[q], m0, hi0, lo0);
            mulhilo(c2[q], m1, hi1, lo1);
            const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[q]), a);
            const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[q]), b);
            c1[q] = lo1; c3[q] = lo0; c0[q] = n0; c2[q] = n2;
        }
        k0 += kStep0; k1 += kStep1;
    }
    for (int q = 0; q < Chains; ++q) {
        const __m512i c[4] = {c0[q], c1[q], c2[q], c3[q]};
        uint32_t* out = words + 2 * kTile * q;
        for (int e = 0; e < 4; ++e) {
            _mm256_storeu_si256((__m256i*)(out + 8 * e), _mm512_castsi512_si256(c[e]));
            _mm256_storeu_si256((__m256i*)(out + kTile + 8 * e), _mm512_extracti64x4_epi64(c[e], 1));
        }
    }
}

inline void draw_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    draw_chains<1>(tile, k0, k1, words);
}
// Bulk draws for the long masks: twice the words, two chains.
constexpr int64_t kDrawsPerBulk = 2;
inline void draw_bulk(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    draw_chains<2>(tile, k0, k1, words);
}
#else
constexpr int64_t kTilesPerDraw = 1;

inline void draw_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) { tile_words(tile, k0, k1, words); }
constexpr int64_t kDrawsPerBulk = 1;
inline void draw_bulk(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) { tile_words(tile, k0, k1, words); }
#endif
constexpr int64_t kDraw = kTilesPerDraw * kTile;  // words drawn at once
constexpr int64_t kBulk = kDrawsPerBulk * kDraw;  // words of draw_bulk, whose tile must be a multiple of kBulk / kTile
"""
"""The C++ of the mask generator, shared by the kernels that draw dropout masks (this one and
:mod:`gatedformer.kernels.epilogue`)."""

_CPP_SOURCE = PHILOX_CPP + r"""
// Dropout with Philox4x32-10 masks.

// y[i] = base[i] + x[i] * factor(i), with factor = scale where the mask keeps i (and x[i] > 0 for the
// relu form) and 0 elsewhere; without `base` there is no addition. A product rather than a select, so that
// NaN and inf inputs propagate as they would through a mask product.
// One draw's worth of masked_scale; a function of its own so that the restrict qualifiers hold (inside the
// threads' lambda GCC drops them and leaves the loop scalar).
template <typename T, bool ReluToo>
inline void masked_scale_run(const T* __restrict base, const T* __restrict x, T* __restrict y,
                             const uint32_t* __restrict words, int64_t m, uint32_t keep_below, T scale) {
    const uint32_t last = last_kept(keep_below);
    if (base != nullptr) {
        for (int64_t j = 0; j < m; ++j) y[j] = base[j] + x[j] * (words[j] <= last ? scale : T(0));
        return;
    }
    for (int64_t j = 0; j < m; ++j) {
        const bool keep = words[j] <= last && (!ReluToo || x[j] > T(0));
        y[j] = x[j] * (keep ? scale : T(0));
    }
}

template <typename T, bool ReluToo>
void masked_scale(const T* base, const T* x, T* y, int64_t n, uint64_t seed, uint32_t keep_below, T scale,
                  int64_t threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    gatedformer::parallel_chunks(n, threads, kBulk, [=](int64_t lo, int64_t hi) {
        alignas(64) uint32_t words[kBulk];
        for (int64_t start = lo; start < hi; start += kBulk) {  // chunks start at multiples of kBulk
            draw_bulk((uint64_t)start / kTile, k0, k1, words);
            const int64_t m = hi - start < kBulk ? hi - start : kBulk;
            masked_scale_run<T, ReluToo>(base != nullptr ? base + start : nullptr, x + start, y + start, words, m,
                                         keep_below, scale);
        }
    });
}

// g_in[i] = g[i] * scale where y[i] > 0, else 0: the backward pass of relu-then-dropout from its output.
template <typename T>
void positive_scale(const T* y, const T* g, T* out, int64_t n, T scale, int64_t threads) {
    gatedformer::parallel_chunks(n, threads, kTile, [=](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) out[i] = g[i] * (y[i] > T(0) ? scale : T(0));
    });
}

// One row segment of embed_dropout: y = (e * scale + pos) * factor, pos and the mask words optional.
inline void embed_run(const float* __restrict e, const float* __restrict pos, float* __restrict y,
                      const uint32_t* __restrict words, int64_t m, float scale, uint32_t keep_below,
                      float drop_scale) {
    const uint32_t last = last_kept(keep_below);
    if (pos != nullptr && words != nullptr) {
        for (int64_t j = 0; j < m; ++j) y[j] = (e[j] * scale + pos[j]) * (words[j] <= last ? drop_scale : 0.0f);
    } else if (pos != nullptr) {
        for (int64_t j = 0; j < m; ++j) y[j] = e[j] * scale + pos[j];
    } else if (words != nullptr) {
        for (int64_t j = 0; j < m; ++j) y[j] = (e[j] * scale) * (words[j] <= last ? drop_scale : 0.0f);
    } else {
        for (int64_t j = 0; j < m; ++j) y[j] = e[j] * scale;
    }
}

// out[r, c] = (table[tokens[r], c] * scale + positions[r % length, c]) * factor(r d + c): a scaled embedding
// look-up, positions (or none) and dropout (or none: dropout false) in one pass over the rows, each element with
// the mask word that dropout_f32 would give it. Returns the number of tokens outside [0, vocab) (nothing written).
int64_t embed_dropout(const float* table, const int64_t* tokens, const float* positions, float* out, int64_t rows,
                      int64_t d, int64_t vocab, int64_t length, float scale, bool dropout, uint64_t seed,
                      uint32_t keep_below, float drop_scale, int64_t threads) {
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r) bad += tokens[r] < 0 || tokens[r] >= vocab;
    if (bad != 0) return bad;
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    gatedformer::parallel_chunks(rows * d, threads, kBulk, [=](int64_t lo, int64_t hi) {
        alignas(64) uint32_t words[kBulk];
        for (int64_t start = lo; start < hi; start += kBulk) {  // chunks start at multiples of kBulk
            const int64_t end = hi - start < kBulk ? hi : start + kBulk;
            if (dropout) draw_bulk((uint64_t)start / kTile, k0, k1, words);
            for (int64_t p = start; p < end;) {  // the row segments of this draw
                const int64_t r = p / d, c = p - r * d, m = end - p < d - c ? end - p : d - c;
                embed_run(table + tokens[r] * d + c, positions != nullptr ? positions + (r % length) * d + c : nullptr,
                          out + p, dropout ? words + (p - start) : nullptr, m, scale, keep_below, drop_scale);
                p += m;
            }
        }
    });
    return 0;
}

// Its backward pass: grad_table[tokens[r], c] += grad[r, c] * factor(r d + c) * scale. The threads split the
// columns (in whole draws where d allows), so that no two of them add into the same element; each draws the words
// of its own columns again.
void embed_dropout_backward(const float* grad, const int64_t* tokens, float* grad_table, int64_t rows, int64_t d,
                            float scale, bool dropout, uint64_t seed, uint32_t keep_below, float drop_scale,
                            int64_t threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32), last = last_kept(keep_below);
    gatedformer::parallel_chunks(d, threads, kDraw, [=](int64_t c0, int64_t c1) {
        alignas(64) uint32_t words[kDraw];
        for (int64_t r = 0; r < rows; ++r) {
            const float* __restrict g = grad + r * d;
            float* __restrict t = grad_table + tokens[r] * d;
            if (!dropout) {
                for (int64_t c = c0; c < c1; ++c) t[c] += g[c] * scale;
                continue;
            }
            for (int64_t p = r * d + c0, end = r * d + c1; p < end;) {
                const int64_t base = p / kDraw * kDraw, stop = end < base + kDraw ? end : base + kDraw;
                draw_words((uint64_t)base / kTile, k0, k1, words);
                for (int64_t q = p; q < stop; ++q)
                    t[q - r * d] += (g[q - r * d] * (words[q - base] <= last ? drop_scale : 0.0f)) * scale;
                p = stop;
            }
        }
    });
}

}  // namespace

extern "C" {
int64_t embed_dropout_f32(const float* table, const int64_t* tokens, const float* positions, float* out,
                          int64_t rows, int64_t d, int64_t vocab, int64_t length, double scale, int64_t dropout,
                          uint64_t seed, uint32_t keep_below, double drop_scale, int64_t threads) {
    return embed_dropout(table, tokens, positions, out, rows, d, vocab, length, (float)scale, dropout != 0, seed,
                         keep_below, (float)drop_scale, threads);
}
void embed_dropout_backward_f32(const float* grad, const int64_t* tokens, float* grad_table, int64_t rows, int64_t d,
                                double scale, int64_t dropout, uint64_t seed, uint32_t keep_below, double drop_scale,
                                int64_t threads) {
    embed_dropout_backward(grad, tokens, grad_table, rows, d, (float)scale, dropout != 0, seed, keep_below,
                           (float)drop_scale, threads);
}
#define DROPOUT_DEFINE(T, SUFFIX)                                                                           \
    void dropout_##SUFFIX(const T* x, T* y, int64_t n, uint64_t seed, uint32_t keep_below, double scale,    \
                          int64_t threads) {                                                                \
        masked_scale<T, false>(nullptr, x, y, n, seed, keep_below, (T)scale, threads);                      \
    }                                                                                                       \
    void dropout_add_##SUFFIX(const T* base, const T* x, T* y, int64_t n, uint64_t seed, uint32_t keep_below, \
                              double scale, int64_t threads) {                                              \
        masked_scale<T, false>(base, x, y, n, seed, keep_below, (T)scale, threads);                         \
    }                                                                                                       \
    void relu_dropout_##SUFFIX(const T* x, T* y, int64_t n, uint64_t seed, uint32_t keep_below, double scale, \
                               int64_t threads) {                                                           \
        masked_scale<T, true>(nullptr, x, y, n, seed, keep_below, (T)scale, threads);                       \
    }                                                                                                       \
    void positive_scale_##SUFFIX(const T* y, const T* g, T* out, int64_t n, double scale, int64_t threads) { \
        positive_scale<T>(y, g, out, n, (T)scale, threads);                                                 \
    }
DROPOUT_DEFINE(float, f32)
DROPOUT_DEFINE(double, f64)
void dropout_tile_words(uint64_t tile, uint64_t seed, uint32_t* words) {
    tile_words(tile, (uint32_t)seed, (uint32_t)(seed >> 32), words);
}
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    p, i, u64, u32, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_double
    for suffix in ("f32", "f64"):
        for name in ("dropout", "relu_dropout"):
            getattr(lib, f"{name}_{suffix}").argtypes = [p, p, i, u64, u32, f, i]
            getattr(lib, f"{name}_{suffix}").restype = None
        getattr(lib, f"dropout_add_{suffix}").argtypes = [p, p, p, i, u64, u32, f, i]
        getattr(lib, f"dropout_add_{suffix}").restype = None
        getattr(lib, f"positive_scale_{suffix}").argtypes = [p, p, p, i, f, i]
        getattr(lib, f"positive_scale_{suffix}").restype = None
    lib.dropout_tile_words.argtypes = [u64, u64, p]
    lib.dropout_tile_words.restype = None
    lib.embed_dropout_f32.argtypes = [p, p, p, p, i, i, i, i, f, i, u64, u32, f, i]
    lib.embed_dropout_f32.restype = i
    lib.embed_dropout_backward_f32.argtypes = [p, p, p, i, i, f, i, u64, u32, f, i]
    lib.embed_dropout_backward_f32.restype = None


_NO_FMA = ("-ffp-contract=off",)
"""No fused multiply-add, so that ``base + x * scale`` rounds as PyTorch's two operations do."""

KERNEL = NativeKernel(
    "dropout", _CPP_SOURCE, _bind, abi_version=9, env_var="GATEDFORMER_DROPOUT_BACKEND",
    description="the compiled dropout kernel", fallback="PyTorch's own dropout",
    # No fused multiply-add, so that ``base + x * scale`` rounds as PyTorch's two operations do.
    extra_cflags=_NO_FMA, avx512=True,
)

_NATIVE_DTYPES = {torch.float32: "f32", torch.float64: "f64"}


# ---- the NumPy reference ---------------------------------------------------------------------------


def philox4x32_10(counter: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                  key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of each counter (four arrays of 32-bit words) under ``key`` (two 32-bit words)."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.uint64(k) for k in key)
    m0, m1 = (np.uint64(m) for m in _MULTIPLIERS)
    s0, s1 = (np.uint64(s) for s in _KEY_STEPS)
    for _ in range(10):
        p0, p1 = c0 * m0, c2 * m1  # < 2**64: no wrap-around
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + s0) & mask, (k1 + s1) & mask
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def philox_words(count: int, seed: int, start: int = 0) -> np.ndarray:
    """The uniform 32-bit words of elements ``start .. start + count - 1`` under ``seed``, in element order."""
    first_tile, end_tile = start // _TILE, -(-(start + count) // _TILE)
    blocks = np.arange(first_tile * _LANES, end_tile * _LANES, dtype=np.uint64)
    zeros = np.zeros_like(blocks)
    words = philox4x32_10((blocks & np.uint64(0xFFFFFFFF), blocks >> np.uint64(32), zeros, zeros),
                          (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    # (4 words, tiles, 8 lanes) -> tile-major, then word-major within a tile.
    flat = np.stack(words).reshape(4, end_tile - first_tile, _LANES).transpose(1, 0, 2).reshape(-1)
    offset = start - first_tile * _TILE
    return flat[offset:offset + count]


# ---- the operations (contiguous CPU tensors) --------------------------------------------------------


def keep_word(keep_below: int) -> int:
    """``keep_below`` as the kernels' 32-bit argument: ``2**32`` (``p`` 0, every element kept) becomes 0, which they
    read as ``2**32`` (see ``last_kept`` in :data:`PHILOX_CPP`)."""
    return keep_below % 2 ** 32


def _native_ok(x: Tensor) -> bool:
    return x.dtype in _NATIVE_DTYPES and KERNEL.pick_backend(x.device) == "native"


def _reference_keep(x: Tensor, seed: int, keep_below: int) -> Tensor:
    return torch.from_numpy(philox_words(x.numel(), seed).astype(np.int64) < keep_below).view(x.shape)


def apply_dropout(x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``x`` times the mask of ``seed`` (``scale`` where kept, 0 elsewhere); ``x`` contiguous on the CPU."""
    if _native_ok(x):
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"dropout_{_NATIVE_DTYPES[x.dtype]}")
        fn(x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_word(keep_below), scale,
           kernel_threads(x.numel(), cost=HEAVY_ELEMENT))
        return out
    return x * _reference_keep(x, seed, keep_below).to(x.dtype).mul_(scale)


def apply_dropout_add(base: Tensor, x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``base + apply_dropout(x, ...)`` in one pass; both contiguous on the CPU, of one shape and dtype."""
    if _native_ok(x) and base.dtype == x.dtype:
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"dropout_add_{_NATIVE_DTYPES[x.dtype]}")
        fn(base.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_word(keep_below), scale,
           kernel_threads(x.numel(), cost=HEAVY_ELEMENT))
        return out
    return base + x * _reference_keep(x, seed, keep_below).to(x.dtype).mul_(scale)


def apply_relu_dropout(x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``relu(x)`` times the mask of ``seed``, in one pass; ``x`` contiguous on the CPU."""
    if _native_ok(x):
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"relu_dropout_{_NATIVE_DTYPES[x.dtype]}")
        fn(x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_word(keep_below), scale,
           kernel_threads(x.numel(), cost=HEAVY_ELEMENT))
        return out
    return x * (_reference_keep(x, seed, keep_below) & (x > 0)).to(x.dtype).mul_(scale)


def scale_where_positive(y: Tensor, grad: Tensor, scale: float) -> Tensor:
    """``grad * scale`` where ``y > 0``, else 0: the gradient of relu-then-dropout, read from its output."""
    if _native_ok(y) and grad.dtype == y.dtype:
        grad = grad.contiguous()
        out = torch.empty_like(y)
        fn = getattr(KERNEL.library(), f"positive_scale_{_NATIVE_DTYPES[y.dtype]}")
        fn(y.data_ptr(), grad.data_ptr(), out.data_ptr(), y.numel(), scale, kernel_threads(y.numel()))
        return out
    return grad * (y > 0).to(grad.dtype).mul_(scale)


def embed_dropout(table: Tensor, tokens: Tensor, positions: Tensor | None, scale: float,
                  mask: tuple[int, int, float] | None) -> Tensor:
    """``(table[tokens] * scale + positions)`` times the mask ``(seed, keep_below, drop scale)`` (none: no dropout)
    in one pass, the mask :func:`apply_dropout` would give the sum. ``table`` ``(V, d)`` and ``positions``
    ``(L, d)`` contiguous float32, ``tokens`` ``(..., L)`` contiguous int64; needs the compiled kernel."""
    vocab, width = table.shape
    length = tokens.shape[-1]
    out = table.new_empty(*tokens.shape, width)
    seed, keep_below, drop_scale = mask or (0, 0, 1.0)
    bad = KERNEL.library().embed_dropout_f32(
        table.data_ptr(), tokens.data_ptr(), None if positions is None else positions.data_ptr(), out.data_ptr(),
        tokens.numel(), width, vocab, length, scale, mask is not None, seed, keep_below, drop_scale,
        kernel_threads(out.numel()))
    if bad:
        raise IndexError(f"index out of range in self: {bad} token ids outside [0, {vocab}) for an embedding of "
                         f"{vocab} rows")
    return out


def embed_dropout_backward(grad: Tensor, tokens: Tensor, vocab: int, scale: float,
                           mask: tuple[int, int, float] | None) -> Tensor:
    """The table's gradient for :func:`embed_dropout`'s output gradient ``grad`` (contiguous float32)."""
    width = grad.shape[-1]
    grad_table = grad.new_zeros(vocab, width)
    seed, keep_below, drop_scale = mask or (0, 0, 1.0)
    KERNEL.library().embed_dropout_backward_f32(
        grad.data_ptr(), tokens.data_ptr(), grad_table.data_ptr(), tokens.numel(), width, scale, mask is not None,
        seed, keep_below, drop_scale, kernel_threads(grad.numel()))
    return grad_table
