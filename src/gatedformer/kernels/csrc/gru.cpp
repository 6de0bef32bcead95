// One GRU step from precomputed projections, forward and backward. Compiled by gatedformer.
// gi, gh: rows of 3d (gate order r, z, n) with row strides sgi, sgh (sgh may be 0: one bias row for all);
// h, out, grad, dh: contiguous rows of d; h may be null (the zero state).
// The per-row loops take every stream as a restrict-qualified parameter: GCC vectorises them (exp and tanh
// included) only then.
#include "parallel.h"
#include "gru.h"

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
#include "common.h"
