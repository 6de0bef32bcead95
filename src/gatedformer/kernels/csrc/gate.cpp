// out = c + F(a) * (G(b) [- c]) row by row, and its backward pass. Compiled by gatedformer.
#include "parallel.h"
#include "gate.h"

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
#include "common.h"
