// The LocalRNN recurrence over blocks of windows; see gatedformer/kernels/local_rnn.py.
#include "parallel.h"
#include "local_rnn.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {
#include "simd.h"
#include "packed_gemm.h"


enum Cell { kTanh = 0, kGru = 1, kLstm = 2 };

// The floats p[0 .. left) of a row, a whole vector while left >= kW (masked past the end of the row).
inline vec ld(const float* p, int64_t left) { return left >= kW ? load(p) : load_first(p, left); }
inline void st(float* p, vec x, int64_t left) {
    if (left >= kW) store(p, x);
    else store_first(p, x, left);
}

// Gate k's pre-activation a = gi + gh + bias at column j (no gh: the zero state's product).
inline vec pre(const float* gi, const float* gh, const float* bias, int64_t k, int64_t d, int64_t j, int64_t left) {
    const vec a = ld(gi + k * d + j, left) + ld(bias + k * d + j, left);
    return gh != nullptr ? a + ld(gh + k * d + j, left) : a;
}

// One window's step: h from the gates (GRU: and the previous h; LSTM: the previous cell, and writes the new one
// when c is not null). Gate orders as torch.nn.GRU (r, z, n) and torch.nn.LSTM (i, f, g, o). With Keep, the
// hidden product gh is overwritten with what the backward pass reads instead of recomputing it: the tanh cell's
// h, the GRU's r, z and W_hn h + b_hn, the LSTM's four gates.
template <int C, bool Keep>
void step_row(const float* gi, float* gh, const float* bias, const float* prev_h, const float* prev_c, float* h,
              float* c, int64_t d) {
    for (int64_t j = 0; j < d; j += kW) {
        const int64_t left = d - j;
        if (C == kTanh) {
            const vec y = vtanh(pre(gi, gh, bias, 0, d, j, left));
            st(h + j, y, left);
            if (Keep) st(gh + j, y, left);
        } else if (C == kGru) {
            const vec r = vsigmoid(pre(gi, gh, bias, 0, d, j, left)), z = vsigmoid(pre(gi, gh, bias, 1, d, j, left));
            const vec hn = gh != nullptr ? ld(gh + 2 * d + j, left) + ld(bias + 2 * d + j, left)
                                         : ld(bias + 2 * d + j, left);
            const vec n = vtanh(ld(gi + 2 * d + j, left) + r * hn);
            const vec p = prev_h != nullptr ? ld(prev_h + j, left) : splat(0.0f);
            st(h + j, n + z * (p - n), left);
            if (Keep) {
                st(gh + j, r, left);
                st(gh + d + j, z, left);
                st(gh + 2 * d + j, hn, left);
            }
        } else {
            const vec i = vsigmoid(pre(gi, gh, bias, 0, d, j, left)), f = vsigmoid(pre(gi, gh, bias, 1, d, j, left));
            const vec g = vtanh(pre(gi, gh, bias, 2, d, j, left)), o = vsigmoid(pre(gi, gh, bias, 3, d, j, left));
            const vec cell = prev_c != nullptr ? f * ld(prev_c + j, left) + i * g : i * g;
            if (c != nullptr) st(c + j, cell, left);
            st(h + j, o * vtanh(cell), left);
            if (Keep) {
                st(gh + j, i, left);
                st(gh + d + j, f, left);
                st(gh + 2 * d + j, g, left);
                st(gh + 3 * d + j, o, left);
            }
        }
    }
}

// Its backward pass from dh (and the LSTM's dc, null for zero): adds the gradient of gi into dgi, writes that of
// gh into dgh (unless null) and adds it into bias_sum; writes the GRU's direct share of the previous h's gradient
// (g z) into dh_prev and the LSTM's previous cell's into dc_prev, where those are not null. With kept, the step's
// activations come from what step_row<C, true> left there; without, from gi and the bias (the zero state).
template <int C>
void step_backward_row(const float* gi, const float* kept, const float* bias, const float* prev_h,
                       const float* prev_c, const float* dh, const float* dc, float* dgi, float* dgh, float* dh_prev,
                       float* dc_prev, float* bias_sum, int64_t d) {
    for (int64_t j = 0; j < d; j += kW) {
        const int64_t left = d - j;
        const vec g = ld(dh + j, left);
        if (C == kTanh) {
            const vec h = kept != nullptr ? ld(kept + j, left) : vtanh(pre(gi, nullptr, bias, 0, d, j, left));
            const vec da = g * (1.0f - h * h);
            st(dgi + j, ld(dgi + j, left) + da, left);
            if (dgh != nullptr) st(dgh + j, da, left);
            st(bias_sum + j, ld(bias_sum + j, left) + da, left);
        } else if (C == kGru) {
            const vec r = kept != nullptr ? ld(kept + j, left) : vsigmoid(pre(gi, nullptr, bias, 0, d, j, left));
            const vec z = kept != nullptr ? ld(kept + d + j, left) : vsigmoid(pre(gi, nullptr, bias, 1, d, j, left));
            const vec hn = ld((kept != nullptr ? kept : bias) + 2 * d + j, left);
            const vec n = vtanh(ld(gi + 2 * d + j, left) + r * hn);
            const vec p = prev_h != nullptr ? ld(prev_h + j, left) : splat(0.0f);
            const vec dn = g * (1.0f - z) * (1.0f - n * n);
            const vec dr = dn * hn * r * (1.0f - r);
            const vec dz = g * (p - n) * z * (1.0f - z);
            const vec dhn = dn * r;
            st(dgi + j, ld(dgi + j, left) + dr, left);
            st(dgi + d + j, ld(dgi + d + j, left) + dz, left);
            st(dgi + 2 * d + j, ld(dgi + 2 * d + j, left) + dn, left);
            if (dgh != nullptr) {
                st(dgh + j, dr, left);
                st(dgh + d + j, dz, left);
                st(dgh + 2 * d + j, dhn, left);
            }
            st(bias_sum + j, ld(bias_sum + j, left) + dr, left);
            st(bias_sum + d + j, ld(bias_sum + d + j, left) + dz, left);
            st(bias_sum + 2 * d + j, ld(bias_sum + 2 * d + j, left) + dhn, left);
            if (dh_prev != nullptr) st(dh_prev + j, g * z, left);
        } else {
            vec i, f, gg, o;
            if (kept != nullptr) {
                i = ld(kept + j, left);
                f = ld(kept + d + j, left);
                gg = ld(kept + 2 * d + j, left);
                o = ld(kept + 3 * d + j, left);
            } else {
                i = vsigmoid(pre(gi, nullptr, bias, 0, d, j, left));
                f = vsigmoid(pre(gi, nullptr, bias, 1, d, j, left));
                gg = vtanh(pre(gi, nullptr, bias, 2, d, j, left));
                o = vsigmoid(pre(gi, nullptr, bias, 3, d, j, left));
            }
            const vec prev = prev_c != nullptr ? ld(prev_c + j, left) : splat(0.0f);
            const vec t = vtanh(f * prev + i * gg);
            const vec dcell = (dc != nullptr ? ld(dc + j, left) : splat(0.0f)) + g * o * (1.0f - t * t);
            const vec da[4] = {dcell * gg * i * (1.0f - i), dcell * prev * f * (1.0f - f), dcell * i * (1.0f - gg * gg),
                               g * t * o * (1.0f - o)};
            for (int k = 0; k < 4; ++k) {
                st(dgi + k * d + j, ld(dgi + k * d + j, left) + da[k], left);
                if (dgh != nullptr) st(dgh + k * d + j, da[k], left);
                st(bias_sum + k * d + j, ld(bias_sum + k * d + j, left) + da[k], left);
            }
            if (dc_prev != nullptr) st(dc_prev + j, dcell * f, left);
        }
    }
}

// A 64-byte aligned float scratch buffer, freed on return (C++14 has no aligned allocation).
struct Scratch {
    void* raw;
    float* data;
    explicit Scratch(int64_t floats) : raw(floats > 0 ? std::malloc((size_t)floats * 4 + 64) : nullptr),
                                       data((float*)(((uintptr_t)raw + 63) / 64 * 64)) {}
    ~Scratch() { std::free(raw); }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
};

// Rows are windows in batch-major order, r = b·L + t (as the output, (B, L, d)). Step j of row r reads position
// p = t - (M-1) + j: row r - (M-1) + j of the projection gin (rows x G), or the pad (b_ih: x = 0) where p < 0.
// Kept for the backward pass (when hs is not null), step by step for each block of n rows from row lo, step j < M-1
// of the block's row r at [lo * (M-1) + j * n + r]: hs (its h, d wide), cs (its LSTM cell, d) and, for step j + 1,
// ghs (G wide: that step's hidden product W_hh h_j, then overwritten by step_row with what its backward pass
// reads: its activations, the GRU's W_hn h_j + b_hn). Each block's steps are then whole runs of memory, which the
// backward pass reads in order; the rows of hs and ghs still pair up one to one for W_hh's gradient.
template <int C>
int forward(const Blas& blas, const float* gin, const float* pad, const float* w, const float* bias,
            int64_t packed_floats, float* out, float* hs, float* cs, float* ghs, int64_t rows, int64_t length,
            int64_t d, int64_t window, int64_t block_rows, int64_t threads) {
    const int64_t width = (C == kTanh ? 1 : C == kGru ? 3 : 4) * d, kept = window - 1;
    const int64_t blocks = (rows + block_rows - 1) / block_rows;
    Scratch packed(kept > 0 ? packed_floats : 0);
    if (kept > 0 && packed.raw == nullptr) return 1;
    int failed = 0;
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        (void)nt;
        if (t == 0 && kept > 0) blas.pack(kRowMajor, kBMatrix, kTrans, block_rows, width, d, 1.0f, w, d, packed.data);
        stream_barrier();
        Scratch scratch(hs != nullptr ? 0 : block_rows * (4 * d + width));  // h and c twice, gh: if nothing is kept
        if (hs == nullptr && scratch.raw == nullptr) {
#pragma omp atomic write
            failed = 1;
            return;
        }
        for (int64_t b = first; b < end; ++b) {
            const int64_t lo = b * block_rows, n = lo + block_rows < rows ? block_rows : rows - lo;
            const float* h_prev = nullptr;
            const float* c_prev = nullptr;
            for (int64_t j = 0; j < window; ++j) {
                float* gh = nullptr;
                if (j > 0) {
                    gh = ghs != nullptr ? ghs + (lo * kept + (j - 1) * n) * width : scratch.data + 4 * block_rows * d;
                    blas.compute(kRowMajor, kNoTrans, kPacked, n, width, d, h_prev, d, packed.data, width, 0.0f, gh,
                                 width);
                }
                float* h = out + lo * d;
                float* c = nullptr;
                if (j < window - 1) {
                    h = hs != nullptr ? hs + (lo * kept + j * n) * d : scratch.data + (j % 2) * block_rows * d;
                    if (C == kLstm)
                        c = cs != nullptr ? cs + (lo * kept + j * n) * d : scratch.data + (2 + j % 2) * block_rows * d;
                }
                for (int64_t r = 0, time = lo % length; r < n; ++r, time = time + 1 == length ? 0 : time + 1) {
                    const float* gi = time - kept + j >= 0 ? gin + (lo + r - kept + j) * width : pad;
                    float* gh_row = gh != nullptr ? gh + r * width : nullptr;
                    const float* h_row = h_prev != nullptr ? h_prev + r * d : nullptr;
                    const float* c_row = c_prev != nullptr ? c_prev + r * d : nullptr;
                    float* c_out = c != nullptr ? c + r * d : nullptr;
                    if (ghs != nullptr && gh != nullptr)
                        step_row<C, true>(gi, gh_row, bias, h_row, c_row, h + r * d, c_out, d);
                    else
                        step_row<C, false>(gi, gh_row, bias, h_row, c_row, h + r * d, c_out, d);
                }
                h_prev = h;
                c_prev = c;
            }
        }
    });
    return failed;
}

// The backward pass from grad_out (rows x d): adds every step's gi gradient into dgin (zeroed by the caller, as
// gin) or, for the steps that read the pad, into dpad, and writes W_hh's gradient into dweight and b_hh's into
// dbias. dpad and dbias are summed per block of rows, then the blocks in order. A step's gradient goes to the row
// it read, up to M-1 rows back: each thread's adds into rows before its own first row (the previous thread's) go
// to a spill buffer, added after. The hidden products' gradients of a block's steps stay in the thread's scratch,
// where one product per block adds their share of W_hh's gradient (dghᵀ h over the block's M-1 steps) into the
// thread's sum; the threads' sums are added in order at the end.
template <int C>
int backward(const Blas& blas, const float* gin, const float* pad, const float* w, const float* bias,
             const float* hs, const float* cs, const float* ghs, const float* grad_out, int64_t packed_floats,
             int64_t packed_h_floats, float* dgin, float* dpad, float* dweight, float* dbias, int64_t rows,
             int64_t length, int64_t d, int64_t window, int64_t block_rows, int64_t threads) {
    const int64_t width = (C == kTanh ? 1 : C == kGru ? 3 : 4) * d, kept = window - 1;
    const int64_t blocks = (rows + block_rows - 1) / block_rows;
    Scratch packed(kept > 0 ? packed_floats : 0);
    std::vector<float> block_sums(blocks * width, 0.0f), pad_sums(blocks * width, 0.0f);
    std::vector<float> spill(threads * kept * width, 0.0f), weight_sums(threads * width * d, 0.0f);
    std::vector<int64_t> spill_to(threads, 0);
    if (kept > 0 && packed.raw == nullptr) return 1;
    int failed = 0;
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        (void)nt;
        if (t == 0 && kept > 0) blas.pack(kRowMajor, kBMatrix, kNoTrans, block_rows, d, width, 1.0f, w, d, packed.data);
        stream_barrier();
        // dh and dc, twice; the block's hidden-product gradients, step by step; its h's packed for W_hh's product.
        Scratch scratch(4 * block_rows * d + block_rows * kept * width);
        Scratch packed_h(kept > 0 ? packed_h_floats : 0);
        float* dghs = scratch.data + 4 * block_rows * d;
        if (scratch.raw == nullptr || (kept > 0 && packed_h.raw == nullptr)) {
#pragma omp atomic write
            failed = 1;
            return;
        }
        const int64_t own_begin = t > 0 ? first * block_rows : 0;  // rows before it are the previous thread's too
        spill_to[t] = own_begin;
        float* own_spill = spill.data() + t * kept * width;
        for (int64_t b = first; b < end; ++b) {
            const int64_t lo = b * block_rows, n = lo + block_rows < rows ? block_rows : rows - lo;
            float* sums = block_sums.data() + b * width;
            float* pad_sum = pad_sums.data() + b * width;
            float* dh = scratch.data;
            float* dc = nullptr;
            std::memcpy(dh, grad_out + lo * d, (size_t)(n * d) * sizeof(float));
            for (int64_t j = window - 1; j >= 0; --j) {
                const int64_t at = lo * kept + (j - 1) * n;  // this block's step j - 1 in hs, cs and ghs
                const float* acts = j > 0 ? ghs + at * width : nullptr;
                const float* h_prev = j > 0 ? hs + at * d : nullptr;
                const float* c_prev = C == kLstm && j > 0 ? cs + at * d : nullptr;
                float* dgh = j > 0 ? dghs + (j - 1) * n * width : nullptr;
                const int64_t other = dh == scratch.data ? 1 : 0;  // the free one of the two dh (and dc) buffers
                float* dh_next = j > 0 ? scratch.data + other * block_rows * d : nullptr;
                float* dc_next = C == kLstm && j > 0 ? scratch.data + (2 + other) * block_rows * d : nullptr;
                for (int64_t r = 0, time = lo % length; r < n; ++r, time = time + 1 == length ? 0 : time + 1) {
                    const int64_t target = lo + r - kept + j;
                    const bool padded = time - kept + j < 0;
                    const float* gi = padded ? pad : gin + target * width;
                    float* dgi = padded ? pad_sum
                               : target >= own_begin ? dgin + target * width
                                                     : own_spill + (target - own_begin + kept) * width;
                    step_backward_row<C>(gi, acts != nullptr ? acts + r * width : nullptr, bias,
                                         h_prev != nullptr ? h_prev + r * d : nullptr,
                                         c_prev != nullptr ? c_prev + r * d : nullptr, dh + r * d,
                                         dc != nullptr ? dc + r * d : nullptr, dgi,
                                         dgh != nullptr ? dgh + r * width : nullptr,
                                         C == kGru && dh_next != nullptr ? dh_next + r * d : nullptr,
                                         dc_next != nullptr ? dc_next + r * d : nullptr, sums, d);
                }
                if (j > 0) {  // the previous h's gradient: W_hh's share (plus the GRU's direct one, written above)
                    blas.compute(kRowMajor, kNoTrans, kPacked, n, d, width, dgh, width, packed.data, d,
                                 C == kGru ? 1.0f : 0.0f, dh_next, d);
                    dh = dh_next;
                    dc = dc_next;
                }
            }
            if (kept > 0) {  // W_hh's gradient += dghᵀ h over the block's steps (rows paired as kept)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, width, d, kept * n, 1.0f, hs + lo * kept * d, d,
                          packed_h.data);
                blas.compute(kRowMajor, kTrans, kPacked, width, d, kept * n, dghs, width, packed_h.data, d, 1.0f,
                             weight_sums.data() + t * width * d, d);
            }
        }
    });
    if (failed) return 1;
    for (int64_t k = 0; k < width * d; ++k) dweight[k] = 0.0f;
    for (int64_t t = 0; t < threads; ++t)
        for (int64_t k = 0; k < width * d; ++k) dweight[k] += weight_sums[t * width * d + k];
    for (int64_t t = 1; t < threads; ++t)
        for (int64_t r = spill_to[t] - kept > 0 ? spill_to[t] - kept : 0; r < spill_to[t]; ++r) {
            const float* from = spill.data() + (t * kept + r - spill_to[t] + kept) * width;
            for (int64_t k = 0; k < width; ++k) dgin[r * width + k] += from[k];
        }
    for (int64_t k = 0; k < width; ++k) dbias[k] = dpad[k] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t k = 0; k < width; ++k) {
            dbias[k] += block_sums[b * width + k];
            dpad[k] += pad_sums[b * width + k];
        }
    return 0;
}

}  // namespace

extern "C" {
int local_rnn_forward_f32(const void* pack, const void* compute, const void* local_threads, int64_t cell,
                          const float* gin, const float* pad, const float* w, const float* bias,
                          int64_t packed_floats, float* out, float* hs, float* cs, float* ghs, int64_t rows,
                          int64_t length, int64_t d, int64_t window, int64_t block_rows, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    FlushDenormals flush;
    if (cell == kGru)
        return forward<kGru>(blas, gin, pad, w, bias, packed_floats, out, hs, cs, ghs, rows, length, d, window,
                             block_rows, threads);
    if (cell == kLstm)
        return forward<kLstm>(blas, gin, pad, w, bias, packed_floats, out, hs, cs, ghs, rows, length, d, window,
                              block_rows, threads);
    return forward<kTanh>(blas, gin, pad, w, bias, packed_floats, out, hs, cs, ghs, rows, length, d, window,
                          block_rows, threads);
}
int local_rnn_backward_f32(const void* pack, const void* compute, const void* local_threads, int64_t cell,
                           const float* gin, const float* pad, const float* w, const float* bias, const float* hs,
                           const float* cs, const float* ghs, const float* grad_out, int64_t packed_floats,
                           int64_t packed_h_floats, float* dgin, float* dpad, float* dweight, float* dbias,
                           int64_t rows, int64_t length, int64_t d, int64_t window, int64_t block_rows,
                           int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    FlushDenormals flush;
    if (cell == kGru)
        return backward<kGru>(blas, gin, pad, w, bias, hs, cs, ghs, grad_out, packed_floats, packed_h_floats, dgin,
                              dpad, dweight, dbias, rows, length, d, window, block_rows, threads);
    if (cell == kLstm)
        return backward<kLstm>(blas, gin, pad, w, bias, hs, cs, ghs, grad_out, packed_floats, packed_h_floats, dgin,
                               dpad, dweight, dbias, rows, length, d, window, block_rows, threads);
    return backward<kTanh>(blas, gin, pad, w, bias, hs, cs, ghs, grad_out, packed_floats, packed_h_floats, dgin,
                           dpad, dweight, dbias, rows, length, d, window, block_rows, threads);
}
}
#include "common.h"
