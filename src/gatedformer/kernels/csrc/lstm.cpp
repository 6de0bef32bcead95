// One LSTM step from precomputed projections, forward and backward. Compiled by gatedformer.
// gi, gh: rows of 4d (gate order i, f, g, o) with row strides sgi, sgh (sgh may be 0: one bias row for all);
// c, h_out, c_out, grad_h, grad_c, dc: contiguous rows of d; c may be null (the zero state), grad_c null (zero).
// The per-row loops take every stream as a restrict-qualified parameter: GCC vectorises them (exp and tanh
// included) only then.
#include "parallel.h"
#include "lstm.h"

#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {
#include "simd.h"
#include "sigmoid.h"


template <typename T, bool HasC>
void forward_row(const T* __restrict a, const T* __restrict b, const T* __restrict c, T* __restrict h_out,
                 T* __restrict c_out, int64_t d) {
    for (int64_t j = 0; j < d; ++j) {
        const T i = sigmoid(a[j] + b[j]), f = sigmoid(a[d + j] + b[d + j]);
        const T g = std::tanh(a[2 * d + j] + b[2 * d + j]), o = sigmoid(a[3 * d + j] + b[3 * d + j]);
        const T cell = HasC ? f * c[j] + i * g : i * g;
        c_out[j] = cell;
        h_out[j] = o * std::tanh(cell);
    }
}

template <typename T, bool HasC, bool HasGradC>
void backward_row(const T* __restrict a, const T* __restrict b, const T* __restrict c, const T* __restrict gh_,
                  const T* __restrict gc_, T* __restrict da, T* __restrict dc, int64_t d) {
    for (int64_t j = 0; j < d; ++j) {
        const T i = sigmoid(a[j] + b[j]), f = sigmoid(a[d + j] + b[d + j]);
        const T g = std::tanh(a[2 * d + j] + b[2 * d + j]), o = sigmoid(a[3 * d + j] + b[3 * d + j]);
        const T prev = HasC ? c[j] : T(0);
        const T t = std::tanh(f * prev + i * g);
        const T dcell = (HasGradC ? gc_[j] : T(0)) + gh_[j] * o * (T(1) - t * t);
        da[j] = dcell * g * i * (T(1) - i);
        da[d + j] = dcell * prev * f * (T(1) - f);
        da[2 * d + j] = dcell * i * (T(1) - g * g);
        da[3 * d + j] = gh_[j] * t * o * (T(1) - o);
        if (HasC) dc[j] = dcell * f;
    }
}

// float32 rows of whole vectors: the sigmoids and tanhs from the inline exp, 16 (or 8) lanes at a time.
template <bool HasC>
void forward_row_vec(const float* a, const float* b, const float* c, float* h_out, float* c_out, int64_t d) {
    for (int64_t j = 0; j < d; j += kW) {
        const vec i = vsigmoid(load(a + j) + load(b + j)), f = vsigmoid(load(a + d + j) + load(b + d + j));
        const vec g = vtanh(load(a + 2 * d + j) + load(b + 2 * d + j));
        const vec o = vsigmoid(load(a + 3 * d + j) + load(b + 3 * d + j));
        const vec cell = HasC ? f * load(c + j) + i * g : i * g;
        store(c_out + j, cell);
        store(h_out + j, o * vtanh(cell));
    }
}

template <bool HasC, bool HasGradC>
void backward_row_vec(const float* a, const float* b, const float* c, const float* gh_, const float* gc_, float* da,
                      float* dc, int64_t d) {
    for (int64_t j = 0; j < d; j += kW) {
        const vec i = vsigmoid(load(a + j) + load(b + j)), f = vsigmoid(load(a + d + j) + load(b + d + j));
        const vec g = vtanh(load(a + 2 * d + j) + load(b + 2 * d + j));
        const vec o = vsigmoid(load(a + 3 * d + j) + load(b + 3 * d + j));
        const vec prev = HasC ? load(c + j) : splat(0);
        const vec t = vtanh(f * prev + i * g), gh = load(gh_ + j);
        const vec dcell = (HasGradC ? load(gc_ + j) : splat(0)) + gh * o * (1.0f - t * t);
        store(da + j, dcell * g * i * (1.0f - i));
        store(da + d + j, dcell * prev * f * (1.0f - f));
        store(da + 2 * d + j, dcell * i * (1.0f - g * g));
        store(da + 3 * d + j, gh * t * o * (1.0f - o));
        if (HasC) store(dc + j, dcell * f);
    }
}

// One row each way: the vector code for float32 rows of whole vectors, the scalar loops for the rest.
template <typename T, bool HasC>
void forward_one(const T* a, const T* b, const T* c, T* h_out, T* c_out, int64_t d) {
    forward_row<T, HasC>(a, b, c, h_out, c_out, d);
}
template <>
void forward_one<float, true>(const float* a, const float* b, const float* c, float* h_out, float* c_out, int64_t d) {
    if (d % kW == 0) forward_row_vec<true>(a, b, c, h_out, c_out, d);
    else forward_row<float, true>(a, b, c, h_out, c_out, d);
}
template <>
void forward_one<float, false>(const float* a, const float* b, const float* c, float* h_out, float* c_out,
                               int64_t d) {
    if (d % kW == 0) forward_row_vec<false>(a, b, c, h_out, c_out, d);
    else forward_row<float, false>(a, b, c, h_out, c_out, d);
}
template <typename T, bool HasC, bool HasGradC>
void backward_one(const T* a, const T* b, const T* c, const T* g, const T* gc, T* da, T* dc, int64_t d) {
    backward_row<T, HasC, HasGradC>(a, b, c, g, gc, da, dc, d);
}
#define LSTM_BACKWARD_FLOAT(HAS_C, HAS_GC)                                                                     \
    template <>                                                                                                \
    void backward_one<float, HAS_C, HAS_GC>(const float* a, const float* b, const float* c, const float* g,    \
                                            const float* gc, float* da, float* dc, int64_t d) {                \
        if (d % kW == 0) backward_row_vec<HAS_C, HAS_GC>(a, b, c, g, gc, da, dc, d);                           \
        else backward_row<float, HAS_C, HAS_GC>(a, b, c, g, gc, da, dc, d);                                    \
    }
LSTM_BACKWARD_FLOAT(true, true)
LSTM_BACKWARD_FLOAT(true, false)
LSTM_BACKWARD_FLOAT(false, true)
LSTM_BACKWARD_FLOAT(false, false)
#undef LSTM_BACKWARD_FLOAT

template <typename T>
void forward(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* c, T* h_out, T* c_out, int64_t rows,
             int64_t d, int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
            const T* a = gi + row * sgi;
            const T* b = gh + row * sgh;
            if (c != nullptr)
                forward_one<T, true>(a, b, c + row * d, h_out + row * d, c_out + row * d, d);
            else
                forward_one<T, false>(a, b, nullptr, h_out + row * d, c_out + row * d, d);
        }
    });
}

template <typename T>
void backward(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* c, const T* grad_h, const T* grad_c,
              T* da, T* dc, int64_t rows, int64_t d, int64_t threads) {
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
            const T* a = gi + row * sgi;
            const T* b = gh + row * sgh;
            const T* g = grad_h + row * d;
            T* out = da + row * 4 * d;
            if (c != nullptr && grad_c != nullptr)
                backward_one<T, true, true>(a, b, c + row * d, g, grad_c + row * d, out, dc + row * d, d);
            else if (c != nullptr)
                backward_one<T, true, false>(a, b, c + row * d, g, nullptr, out, dc + row * d, d);
            else if (grad_c != nullptr)
                backward_one<T, false, true>(a, b, nullptr, g, grad_c + row * d, out, nullptr, d);
            else
                backward_one<T, false, false>(a, b, nullptr, g, nullptr, out, nullptr, d);
        }
    });
}

}  // namespace

#define LSTM_DEFINE(T, SUFFIX)                                                                               \
    void lstm_forward_##SUFFIX(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* c, T* h_out,     \
                               T* c_out, int64_t rows, int64_t d, int64_t threads) {                         \
        forward<T>(gi, sgi, gh, sgh, c, h_out, c_out, rows, d, threads);                                     \
    }                                                                                                        \
    void lstm_backward_##SUFFIX(const T* gi, int64_t sgi, const T* gh, int64_t sgh, const T* c,              \
                                const T* grad_h, const T* grad_c, T* da, T* dc, int64_t rows, int64_t d,     \
                                int64_t threads) {                                                           \
        backward<T>(gi, sgi, gh, sgh, c, grad_h, grad_c, da, dc, rows, d, threads);                          \
    }

extern "C" {
LSTM_DEFINE(float, f32)
LSTM_DEFINE(double, f64)
}
#include "common.h"
