// Element-wise SRU recurrence, forward and backward (BPTT). Compiled by gatedformer.
// Layout: every stream is indexed [t][b][d][j] with j (the hidden unit) contiguous. Input streams
// come with their own (t, b, d) strides; outputs and saved cells are contiguous (L, B, D, H).
// Direction d == 1 runs from t = L - 1 down to 0. The B * D rows are independent and split between
// threads. Over j, float rows run whole vectors with the inline exp (forward_vectors, backward_vectors);
// the rest, and double rows, a loop that -ffast-math vectorises with glibc's libmvec.
#include "parallel.h"
#include "sru.h"

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
    T *gvf, *gvr, *gbf, *gbr;  // per-row partial sums (B, D, H), summed over b once every row is done
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

// c after the last step of every row (t = L - 1 forwards, t = 0 backwards), a tensor of its own for the caller: a
// view of c_all would have to be copied wherever outputs must not share memory (a custom operator's).
template <typename T>
void last_cells(const T* c_all, int64_t L, int64_t B, int64_t D, int64_t H, T* c_last) {
    const int64_t ot = B * D * H;
    for (int64_t row = 0; row < B * D; ++row) {
        const T* c = c_all + (row % D == 0 ? L - 1 : 0) * ot + row * H;
        for (int64_t j = 0; j < H; ++j) c_last[row * H + j] = c[j];
    }
}

// The rows' partial sums (B, D, H) of one parameter's gradient, summed over b into (D, H) in double.
template <typename T>
void sum_rows(const T* partial, int64_t B, int64_t DH, T* out) {
    for (int64_t k = 0; k < DH; ++k) {
        double sum = 0;
        for (int64_t b = 0; b < B; ++b) sum += partial[b * DH + k];
        out[k] = static_cast<T>(sum);
    }
}

#define SRU_DEFINE(T, SUFFIX)                                                                                  \
    void sru_forward_##SUFFIX(SRU_ARGS(T), T* h, T* c_all, T* c_last) {                                        \
        const Args<T> a = SRU_MAKE_ARGS(T);                                                                    \
        gatedformer::parallel_chunks(B * D, threads, 1,                                                          \
                                     [&](int64_t lo, int64_t hi) { forward_rows(a, h, c_all, lo, hi); });      \
        last_cells(c_all, L, B, D, H, c_last);                                                                 \
    }                                                                                                          \
    void sru_backward_##SUFFIX(SRU_ARGS(T), SRU_GRAD_ARGS(T)) {                                                \
        const Args<T> a = SRU_MAKE_ARGS(T);                                                                    \
        /* each row accumulates its own partial sums (threads own whole rows), summed over b afterwards */     \
        const int64_t n = B * D * H;                                                                           \
        std::vector<T> partial(4 * n);                                                                         \
        Grads<T> g = SRU_MAKE_GRADS(T);                                                                        \
        g.gvf = partial.data();                                                                                \
        g.gvr = g.gvf + n;                                                                                     \
        g.gbf = g.gvr + n;                                                                                     \
        g.gbr = g.gbf + n;                                                                                     \
        gatedformer::parallel_chunks(B * D, threads, 1,                                                          \
                                     [&](int64_t lo, int64_t hi) { backward_rows(a, g, lo, hi); });            \
        sum_rows(g.gvf, B, D * H, gvf);                                                                        \
        sum_rows(g.gvr, B, D * H, gvr);                                                                        \
        sum_rows(g.gbf, B, D * H, gbf);                                                                        \
        sum_rows(g.gbr, B, D * H, gbr);                                                                        \
    }

extern "C" {
SRU_DEFINE(float, f32)
SRU_DEFINE(double, f64)
}
#include "common.h"
