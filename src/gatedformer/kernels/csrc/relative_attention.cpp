// Relative-position causal attention (Transformer-XL), forward and backward. Compiled by gatedformer.
#include "parallel.h"
#include "relative_attention.h"

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
constexpr int kPanelVecs = 1;   // vectors per panel of packed keys
constexpr int kAccs = 16;       // accumulators a loop keeps in registers (of 32)
#else
constexpr int64_t kRows = 4;
constexpr int kPanelVecs = 2;
constexpr int kAccs = 8;        // of 16
#endif
constexpr int64_t kPanel = kPanelVecs * kW;  // keys per panel
inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Shapes of one call. Q rows are q_row floats apart, K/V rows kv_row (V at + v_at), position rows r_row.
struct Shape {
    int64_t L, M, K, D, Dp;  // queries, memory, keys, head size, head size padded to whole vectors
    float scale;
};

// Rows of a tensor, stride floats apart, the first `split` of them at `first` and the others at `rest`: keys and
// values over [memory, current] come from two projections' outputs without being joined in memory.
template <typename T>
struct Rows {
    T* first;
    T* rest;
    int64_t split, first_stride, stride;
    T* at(int64_t j) const { return j < split ? first + j * first_stride : rest + (j - split) * stride; }
};
template <typename T>
Rows<T> rows_of(T* base, int64_t stride) { return Rows<T>{base, base, 0, stride, stride}; }

// The kW floats of a row from column d on, zeros from column D on (a masked load for the last part vector).
inline vec load_part(const float* row, int64_t d, int64_t D) {
    return d + kW <= D ? load(row + d) : d < D ? load_first(row + d, D - d) : splat(0);
}

// dst[0 .. D) = src[0 .. D) from a padded row (whole vectors readable): inline, where memcpy of a few dozen bytes is
// a call.
inline void store_row(float* dst, const float* src, int64_t D) {
    for (int64_t d = 0; d < D; d += kW) {
        if (d + kW <= D)
            store(dst + d, load(src + d));
        else
            store_first(dst + d, load(src + d), D - d);
    }
}

// dst[j][d] = (src row j [d] + add[d]) * mul for d < D (no add where it is null), zero for D <= d < Dp.
void pack_rows(const Rows<const float>& src, int64_t n, const Shape& z, const float* add, float mul, float* dst) {
    for (int64_t j = 0; j < n; ++j) {
        const float* row = src.at(j);
        for (int64_t d = 0; d < z.Dp; d += kW)
            store(dst + j * z.Dp + d,
                  (load_part(row, d, z.D) + (add != nullptr ? load_part(add, d, z.D) : splat(0))) * mul);
    }
}

// Rows j < n of src in panels of kPanel rows, each stored transposed: element d of row j lands at
// panels[(j / kPanel) * Dp * kPanel + d * kPanel + j % kPanel]; rows n .. round_up(n, kPanel) and the columns
// D <= d < Dp are zero.
void pack_panels(const Rows<const float>& src, int64_t n, int64_t D, int64_t Dp, float* panels) {
    const int64_t padded = round_up(n, kPanel);
#if defined(__AVX512F__)
    // 16 rows x 16 columns at a time, transposed in registers (scalar stores are several times slower); a head
    // narrower than 16 reads its columns under a mask, rows past n read as zero.
    for (int64_t j = 0; j < padded; j += kPanel) {
        float* panel = panels + j * Dp;
        for (int64_t d0 = 0; d0 < Dp; d0 += 16) {
            const int64_t cols = D - d0 < 16 ? (D > d0 ? D - d0 : 0) : 16;
            const __mmask16 mask = (__mmask16)((1u << cols) - 1);
            __m512 x[16], columns[16];
            for (int k = 0; k < 16; ++k)
                x[k] = j + k < n ? _mm512_maskz_loadu_ps(mask, src.at(j + k) + d0) : _mm512_setzero_ps();
            transpose16(x, columns);
            for (int k = 0; k < 16; ++k) _mm512_storeu_ps(panel + (d0 + k) * kPanel, columns[k]);
        }
    }
#else
    for (int64_t j = 0; j < padded; ++j) {
        float* column = panels + (j / kPanel) * Dp * kPanel + j % kPanel;
        for (int64_t d = 0; d < Dp; ++d) column[d * kPanel] = j < n && d < D ? src.at(j)[d] : 0.0f;
    }
#endif
}

// S[r][j] = sum_{d < depth} A_r[d] X_j[d] for r < kRows and the P panels of keys from j: kRows x P x kPanelVecs
// accumulators, one broadcast of A_r[d] for P * kPanelVecs fused multiply-adds. D is a compile-time constant (the
// padded head size, the panels' stride) so that the loop unrolls and the panel's vectors stay in registers; depth is
// the head size itself: the padding columns are zero and need no multiply-adds (a quarter of them at heads of 12).
template <int D, int P>
inline void panel_products(const float* const a[kRows], const float* panel, float* s, int64_t lds, int64_t j,
                           int64_t depth) {
    vec acc[kRows][P * kPanelVecs];
    for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < P * kPanelVecs; ++v) acc[r][v] = splat(0);
    const auto step = [&](int d) __attribute__((always_inline)) {
        vec b[P * kPanelVecs];
        for (int q = 0; q < P; ++q)
            for (int v = 0; v < kPanelVecs; ++v)
                b[q * kPanelVecs + v] = load(panel + q * D * kPanel + d * kPanel + v * kW);
        for (int r = 0; r < kRows; ++r) {
            const vec ar = splat(a[r][d]);
            for (int v = 0; v < P * kPanelVecs; ++v) acc[r][v] += ar * b[v];
        }
    };
    if (depth == D)
        for (int d = 0; d < D; ++d) step(d);
    else
        for (int d = 0; d < depth; ++d) step(d);
    for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < P * kPanelVecs; ++v) store(s + r * lds + j + v * kW, acc[r][v]);
}

// The products of the block's rows with the packed keys j0 <= j < j1 (both multiples of kPanel).
template <int D>
void products(const float* const a[kRows], const float* panels, int64_t j0, int64_t j1, float* s, int64_t lds,
              int64_t depth) {
    int64_t j = j0;
    if (kRows * 2 * kPanelVecs <= kAccs)
        for (; j + 2 * kPanel <= j1; j += 2 * kPanel) panel_products<D, 2>(a, panels + j * D, s, lds, j, depth);
    for (; j < j1; j += kPanel) panel_products<D, 1>(a, panels + j * D, s, lds, j, depth);
}

// out_r (+)= sum_{j0 <= j < n} W(r, j) X_j for r < kRows, W(r, j) = w[r * wr + j * wc], X_j = x + j * NV * kW.
template <int NV, bool Accumulate>
void weighted_sum(const float* w, int64_t wr, int64_t wc, int64_t j0, int64_t n, const float* x,
                  float* const out[kRows]) {
    // Rows whose accumulators are kept in registers at once: a power of two, so that it divides kRows.
    constexpr int fit = kAccs / NV;
    constexpr int R = fit >= kRows ? kRows : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
    for (int r0 = 0; r0 < kRows; r0 += R) {
        vec acc[R][NV];
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v) acc[r][v] = Accumulate ? load(out[r0 + r] + kW * v) : splat(0);
        for (int64_t j = j0; j < n; ++j) {
            const float* xj = x + j * NV * kW;
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

// Rows i0 .. i0 + rows - 1 of a packed block; rows past the end repeat the last one (their results are unused).
inline void block_rows(const float* base, int64_t stride, int64_t i0, int64_t rows, const float* out[kRows]) {
    for (int64_t r = 0; r < kRows; ++r) out[r] = base + (i0 + (r < rows ? r : rows - 1)) * stride;
}

// One (sequence, head): its rows in every tensor, and the head's position keys packed (shared by the sequences).
struct Head {
    Rows<const float> q, k, v;
    const float *u, *pb;  // pb: the position bias (the paper's v)
    const float *r_panels, *r_rows;  // as pack_panels and pack_rows leave them (rows: the backward pass only)
};

// The scores of rows i0 .. i0 + rows - 1 (content products in sc, position products in sp), combined in place in
// sc: sc[r][j] = sc[r][j] + sp[r][j + L - 1 - i] for the causal keys j <= M + i; lanes past them get `fill`.
// Returns nothing; the caller turns the rows into probabilities.
template <int D>
void block_scores(const Shape& z, const float* a, const float* b, const float* kt, const float* rt, int64_t i0,
                  int64_t rows, float* sc, float* sp, int64_t ld) {
    const float *ar[kRows], *br[kRows];
    block_rows(a, z.Dp, i0, rows, ar);
    block_rows(b, z.Dp, i0, rows, br);
    const int64_t n = z.M + i0 + rows;  // keys that any row of the block sees
    products<D>(ar, kt, 0, round_up(n, kPanel), sc, ld, z.D);
    // Row i reads position columns L - 1 - i .. K - 1: the block's lowest is that of its last row.
    const int64_t c0 = (z.L - i0 - rows) / kPanel * kPanel;
    products<D>(br, rt, c0, round_up(z.K, kPanel), sp, ld, z.D);
}

template <int NV>
void forward_head(const Shape& z, const Head& h, float* o, int64_t o_row, float* lse, std::vector<float>& work) {
    const int64_t Dp = z.Dp, ld = round_up(z.K, kPanel) + kPanel;
    float* kt = aligned_work(work, ld * Dp + z.K * Dp + 2 * z.L * Dp + 2 * kRows * ld + kRows * Dp);
    const float* rt = h.r_panels;
    float* vr = kt + ld * Dp;
    float* a = vr + z.K * Dp;
    float* b = a + z.L * Dp;
    float* sc = b + z.L * Dp;
    float* sp = sc + kRows * ld;
    float* scratch = sp + kRows * ld;
    pack_rows(h.q, z.L, z, h.u, z.scale, a);
    pack_rows(h.q, z.L, z, h.pb, z.scale, b);
    pack_panels(h.k, z.K, z.D, Dp, kt);
    pack_rows(h.v, z.K, z, nullptr, 1.0f, vr);
    std::memset(sp, 0, sizeof(float) * kRows * ld);  // columns the products skip are read (then masked)
    for (int64_t i0 = 0; i0 < z.L; i0 += kRows) {
        const int64_t rows = z.L - i0 < kRows ? z.L - i0 : kRows, n = z.M + i0 + rows;
        block_scores<NV * kW>(z, a, b, kt, rt, i0, rows, sc, sp, ld);
        float inv[kRows];
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r, valid = z.M + i + 1, shift = z.L - 1 - i, span = round_up(valid, kW);
            float* s = sc + r * ld;
            const float* p = sp + r * ld + shift;
            vec top = splat(-FLT_MAX);
            for (int64_t jb = 0; jb < span; jb += kW) {
                const vec x = below(load(s + jb) + load(p + jb), jb, valid, -FLT_MAX);
                store(s + jb, x);
                top = vmax(top, x);
            }
            const float m = hmax(top);
            vec sum = splat(0);
            for (int64_t jb = 0; jb < span; jb += kW) {
                const vec e = below(vexp(load(s + jb) - m), jb, valid, 0.0f);
                store(s + jb, e);
                sum += e;
            }
            for (int64_t j = span; j < n; ++j) s[j] = 0.0f;
            const float total = hsum(sum);
            inv[r] = 1.0f / total;
            if (lse != nullptr) lse[i] = m + std::log(total);
        }
        float* out[kRows];
        for (int64_t r = 0; r < kRows; ++r) out[r] = scratch + r * Dp;
        for (int64_t r = rows; r < kRows; ++r)  // rows past the end: zero weights, results unused
            std::memset(sc + r * ld, 0, sizeof(float) * n);
        weighted_sum<NV, false>(sc, ld, 1, 0, n, vr, out);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t d = 0; d < z.D; d += kW) {
                const vec x = load(out[r] + d) * inv[r];
                if (d + kW <= z.D)
                    store(o + (i0 + r) * o_row + d, x);
                else
                    store_first(o + (i0 + r) * o_row + d, x, z.D - d);
            }
    }
}

// Gradients of one (sequence, head): gq, gk, gv like q, k and v, gr like r (this sequence's share), gu and gpb
// (D each) this head's share of u's and v's.
struct HeadGrad {
    Rows<float> q, k, v, r;
    float *u, *pb;
};

template <int NV>
void backward_head(const Shape& z, const Head& h, const float* o, const float* go, int64_t o_row, const float* lse,
                   const HeadGrad& g, std::vector<float>& work) {
    const int64_t Dp = z.Dp, ld = round_up(z.K, kPanel) + kPanel, Lr = round_up(z.L, kRows);
    float* kt = aligned_work(work, 2 * ld * Dp + z.K * Dp + 3 * z.L * Dp + 3 * Lr * ld + kRows * ld
                             + 2 * z.L * Dp + z.L + kRows * Dp);
    const float* rt = h.r_panels;
    const float* rr = h.r_rows;       // position rows
    float* vt = kt + ld * Dp;
    float* kr = vt + ld * Dp;         // K rows
    float* a = kr + z.K * Dp;         // (q + u) / sqrt(D)
    float* b = a + z.L * Dp;          // (q + v) / sqrt(D)
    float* dout = b + z.L * Dp;
    float* prob = dout + z.L * Dp;    // P, by key
    float* ds = prob + Lr * ld;       // dS, by key
    float* dsp = ds + Lr * ld;        // dS, by distance column (the shift undone)
    float* sp = dsp + Lr * ld;
    float* ga = sp + kRows * ld;      // dS K: the content part of dQ, before the scale
    float* gb = ga + z.L * Dp;        // dS R: the position part
    float* delta = gb + z.L * Dp;
    float* scratch = delta + z.L;
    pack_rows(h.q, z.L, z, h.u, z.scale, a);
    pack_rows(h.q, z.L, z, h.pb, z.scale, b);
    pack_panels(h.k, z.K, z.D, Dp, kt);
    pack_panels(h.v, z.K, z.D, Dp, vt);
    pack_rows(h.k, z.K, z, nullptr, 1.0f, kr);
    pack_rows(rows_of(go, o_row), z.L, z, nullptr, 1.0f, dout);
    std::memset(dsp, 0, sizeof(float) * Lr * ld);
    std::memset(sp, 0, sizeof(float) * kRows * ld);
    for (int64_t i = 0; i < z.L; ++i) {
        float acc = 0.0f;
        for (int64_t d = 0; d < z.D; ++d) acc += go[i * o_row + d] * o[i * o_row + d];
        delta[i] = acc;
    }
    for (int64_t i0 = 0; i0 < z.L; i0 += kRows) {
        const int64_t rows = z.L - i0 < kRows ? z.L - i0 : kRows, n = z.M + i0 + rows;
        float* pb = prob + i0 * ld;
        float* db = ds + i0 * ld;
        block_scores<NV * kW>(z, a, b, kt, rt, i0, rows, pb, sp, ld);
        const float* gr[kRows];
        block_rows(dout, Dp, i0, rows, gr);
        products<NV * kW>(gr, vt, 0, round_up(n, kPanel), db, ld, z.D);  // dP = dO V^T
        for (int64_t r = 0; r < kRows; ++r) {
            float* p = pb + r * ld;
            float* dr = db + r * ld;
            if (r >= rows) {  // rows past the end (the buffers have them): zero, so the sums below may read them
                std::memset(p, 0, sizeof(float) * ld);
                std::memset(dr, 0, sizeof(float) * ld);
                continue;
            }
            const int64_t i = i0 + r, valid = z.M + i + 1, shift = z.L - 1 - i, span = round_up(valid, kW);
            const float* s = sp + r * ld + shift;
            float* dshift = dsp + i * ld + shift;
            const float l = lse[i], dl = delta[i];
            // Whole vectors; the keys past M + i get P = dS = 0, which is what the sums below read.
            for (int64_t jb = 0; jb < span; jb += kW) {
                const vec e = below(vexp(vmin(load(p + jb) + load(s + jb) - l, splat(0))), jb, valid, 0.0f);
                const vec grad = e * (load(dr + jb) - dl);
                store(p + jb, e);
                store(dr + jb, grad);
                store(dshift + jb, grad);
            }
            std::memset(p + span, 0, sizeof(float) * (ld - span));
            std::memset(dr + span, 0, sizeof(float) * (ld - span));
        }
        float *outa[kRows], *outb[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
            outa[r] = r < rows ? ga + (i0 + r) * Dp : scratch;
            outb[r] = r < rows ? gb + (i0 + r) * Dp : scratch;
        }
        weighted_sum<NV, false>(db, ld, 1, 0, n, kr, outa);
        // Row i's distance columns start at L - 1 - i; the block's lowest is its last row's.
        const int64_t c0 = z.L - i0 - rows;
        weighted_sum<NV, false>(dsp + i0 * ld, ld, 1, c0, z.K, rr, outb);
    }
    // dQ = scale (dS K + dS_shifted R); u and v take the sums of the two parts over the rows.
    {
        vec sum_a[NV], sum_b[NV];
        for (int v = 0; v < NV; ++v) sum_a[v] = sum_b[v] = splat(0);
        float* row = scratch;
        for (int64_t i = 0; i < z.L; ++i) {
            for (int v = 0; v < NV; ++v) {
                const vec ca = load(ga + i * Dp + v * kW) * z.scale, cb = load(gb + i * Dp + v * kW) * z.scale;
                store(row + v * kW, ca + cb);
                sum_a[v] += ca;
                sum_b[v] += cb;
            }
            store_row(g.q.at(i), row, z.D);
        }
        for (int v = 0; v < NV; ++v) {
            store(row + v * kW, sum_a[v]);
            store(row + Dp + v * kW, sum_b[v]);
        }
        std::memcpy(g.u, row, sizeof(float) * z.D);
        std::memcpy(g.pb, row + Dp, sizeof(float) * z.D);
    }
    // dK_j = sum_i dS_ij A_i, dV_j = sum_i P_ij dO_i over the rows i >= j - M that see key j, and
    // dR_c = sum_i dS_shifted_ic B_i over the rows i >= L - 1 - c that reach distance column c.
    float* out[kRows];
    for (int64_t r = 0; r < kRows; ++r) out[r] = scratch + r * Dp;
    for (int64_t j0 = 0; j0 < z.K; j0 += kRows) {
        const int64_t cols = z.K - j0 < kRows ? z.K - j0 : kRows;
        const int64_t first = j0 > z.M ? j0 - z.M : 0;
        weighted_sum<NV, false>(ds + first * ld + j0, 1, ld, 0, z.L - first, a + first * Dp, out);
        for (int64_t r = 0; r < cols; ++r) store_row(g.k.at(j0 + r), out[r], z.D);
        weighted_sum<NV, false>(prob + first * ld + j0, 1, ld, 0, z.L - first, dout + first * Dp, out);
        for (int64_t r = 0; r < cols; ++r) store_row(g.v.at(j0 + r), out[r], z.D);
        const int64_t from = z.L - j0 - kRows > 0 ? z.L - j0 - kRows : 0;
        weighted_sum<NV, false>(dsp + from * ld + j0, 1, ld, 0, z.L - from, b + from * Dp, out);
        for (int64_t r = 0; r < cols; ++r) store_row(g.r.at(j0 + r), out[r], z.D);
    }
}

// A (B, rows, width) tensor whose sequences are `batch` floats apart and rows `row` apart (e.g. the queries, a view
// of one product's output that also holds the keys and values).
template <typename T>
struct Strided {
    T* base;
    int64_t batch, row;
    Rows<T> of(int64_t b, int64_t offset) const { return rows_of(base + b * batch + offset, row); }
};

// Keys then values over [memory, current]: the memory's (B, M, 2 H D) rows and the current window's (B, L, 2 H D),
// each with its own strides.
template <typename T>
struct KeyValues {
    Strided<T> mem, cur;
    // Sequence b's keys (offset 0) or values (offset H D) of head hd.
    Rows<T> of(int64_t b, int64_t offset, const Shape& z) const {
        return Rows<T>{mem.base + b * mem.batch + offset, cur.base + b * cur.batch + offset, z.M, mem.row, cur.row};
    }
};

// Every head's position keys packed once, for all the sequences: panels (ld rows each) and, with `rows`, rows.
struct PackedPositions {
    std::vector<float> work;
    float *panels, *rows;
    int64_t panel_floats, row_floats;
    PackedPositions(const Shape& z, const float* r, int64_t H, bool with_rows) {
        const int64_t ld = round_up(z.K, kPanel) + kPanel;
        panel_floats = round_up(ld * z.Dp, kW);
        row_floats = with_rows ? round_up(z.K * z.Dp, kW) : 0;
        panels = aligned_work(work, H * (panel_floats + row_floats));
        rows = panels + H * panel_floats;
        for (int64_t hd = 0; hd < H; ++hd) {
            const Rows<const float> r_head = rows_of(r + hd * z.D, H * z.D);
            pack_panels(r_head, z.K, z.D, z.Dp, panels + hd * panel_floats);
            if (with_rows) pack_rows(r_head, z.K, z, nullptr, 1.0f, rows + hd * row_floats);
        }
    }
};

template <int NV>
void forward(const Shape& z, Strided<const float> q, KeyValues<const float> kv, const float* r, const float* u,
             const float* pb, float* out, float* lse, int64_t B, int64_t H, int64_t threads) {
    const int64_t HD = H * z.D;
    const PackedPositions positions(z, r, H, false);
    const float* r_panels = positions.panels;
    const int64_t r_stride = positions.panel_floats;
    gatedformer::parallel_chunks(B * H, threads, 1, [=](int64_t lo, int64_t hi) {
        const FlushDenormals flush;
        std::vector<float> work;
        for (int64_t bh = lo; bh < hi; ++bh) {
            const int64_t bi = bh / H, hd = bh % H, at = hd * z.D;
            const Head head{q.of(bi, at), kv.of(bi, at, z), kv.of(bi, HD + at, z), u + at, pb + at,
                            r_panels + hd * r_stride, nullptr};
            forward_head<NV>(z, head, out + bi * z.L * HD + hd * z.D, HD, lse != nullptr ? lse + bh * z.L : nullptr,
                             work);
        }
    });
}

template <int NV>
void backward(const Shape& z, Strided<const float> q, KeyValues<const float> kv, const float* r, const float* u,
              const float* pb, const float* out, const float* grad_out, const float* lse, Strided<float> gq,
              KeyValues<float> gkv, float* gr, float* gu, float* gpb, int64_t B, int64_t H, int64_t threads) {
    const int64_t HD = H * z.D;
    const PackedPositions positions(z, r, H, true);
    const float *r_panels = positions.panels, *r_rows = positions.rows;
    const int64_t panel_stride = positions.panel_floats, row_stride = positions.row_floats;
    gatedformer::parallel_chunks(B * H, threads, 1, [=](int64_t lo, int64_t hi) {
        const FlushDenormals flush;
        std::vector<float> work;
        for (int64_t bh = lo; bh < hi; ++bh) {
            const int64_t bi = bh / H, hd = bh % H, at = hd * z.D, o_at = bi * z.L * HD + at;
            const Head head{q.of(bi, at), kv.of(bi, at, z), kv.of(bi, HD + at, z), u + at, pb + at,
                            r_panels + hd * panel_stride, r_rows + hd * row_stride};
            const HeadGrad grad{gq.of(bi, at), gkv.of(bi, at, z), gkv.of(bi, HD + at, z),
                                rows_of(gr + bi * z.K * HD + at, HD), gu + bh * z.D, gpb + bh * z.D};
            backward_head<NV>(z, head, out + o_at, grad_out + o_at, HD, lse + bh * z.L, grad, work);
        }
    });
}

bool make_shape(int64_t L, int64_t M, int64_t D, double scale, Shape* z) {
    if (L < 1 || M < 0 || D < 1 || D > 128) return false;
    const int64_t Dp = D <= 16 ? 16 : D <= 32 ? 32 : D <= 48 ? 48 : D <= 64 ? 64 : D <= 96 ? 96 : 128;
    *z = Shape{L, M, L + M, D, Dp, (float)scale};
    return true;
}

}  // namespace

extern "C" {
// q: (B, L, H D), sequences q_batch floats apart and rows q_row apart; the keys then values of the memory, (B, M,
// 2 H D) at kv_mem, and of the current window, (B, L, 2 H D) at kv_cur, each with its sequences' and rows' strides;
// r: (M + L, H D), row c the distance M + L - 1 - c; u, pb: (H, D). out: (B, L, H D); lse: (B, H, L) or null.
int relative_attention_forward_f32(const float* q, int64_t q_batch, int64_t q_row, const float* kv_mem,
                                   int64_t kv_mem_batch, int64_t kv_mem_row, const float* kv_cur, int64_t kv_cur_batch,
                                   int64_t kv_cur_row, const float* r, const float* u, const float* pb, float* out,
                                   float* lse, int64_t B, int64_t L, int64_t M, int64_t H, int64_t D, double scale,
                                   int64_t threads) {
    Shape z;
    if (!make_shape(L, M, D, scale, &z)) return 1;
    const Strided<const float> qs{q, q_batch, q_row};
    const KeyValues<const float> kv{{kv_mem, kv_mem_batch, kv_mem_row}, {kv_cur, kv_cur_batch, kv_cur_row}};
    switch (z.Dp / kW) {
        case 1: forward<1>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
        case 2: forward<2>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
        case 3: forward<3>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
        case 4: forward<4>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
        case 6: forward<6>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
        case 8: forward<8>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
#if !defined(__AVX512F__)
        case 12: forward<12>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
        case 16: forward<16>(z, qs, kv, r, u, pb, out, lse, B, H, threads); return 0;
#endif
        default: return 1;
    }
}
// gq, gkv_mem, gkv_cur: laid out as q, kv_mem and kv_cur; gr: (B, M + L, H D), each sequence's share of r's
// gradient; gu, gpb: (B, H, D), likewise for u and pb.
int relative_attention_backward_f32(const float* q, int64_t q_batch, int64_t q_row, const float* kv_mem,
                                    int64_t kv_mem_batch, int64_t kv_mem_row, const float* kv_cur,
                                    int64_t kv_cur_batch, int64_t kv_cur_row, const float* r, const float* u,
                                    const float* pb, const float* out, const float* grad_out, const float* lse,
                                    float* gq, float* gkv_mem, float* gkv_cur, float* gr, float* gu, float* gpb,
                                    int64_t B, int64_t L, int64_t M, int64_t H, int64_t D, double scale,
                                    int64_t threads) {
    Shape z;
    if (!make_shape(L, M, D, scale, &z)) return 1;
    const Strided<const float> qs{q, q_batch, q_row};
    const Strided<float> gqs{gq, q_batch, q_row};
    const KeyValues<const float> kv{{kv_mem, kv_mem_batch, kv_mem_row}, {kv_cur, kv_cur_batch, kv_cur_row}};
    const KeyValues<float> gkv{{gkv_mem, kv_mem_batch, kv_mem_row}, {gkv_cur, kv_cur_batch, kv_cur_row}};
#define GATEDFORMER_BACKWARD(NV) \
    backward<NV>(z, qs, kv, r, u, pb, out, grad_out, lse, gqs, gkv, gr, gu, gpb, B, H, threads)
    switch (z.Dp / kW) {
        case 1: GATEDFORMER_BACKWARD(1); return 0;
        case 2: GATEDFORMER_BACKWARD(2); return 0;
        case 3: GATEDFORMER_BACKWARD(3); return 0;
        case 4: GATEDFORMER_BACKWARD(4); return 0;
        case 6: GATEDFORMER_BACKWARD(6); return 0;
        case 8: GATEDFORMER_BACKWARD(8); return 0;
#if !defined(__AVX512F__)
        case 12: GATEDFORMER_BACKWARD(12); return 0;
        case 16: GATEDFORMER_BACKWARD(16); return 0;
#endif
        default: return 1;
    }
#undef GATEDFORMER_BACKWARD
}
}
#include "common.h"
