#include "parallel.h"
#include "dropout.h"
#include "philox.h"

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
#include "common.h"
