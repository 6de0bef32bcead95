// Softmax cross-entropy over rows of logits; see gatedformer/kernels/cross_entropy.py.
#include "parallel.h"
#include "cross_entropy.h"
#if !defined(CROSS_ENTROPY_ROW_BLOCK)  // rows per partial sum of the bias gradient: ROW_BLOCK in cross_entropy.py
#error "compile with -DCROSS_ENTROPY_ROW_BLOCK=<rows>, as gatedformer/kernels/cross_entropy.py does"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockRows = CROSS_ENTROPY_ROW_BLOCK;

#if defined(__AVX2__)
#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vec __attribute__((vector_size(4 * kW), aligned(4), may_alias));
typedef int32_t ivec __attribute__((vector_size(4 * kW)));
inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec x) { *reinterpret_cast<vec*>(p) = x; }
inline vec splat(float x) { return vec{} + x; }
// exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts, so r is
// exact), exp(r) by its Taylor series to r^6 (within 2e-7). x is held above -87 so that 2^n stays a normal float;
// the comparison is written so that a NaN lane is not replaced (it stays NaN through the polynomial).
inline vec vexp(vec x) {
    x = x < splat(-87.0f) ? splat(-87.0f) : x;
#if defined(__AVX512F__)
    const vec n = (vec)_mm512_roundscale_ps((__m512)(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vec n = (vec)_mm256_round_ps((__m256)(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const vec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    vec p = splat(1.0f / 720);
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return p * (vec)bits;
}
#else
constexpr int kW = 1;
#endif

inline float exp_one(float x) { return std::exp(x < -87.0f ? -87.0f : x); }

// x[j] += bias[j] (bias may be null); returns the largest x[j], or NaN if any x[j] is NaN, and adds up the x[j]
// in `total` (for label smoothing).
float add_bias_max(float* x, const float* bias, int64_t n, float& total) {
    float top = -INFINITY, sum = 0.0f;
    bool nan = false;
    int64_t j = 0;
#if defined(__AVX2__)
    vec lanes = splat(-INFINITY), sums = splat(0.0f);
    ivec bad = ivec{};
    for (; j + kW <= n; j += kW) {
        vec v = load(x + j);
        if (bias != nullptr) {
            v += load(bias + j);
            store(x + j, v);
        }
        bad |= (ivec)(v != v);
        lanes = v > lanes ? v : lanes;
        sums += v;
    }
    for (int k = 0; k < kW; ++k) {
        top = lanes[k] > top ? lanes[k] : top;
        nan = nan || bad[k] != 0;
        sum += sums[k];
    }
#endif
    for (; j < n; ++j) {
        if (bias != nullptr) x[j] += bias[j];
        nan = nan || x[j] != x[j];
        top = x[j] > top ? x[j] : top;
        sum += x[j];
    }
    total = sum;
    return nan ? NAN : top;
}

// The sum of exp(x[j] - top); with Keep, each exp(x[j] - top) is also written over x[j] (for the gradient pass,
// which then computes no exponential of its own).
template <bool Keep>
float sum_exp(float* x, int64_t n, float top) {
    float total = 0.0f;
    int64_t j = 0;
#if defined(__AVX2__)
    vec lanes = splat(0.0f);
    for (; j + kW <= n; j += kW) {
        const vec e = vexp(load(x + j) - top);
        if (Keep) store(x + j, e);
        lanes += e;
    }
    for (int k = 0; k < kW; ++k) total += lanes[k];
#endif
    for (; j < n; ++j) {
        const float e = exp_one(x[j] - top);
        if (Keep) x[j] = e;
        total += e;
    }
    return total;
}

// x[j] <- x[j] * factor - shift (x: the exponentials sum_exp<true> kept), and sums[j] += x[j].
void write_grad(float* x, int64_t n, float factor, float shift, float* sums) {
    int64_t j = 0;
#if defined(__AVX2__)
    for (; j + kW <= n; j += kW) {
        const vec g = load(x + j) * factor - shift;
        store(x + j, g);
        store(sums + j, load(sums + j) + g);
    }
#endif
    for (; j < n; ++j) {
        x[j] = x[j] * factor - shift;
        sums[j] += x[j];
    }
}

}  // namespace

extern "C" {
// logits: rows x V, contiguous, overwritten (bias added; with want_grad, the gradient). losses: rows. col_sums: V,
// written with want_grad. smoothing: label smoothing in [0, 1]. Returns -1, or the first row whose target is
// neither in [0, V) nor ignore_index.
int64_t softmax_cross_entropy_f32(float* logits, const float* bias, const int64_t* targets, int64_t rows, int64_t V,
                                  int64_t ignore_index, double smoothing, float* losses, int want_grad, double scale,
                                  float* col_sums, int64_t threads) {
    const float on_target = (float)(1.0 - smoothing), spread = (float)(smoothing / (double)V);
    for (int64_t r = 0; r < rows; ++r)
        if (targets[r] != ignore_index && (targets[r] < 0 || targets[r] >= V)) return r;
    const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
    std::vector<float> partial(want_grad ? blocks * V : 0, 0.0f);
    float* partials = partial.data();
    gatedformer::parallel_chunks(blocks, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
            const int64_t end = (b + 1) * kBlockRows < rows ? (b + 1) * kBlockRows : rows;
            for (int64_t r = b * kBlockRows; r < end; ++r) {
                float* x = logits + r * V;
                float sum_x = 0.0f;
                const float top = add_bias_max(x, bias, V, sum_x);
                const bool ignored = targets[r] == ignore_index;
                const float target_logit = ignored ? 0.0f : x[targets[r]];  // read before the exponentials replace it
                const bool keep = want_grad && !ignored;
                const float total = keep ? sum_exp<true>(x, V, top) : sum_exp<false>(x, V, top);
                const float lse = top + std::log(total);
                losses[r] = ignored ? 0.0f
                                    : spread > 0.0f ? lse - on_target * target_logit - spread * sum_x
                                                    : lse - target_logit;
                if (!want_grad) continue;
                if (ignored) {
                    std::memset(x, 0, sizeof(float) * V);
                    continue;
                }
                write_grad(x, V, (float)scale / total, (float)scale * spread, partials + b * V);
                x[targets[r]] -= (float)scale * on_target;
                partials[b * V + targets[r]] -= (float)scale * on_target;
            }
        }
    });
    if (!want_grad) return -1;
    gatedformer::parallel_chunks(V, threads, 256, [=](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) total += partials[b * V + j];
            col_sums[j] = total;
        }
    });
    return -1;
}
}
#include "common.h"
