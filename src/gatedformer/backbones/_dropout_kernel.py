"""Dropout masks from a counter-based generator, drawn and applied in one pass by a small C++ kernel.

Every mask element is a 32-bit uniform word of Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
random numbers: as easy as 1, 2, 3", SC 2011; the generator behind cuRAND and PyTorch's CUDA dropout)
under a 64-bit key, the *seed*: element ``i`` lies in tile ``t = i // 32`` at ``j = i % 32`` and reads
word ``j // 8`` of the block whose counter is ``(8t + j % 8, 0, 0)`` (the 64-bit block number in the first
two words). An element is kept when its word is below ``keep_below`` (``2**32`` times the keep
probability), so a mask is a pure function of the seed and the element's index:

* the backward pass regenerates the mask instead of storing it (plain dropout saves nothing);
* the threads of a call may split the elements any way they like and still draw the same mask;
* the vectorised kernel (AVX2: eight blocks at once, AVX-512: sixteen) and :func:`philox_words`, the NumPy reference the
  tests check it against, give identical masks.

``GATEDFORMER_DROPOUT_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the default). Without the kernel
the functions here compute the same masks with the NumPy reference (several times slower), and
:mod:`gatedformer.backbones.dropout` uses PyTorch's own dropout instead.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor

from gatedformer.backbones._native import NativeKernel, kernel_threads

__all__ = ["KERNEL", "apply_dropout", "apply_dropout_add", "apply_relu_dropout", "bias_dropout_add_",
           "bias_relu_dropout_", "dropout_add_norm", "dropout_add_norm_backward", "philox4x32_10", "philox_words",
           "scale_where_positive", "scale_where_positive_with_sums"]

_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_LANES = 8
_TILE = 4 * _LANES

_CPP_SOURCE = r"""
// Dropout with Philox4x32-10 masks; see gatedformer/backbones/_dropout_kernel.py for the layout.
// Generated and compiled by gatedformer.
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kStep0 = 0x9E3779B9u, kStep1 = 0xBB67AE85u;
constexpr int64_t kLanes = 8, kTile = 4 * kLanes;

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

inline void draw_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    const uint64_t first = tile * kLanes;  // a multiple of 16: the sixteen blocks share their high word
    __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)first),
                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i c1 = _mm512_set1_epi32((int)(uint32_t)(first >> 32));
    __m512i c2 = _mm512_setzero_si512(), c3 = _mm512_setzero_si512();
    const __m512i m0 = _mm512_set1_epi32((int)kM0), m1 = _mm512_set1_epi32((int)kM1);
    for (int round = 0; round < 10; ++round) {
        __m512i hi0, lo0, hi1, lo1;
        mulhilo(c0, m0, hi0, lo0);
        mulhilo(c2, m1, hi1, lo1);
        const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32((int)k0));
        const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32((int)k1));
        c1 = lo1; c3 = lo0; c0 = n0; c2 = n2;
        k0 += kStep0; k1 += kStep1;
    }
    const __m512i c[4] = {c0, c1, c2, c3};
    for (int e = 0; e < 4; ++e) {
        _mm256_storeu_si256((__m256i*)(words + 8 * e), _mm512_castsi512_si256(c[e]));
        _mm256_storeu_si256((__m256i*)(words + kTile + 8 * e), _mm512_extracti64x4_epi64(c[e], 1));
    }
}
#else
constexpr int64_t kTilesPerDraw = 1;

inline void draw_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) { tile_words(tile, k0, k1, words); }
#endif
constexpr int64_t kDraw = kTilesPerDraw * kTile;  // words drawn at once

// y[i] = base[i] + x[i] * factor(i), with factor = scale where the mask keeps i (and x[i] > 0 for the
// relu form) and 0 elsewhere; without `base` there is no addition. A product rather than a select, so that
// NaN and inf inputs propagate as they would through a mask product.
template <typename T, bool ReluToo>
void masked_scale(const T* base, const T* x, T* y, int64_t n, uint64_t seed, uint32_t keep_below, T scale,
                  int64_t threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    gatedformer::parallel_chunks(n, threads, kDraw, [=](int64_t lo, int64_t hi) {
        alignas(64) uint32_t words[kDraw];
        for (int64_t start = lo; start < hi; start += kDraw) {  // chunks start at multiples of kDraw
            draw_words((uint64_t)start / kTile, k0, k1, words);
            const int64_t m = hi - start < kDraw ? hi - start : kDraw;
            const T* xs = x + start;
            T* ys = y + start;
            if (base != nullptr) {
                const T* bs = base + start;
                for (int64_t j = 0; j < m; ++j) ys[j] = bs[j] + xs[j] * (words[j] < keep_below ? scale : T(0));
            } else {
                for (int64_t j = 0; j < m; ++j) {
                    const bool keep = words[j] < keep_below && (!ReluToo || xs[j] > T(0));
                    ys[j] = xs[j] * (keep ? scale : T(0));
                }
            }
        }
    });
}

// The epilogue of a linear layer, in place on its product h (rows of `cols`): h[i] = f(h[i] + bias[i % cols])
// times the mask, plus base[i] when there is a base (a residual connection); f is the ReLU or the identity.
// Bit k set where x[k] > 0, for k < count <= 32.
inline uint32_t positive_bits(const float* x, int64_t count) {
    if (count == 32) {
#if defined(__AVX512F__)
        const __m512 zero = _mm512_setzero_ps();
        return (uint32_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(x), zero, _CMP_GT_OQ)
             | (uint32_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(x + 16), zero, _CMP_GT_OQ) << 16;
#elif defined(__AVX2__)
        const __m256 zero = _mm256_setzero_ps();
        uint32_t bits = 0;
        for (int q = 0; q < 4; ++q) {
            const __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(x + 8 * q), zero, _CMP_GT_OQ);
            bits |= (uint32_t)_mm256_movemask_ps(above) << (8 * q);
        }
        return bits;
#endif
    }
    uint32_t bits = 0;
    for (int64_t k = 0; k < count; ++k) bits |= (uint32_t)(x[k] > 0.0f) << k;
    return bits;
}

// With `positive`, bit i % 32 of positive[i / 32] is set where the result is > 0 (what the backward pass of
// the ReLU form needs, 32 times smaller than the result).
template <bool ReluToo>
void bias_epilogue(const float* base, float* h, const float* bias, int64_t n, int64_t cols, uint64_t seed,
                   uint32_t keep_below, float scale, int64_t threads, uint32_t* positive = nullptr) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    gatedformer::parallel_chunks(n, threads, kDraw, [=](int64_t lo, int64_t hi) {
        alignas(64) uint32_t words[kDraw];
        int64_t col = lo % cols;
        for (int64_t start = lo; start < hi; start += kDraw) {
            draw_words((uint64_t)start / kTile, k0, k1, words);
            const int64_t m = hi - start < kDraw ? hi - start : kDraw;
            for (int64_t j = 0; j < m;) {  // runs of one row, so that the bias is read contiguously
                const int64_t run = m - j < cols - col ? m - j : cols - col;
                float* hs = h + start + j;
                const float* bs = bias + col;
                const uint32_t* ws = words + j;
                if (base != nullptr) {
                    const float* as = base + start + j;
                    for (int64_t k = 0; k < run; ++k)
                        hs[k] = as[k] + (hs[k] + bs[k]) * (ws[k] < keep_below ? scale : 0.0f);
                } else {
                    for (int64_t k = 0; k < run; ++k) {
                        const float v = hs[k] + bs[k];
                        const bool keep = ws[k] < keep_below && (!ReluToo || v > 0.0f);
                        hs[k] = v * (keep ? scale : 0.0f);
                    }
                }
                j += run;
                col = col + run == cols ? 0 : col + run;
            }
            if (positive != nullptr)  // draws start at multiples of 32: each word is one thread's
                for (int64_t w = 0; w * 32 < m; ++w)
                    positive[(start >> 5) + w] = positive_bits(h + start + 32 * w, m - 32 * w < 32 ? m - 32 * w : 32);
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

// out = g * scale where the bit of element i in `positive` is set (else 0), on rows of `cols`, also summing each
// column of out into colsum (the gradient of a bias before the ReLU). Rows are summed in fixed blocks, then the
// blocks in order: the same sums whatever the number of threads.
constexpr int64_t kSumRows = 64;
typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t v16u __attribute__((vector_size(64)));
constexpr v16u kLaneBits = {1u << 0, 1u << 1, 1u << 2, 1u << 3, 1u << 4, 1u << 5, 1u << 6, 1u << 7,
                            1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};

void positive_scale_colsum(const uint32_t* positive, const float* g, float* out, float* colsum, int64_t rows,
                           int64_t cols, float scale, int64_t threads) {
    const int64_t blocks = (rows + kSumRows - 1) / kSumRows;
    std::vector<float> partial(blocks * cols, 0.0f);
    float* partials = partial.data();
    gatedformer::parallel_chunks(blocks, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
            float* acc = partials + b * cols;
            const int64_t end = (b + 1) * kSumRows < rows ? (b + 1) * kSumRows : rows;
            for (int64_t r = b * kSumRows; r < end; ++r) {
                const float* gr = g + r * cols;
                float* orow = out + r * cols;
                const int64_t first = r * cols;
                int64_t c = 0;
                if (first % 16 == 0)  // whole words' halves: sixteen lanes test their bits at once
                    for (; c + 16 <= cols; c += 16) {
                        const uint32_t half = positive[(first + c) >> 5] >> ((first + c) & 16);
                        const v16u set = (v16u{} + half) & kLaneBits;
                        const v16f v = set != 0 ? *reinterpret_cast<const v16f*>(gr + c) * scale : v16f{};
                        *reinterpret_cast<v16f*>(orow + c) = v;
                        *reinterpret_cast<v16f*>(acc + c) += v;
                    }
                for (; c < cols; ++c) {
                    const int64_t i = first + c;
                    const float v = gr[c] * ((positive[i >> 5] >> (i & 31)) & 1u ? scale : 0.0f);
                    orow[c] = v;
                    acc[c] += v;
                }
            }
        }
    });
    for (int64_t c = 0; c < cols; ++c) colsum[c] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t c = 0; c < cols; ++c) colsum[c] += partials[b * cols + c];
}

// The mask words of elements first .. first + count - 1 into out[0 .. count).
inline void range_words(uint64_t first, int64_t count, uint32_t k0, uint32_t k1, uint32_t* out) {
    alignas(64) uint32_t words[kDraw];
    uint64_t at = first / kDraw * kDraw;  // draws start at multiples of kDraw (what draw_words takes)
    for (int64_t written = 0; written < count; at += kDraw) {
        draw_words(at / kTile, k0, k1, words);
        const int64_t skip = (int64_t)(first + written - at);
        const int64_t take = kDraw - skip < count - written ? kDraw - skip : count - written;
        for (int64_t k = 0; k < take; ++k) out[written + k] = words[skip + k];
        written += take;
    }
}

// Vector pieces of the row kernels below: 16 lanes (one AVX-512 register, two AVX2 ones). Sums keep 16
// partial sums and add them up in a fixed order, so results do not depend on the threads.
inline v16f load16(const float* p) { return *reinterpret_cast<const v16f*>(p); }
inline void store16(float* p, v16f x) { *reinterpret_cast<v16f*>(p) = x; }
inline float lanes_sum(v16f x) {
    float total = 0.0f;
    for (int k = 0; k < 16; ++k) total += x[k];
    return total;
}
inline v16f keep_factor(const uint32_t* words, uint32_t keep_below, float scale) {
    v16u w;
    for (int k = 0; k < 16; ++k) w[k] = words[k];
    return w < (v16u{} + keep_below) ? v16f{} + scale : v16f{};
}

// Bit k set where words[k] < keep_below, for k < count <= 32.
inline uint32_t keep_bits32(const uint32_t* words, int64_t count, uint32_t keep_below) {
#if defined(__AVX512F__)
    if (count == 32) {
        const __m512i limit = _mm512_set1_epi32((int)keep_below);
        return (uint32_t)_mm512_cmplt_epu32_mask(_mm512_loadu_si512(words), limit)
             | (uint32_t)_mm512_cmplt_epu32_mask(_mm512_loadu_si512(words + 16), limit) << 16;
    }
#endif
    uint32_t bits = 0;
    for (int64_t k = 0; k < count; ++k) bits |= (uint32_t)(words[k] < keep_below) << k;
    return bits;
}

// A post-LN residual sublayer's tail, row by row (rows of `cols`): v = base + (h + bias) * mask, then
// y = (v - mean) * rstd * gamma + beta with rstd = 1 / sqrt(var + eps). xhat (which may be h itself) gets the
// normalised rows (v - mean) * rstd, rstd is kept per row, and the mask as bits (row r's element c at bit c % 32 of
// keep_bits[r * row_words(cols) + c / 32]): what the backward pass needs, without drawing the mask again.
inline int64_t row_words(int64_t cols) { return (cols + 31) / 32; }

void dropout_add_norm(const float* base, const float* h, const float* bias, float* xhat, const float* gamma,
                      const float* beta, float* y, float* rstd, uint32_t* keep_bits, int64_t rows, int64_t cols,
                      float eps, uint64_t seed, uint32_t keep_below, float scale, int64_t threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const int64_t whole = cols / 16 * 16;
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        std::vector<uint32_t> words(cols);
        for (int64_t r = lo; r < hi; ++r) {
            range_words((uint64_t)(r * cols), cols, k0, k1, words.data());
            uint32_t* bits = keep_bits + r * row_words(cols);
            for (int64_t w = 0; w < row_words(cols); ++w)
                bits[w] = keep_bits32(&words[32 * w], cols - 32 * w < 32 ? cols - 32 * w : 32, keep_below);
            const float* hr = h + r * cols;
            float* xr = xhat + r * cols;
            const float* br = base + r * cols;
            float* yr = y + r * cols;
            v16f sums{};
            float sum = 0.0f;
            for (int64_t c = 0; c < whole; c += 16) {
                const v16f kept = (load16(hr + c) + load16(bias + c)) * keep_factor(&words[c], keep_below, scale);
                const v16f v = load16(br + c) + kept;
                store16(xr + c, v);
                sums += v;
            }
            for (int64_t c = whole; c < cols; ++c) {
                xr[c] = br[c] + (hr[c] + bias[c]) * (words[c] < keep_below ? scale : 0.0f);
                sum += xr[c];
            }
            const float mean = (lanes_sum(sums) + sum) / (float)cols;
            v16f squares_v{};
            float squares = 0.0f;
            for (int64_t c = 0; c < whole; c += 16) {
                const v16f d = load16(xr + c) - mean;
                squares_v += d * d;
            }
            for (int64_t c = whole; c < cols; ++c) squares += (xr[c] - mean) * (xr[c] - mean);
            const float inv = 1.0f / std::sqrt((lanes_sum(squares_v) + squares) / (float)cols + eps);
            for (int64_t c = 0; c < whole; c += 16) {
                const v16f normed = (load16(xr + c) - mean) * inv;
                store16(xr + c, normed);
                store16(yr + c, normed * load16(gamma + c) + load16(beta + c));
            }
            for (int64_t c = whole; c < cols; ++c) {
                xr[c] = (xr[c] - mean) * inv;
                yr[c] = xr[c] * gamma[c] + beta[c];
            }
            rstd[r] = inv;
        }
    });
}

// Its backward pass from dy: with a = dy * gamma, dv = rstd * (a - mean(a) - xhat * mean(a * xhat)) (the
// residual's gradient) and dh = dv * mask (the linear layer's); sums[0 .. cols) gets the gradient of gamma
// (sum of dy * xhat), sums[cols .. 2 cols) that of beta (sum of dy) and sums[2 cols ..) that of the bias
// (sum of dh), in fixed blocks of rows as positive_scale_colsum.
void dropout_add_norm_backward(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                               const uint32_t* keep_bits, float* dv, float* dh, float* sums, int64_t rows,
                               int64_t cols, float scale, int64_t threads) {
    const int64_t blocks = (rows + kSumRows - 1) / kSumRows, whole = cols / 16 * 16;
    std::vector<float> partial(blocks * 3 * cols, 0.0f);
    float* partials = partial.data();
    gatedformer::parallel_chunks(blocks, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
            float* acc_gamma = partials + b * 3 * cols;
            float* acc_beta = acc_gamma + cols;
            float* acc_bias = acc_beta + cols;
            const int64_t end = (b + 1) * kSumRows < rows ? (b + 1) * kSumRows : rows;
            for (int64_t r = b * kSumRows; r < end; ++r) {
                const uint32_t* bits = keep_bits + r * row_words(cols);
                const float* gr = dy + r * cols;
                const float* xr = xhat + r * cols;
                float* vr = dv + r * cols;
                float* hr = dh + r * cols;
                v16f a_v{}, ax_v{};
                float mean_a = 0.0f, mean_ax = 0.0f;
                for (int64_t c = 0; c < whole; c += 16) {
                    const v16f a = load16(gr + c) * load16(gamma + c);
                    a_v += a;
                    ax_v += a * load16(xr + c);
                }
                for (int64_t c = whole; c < cols; ++c) {
                    mean_a += gr[c] * gamma[c];
                    mean_ax += gr[c] * gamma[c] * xr[c];
                }
                mean_a = (lanes_sum(a_v) + mean_a) / (float)cols;
                mean_ax = (lanes_sum(ax_v) + mean_ax) / (float)cols;
                const float inv = rstd[r];
                for (int64_t c = 0; c < whole; c += 16) {
                    const v16f g = load16(gr + c), x = load16(xr + c);
                    const v16f v = (g * load16(gamma + c) - mean_a - x * mean_ax) * inv;
                    const v16u set = (v16u{} + (bits[c >> 5] >> (c & 16))) & kLaneBits;
                    const v16f d = set != 0 ? v * scale : v16f{};
                    store16(vr + c, v);
                    store16(hr + c, d);
                    store16(acc_gamma + c, load16(acc_gamma + c) + g * x);
                    store16(acc_beta + c, load16(acc_beta + c) + g);
                    store16(acc_bias + c, load16(acc_bias + c) + d);
                }
                for (int64_t c = whole; c < cols; ++c) {
                    const float v = inv * (gr[c] * gamma[c] - mean_a - xr[c] * mean_ax);
                    const float d = v * ((bits[c >> 5] >> (c & 31)) & 1u ? scale : 0.0f);
                    vr[c] = v;
                    hr[c] = d;
                    acc_gamma[c] += gr[c] * xr[c];
                    acc_beta[c] += gr[c];
                    acc_bias[c] += d;
                }
            }
        }
    });
    for (int64_t c = 0; c < 3 * cols; ++c) sums[c] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t c = 0; c < 3 * cols; ++c) sums[c] += partials[b * 3 * cols + c];
}

}  // namespace

extern "C" {
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
void bias_relu_dropout_f32(float* h, const float* bias, int64_t n, int64_t cols, uint64_t seed, uint32_t keep_below,
                           double scale, int64_t threads, uint32_t* positive) {
    bias_epilogue<true>(nullptr, h, bias, n, cols, seed, keep_below, (float)scale, threads, positive);
}
void bias_dropout_add_f32(const float* base, float* h, const float* bias, int64_t n, int64_t cols, uint64_t seed,
                          uint32_t keep_below, double scale, int64_t threads) {
    bias_epilogue<false>(base, h, bias, n, cols, seed, keep_below, (float)scale, threads);
}
void positive_scale_colsum_f32(const uint32_t* positive, const float* g, float* out, float* colsum, int64_t rows,
                               int64_t cols, double scale, int64_t threads) {
    positive_scale_colsum(positive, g, out, colsum, rows, cols, (float)scale, threads);
}
void dropout_add_norm_f32(const float* base, const float* h, const float* bias, float* xhat, const float* gamma,
                          const float* beta, float* y, float* rstd, uint32_t* keep_bits, int64_t rows, int64_t cols,
                          double eps, uint64_t seed, uint32_t keep_below, double scale, int64_t threads) {
    dropout_add_norm(base, h, bias, xhat, gamma, beta, y, rstd, keep_bits, rows, cols, (float)eps, seed, keep_below,
                     (float)scale, threads);
}
void dropout_add_norm_backward_f32(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                                   const uint32_t* keep_bits, float* dv, float* dh, float* sums, int64_t rows,
                                   int64_t cols, double scale, int64_t threads) {
    dropout_add_norm_backward(dy, xhat, rstd, gamma, keep_bits, dv, dh, sums, rows, cols, (float)scale, threads);
}
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
    lib.bias_relu_dropout_f32.argtypes = [p, p, i, i, u64, u32, f, i, p]
    lib.bias_relu_dropout_f32.restype = None
    lib.bias_dropout_add_f32.argtypes = [p, p, p, i, i, u64, u32, f, i]
    lib.bias_dropout_add_f32.restype = None
    lib.positive_scale_colsum_f32.argtypes = [p, p, p, p, i, i, f, i]
    lib.positive_scale_colsum_f32.restype = None
    lib.dropout_add_norm_f32.argtypes = [p, p, p, p, p, p, p, p, p, i, i, f, u64, u32, f, i]
    lib.dropout_add_norm_f32.restype = None
    lib.dropout_add_norm_backward_f32.argtypes = [p, p, p, p, p, p, p, p, i, i, f, i]
    lib.dropout_add_norm_backward_f32.restype = None
    lib.dropout_tile_words.argtypes = [u64, u64, p]
    lib.dropout_tile_words.restype = None


KERNEL = NativeKernel(
    "dropout", _CPP_SOURCE, _bind, abi_version=6, env_var="GATEDFORMER_DROPOUT_BACKEND",
    description="the compiled dropout kernel", fallback="PyTorch's own dropout",
    # No fused multiply-add, so that ``base + x * scale`` rounds as PyTorch's two operations do.
    extra_cflags=("-ffp-contract=off",), avx512=True,
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


def _native_ok(x: Tensor) -> bool:
    return x.dtype in _NATIVE_DTYPES and KERNEL.pick_backend(x.device) == "native"


def _reference_keep(x: Tensor, seed: int, keep_below: int) -> Tensor:
    return torch.from_numpy(philox_words(x.numel(), seed) < np.uint32(keep_below)).view(x.shape)


def apply_dropout(x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``x`` times the mask of ``seed`` (``scale`` where kept, 0 elsewhere); ``x`` contiguous on the CPU."""
    if _native_ok(x):
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"dropout_{_NATIVE_DTYPES[x.dtype]}")
        fn(x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_below, scale, kernel_threads(x.numel()))
        return out
    return x * _reference_keep(x, seed, keep_below).to(x.dtype).mul_(scale)


def apply_dropout_add(base: Tensor, x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``base + apply_dropout(x, ...)`` in one pass; both contiguous on the CPU, of one shape and dtype."""
    if _native_ok(x) and base.dtype == x.dtype:
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"dropout_add_{_NATIVE_DTYPES[x.dtype]}")
        fn(base.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_below, scale,
           kernel_threads(x.numel()))
        return out
    return base + x * _reference_keep(x, seed, keep_below).to(x.dtype).mul_(scale)


def apply_relu_dropout(x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``relu(x)`` times the mask of ``seed``, in one pass; ``x`` contiguous on the CPU."""
    if _native_ok(x):
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"relu_dropout_{_NATIVE_DTYPES[x.dtype]}")
        fn(x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_below, scale, kernel_threads(x.numel()))
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


def bias_relu_dropout_(h: Tensor, bias: Tensor, seed: int, keep_below: int, scale: float) -> tuple[Tensor, Tensor]:
    """``h <- relu(h + bias)`` times the mask of ``seed``, in place: the epilogue of a linear layer's product ``h``
    (contiguous float32 rows on the CPU, ``bias`` one row). The mask is the one :func:`apply_relu_dropout` draws.

    Also returns where the result is positive, one bit per element (``int32`` words, element ``i`` at bit
    ``i % 32`` of word ``i // 32``): all that :func:`scale_where_positive_with_sums` needs of it.
    """
    positive = torch.empty(-(-h.numel() // 32), dtype=torch.int32)
    if _native_ok(h) and h.dtype == torch.float32:
        KERNEL.library().bias_relu_dropout_f32(h.data_ptr(), bias.data_ptr(), h.numel(), h.shape[-1], seed, keep_below,
                                               scale, kernel_threads(h.numel()), positive.data_ptr())
        return h, positive
    h.copy_(apply_relu_dropout(h + bias, seed, keep_below, scale))
    return h, _pack_bits(h.reshape(-1) > 0)


def _pack_bits(flags: Tensor) -> Tensor:
    padded = np.zeros(-(-flags.numel() // 32) * 32, dtype=np.uint8)
    padded[:flags.numel()] = flags.numpy()
    return torch.from_numpy(np.packbits(padded, bitorder="little").view(np.int32).copy())


def _unpack_bits(positive: Tensor, count: int) -> Tensor:
    return torch.from_numpy(np.unpackbits(positive.numpy().view(np.uint8), bitorder="little")[:count].astype(bool))


def bias_dropout_add_(h: Tensor, base: Tensor | None, bias: Tensor, seed: int, keep_below: int,
                      scale: float) -> Tensor:
    """``h <- base + (h + bias)`` times the mask of ``seed``, in place (see :func:`bias_relu_dropout_`); without
    a ``base``, only the bias and the mask."""
    if _native_ok(h) and h.dtype == torch.float32 and (base is None or base.dtype == h.dtype):
        KERNEL.library().bias_dropout_add_f32(None if base is None else base.data_ptr(), h.data_ptr(),
                                              bias.data_ptr(), h.numel(), h.shape[-1], seed, keep_below, scale,
                                              kernel_threads(h.numel()))
        return h
    if base is None:
        return h.copy_(apply_dropout(h + bias, seed, keep_below, scale))
    return h.copy_(apply_dropout_add(base, h + bias, seed, keep_below, scale))


def scale_where_positive_with_sums(positive: Tensor, grad: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``grad * scale`` where the bits of ``positive`` (from :func:`bias_relu_dropout_`) are set, else 0, for 2-d
    ``grad``; and the sums of its columns (one pass natively)."""
    if _native_ok(grad) and grad.dtype == torch.float32:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        sums = grad.new_empty(grad.shape[1])
        KERNEL.library().positive_scale_colsum_f32(positive.data_ptr(), grad.data_ptr(), out.data_ptr(),
                                                   sums.data_ptr(), grad.shape[0], grad.shape[1], scale,
                                                   kernel_threads(grad.numel()))
        return out, sums
    keep = _unpack_bits(positive, grad.numel()).view(grad.shape)
    out = grad * keep.to(grad.dtype) * scale
    return out, out.sum(0)


def dropout_add_norm(h: Tensor, base: Tensor, bias: Tensor | None, gamma: Tensor, beta: Tensor, eps: float, seed: int,
                     keep_below: int, scale: float, in_place: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``LayerNorm(base + (h + bias) * mask)`` over the rows of 2-d float32 ``h`` (the mask of ``seed``, as in
    :func:`apply_dropout_add`; no bias: ``None``). Returns the result, the normalised rows (written over ``h``
    with ``in_place``), each row's ``1 / sqrt(var + eps)`` and the mask as bits (``int32`` words,
    ``ceil(cols / 32)`` a row). Needs the compiled kernel."""
    rows, cols = h.shape
    y, rstd = torch.empty_like(h), h.new_empty(rows)
    xhat = h if in_place else torch.empty_like(h)
    bias = h.new_zeros(cols) if bias is None else bias
    keep_bits = torch.empty(rows, -(-cols // 32), dtype=torch.int32)
    KERNEL.library().dropout_add_norm_f32(base.data_ptr(), h.data_ptr(), bias.data_ptr(), xhat.data_ptr(),
                                          gamma.data_ptr(), beta.data_ptr(), y.data_ptr(), rstd.data_ptr(),
                                          keep_bits.data_ptr(), rows, cols, eps, seed, keep_below, scale,
                                          kernel_threads(h.numel()))
    return y, xhat, rstd, keep_bits


def dropout_add_norm_backward(grad: Tensor, xhat: Tensor, rstd: Tensor, gamma: Tensor, keep_bits: Tensor,
                              scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`dropout_add_norm` from that of its result: the residual's, the linear layer's
    (before the mask), and the sums over rows for gamma, beta and the bias."""
    rows, cols = xhat.shape
    grad = grad.contiguous()
    dv, dh, sums = torch.empty_like(xhat), torch.empty_like(xhat), xhat.new_empty(3, cols)
    KERNEL.library().dropout_add_norm_backward_f32(grad.data_ptr(), xhat.data_ptr(), rstd.data_ptr(),
                                                   gamma.data_ptr(), keep_bits.data_ptr(), dv.data_ptr(),
                                                   dh.data_ptr(), sums.data_ptr(), rows, cols, scale,
                                                   kernel_threads(grad.numel()))
    return dv, dh, sums[0], sums[1], sums[2]
