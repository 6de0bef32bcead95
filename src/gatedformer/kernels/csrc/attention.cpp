// Causal attention over packed QKV rows, forward and backward. Compiled by gatedformer.
// qkv: (B, L, 3, H, D) contiguous; out, grad_out: (B, L, H, D); lse: (B, H, L); grad_qkv like qkv.
#include "parallel.h"
#include "attention.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {

#include "simd.h"

#if defined(__AVX512F__)
constexpr int64_t kRows = 8;    // query rows per block
constexpr int kPanelVecs = 1;   // vectors per panel of the packed K (and V) used for Q K^T (and dO V^T)
constexpr int kAccs = 16;       // accumulators a loop keeps in registers (of 32)
#else
constexpr int64_t kRows = 4;
constexpr int kPanelVecs = 2;
constexpr int kAccs = 8;        // of 16
#endif
constexpr int64_t kPanel = kPanelVecs * kW;  // keys per panel

inline int64_t round_panel(int64_t n) { return (n + kPanel - 1) / kPanel * kPanel; }

struct Head {
    const float* q;  // row i of Q at q + i * row, of K at q + i * row + kv, of V at + 2 * kv
    int64_t row, kv;
    const float* bias;  // the projection's bias, laid out like a row (null: none, or already added)
    const float* bias_at(int64_t offset) const { return bias != nullptr ? bias + offset : nullptr; }
};

// S[r][j] = sum_d A_r[d] * X_j[d] for r < kRows and j < n (a multiple of kPanel), with the keys X packed in
// panels of kPanel (see pack_panels): kRows x P x kPanelVecs independent accumulators keep both FMA units busy.
// Two panels at a time where n allows and the registers suffice (twice the accumulators per broadcast of A),
// one for the rest. With `row_max`, the lanes of row_max[r] take the largest S[r][j] over row r's causal keys
// j < first_key + r + 1 (reduced to one number once the row is done, not once per panel).
template <int D, int P>
inline void panel_products(const float* const a[kRows], const float* panel, float* s, int64_t lds, int64_t j,
                           vec* row_max, int64_t first_key) {
    vec acc[kRows][P * kPanelVecs];
    for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < P * kPanelVecs; ++v) acc[r][v] = splat(0);
    for (int d = 0; d < D; ++d) {
        vec b[P * kPanelVecs];
        for (int q = 0; q < P; ++q)
            for (int v = 0; v < kPanelVecs; ++v)
                b[q * kPanelVecs + v] = load(panel + q * D * kPanel + d * kPanel + v * kW);
        for (int r = 0; r < kRows; ++r) {
            const vec ar = splat(a[r][d]);
            for (int v = 0; v < P * kPanelVecs; ++v) acc[r][v] += ar * b[v];
        }
    }
    // Keys below first_key + 1 are causal for every row: only the panels reaching past it need the mask.
    const bool masked = j + P * kPanel > first_key + 1;
    for (int r = 0; r < kRows; ++r)
        for (int q = 0; q < P; ++q)
            for (int v = 0; v < kPanelVecs; ++v) {
                const int64_t at = j + q * kPanel + v * kW;
                const vec x = acc[r][q * kPanelVecs + v];
                store(s + r * lds + at, x);
                if (row_max != nullptr)
                    row_max[r] = vmax(row_max[r], masked ? below(x, at, first_key + r + 1, -FLT_MAX) : x);
            }
}

template <int D>
void row_products(const float* const a[kRows], const float* panels, int64_t n, float* s, int64_t lds,
                  float* row_max = nullptr, int64_t first_key = 0) {
    vec lanes[kRows];
    for (int r = 0; r < kRows; ++r) lanes[r] = splat(-FLT_MAX);
    vec* maxima = row_max != nullptr ? lanes : nullptr;
    int64_t j = 0;
    if (kRows * 2 * kPanelVecs <= kAccs)  // only where the accumulators of two panels fit in registers
        for (; j + 2 * kPanel <= n; j += 2 * kPanel)
            panel_products<D, 2>(a, panels + j * D, s, lds, j, maxima, first_key);
    for (; j < n; j += kPanel) panel_products<D, 1>(a, panels + j * D, s, lds, j, maxima, first_key);
    if (row_max != nullptr)
        for (int r = 0; r < kRows; ++r) {
            float top = -FLT_MAX;
            for (int k = 0; k < kW; ++k) top = lanes[r][k] > top ? lanes[r][k] : top;
            row_max[r] = top;
        }
}

// out_r (+)= sum_{j0 <= j < n} W(r, j) * X_j for r < kRows, with W(r, j) = w[r * wr + j * wc] and X_j = x + j * stride
// (D floats each): the rows of W times X (wr = ldw, wc = 1) or, for a transposed W (wr = 1, wc = ldw), its columns.
template <int D, bool Accumulate>
void weighted_sum(const float* w, int64_t wr, int64_t wc, int64_t j0, int64_t n, const float* x, int64_t stride,
                  float* const out[kRows]) {
    constexpr int NV = D / kW > 0 ? D / kW : 1;  // (heads narrower than a vector are refused)
    constexpr int R = kAccs / NV < 1 ? 1 : (kAccs / NV > kRows ? kRows : kAccs / NV);  // accumulators in registers
    for (int r0 = 0; r0 < kRows; r0 += R) {
        vec acc[R][NV];
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v) acc[r][v] = Accumulate ? load(out[r0 + r] + kW * v) : splat(0);
        for (int64_t j = j0; j < n; ++j) {
            const float* xj = x + j * stride;
            const float* wj = w + j * wc + r0 * wr;
            for (int v = 0; v < NV; ++v) {
                const vec xv = load(xj + kW * v);
                for (int r = 0; r < R; ++r) acc[r][v] += splat(wj[r * wr]) * xv;
            }
        }
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v) store(out[r0 + r] + kW * v, acc[r][v]);
    }
}

// Rows of the projection are far apart (3 H D floats), too far for the hardware prefetcher to follow: ask
// for row j a few rows before it is read.
constexpr int64_t kPrefetchRows = 8;
template <int D>
inline void prefetch_row(const float* x, int64_t stride, int64_t j, int64_t L) {
    if (j >= L) return;
    for (int d = 0; d < D; d += 16) __builtin_prefetch(x + j * stride + d);
}

// The rows X_j + bias (j < L; no bias where it is null) in panels of kPanel rows, each stored transposed:
// element d of row j lands at panels[(j / kPanel) * D * kPanel + d * kPanel + j % kPanel]; rows past L are zero.
template <int D>
void pack_panels(const float* x, int64_t stride, int64_t L, const float* bias, float* panels) {
    const int64_t padded = round_panel(L), whole = L / kPanel * kPanel;
    std::memset(panels + whole * D, 0, sizeof(float) * (padded - whole) * D);
    int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    // Whole panels by gathering each column of kPanel rows into vectors (scalar stores are several times slower).
    for (; j < whole; j += kPanel) {
        for (int64_t ahead = j + kPanel; ahead < j + 2 * kPanel; ++ahead) prefetch_row<D>(x, stride, ahead, L);
        const float* base = x + j * stride;
        float* panel = panels + j * D;
#if defined(__AVX512F__)
        // 16 rows x 16 columns at a time, transposed in registers: whole-row loads instead of 16-lane gathers.
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16], columns[16];
            const __m512 shift = bias != nullptr ? _mm512_loadu_ps(bias + d0) : _mm512_setzero_ps();
            for (int k = 0; k < 16; ++k) r[k] = _mm512_add_ps(_mm512_loadu_ps(base + k * stride + d0), shift);
            transpose16(r, columns);
            for (int k = 0; k < 16; ++k) _mm512_store_ps(panel + (d0 + k) * kPanel, columns[k]);
        }
#else
        const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                _mm256_set1_epi32((int)stride));
        for (int d = 0; d < D; ++d) {
            const __m256 shift = _mm256_set1_ps(bias != nullptr ? bias[d] : 0.0f);
            _mm256_storeu_ps(panel + d * kPanel, _mm256_add_ps(_mm256_i32gather_ps(base + d, rows, 4), shift));
            _mm256_storeu_ps(panel + d * kPanel + 8,
                             _mm256_add_ps(_mm256_i32gather_ps(base + 8 * stride + d, rows, 4), shift));
        }
#endif
    }
#endif
    for (; j < L; ++j) {
        prefetch_row<D>(x, stride, j + kPrefetchRows, L);
        float* column = panels + (j / kPanel) * D * kPanel + j % kPanel;
        const float* row = x + j * stride;
        for (int d = 0; d < D; ++d) column[d * kPanel] = row[d] + (bias != nullptr ? bias[d] : 0.0f);
    }
}

// The rows X_j + bias (j < L; no bias where it is null) copied next to each other: strided rows of the
// projection would keep evicting each other from the L1 cache (their stride is a multiple of its set size).
template <int D>
void pack_rows(const float* x, int64_t stride, int64_t L, const float* bias, float* rows) {
    for (int64_t j = 0; j < L; ++j) {
        prefetch_row<D>(x, stride, j + kPrefetchRows, L);
        if (bias == nullptr) {
            std::memcpy(rows + j * D, x + j * stride, sizeof(float) * D);
            continue;
        }
        for (int d = 0; d < D; d += kW) store(rows + j * D + d, load(x + j * stride + d) + load(bias + d));
    }
}

// Rows i0 .. i0 + rows - 1 of the block; rows past the end repeat the last one (their results are unused).
inline void block_rows(const float* base, int64_t stride, int64_t i0, int64_t rows, const float* out[kRows]) {
    for (int64_t r = 0; r < kRows; ++r) out[r] = base + (i0 + (r < rows ? r : rows - 1)) * stride;
}

template <int D>
void forward_head(const Head& h, int64_t L, float scale, float* o, int64_t o_row, float* lse,
                  std::vector<float>& work) {
    const int64_t ld = round_panel(L);
    float* kt = aligned_work(work, D * ld + kRows * ld + 2 * L * D);
    float* s = kt + D * ld;
    float* v = s + kRows * ld;
    pack_panels<D>(h.q + h.kv, h.row, L, h.bias_at(h.kv), kt);
    pack_rows<D>(h.q + 2 * h.kv, h.row, L, h.bias_at(2 * h.kv), v);
    // Q is read in place, or with its bias added first.
    const float* queries = h.q;
    int64_t query_row = h.row;
    if (h.bias != nullptr) {
        float* biased = v + L * D;
        pack_rows<D>(h.q, h.row, L, h.bias, biased);
        queries = biased;
        query_row = D;
    }
    for (int64_t i0 = 0; i0 < L; i0 += kRows) {
        const int64_t rows = L - i0 < kRows ? L - i0 : kRows, n = i0 + rows;
        const float* q[kRows];
        block_rows(queries, query_row, i0, rows, q);
        float row_max[kRows], inv[kRows];
        row_products<D>(q, kt, round_panel(n), s, ld, row_max, i0);
        for (int64_t r = 0; r < kRows; ++r) {
            float* p = s + r * ld;
            const int64_t valid = r < rows ? i0 + r + 1 : 0;  // keys 0 .. i
            if (valid == 0) {  // a row past the end: its output is discarded
                for (int64_t j = 0; j < n; ++j) p[j] = 0.0f;
                inv[r] = 0.0f;
                continue;
            }
            // Whole vectors up to `span` (<= the panels computed), the keys past i masked out. The rows of P are
            // left unnormalised: the output rows are scaled by 1 / sum instead, after the product with V.
            const int64_t span = (valid + kW - 1) / kW * kW;
            const float m = row_max[r] * scale;
            vec vsum = splat(0);
            for (int64_t jb = 0; jb < span; jb += kW) {
                const vec e = below(vexp(vmin(load(p + jb) * scale - m, splat(0))), jb, valid, 0.0f);
                store(p + jb, e);
                vsum += e;
            }
            float sum = 0.0f;
            for (int k = 0; k < kW; ++k) sum += vsum[k];
            inv[r] = 1.0f / sum;
            for (int64_t j = span; j < n; ++j) p[j] = 0.0f;
            if (lse != nullptr) lse[i0 + r] = m + std::log(sum);
        }
        float* out[kRows];
        float scratch[kRows][D];
        for (int64_t r = 0; r < kRows; ++r) out[r] = r < rows ? o + (i0 + r) * o_row : scratch[r];
        weighted_sum<D, false>(s, ld, 1, 0, n, v, D, out);
        for (int64_t r = 0; r < rows; ++r)
            for (int d = 0; d < D; d += kW) store(out[r] + d, load(out[r] + d) * inv[r]);
    }
}

constexpr int64_t kChunk = 64;  // query rows whose P and dS rows are kept at once in the backward pass

template <int D>
void backward_head(const Head& h, int64_t L, float scale, const float* o, const float* go, int64_t o_row,
                   const float* lse, float* g, float* grad_bias, std::vector<float>& work) {
    const int64_t ld = round_panel(L);
    float* kt = aligned_work(work, 2 * D * ld + 2 * kChunk * ld + 5 * L * D + L + kRows * D);
    float* vt = kt + D * ld;
    float* p = vt + D * ld;      // P rows of the chunk
    float* ds = p + kChunk * ld;  // dS rows of the chunk
    float* gk = ds + kChunk * ld;
    float* gv = gk + L * D;
    float* k = gv + L * D;
    float* q = k + L * D;
    float* dout = q + L * D;
    float* delta = dout + L * D;
    float* scratch = delta + L;  // kRows rows of D
    pack_panels<D>(h.q + h.kv, h.row, L, h.bias_at(h.kv), kt);
    pack_panels<D>(h.q + 2 * h.kv, h.row, L, h.bias_at(2 * h.kv), vt);
    pack_rows<D>(h.q + h.kv, h.row, L, h.bias_at(h.kv), k);
    pack_rows<D>(h.q, h.row, L, h.bias, q);
    pack_rows<D>(go, o_row, L, nullptr, dout);
    std::memset(gk, 0, sizeof(float) * 2 * L * D);
    for (int64_t i = 0; i < L; ++i) {
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc += dout[i * D + d] * o[i * o_row + d];
        delta[i] = acc;
    }
    for (int64_t c0 = 0; c0 < L; c0 += kChunk) {
        const int64_t c1 = L - c0 < kChunk ? L : c0 + kChunk;
        for (int64_t i0 = c0; i0 < c1; i0 += kRows) {
            const int64_t rows = c1 - i0 < kRows ? c1 - i0 : kRows, n = i0 + rows;
            const float *qr[kRows], *dr_[kRows];
            block_rows(q, D, i0, rows, qr);
            block_rows(dout, D, i0, rows, dr_);
            float* pb = p + (i0 - c0) * ld;
            float* db = ds + (i0 - c0) * ld;
            row_products<D>(qr, kt, round_panel(n), pb, ld);
            row_products<D>(dr_, vt, round_panel(n), db, ld);
            for (int64_t r = 0; r < kRows; ++r) {
                if (r >= rows) break;
                float* pr = pb + r * ld;
                float* dr = db + r * ld;
                const int64_t valid = i0 + r + 1;
                const float l = lse[i0 + r], dl = delta[i0 + r];
                // Whole vectors again; the keys past i get P = dS = 0, which is what the products below read.
                const int64_t span = (valid + kW - 1) / kW * kW;
                for (int64_t jb = 0; jb < span; jb += kW) {
                    const vec e = below(vexp(vmin(load(pr + jb) * scale - l, splat(0))), jb, valid, 0.0f);
                    store(pr + jb, e);
                    store(dr + jb, e * (load(dr + jb) - dl) * scale);
                }
            }
            float* gq[kRows];
            for (int64_t r = 0; r < kRows; ++r) gq[r] = r < rows ? g + (i0 + r) * h.row : scratch + r * D;
            weighted_sum<D, false>(db, ld, 1, 0, n, k, D, gq);
        }
        // dV_j += sum_i P_ij dO_i and dK_j += sum_i dS_ij Q_i over the chunk's rows i >= j.
        for (int64_t j0 = 0; j0 < c1; j0 += kRows) {
            const int64_t i_start = j0 > c0 ? j0 : c0;
            float *gvr[kRows], *gkr[kRows];
            for (int64_t r = 0; r < kRows; ++r) {
                const bool real = j0 + r < L;
                gvr[r] = real ? gv + (j0 + r) * D : scratch + r * D;
                gkr[r] = real ? gk + (j0 + r) * D : scratch + r * D;
            }
            const int64_t first = i_start - c0;
            weighted_sum<D, true>(p + first * ld + j0, 1, ld, 0, c1 - i_start, dout + i_start * D, D, gvr);
            weighted_sum<D, true>(ds + first * ld + j0, 1, ld, 0, c1 - i_start, q + i_start * D, D, gkr);
        }
    }
    for (int64_t j = 0; j < L; ++j) {
        std::memcpy(g + j * h.row + h.kv, gk + j * D, sizeof(float) * D);
        std::memcpy(g + j * h.row + 2 * h.kv, gv + j * D, sizeof(float) * D);
    }
    if (grad_bias == nullptr) return;
    // The bias's gradient: the column sums of dQ, dK and dV over this head's rows (dQ read back while cached).
    for (int d = 0; d < D; d += kW) {
        vec sq = splat(0), sk = splat(0), sv = splat(0);
        for (int64_t j = 0; j < L; ++j) {
            sq += load(g + j * h.row + d);
            sk += load(gk + j * D + d);
            sv += load(gv + j * D + d);
        }
        store(grad_bias + d, sq);
        store(grad_bias + h.kv + d, sk);
        store(grad_bias + 2 * h.kv + d, sv);
    }
}

template <int D>
void forward(const float* qkv, const float* bias, float* out, float* lse, int64_t B, int64_t L, int64_t H, float scale,
             int64_t threads) {
    gatedformer::parallel_chunks(B * H, threads, 1, [=](int64_t lo, int64_t hi) {
        const FlushDenormals flush;
        std::vector<float> work;
        for (int64_t bh = lo; bh < hi; ++bh) {
            const int64_t b = bh / H, hd = bh % H;
            const Head head{qkv + b * L * 3 * H * D + hd * D, 3 * H * D, H * D, bias ? bias + hd * D : nullptr};
            forward_head<D>(head, L, scale, out + b * L * H * D + hd * D, H * D, lse ? lse + bh * L : nullptr, work);
        }
    });
}

template <int D>
void backward(const float* qkv, const float* bias, const float* out, const float* grad_out, const float* lse,
              float* grad_qkv, float* grad_bias, int64_t B, int64_t L, int64_t H, float scale, int64_t threads) {
    gatedformer::parallel_chunks(B * H, threads, 1, [=](int64_t lo, int64_t hi) {
        const FlushDenormals flush;
        std::vector<float> work;
        for (int64_t bh = lo; bh < hi; ++bh) {
            const int64_t b = bh / H, hd = bh % H;
            const int64_t at = b * L * 3 * H * D + hd * D, o_at = b * L * H * D + hd * D;
            const Head head{qkv + at, 3 * H * D, H * D, bias ? bias + hd * D : nullptr};
            backward_head<D>(head, L, scale, out + o_at, grad_out + o_at, H * D, lse + bh * L, grad_qkv + at,
                             grad_bias ? grad_bias + b * 3 * H * D + hd * D : nullptr, work);
        }
    });
}

}  // namespace

extern "C" {
int attention_head_supported(int64_t D) {
    return D % kW == 0 && (D == 8 || D == 16 || D == 32 || D == 64 || D == 128);
}
// bias: the projection's (3 H D), added to Q, K and V as they are read; null if qkv has it already.
int attention_forward_f32(const float* qkv, const float* bias, float* out, float* lse, int64_t B, int64_t L,
                          int64_t H, int64_t D, double scale, int64_t threads) {
    if (D % kW) return 1;
    switch (D) {
        case 8: forward<8>(qkv, bias, out, lse, B, L, H, (float)scale, threads); return 0;
        case 16: forward<16>(qkv, bias, out, lse, B, L, H, (float)scale, threads); return 0;
        case 32: forward<32>(qkv, bias, out, lse, B, L, H, (float)scale, threads); return 0;
        case 64: forward<64>(qkv, bias, out, lse, B, L, H, (float)scale, threads); return 0;
        case 128: forward<128>(qkv, bias, out, lse, B, L, H, (float)scale, threads); return 0;
        default: return 1;
    }
}
// grad_bias: (B, 3 H D) per-sequence sums of the gradient's rows (null: not wanted).
int attention_backward_f32(const float* qkv, const float* bias, const float* out, const float* grad_out,
                           const float* lse, float* grad_qkv, float* grad_bias, int64_t B, int64_t L, int64_t H,
                           int64_t D, double scale, int64_t threads) {
    if (D % kW) return 1;
    switch (D) {
        case 8: backward<8>(qkv, bias, out, grad_out, lse, grad_qkv, grad_bias, B, L, H, (float)scale, threads);
            return 0;
        case 16: backward<16>(qkv, bias, out, grad_out, lse, grad_qkv, grad_bias, B, L, H, (float)scale, threads);
            return 0;
        case 32: backward<32>(qkv, bias, out, grad_out, lse, grad_qkv, grad_bias, B, L, H, (float)scale, threads);
            return 0;
        case 64: backward<64>(qkv, bias, out, grad_out, lse, grad_qkv, grad_bias, B, L, H, (float)scale, threads);
            return 0;
        case 128: backward<128>(qkv, bias, out, grad_out, lse, grad_qkv, grad_bias, B, L, H, (float)scale, threads);
            return 0;
        default: return 1;
    }
}
}
#include "common.h"
