#include "parallel.h"
#include "epilogue.h"
#include "philox.h"

#if defined(_OPENMP)
#include <omp.h>
#endif
// Linear-layer epilogues with dropout masks; see gatedformer/kernels/epilogue.py.
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

// The epilogue of a linear layer, in place on its product h (rows of `cols`): h[i] = f(h[i] + bias[i % cols])
// times the mask, plus base[i] when there is a base (a residual connection); f is the ReLU or the identity.
// With `positive`, bit i % 32 of positive[i / 32] is set where the result is > 0 (what the backward pass of
// the ReLU form needs, 32 times smaller than the result).
template <bool ReluToo>
void bias_epilogue_range(const float* base, float* h, const float* bias, int64_t lo, int64_t hi, int64_t cols,
                         uint32_t k0, uint32_t k1, uint32_t keep_below, float scale, uint32_t* positive) {
    const uint32_t last = last_kept(keep_below);
    alignas(64) uint32_t words[kBulk];
    int64_t col = lo % cols;
    for (int64_t start = lo; start < hi; start += kBulk) {  // lo: a multiple of kBulk
        draw_bulk((uint64_t)start / kTile, k0, k1, words);
        const int64_t m = hi - start < kBulk ? hi - start : kBulk;
        for (int64_t j = 0; j < m;) {  // runs of one row, so that the bias is read contiguously
            const int64_t run = m - j < cols - col ? m - j : cols - col;
            float* hs = h + start + j;
            const float* bs = bias + col;
            const uint32_t* ws = words + j;
            if (base != nullptr) {
                const float* as = base + start + j;
                for (int64_t k = 0; k < run; ++k)
                    hs[k] = as[k] + (hs[k] + bs[k]) * (ws[k] <= last ? scale : 0.0f);
            } else {
                for (int64_t k = 0; k < run; ++k) {
                    const float v = hs[k] + bs[k];
                    const bool keep = ws[k] <= last && (!ReluToo || v > 0.0f);
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
}

template <bool ReluToo>
void bias_epilogue(const float* base, float* h, const float* bias, int64_t n, int64_t cols, uint64_t seed,
                   uint32_t keep_below, float scale, int64_t threads, uint32_t* positive = nullptr) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    gatedformer::parallel_chunks(n, threads, kBulk, [=](int64_t lo, int64_t hi) {
        bias_epilogue_range<ReluToo>(base, h, bias, lo, hi, cols, k0, k1, keep_below, scale, positive);
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

// Rows [lo, hi) of positive_scale_colsum, adding their column sums to acc.
void positive_scale_rows(const uint32_t* positive, const float* g, float* out, float* acc, int64_t lo, int64_t hi,
                         int64_t cols, float scale) {
    for (int64_t r = lo; r < hi; ++r) {
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

// Adds up the blocks' partial sums (`width` each) in order: the same sums whatever the number of threads.
void sum_blocks(const float* partials, int64_t blocks, int64_t width, float* sums) {
    for (int64_t c = 0; c < width; ++c) sums[c] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t c = 0; c < width; ++c) sums[c] += partials[b * width + c];
}

void positive_scale_colsum(const uint32_t* positive, const float* g, float* out, float* colsum, int64_t rows,
                           int64_t cols, float scale, int64_t threads) {
    const int64_t blocks = (rows + kSumRows - 1) / kSumRows;
    std::vector<float> partial(blocks * cols, 0.0f);
    float* partials = partial.data();
    gatedformer::parallel_chunks(blocks, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b)
            positive_scale_rows(positive, g, out, partials + b * cols, b * kSumRows,
                                (b + 1) * kSumRows < rows ? (b + 1) * kSumRows : rows, cols, scale);
    });
    sum_blocks(partials, blocks, cols, colsum);
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
    return w <= (v16u{} + last_kept(keep_below)) ? v16f{} + scale : v16f{};
}

// Bit k set where words[k] keeps its element, for k < count <= 32.
inline uint32_t keep_bits32(const uint32_t* words, int64_t count, uint32_t keep_below) {
    const uint32_t last = last_kept(keep_below);
#if defined(__AVX512F__)
    if (count == 32) {
        const __m512i limit = _mm512_set1_epi32((int)last);
        return (uint32_t)_mm512_cmple_epu32_mask(_mm512_loadu_si512(words), limit)
             | (uint32_t)_mm512_cmple_epu32_mask(_mm512_loadu_si512(words + 16), limit) << 16;
    }
#endif
    uint32_t bits = 0;
    for (int64_t k = 0; k < count; ++k) bits |= (uint32_t)(words[k] <= last) << k;
    return bits;
}

// A post-LN residual sublayer's tail, row by row (rows of `cols`): v = base + (h + bias) * mask, then
// y = (v - mean) * rstd * gamma + beta with rstd = 1 / sqrt(var + eps). xhat (which may be h itself) gets the
// normalised rows (v - mean) * rstd, rstd is kept per row, and the mask as bits (row r's element c at bit c % 32 of
// keep_bits[r * row_words(cols) + c / 32]): what the backward pass needs, without drawing the mask again.
inline int64_t row_words(int64_t cols) { return (cols + 31) / 32; }

// Rows [lo, hi) of dropout_add_norm (k0, k1: the seed's halves).
void dropout_add_norm_rows(const float* base, const float* h, const float* bias, const float* gate, float* xhat,
                           const float* gamma, const float* beta, float* y, float* rstd, uint32_t* keep_bits,
                           int64_t lo, int64_t hi, int64_t cols, float eps, uint32_t k0, uint32_t k1,
                           uint32_t keep_below, float scale) {
    const int64_t whole = cols / 16 * 16;
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
        const float* gr = gate != nullptr ? gate + r * cols : nullptr;
        v16f sums{};
        float sum = 0.0f;
        for (int64_t c = 0; c < whole; c += 16) {
            const v16f kept = (load16(hr + c) + load16(bias + c)) * keep_factor(&words[c], keep_below, scale);
            const v16f v = load16(br + c) + (gr != nullptr ? load16(gr + c) * kept : kept);
            store16(xr + c, v);
            sums += v;
        }
        for (int64_t c = whole; c < cols; ++c) {
            const float kept = (hr[c] + bias[c]) * (words[c] <= last_kept(keep_below) ? scale : 0.0f);
            xr[c] = br[c] + (gr != nullptr ? gr[c] * kept : kept);
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
}

void dropout_add_norm(const float* base, const float* h, const float* bias, const float* gate, float* xhat,
                      const float* gamma, const float* beta, float* y, float* rstd, uint32_t* keep_bits, int64_t rows,
                      int64_t cols, float eps, uint64_t seed, uint32_t keep_below, float scale, int64_t threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    gatedformer::parallel_chunks(rows, threads, 1, [=](int64_t lo, int64_t hi) {
        dropout_add_norm_rows(base, h, bias, gate, xhat, gamma, beta, y, rstd, keep_bits, lo, hi, cols, eps, k0, k1,
                              keep_below, scale);
    });
}

// Its backward pass from dy: with a = dy * gamma, dv = rstd * (a - mean(a) - xhat * mean(a * xhat)) (the
// residual's gradient) and dh = dv * mask (the linear layer's); sums[0 .. cols) gets the gradient of gamma
// (sum of dy * xhat), sums[cols .. 2 cols) that of beta (sum of dy) and sums[2 cols .. 3 cols) that of the bias
// (sum of dh), in fixed blocks of rows as positive_scale_colsum. With a gate g (the forward's, then h and bias
// are needed too): dh = dv * g * mask, dgate = dv * s * g * (1 - g) (the gradient of g's pre-activation, for
// g = sigmoid) with s = (h + bias) * mask, and sums[3 cols .. 4 cols) its column sums.
// Rows [lo, hi) of dropout_add_norm_backward, adding their column sums to acc (n_sums rows of cols).
void dropout_add_norm_backward_rows(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                                    const uint32_t* keep_bits, const float* gate, const float* h, const float* bias,
                                    float* dv, float* dh, float* dgate, float* acc, int64_t lo, int64_t hi,
                                    int64_t cols, float scale) {
    const int64_t whole = cols / 16 * 16;
    float* acc_gamma = acc;
    float* acc_beta = acc_gamma + cols;
    float* acc_bias = acc_beta + cols;
    float* acc_gate = acc_bias + cols;  // only with a gate
    for (int64_t r = lo; r < hi; ++r) {
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
        if (gate != nullptr) {
            const float* gater = gate + r * cols;
            const float* pre = h + r * cols;
            float* dgr = dgate + r * cols;
            for (int64_t c = 0; c < whole; c += 16) {
                const v16f g = load16(gr + c), x = load16(xr + c), gg = load16(gater + c);
                const v16f v = (g * load16(gamma + c) - mean_a - x * mean_ax) * inv;
                const v16u set = (v16u{} + (bits[c >> 5] >> (c & 16))) & kLaneBits;
                const v16f keep = set != 0 ? v16f{} + scale : v16f{};
                const v16f d = v * gg * keep;
                const v16f da = v * ((load16(pre + c) + load16(bias + c)) * keep) * (gg * (1.0f - gg));
                store16(vr + c, v);
                store16(hr + c, d);
                store16(dgr + c, da);
                store16(acc_gamma + c, load16(acc_gamma + c) + g * x);
                store16(acc_beta + c, load16(acc_beta + c) + g);
                store16(acc_bias + c, load16(acc_bias + c) + d);
                store16(acc_gate + c, load16(acc_gate + c) + da);
            }
            for (int64_t c = whole; c < cols; ++c) {
                const float v = inv * (gr[c] * gamma[c] - mean_a - xr[c] * mean_ax);
                const float keep = (bits[c >> 5] >> (c & 31)) & 1u ? scale : 0.0f;
                const float d = v * gater[c] * keep;
                const float da = v * ((pre[c] + bias[c]) * keep) * (gater[c] * (1.0f - gater[c]));
                vr[c] = v;
                hr[c] = d;
                dgr[c] = da;
                acc_gamma[c] += gr[c] * xr[c];
                acc_beta[c] += gr[c];
                acc_bias[c] += d;
                acc_gate[c] += da;
            }
            continue;
        }
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

void dropout_add_norm_backward(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                               const uint32_t* keep_bits, const float* gate, const float* h, const float* bias,
                               float* dv, float* dh, float* dgate, float* sums, int64_t rows, int64_t cols,
                               float scale, int64_t threads) {
    const int64_t n_sums = gate != nullptr ? 4 : 3;
    const int64_t blocks = (rows + kSumRows - 1) / kSumRows;
    std::vector<float> partial(blocks * n_sums * cols, 0.0f);
    float* partials = partial.data();
    gatedformer::parallel_chunks(blocks, threads, 1, [=](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b)
            dropout_add_norm_backward_rows(dy, xhat, rstd, gamma, keep_bits, gate, h, bias, dv, dh, dgate,
                                           partials + b * n_sums * cols, b * kSumRows,
                                           (b + 1) * kSumRows < rows ? (b + 1) * kSumRows : rows, cols, scale);
    });
    sum_blocks(partials, blocks, n_sums * cols, sums);
}


// ---- A whole post-LN FFN sublayer, each thread streaming its own blocks of rows through it ----------------------
// norm(x + dropout(W2 dropout(relu(W1 x + b1)) + b2)) with the same masks and sums as the kernels above called one
// after the other. Each of the `threads` OpenMP threads takes a contiguous share of blocks of `block_rows` rows and
// runs the whole sublayer on them with MKL on one thread (its packed products, the weights packed once per call):
// one parallel region instead of one per operation, and each block's hidden rows still in cache when the epilogue
// and the second product read them. MKL's functions come in by address from the Python side (PyTorch links MKL).
#include "packed_gemm.h"

// The two packed weights of one call: scratch, freed on return. MKL asks for several MB each whatever the sizes,
// of which only the packed weight's own size is written, so most of the pages are never touched. 64-byte aligned
// by hand (C++14 has no aligned allocation).
struct PackedPair {
    void* raw_first;
    void* raw_second;
    float* first;
    float* second;
    PackedPair(int64_t first_floats, int64_t second_floats)
        : raw_first(std::malloc((size_t)first_floats * 4 + 64)),
          raw_second(std::malloc((size_t)second_floats * 4 + 64)), first(aligned(raw_first)),
          second(aligned(raw_second)) {}
    ~PackedPair() {
        std::free(raw_first);
        std::free(raw_second);
    }
    PackedPair(const PackedPair&) = delete;
    PackedPair& operator=(const PackedPair&) = delete;
    bool ok() const { return raw_first != nullptr && raw_second != nullptr; }
    static float* aligned(void* raw) { return (float*)(((uintptr_t)raw + 63) / 64 * 64); }
};

void ffn_forward(const Blas& blas, const float* x, const float* w1, const float* b1, const float* w2, const float* b2,
                 const float* gamma, const float* beta, float* packed_w1t, float* packed_w2t, float* hidden,
                 uint32_t* positive, float* xhat, float* y, float* rstd, uint32_t* keep_bits, int64_t rows, int64_t d,
                 int64_t f, float eps, uint64_t inner_seed, uint32_t inner_keep, float inner_scale, uint64_t outer_seed,
                 uint32_t outer_keep, float outer_scale, int64_t block_rows, int64_t threads) {
    const uint32_t ik0 = (uint32_t)inner_seed, ik1 = (uint32_t)(inner_seed >> 32);
    const uint32_t ok0 = (uint32_t)outer_seed, ok1 = (uint32_t)(outer_seed >> 32);
    const int64_t blocks = (rows + block_rows - 1) / block_rows;
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        if (t == 0) blas.pack(kRowMajor, kBMatrix, kTrans, block_rows, f, d, 1.0f, w1, d, packed_w1t);
        if (t == (nt > 1 ? 1 : 0)) blas.pack(kRowMajor, kBMatrix, kTrans, block_rows, d, f, 1.0f, w2, f, packed_w2t);
        stream_barrier();
        for (int64_t b = first; b < end; ++b) {
            const int64_t lo = b * block_rows, hi = lo + block_rows < rows ? lo + block_rows : rows;
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, f, d, x + lo * d, d, packed_w1t, f, 0.0f,
                         hidden + lo * f, f);
            bias_epilogue_range<true>(nullptr, hidden, b1, lo * f, hi * f, f, ik0, ik1, inner_keep, inner_scale,
                                      positive);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, f, hidden + lo * f, f, packed_w2t, d, 0.0f,
                         xhat + lo * d, d);
            if (gamma != nullptr)
                dropout_add_norm_rows(x, xhat, b2, nullptr, xhat, gamma, beta, y, rstd, keep_bits, lo, hi, d, eps, ok0,
                                      ok1, outer_keep, outer_scale);
        }
    });
}

// Its backward pass: grad_x gets the residual's gradient plus the body's, grad_outer the second product's output
// gradient and grad_inner the first's; sums gets those of gamma, beta and b2 (d each), then b1's (f). Without dy (the
// body only, gamma null in the forward pass), grad_outer is given and grad_x already holds the rest of x's gradient,
// to which the body's is added. With grad_weights (else null), W1's gradient (f x d) then W2's (d x f) there: each
// thread makes them from its own rows once they are done, into a share of its own, and the shares are summed after.
void ffn_backward(const Blas& blas, FortranGemmFn gemm, const float* x, const float* hidden, float* grad_weights,
                  const float* dy, const float* xhat, const float* rstd, const float* gamma,
                  const uint32_t* keep_bits, const uint32_t* positive, const float* w1, const float* w2,
                  float* packed_w2, float* packed_w1, float* grad_x, float* grad_outer, float* grad_inner, float* sums,
                  int64_t rows, int64_t d, int64_t f, float outer_scale, float inner_scale, int64_t block_rows,
                  int64_t threads) {
    const int64_t sum_blocks_n = (rows + kSumRows - 1) / kSumRows;
    std::vector<float> outer_partial(sum_blocks_n * 3 * d, 0.0f), inner_partial(sum_blocks_n * f, 0.0f);
    float* outer_partials = outer_partial.data();
    float* inner_partials = inner_partial.data();
    std::vector<float> weight_partial(grad_weights != nullptr ? threads * 2 * d * f : 0, 0.0f);
    float* weight_partials = weight_partial.data();
    const int64_t blocks = (rows + block_rows - 1) / block_rows;
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        if (t == 0) blas.pack(kRowMajor, kBMatrix, kNoTrans, block_rows, f, d, 1.0f, w2, f, packed_w2);
        if (t == (nt > 1 ? 1 : 0)) blas.pack(kRowMajor, kBMatrix, kNoTrans, block_rows, d, f, 1.0f, w1, d, packed_w1);
        stream_barrier();
        for (int64_t b = first; b < end; ++b) {
            const int64_t lo = b * block_rows, hi = lo + block_rows < rows ? lo + block_rows : rows;
            for (int64_t s = lo; dy != nullptr && s < hi; s += kSumRows)  // block_rows: a multiple of kSumRows
                dropout_add_norm_backward_rows(dy, xhat, rstd, gamma, keep_bits, nullptr, nullptr, nullptr, grad_x,
                                               grad_outer, nullptr, outer_partials + s / kSumRows * 3 * d, s,
                                               s + kSumRows < hi ? s + kSumRows : hi, d, outer_scale);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, f, d, grad_outer + lo * d, d, packed_w2, f, 0.0f,
                         grad_inner + lo * f, f);
            for (int64_t s = lo; s < hi; s += kSumRows)
                positive_scale_rows(positive, grad_inner, grad_inner, inner_partials + s / kSumRows * f, s,
                                    s + kSumRows < hi ? s + kSumRows : hi, f, inner_scale);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, f, grad_inner + lo * f, f, packed_w1, d, 1.0f,
                         grad_x + lo * d, d);
        }
        if (grad_weights != nullptr && first < end) {  // one product per weight over the thread's rows
            const int64_t lo = first * block_rows, hi = end * block_rows < rows ? end * block_rows : rows;
            float* share = weight_partials + t * 2 * d * f;
            add_at_b(gemm, f, d, hi - lo, grad_inner + lo * f, f, x + lo * d, d, share);
            add_at_b(gemm, d, f, hi - lo, grad_outer + lo * d, d, hidden + lo * f, f, share + f * d);
        }
    });
    sum_blocks(outer_partials, sum_blocks_n, 3 * d, sums);
    sum_blocks(inner_partials, sum_blocks_n, f, sums + 3 * d);
    if (grad_weights != nullptr) sum_blocks(weight_partials, threads, 2 * d * f, grad_weights);
}


// ---- A whole post-LN causal self-attention sublayer, streamed the same way by blocks of whole sequences ----------
// norm(x + dropout(Wo attention(Wqkv x + bqkv) + bo)); the attention kernel (another library) comes in by address,
// called on each block's sequences on the calling thread. As the FFN's, with gamma null the forward pass stops at
// the output projection's product (in xhat) and the backward pass, without dy, starts from its given gradient.
typedef int (*AttentionForwardFn)(const float* qkv, const float* bias, float* out, float* lse, int64_t B, int64_t L,
                                  int64_t H, int64_t D, double scale, int64_t threads);
typedef int (*AttentionBackwardFn)(const float* qkv, const float* bias, const float* out, const float* grad_out,
                                   const float* lse, float* grad_qkv, float* grad_bias, int64_t B, int64_t L,
                                   int64_t H, int64_t D, double scale, int64_t threads);

void attention_sublayer_forward(const Blas& blas, AttentionForwardFn attend, const float* x, const float* w_qkv,
                                const float* b_qkv, const float* w_out, const float* b_out, const float* gamma,
                                const float* beta, float* packed_qkv, float* packed_out, float* qkv, float* attended,
                                float* lse, float* xhat, float* y, float* rstd, uint32_t* keep_bits, int64_t batch,
                                int64_t length, int64_t heads, int64_t d, float eps, uint64_t seed, uint32_t keep,
                                float scale, int64_t block_sequences, int64_t threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const int64_t blocks = (batch + block_sequences - 1) / block_sequences, head = d / heads;
    const double softmax_scale = 1.0 / std::sqrt((double)head);
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        const int64_t rows_max = block_sequences * length;
        if (t == 0) blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, 3 * d, d, 1.0f, w_qkv, d, packed_qkv);
        if (t == (nt > 1 ? 1 : 0)) blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, w_out, d, packed_out);
        stream_barrier();
        for (int64_t b = first; b < end; ++b) {
            const int64_t s0 = b * block_sequences, s1 = s0 + block_sequences < batch ? s0 + block_sequences : batch;
            const int64_t lo = s0 * length, hi = s1 * length;
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, 3 * d, d, x + lo * d, d, packed_qkv, 3 * d, 0.0f,
                         qkv + lo * 3 * d, 3 * d);
            attend(qkv + lo * 3 * d, b_qkv, attended + lo * d, lse + s0 * heads * length, s1 - s0, length, heads, head,
                   softmax_scale, 1);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, attended + lo * d, d, packed_out, d,
                         0.0f, xhat + lo * d, d);
            if (gamma != nullptr)
                dropout_add_norm_rows(x, xhat, b_out, nullptr, xhat, gamma, beta, y, rstd, keep_bits, lo, hi, d, eps,
                                      k0, k1, keep, scale);
        }
    });
}

// Its backward pass up to the weights' gradients: grad_x (the residual's and the body's), grad_projected (the output
// projection's output gradient), grad_qkv, grad_bias_qkv per sequence, and sums: gamma's, beta's and bo's.
void attention_sublayer_backward(const Blas& blas, AttentionBackwardFn attend_back, const float* dy, const float* xhat,
                                 const float* rstd, const float* gamma, const uint32_t* keep_bits, const float* qkv,
                                 const float* b_qkv, const float* attended, const float* lse, const float* w_qkv,
                                 const float* w_out, float* packed_out, float* packed_qkv, float* grad_x,
                                 float* grad_projected, float* grad_attended, float* grad_qkv, float* grad_b_qkv,
                                 float* sums, int64_t batch, int64_t length, int64_t heads, int64_t d, float scale,
                                 int64_t block_sequences, int64_t threads) {
    const int64_t rows = batch * length, sum_blocks_n = (rows + kSumRows - 1) / kSumRows;
    std::vector<float> partial(sum_blocks_n * 3 * d, 0.0f);
    float* partials = partial.data();
    const int64_t blocks = (batch + block_sequences - 1) / block_sequences, head = d / heads;
    const double softmax_scale = 1.0 / std::sqrt((double)head);
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        const int64_t rows_max = block_sequences * length;
        if (t == 0) blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, w_out, d, packed_out);
        if (t == (nt > 1 ? 1 : 0)) blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, 3 * d, 1.0f, w_qkv, d,
                                             packed_qkv);
        stream_barrier();
        for (int64_t b = first; b < end; ++b) {
            const int64_t s0 = b * block_sequences, s1 = s0 + block_sequences < batch ? s0 + block_sequences : batch;
            const int64_t lo = s0 * length, hi = s1 * length;
            for (int64_t s = lo; dy != nullptr && s < hi; s += kSumRows)  // whole sequences: a multiple of kSumRows
                dropout_add_norm_backward_rows(dy, xhat, rstd, gamma, keep_bits, nullptr, nullptr, nullptr, grad_x,
                                               grad_projected, nullptr, partials + s / kSumRows * 3 * d, s,
                                               s + kSumRows < hi ? s + kSumRows : hi, d, scale);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, grad_projected + lo * d, d, packed_out, d, 0.0f,
                         grad_attended + lo * d, d);
            attend_back(qkv + lo * 3 * d, b_qkv, attended + lo * d, grad_attended + lo * d, lse + s0 * heads * length,
                        grad_qkv + lo * 3 * d, grad_b_qkv == nullptr ? nullptr : grad_b_qkv + s0 * 3 * d, s1 - s0,
                        length, heads, head, softmax_scale, 1);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, 3 * d, grad_qkv + lo * 3 * d, 3 * d, packed_qkv, d,
                         1.0f, grad_x + lo * d, d);
        }
    });
    sum_blocks(partials, sum_blocks_n, 3 * d, sums);
}

// ---- Transformer-XL's post-LN relative attention sublayer, streamed by blocks of whole sequences -----------------
// norm(x + dropout(Wo attend(Wq x, Wkv [memory ∘ x], r))): per block, the queries' and the window's keys' and values'
// products side by side in qkv (rows of 3d, as one product with [Wq; Wkv] leaves them), the memory's keys and values
// in memory_kv, the relative attention kernel (another library, by address) on the block's sequences, the output
// projection and the tail. r, the projected position encodings, is shared by the sequences and made by the caller.
// As above, with gamma null the forward pass stops at the output projection's product (in xhat) and the backward
// pass, without dy, starts from its given gradient. `failed` is set where the kernel refuses its shapes.
typedef int (*RelativeForwardFn)(const float* q, int64_t q_batch, int64_t q_row, const float* kv_mem,
                                 int64_t kv_mem_batch, int64_t kv_mem_row, const float* kv_cur, int64_t kv_cur_batch,
                                 int64_t kv_cur_row, const float* r, const float* u, const float* pb, float* out,
                                 float* lse, int64_t B, int64_t L, int64_t M, int64_t H, int64_t D, double scale,
                                 int64_t threads);
typedef int (*RelativeBackwardFn)(const float* q, int64_t q_batch, int64_t q_row, const float* kv_mem,
                                  int64_t kv_mem_batch, int64_t kv_mem_row, const float* kv_cur, int64_t kv_cur_batch,
                                  int64_t kv_cur_row, const float* r, const float* u, const float* pb, const float* out,
                                  const float* grad_out, const float* lse, float* gq, float* gkv_mem, float* gkv_cur,
                                  float* gr, float* gu, float* gpb, int64_t B, int64_t L, int64_t M, int64_t H,
                                  int64_t D, double scale, int64_t threads);

// The sizes of one call, and where sequence s's rows start in each tensor.
struct RelativeShape {
    int64_t batch, length, mem, heads, d;
    int64_t head() const { return d / heads; }
    int64_t keys() const { return mem + length; }
};

void relative_sublayer_forward(const Blas& blas, RelativeForwardFn attend, const float* x, const float* memory,
                               const float* r, const float* u, const float* pb, const float* w_q, const float* w_kv,
                               const float* w_out, const float* bias, const float* gamma, const float* beta,
                               float* packed_q, float* packed_kv, float* packed_out, float* qkv, float* memory_kv,
                               float* attended, float* lse, float* xhat, float* y, float* rstd, uint32_t* keep_bits,
                               const RelativeShape& z, float eps, uint64_t seed, uint32_t keep, float scale,
                               int64_t block_sequences, int64_t threads, int* failed) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const int64_t L = z.length, M = z.mem, d = z.d, blocks = (z.batch + block_sequences - 1) / block_sequences;
    const double softmax_scale = 1.0 / std::sqrt((double)z.head());
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        const int64_t rows_max = block_sequences * (L > M ? L : M);
        if (t == 0) {
            blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, w_q, d, packed_q);
            blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, w_out, d, packed_out);
        }
        if (t == (nt > 1 ? 1 : 0))
            blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, 2 * d, d, 1.0f, w_kv, d, packed_kv);
        stream_barrier();
        for (int64_t b = first; b < end; ++b) {
            const int64_t s0 = b * block_sequences;
            const int64_t s1 = s0 + block_sequences < z.batch ? s0 + block_sequences : z.batch;
            const int64_t lo = s0 * L, hi = s1 * L;
            float* q = qkv + lo * 3 * d;
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, x + lo * d, d, packed_q, d, 0.0f, q, 3 * d);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, 2 * d, d, x + lo * d, d, packed_kv, 2 * d, 0.0f, q + d,
                         3 * d);
            float* kv_mem = q + d;  // not read without a memory
            if (M > 0) {
                kv_mem = memory_kv + s0 * M * 2 * d;
                blas.compute(kRowMajor, kNoTrans, kPacked, (s1 - s0) * M, 2 * d, d, memory + s0 * M * d, d, packed_kv,
                             2 * d, 0.0f, kv_mem, 2 * d);
            }
            if (attend(q, L * 3 * d, 3 * d, kv_mem, M * 2 * d, 2 * d, q + d, L * 3 * d, 3 * d, r, u, pb,
                       attended + lo * d, lse + s0 * z.heads * L, s1 - s0, L, M, z.heads, z.head(), softmax_scale, 1))
                *failed = 1;
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, attended + lo * d, d, packed_out, d, 0.0f,
                         xhat + lo * d, d);
            if (gamma != nullptr)
                dropout_add_norm_rows(x, xhat, bias, nullptr, xhat, gamma, beta, y, rstd, keep_bits, lo, hi, d, eps, k0,
                                      k1, keep, scale);
        }
    });
}

// Its backward pass: grad_x (the residual's and the body's), grad_projected, grad_qkv (laid out as qkv),
// grad_memory_kv, and per sequence grad_r (B, M + L, d), grad_u and grad_pb (B, H, D); sums gets gamma's, beta's and
// the (zero) bias's. With grad_weights (else null), the gradients of Wo (d x d) then [Wq; Wkv] (3d x d) there: each
// thread adds its blocks' products to a share of its own while they are in cache, and the shares are summed after.
void relative_sublayer_backward(const Blas& blas, RelativeBackwardFn attend_back, FortranGemmFn gemm, const float* x,
                                const float* memory, float* grad_weights, const float* dy, const float* xhat,
                                const float* rstd, const float* gamma, const uint32_t* keep_bits, const float* qkv,
                                const float* memory_kv, const float* r, const float* u, const float* pb,
                                const float* attended, const float* lse, const float* w_q, const float* w_kv,
                                const float* w_out, float* packed_out, float* packed_q, float* packed_kv,
                                float* grad_x, float* grad_projected, float* grad_attended, float* grad_qkv,
                                float* grad_memory_kv, float* grad_r, float* grad_u, float* grad_pb, float* sums,
                                const RelativeShape& z, float scale, int64_t block_sequences, int64_t threads,
                                int* failed) {
    const int64_t L = z.length, M = z.mem, d = z.d, rows = z.batch * L, sum_blocks_n = (rows + kSumRows - 1) / kSumRows;
    std::vector<float> partial(sum_blocks_n * 3 * d, 0.0f);
    float* partials = partial.data();
    const int64_t weight_floats = 4 * d * d;
    std::vector<float> weight_partial(grad_weights != nullptr ? threads * weight_floats : 0, 0.0f);
    float* weight_partials = weight_partial.data();
    const int64_t blocks = (z.batch + block_sequences - 1) / block_sequences;
    const double softmax_scale = 1.0 / std::sqrt((double)z.head());
    stream_blocks(blas, blocks, threads, [&](int64_t t, int64_t nt, int64_t first, int64_t end) {
        const int64_t rows_max = block_sequences * L;
        float* weights_share = weight_partials + t * weight_floats;
        if (t == 0) {
            blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, w_out, d, packed_out);
            blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, w_q, d, packed_q);
        }
        if (t == (nt > 1 ? 1 : 0))
            blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, 2 * d, 1.0f, w_kv, d, packed_kv);
        stream_barrier();
        for (int64_t b = first; b < end; ++b) {
            const int64_t s0 = b * block_sequences;
            const int64_t s1 = s0 + block_sequences < z.batch ? s0 + block_sequences : z.batch;
            const int64_t lo = s0 * L, hi = s1 * L;
            for (int64_t s = lo; dy != nullptr && s < hi; s += kSumRows)  // whole sequences: a multiple of kSumRows
                dropout_add_norm_backward_rows(dy, xhat, rstd, gamma, keep_bits, nullptr, nullptr, nullptr, grad_x,
                                               grad_projected, nullptr, partials + s / kSumRows * 3 * d, s,
                                               s + kSumRows < hi ? s + kSumRows : hi, d, scale);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, grad_projected + lo * d, d, packed_out, d, 0.0f,
                         grad_attended + lo * d, d);
            const float* q = qkv + lo * 3 * d;
            float* gq = grad_qkv + lo * 3 * d;
            const float* kv_mem = M > 0 ? memory_kv + s0 * M * 2 * d : q + d;
            float* gkv_mem = M > 0 ? grad_memory_kv + s0 * M * 2 * d : gq + d;
            if (attend_back(q, L * 3 * d, 3 * d, kv_mem, M * 2 * d, 2 * d, q + d, L * 3 * d, 3 * d, r, u, pb,
                            attended + lo * d, grad_attended + lo * d, lse + s0 * z.heads * L, gq, gkv_mem, gq + d,
                            grad_r + s0 * z.keys() * d, grad_u + s0 * d, grad_pb + s0 * d, s1 - s0, L, M, z.heads,
                            z.head(), softmax_scale, 1))
                *failed = 1;
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, gq, 3 * d, packed_q, d, 1.0f, grad_x + lo * d, d);
            blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, 2 * d, gq + d, 3 * d, packed_kv, d, 1.0f,
                         grad_x + lo * d, d);
            if (grad_weights != nullptr) {
                add_at_b(gemm, d, d, hi - lo, grad_projected + lo * d, d, attended + lo * d, d, weights_share);
                add_at_b(gemm, 3 * d, d, hi - lo, gq, 3 * d, x + lo * d, d, weights_share + d * d);
                if (M > 0)
                    add_at_b(gemm, 2 * d, d, (s1 - s0) * M, gkv_mem, 2 * d, memory + s0 * M * d, d,
                             weights_share + 2 * d * d);
            }
        }
    });
    sum_blocks(partials, sum_blocks_n, 3 * d, sums);
    if (grad_weights != nullptr) sum_blocks(weight_partials, threads, weight_floats, grad_weights);
}


// ---- Transformer-XL's post-LN layers and their gates, all of them in one parallel region --------------------------
// Every layer's attention sublayer then its FFN sublayer (relative_sublayer_forward's and ffn_forward's arithmetic,
// with the same masks), each thread taking its own blocks of whole sequences through all the layers: every layer's
// weights are packed once at the start, and after that the threads never wait for one another, where calling the
// sublayers one by one joins the threads and returns to Python 2 x layers times. The backward pass likewise runs the
// layers in reverse on each thread's sequences; each thread adds the weights' gradients to shares of its own, summed
// at the end, and the column sums are taken in fixed blocks of rows, as the sublayers' own.
//
// A layer's tensors come as kStackSlots addresses (table), its settings as the two LayerNorms' eps and the three
// masks' scales (reals), seeds and keep words (the attention's output, the FFN's hidden layer, the FFN's output).
enum StackSlot {
    kInput, kMemory, kR, kU, kPb, kWq, kWkv, kWout, kGammaA, kBetaA, kQkv, kMemoryKv, kAttended, kLse, kXhatA, kYA,
    kRstdA, kKeepA, kW1, kB1, kW2, kB2, kGammaF, kBetaF, kHidden, kPositive, kXhatF, kOutput, kRstdF, kKeepF,
    kSduWA, kSduBA, kSduA, kSduWF, kSduBF, kSduF, kCarryA, kCarryF, kGrcWA, kGrcBA, kGrcA, kGrcWF, kGrcBF, kGrcF,
    kEauW1, kEauB1, kEauW2, kEauB2, kEauW3, kEauB3, kEauH, kEauE, kEauAdj, kEauOut, kStackSlots
};
// A layer's gate units, where it has them: an SDU branch (Highway Transformer: norm(x + dropout(F(x) + Ψ(x W1 + b1)
// ⊙ (x W2 + b2)))) or a highway gate (norm((1 - T) ⊙ x + T ⊙ f(x) + dropout(F(x))), T = σ(x W1 + b1),
// f(x) = x W2 + b2) or a gated MHDPA (norm(x + dropout((1 - T) ⊙ F(x) + T ⊙ f(x))), the body's output then kept in
// the carry's slot): each sublayer's Linear(d, 2d) weight and bias and its biased product, kept for the backward
// pass; reals 5 and 6 give their tails (the gate kernel's codes: SDU with sigmoid 0, with tanh 1, the highway gate's
// lerp 2; the gated MHDPA kMix, the lerp tail on the body's output; -1 for none). A gated residual connection
// (norm(x + g ⊙ dropout(F(x))), g = σ(x Wg + bg), on a sublayer without a unit): its Linear(d, d) weight and bias
// and its gate, kept, with the body's output in the carry's slot; reals 7 and 8 say where there is one. An EAU on
// the attention's output (s + σ(W2 relu(W1 s + b1) + b2) ⊙ tanh(W3 s + b3), without a unit; reals[9]): its six
// parameters, its hidden rows (after the ReLU), the two pre-activations and its output, kept, with s in the carry's.
constexpr int kStackReals = 10, kStackMasks = 3, kStackPacks = 12, kLerp = 2, kEau = 3, kMix = 5;
typedef void (*BiasSigmoidFn)(float* x, const float* bias, int64_t rows, int64_t cols, int64_t threads);

typedef int (*TailForwardFn)(int tail, const float* c, const float* a, int64_t a_row, const float* b, int64_t b_row,
                             float* out, int64_t rows, int64_t cols, int64_t threads);
typedef int (*TailBackwardFn)(int tail, const float* dout, const float* c, const float* a, int64_t a_row,
                              const float* b, int64_t b_row, float* dc, float* da, int64_t da_row, float* db,
                              int64_t db_row, int64_t rows, int64_t cols, int64_t threads);

struct StackShape {
    int64_t layers, batch, length, mem, heads, d, f, block_sequences, ffn_rows, gated;
    int64_t keys() const { return mem + length; }
    int64_t head() const { return d / heads; }
    int64_t rows() const { return batch * length; }
    // Wo, [Wq; Wkv], W1, W2, and with gates the two sublayers' units' [W1; W2] and GRCs' Wg
    int64_t eau() const { return d / 2; }  // the EAU's hidden width
    // (and the EAU's W1, W2, W3)
    int64_t weight_floats() const { return 4 * d * d + 2 * d * f + (gated ? 7 * d * d + 2 * eau() * d : 0); }
    int64_t small_floats() const { return keys() * d + 2 * d; }  // r's, u's and the position bias's
    // attention's and FFN's LayerNorm sums, b1's, and with gates the two sublayers' units' [b1; b2] and GRCs' bg
    int64_t sum_floats() const { return 6 * d + f + (gated ? 8 * d + eau() : 0); }  // (and b1, b2, b3)
};

// Adds a row of `cols` biases to each of `rows` rows.
inline void add_bias_rows(float* __restrict x, const float* __restrict bias, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) x[r * cols + c] += bias[c];
}

// Adds (or with sign -1 subtracts) the column sums of rows [lo, hi) of g (cols wide, rows row_floats apart) to the
// partial sums of their blocks of kSumRows rows.
inline void add_block_column_sums(const float* __restrict g, int64_t lo, int64_t hi, int64_t cols, int64_t row_floats,
                                  float* __restrict partials, int64_t stride, float sign = 1.0f) {
    for (int64_t r = lo; r < hi; ++r) {
        float* __restrict part = partials + r / kSumRows * stride;
        const float* __restrict row = g + r * row_floats;
        for (int64_t c = 0; c < cols; ++c) part[c] += sign * row[c];
    }
}

struct LayerTable {
    const int64_t* addresses;
    float* at(int64_t layer, int slot) const { return reinterpret_cast<float*>(addresses[layer * kStackSlots + slot]); }
    uint32_t* bits(int64_t layer, int slot) const { return reinterpret_cast<uint32_t*>(at(layer, slot)); }
};

inline int64_t padded16(int64_t floats) { return (floats + 15) / 16 * 16; }

// Room for every layer's packed weights, kept by the calling thread from one call to the next and grown when needed.
// MKL asks for several MB per packed weight, whatever its size, and writes a few pages of it: allocated afresh for
// each call, that much comes straight from mmap, and whatever the packing touches faults in again on every call,
// a cost of the same order as the small products themselves.
float* kept_pack_room(int64_t floats) {
    struct Kept {
        void* raw = nullptr;
        int64_t floats = 0;
        ~Kept() { std::free(raw); }
    };
    static thread_local Kept kept;
    if (kept.floats < floats) {
        std::free(kept.raw);
        kept.raw = std::malloc((size_t)floats * 4 + 64);
        kept.floats = kept.raw != nullptr ? floats : 0;
    }
    return kept.raw != nullptr ? PackedPair::aligned(kept.raw) : nullptr;
}

// Where packed weight j (of kStackPacks) of a layer starts in one buffer for all the layers.
struct PackedLayers {
    const int64_t* floats;  // kStackPacks sizes
    float* base;
    int64_t per_layer() const {
        int64_t total = 0;
        for (int j = 0; j < kStackPacks; ++j) total += padded16(floats[j]);
        return total;
    }
    float* at(int64_t layer, int j) const {
        float* p = base + layer * per_layer();
        for (int k = 0; k < j; ++k) p += padded16(floats[k]);
        return p;
    }
};

void relative_stack_forward(const Blas& blas, RelativeForwardFn attend, TailForwardFn tail_forward,
                            BiasSigmoidFn bias_sigmoid, const LayerTable& t, const double* reals,
                            const uint64_t* seeds, const uint32_t* keeps, const float* zero,
                            const PackedLayers& packed, const StackShape& z, int64_t threads, int* failed) {
    const int64_t L = z.length, M = z.mem, d = z.d, f = z.f, bs = z.block_sequences;
    const int64_t blocks = (z.batch + bs - 1) / bs;
    const double softmax_scale = 1.0 / std::sqrt((double)z.head());
    stream_blocks(blas, blocks, threads, [&](int64_t th, int64_t nt, int64_t first, int64_t end) {
        const int64_t rows_max = bs * (L > M ? L : M);
        for (int64_t job = th; job < z.layers * kStackPacks; job += nt) {
            const int64_t i = job / kStackPacks;
            const int j = (int)(job % kStackPacks);
            float* dest = packed.at(i, j);
            if (j == 0) blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, t.at(i, kWq), d, dest);
            if (j == 1) blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, 2 * d, d, 1.0f, t.at(i, kWkv), d, dest);
            if (j == 2) blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, t.at(i, kWout), d, dest);
            if (j == 3) blas.pack(kRowMajor, kBMatrix, kTrans, z.ffn_rows, f, d, 1.0f, t.at(i, kW1), d, dest);
            if (j == 4) blas.pack(kRowMajor, kBMatrix, kTrans, z.ffn_rows, d, f, 1.0f, t.at(i, kW2), f, dest);
            if (j == 5 && t.at(i, kSduWA) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, 2 * d, d, 1.0f, t.at(i, kSduWA), d, dest);
            if (j == 6 && t.at(i, kSduWF) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, z.ffn_rows, 2 * d, d, 1.0f, t.at(i, kSduWF), d, dest);
            if (j == 7 && t.at(i, kGrcWA) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, t.at(i, kGrcWA), d, dest);
            if (j == 8 && t.at(i, kGrcWF) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, z.ffn_rows, d, d, 1.0f, t.at(i, kGrcWF), d, dest);
            if (j == 9 && t.at(i, kEauW1) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, z.eau(), d, 1.0f, t.at(i, kEauW1), d, dest);
            if (j == 10 && t.at(i, kEauW2) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, z.eau(), 1.0f, t.at(i, kEauW2), z.eau(), dest);
            if (j == 11 && t.at(i, kEauW3) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kTrans, rows_max, d, d, 1.0f, t.at(i, kEauW3), d, dest);
        }
        stream_barrier();
        const int64_t eh = z.eau();
        for (int64_t i = 0; i < z.layers; ++i) {
            const double* real = reals + i * kStackReals;
            const int sdu_a = (int)real[5], sdu_f = (int)real[6];
            const bool grc_a = real[7] != 0.0, grc_f = real[8] != 0.0, eau_a = real[9] != 0.0;
            const uint64_t* seed = seeds + i * kStackMasks;
            const uint32_t* keep = keeps + i * kStackMasks;
            const float* x = t.at(i, kInput);
            float* xhat_a = t.at(i, kXhatA);
            float* y_a = t.at(i, kYA);
            float* hidden = t.at(i, kHidden);
            float* xhat_f = t.at(i, kXhatF);
            for (int64_t b = first; b < end; ++b) {
                const int64_t s0 = b * bs, s1 = s0 + bs < z.batch ? s0 + bs : z.batch;
                const int64_t lo = s0 * L, hi = s1 * L;
                float* q = t.at(i, kQkv) + lo * 3 * d;
                blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, x + lo * d, d, packed.at(i, 0), d, 0.0f, q,
                             3 * d);
                blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, 2 * d, d, x + lo * d, d, packed.at(i, 1), 2 * d,
                             0.0f, q + d, 3 * d);
                float* kv_mem = q + d;  // not read without a memory
                if (M > 0) {
                    kv_mem = t.at(i, kMemoryKv) + s0 * M * 2 * d;
                    blas.compute(kRowMajor, kNoTrans, kPacked, (s1 - s0) * M, 2 * d, d, t.at(i, kMemory) + s0 * M * d,
                                 d, packed.at(i, 1), 2 * d, 0.0f, kv_mem, 2 * d);
                }
                if (attend(q, L * 3 * d, 3 * d, kv_mem, M * 2 * d, 2 * d, q + d, L * 3 * d, 3 * d, t.at(i, kR),
                           t.at(i, kU), t.at(i, kPb), t.at(i, kAttended) + lo * d, t.at(i, kLse) + s0 * z.heads * L,
                           s1 - s0, L, M, z.heads, z.head(), softmax_scale, 1))
                    *failed = 1;
                // kept for a gated MHDPA's, a GRC's or an EAU's backward pass
                float* body_a = sdu_a == kMix || grc_a || eau_a ? t.at(i, kCarryA) : xhat_a;
                blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, t.at(i, kAttended) + lo * d, d,
                             packed.at(i, 2), d, 0.0f, body_a + lo * d, d);
                if (eau_a) {  // the EAU on the body's output, into its own rows
                    const float* sr = body_a + lo * d;
                    float* h = t.at(i, kEauH) + lo * eh;
                    float* e = t.at(i, kEauE) + lo * d;
                    float* adj = t.at(i, kEauAdj) + lo * d;
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, eh, d, sr, d, packed.at(i, 9), eh, 0.0f, h, eh);
                    add_bias_rows(h, t.at(i, kEauB1), hi - lo, eh);
                    for (int64_t c = 0; c < (hi - lo) * eh; ++c) h[c] = h[c] > 0.0f ? h[c] : 0.0f;
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, eh, h, eh, packed.at(i, 10), d, 0.0f, e, d);
                    add_bias_rows(e, t.at(i, kEauB2), hi - lo, d);
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, sr, d, packed.at(i, 11), d, 0.0f, adj,
                                 d);
                    add_bias_rows(adj, t.at(i, kEauB3), hi - lo, d);
                    if (tail_forward(kEau, sr, e, d, adj, d, t.at(i, kEauOut) + lo * d, hi - lo, d, 1)) *failed = 1;
                    body_a = t.at(i, kEauOut);
                }
                // What the dropout takes (the body's output, plus an SDU's, or mixed by a gated MHDPA) and the
                // residual stream it is added to (x, or a highway gate's mix): written into y_a's rows, which the
                // LayerNorm pass reads before it writes them.
                const float* summed_a = body_a;
                const float* base_a = x;
                if (sdu_a >= 0) {
                    float* p = t.at(i, kSduA) + lo * 2 * d;
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, 2 * d, d, x + lo * d, d, packed.at(i, 5),
                                 2 * d, 0.0f, p, 2 * d);
                    add_bias_rows(p, t.at(i, kSduBA), hi - lo, 2 * d);
                    const float* c = sdu_a == kLerp ? x + lo * d : body_a + lo * d;
                    if (tail_forward(sdu_a == kMix ? kLerp : sdu_a, c, p, 2 * d, p + d, 2 * d, y_a + lo * d, hi - lo,
                                     d, 1))
                        *failed = 1;
                    (sdu_a == kLerp ? base_a : summed_a) = y_a;
                }
                const float* gate_a = nullptr;
                if (grc_a) {  // g = σ(x Wg + bg), which the LayerNorm pass multiplies the dropped output by
                    float* g = t.at(i, kGrcA) + lo * d;
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, x + lo * d, d, packed.at(i, 7), d, 0.0f,
                                 g, d);
                    bias_sigmoid(g, t.at(i, kGrcBA), hi - lo, d, 1);
                    gate_a = t.at(i, kGrcA);
                }
                dropout_add_norm_rows(base_a, summed_a, zero, gate_a, xhat_a, t.at(i, kGammaA), t.at(i, kBetaA), y_a,
                                      t.at(i, kRstdA), t.bits(i, kKeepA), lo, hi, d, (float)real[0], (uint32_t)seed[0],
                                      (uint32_t)(seed[0] >> 32), keep[0], (float)real[2]);
                for (int64_t clo = lo; clo < hi; clo += z.ffn_rows) {
                    const int64_t chi = clo + z.ffn_rows < hi ? clo + z.ffn_rows : hi;
                    blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, f, d, y_a + clo * d, d, packed.at(i, 3), f,
                                 0.0f, hidden + clo * f, f);
                    bias_epilogue_range<true>(nullptr, hidden, t.at(i, kB1), clo * f, chi * f, f, (uint32_t)seed[1],
                                              (uint32_t)(seed[1] >> 32), keep[1], (float)real[3], t.bits(i, kPositive));
                    float* body_f = sdu_f == kMix || grc_f ? t.at(i, kCarryF) : xhat_f;
                    blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, d, f, hidden + clo * f, f, packed.at(i, 4), d,
                                 0.0f, body_f + clo * d, d);
                    const float* summed_f = body_f;
                    const float* base_f = y_a;
                    if (sdu_f >= 0) {  // into the output's rows, as above
                        float* p = t.at(i, kSduF) + clo * 2 * d;
                        blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, 2 * d, d, y_a + clo * d, d,
                                     packed.at(i, 6), 2 * d, 0.0f, p, 2 * d);
                        add_bias_rows(p, t.at(i, kSduBF), chi - clo, 2 * d);
                        if (sdu_f == kMix)  // (1 - T) ⊙ (F + b2) + T ⊙ f = lerp(F, f - b2, T) + b2: the pass adds b2
                            for (int64_t r = 0; r < chi - clo; ++r)
                                for (int64_t c = 0; c < d; ++c) p[r * 2 * d + d + c] -= t.at(i, kB2)[c];
                        const float* c = sdu_f == kLerp ? y_a + clo * d : body_f + clo * d;
                        if (tail_forward(sdu_f == kMix ? kLerp : sdu_f, c, p, 2 * d, p + d, 2 * d,
                                         t.at(i, kOutput) + clo * d, chi - clo, d, 1))
                            *failed = 1;
                        (sdu_f == kLerp ? base_f : summed_f) = t.at(i, kOutput);
                    }
                    const float* gate_f = nullptr;
                    if (grc_f) {
                        float* g = t.at(i, kGrcF) + clo * d;
                        blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, d, d, y_a + clo * d, d, packed.at(i, 8),
                                     d, 0.0f, g, d);
                        bias_sigmoid(g, t.at(i, kGrcBF), chi - clo, d, 1);
                        gate_f = t.at(i, kGrcF);
                    }
                    dropout_add_norm_rows(base_f, summed_f, t.at(i, kB2), gate_f, xhat_f, t.at(i, kGammaF),
                                          t.at(i, kBetaF), t.at(i, kOutput), t.at(i, kRstdF), t.bits(i, kKeepF), clo,
                                          chi, d, (float)real[1], (uint32_t)seed[2], (uint32_t)(seed[2] >> 32), keep[2],
                                          (float)real[4]);
                }
            }
        }
    });
}

// dropout_add_norm_backward_rows over rows [lo, hi) for a sublayer with a GRC, block by block of kSumRows rows: its
// sums come with the gate's (gamma, beta, bias, then the gate's bias: 4 x cols, in scratch) and are shared out to the
// LayerNorm's three (norm_sums) and the gate bias's (gate_sums), both `stride` floats per block.
void gated_norm_backward_rows(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                              const uint32_t* keep_bits, const float* gate, const float* h, const float* bias,
                              float* dv, float* dh, float* dgate, float* norm_sums, float* gate_sums, int64_t stride,
                              float* scratch, int64_t lo, int64_t hi, int64_t cols, float scale) {
    for (int64_t s = lo; s < hi; s += kSumRows) {
        const int64_t e = s + kSumRows < hi ? s + kSumRows : hi;
        for (int64_t k = 0; k < 4 * cols; ++k) scratch[k] = 0.0f;
        dropout_add_norm_backward_rows(dy, xhat, rstd, gamma, keep_bits, gate, h, bias, dv, dh, dgate, scratch, s, e,
                                       cols, scale);
        float* ns = norm_sums + s / kSumRows * stride;
        float* gs = gate_sums + s / kSumRows * stride;
        for (int64_t k = 0; k < 3 * cols; ++k) ns[k] += scratch[k];
        for (int64_t k = 0; k < cols; ++k) gs[k] += scratch[3 * cols + k];
    }
}

// Its backward pass from grad (the last layer's output gradient) to grad_input (the first layer's input gradient).
// weights gets each layer's weight_floats() (Wo's, then [Wq; Wkv]'s, W1's and W2's gradients), small its
// small_floats() (r's, u's and the position bias's) and sums its sum_floats() (the attention LayerNorm's gamma, beta
// and the zero bias's, then the FFN LayerNorm's gamma, beta and b2's, then b1's). Memories get no gradient.
// Where thread th's slice of `width` columns starts (of nt slices, whole 64-byte lines each, so that no two threads
// write one line).
inline int64_t column_slice(int64_t width, int64_t th, int64_t nt) {
    const int64_t lines = (width + 15) / 16;
    const int64_t at = th * lines / nt * 16;
    return at < width ? at : width;
}

// out = 0 + shares[0] + shares[1] + ... (each `width` floats, `count` of them) over thread th's slice of the columns.
void add_shares(const float* shares, int64_t count, int64_t width, float* out, int64_t th, int64_t nt) {
    const int64_t lo = column_slice(width, th, nt), hi = column_slice(width, th + 1, nt);
    for (int64_t k = lo; k < hi; ++k) out[k] = 0.0f + shares[k];
    for (int64_t j = 1; j < count; ++j)
        for (int64_t k = lo; k < hi; ++k) out[k] += shares[j * width + k];
}

void relative_stack_backward(const Blas& blas, RelativeBackwardFn attend_back, TailBackwardFn tail_backward,
                             FortranGemmFn gemm, const LayerTable& t,
                             const double* reals, const float* grad, float* grad_input, const PackedLayers& packed,
                             float* weights, float* small, float* sums, float* scratch, const StackShape& z,
                             int64_t threads, int* failed) {
    const int64_t L = z.length, M = z.mem, d = z.d, f = z.f, bs = z.block_sequences, K = z.keys(), rows = z.rows();
    const int64_t blocks = (z.batch + bs - 1) / bs, sum_blocks_n = (rows + kSumRows - 1) / kSumRows;
    const double softmax_scale = 1.0 / std::sqrt((double)z.head());
    // Scratch: the layer's other gradient buffer, then per row the FFN input's, the two products' outputs', the
    // attention output projection's, the attention's and the projections' gradients, the memory's keys' and values',
    // and per sequence r's, u's and the position bias's; then each thread's shares and the blocks' column sums.
    float* grad_other = scratch;
    float* grad_a = grad_other + padded16(rows * d);
    float* grad_outer = grad_a + padded16(rows * d);
    float* grad_inner = grad_outer + padded16(rows * d);
    float* grad_projected = grad_inner + padded16(rows * f);
    float* grad_attended = grad_projected + padded16(rows * d);
    float* grad_qkv = grad_attended + padded16(rows * d);
    float* grad_memory_kv = grad_qkv + padded16(rows * 3 * d);
    float* grad_r = grad_memory_kv + padded16(z.batch * M * 2 * d);
    float* grad_u = grad_r + padded16(z.batch * K * d);
    float* grad_pb = grad_u + padded16(z.batch * d);
    // With gate units: per row, a unit's [a; b] gradients, and a highway gate's mix's
    float* grad_sdu = grad_pb + padded16(z.batch * d);
    float* grad_carry = grad_sdu + (z.gated ? padded16(rows * 2 * d) : 0);
    float* grad_eau = grad_carry + (z.gated ? padded16(rows * d) : 0);  // an EAU's [e; adj] and hidden gradients
    float* grad_hidden = grad_eau + (z.gated ? padded16(rows * 2 * d) : 0);
    float* weight_shares = grad_hidden + (z.gated ? padded16(rows * z.eau()) : 0);
    float* small_shares = weight_shares + threads * z.layers * z.weight_floats();
    float* partials = small_shares + threads * z.layers * z.small_floats();
    stream_blocks(blas, blocks, threads, [&](int64_t th, int64_t nt, int64_t first, int64_t end) {
        const int64_t rows_max = bs * L;
        float* my_weights = weight_shares + th * z.layers * z.weight_floats();
        float* my_small = small_shares + th * z.layers * z.small_floats();
        for (int64_t k = 0; k < z.layers * z.weight_floats(); ++k) my_weights[k] = 0.0f;
        for (int64_t k = 0; k < z.layers * z.small_floats(); ++k) my_small[k] = 0.0f;
        // Each thread zeroes the column sums' rows of its own blocks (whole 64-row blocks): zeroed by one thread for
        // all, every other thread's first addition to a line would fetch it from that thread's cache.
        const int64_t my_sums_lo = first * bs * L / kSumRows;
        const int64_t my_sums_hi = ((end * bs < z.batch ? end * bs : z.batch) * L + kSumRows - 1) / kSumRows;
        for (int64_t i = 0; i < z.layers && my_sums_lo < my_sums_hi; ++i)
            for (int64_t k = (i * sum_blocks_n + my_sums_lo) * z.sum_floats();
                 k < (i * sum_blocks_n + my_sums_hi) * z.sum_floats(); ++k)
                partials[k] = 0.0f;
        for (int64_t job = th; job < z.layers * kStackPacks; job += nt) {
            const int64_t i = job / kStackPacks;
            const int j = (int)(job % kStackPacks);
            float* dest = packed.at(i, j);
            if (j == 0) blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, t.at(i, kWq), d, dest);
            if (j == 1) blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, 2 * d, 1.0f, t.at(i, kWkv), d, dest);
            if (j == 2) blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, t.at(i, kWout), d, dest);
            if (j == 3) blas.pack(kRowMajor, kBMatrix, kNoTrans, z.ffn_rows, d, f, 1.0f, t.at(i, kW1), d, dest);
            if (j == 4) blas.pack(kRowMajor, kBMatrix, kNoTrans, z.ffn_rows, f, d, 1.0f, t.at(i, kW2), f, dest);
            if (j == 5 && t.at(i, kSduWA) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, 2 * d, 1.0f, t.at(i, kSduWA), d, dest);
            if (j == 6 && t.at(i, kSduWF) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, z.ffn_rows, d, 2 * d, 1.0f, t.at(i, kSduWF), d, dest);
            if (j == 7 && t.at(i, kGrcWA) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, t.at(i, kGrcWA), d, dest);
            if (j == 8 && t.at(i, kGrcWF) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, z.ffn_rows, d, d, 1.0f, t.at(i, kGrcWF), d, dest);
            if (j == 9 && t.at(i, kEauW1) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, z.eau(), 1.0f, t.at(i, kEauW1), d, dest);
            if (j == 10 && t.at(i, kEauW2) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, z.eau(), d, 1.0f, t.at(i, kEauW2), z.eau(), dest);
            if (j == 11 && t.at(i, kEauW3) != nullptr)
                blas.pack(kRowMajor, kBMatrix, kNoTrans, rows_max, d, d, 1.0f, t.at(i, kEauW3), d, dest);
        }
        stream_barrier();
        // Where the units' and the GRCs' gradients go
        const int64_t sdu_weights = 4 * d * d + 2 * d * f, sdu_sums = 6 * d + f;
        const int64_t grc_weights = sdu_weights + 4 * d * d, grc_sums = sdu_sums + 4 * d;
        const int64_t eau_weights = grc_weights + 2 * d * d, eau_sums = grc_sums + 2 * d, eh = z.eau();
        std::vector<float> gated_sums(4 * d);  // a GRC sublayer's block of sums (see gated_norm_backward_rows)
        const std::vector<float> zeros(d, 0.0f);  // the attention's output projection's (absent) bias
        for (int64_t i = z.layers - 1; i >= 0; --i) {
            const double* real = reals + i * kStackReals;
            const int sdu_a = (int)real[5], sdu_f = (int)real[6];
            const bool grc_a = real[7] != 0.0, grc_f = real[8] != 0.0, eau_a = real[9] != 0.0;
            const float* dy = i == z.layers - 1 ? grad : ((i + 1) % 2 == 0 ? grad_input : grad_other);
            float* dx = i % 2 == 0 ? grad_input : grad_other;
            const float* x = t.at(i, kInput);
            const float* y_a = t.at(i, kYA);
            const float* hidden = t.at(i, kHidden);
            float* layer_sums = partials + i * sum_blocks_n * z.sum_floats();
            float* w_share = my_weights + i * z.weight_floats();
            float* r_share = my_small + i * z.small_floats();
            for (int64_t b = first; b < end; ++b) {
                const int64_t s0 = b * bs, s1 = s0 + bs < z.batch ? s0 + bs : z.batch;
                const int64_t lo = s0 * L, hi = s1 * L;
                // The residual stream's gradient: y_a's, or with a highway gate its mix's (then through the mix);
                // and the body's output's: the pass's, or with a gated MHDPA the share that goes through its mix.
                float* carry_f = sdu_f == kLerp ? grad_carry : grad_a;
                const float* grad_body_f = sdu_f == kMix ? grad_carry : grad_outer;
                for (int64_t clo = lo; clo < hi; clo += z.ffn_rows) {
                    const int64_t chi = clo + z.ffn_rows < hi ? clo + z.ffn_rows : hi;
                    if (grc_f)  // the gate's pre-activation's gradient into grad_sdu's rows (d wide)
                        gated_norm_backward_rows(dy, t.at(i, kXhatF), t.at(i, kRstdF), t.at(i, kGammaF),
                                                 t.bits(i, kKeepF), t.at(i, kGrcF), t.at(i, kCarryF), t.at(i, kB2),
                                                 carry_f, grad_outer, grad_sdu, layer_sums + 3 * d,
                                                 layer_sums + grc_sums + d, z.sum_floats(), gated_sums.data(), clo,
                                                 chi, d, (float)real[4]);
                    else
                        for (int64_t s = clo; s < chi; s += kSumRows)  // chunks: multiples of kSumRows
                            dropout_add_norm_backward_rows(dy, t.at(i, kXhatF), t.at(i, kRstdF), t.at(i, kGammaF),
                                                           t.bits(i, kKeepF), nullptr, nullptr, nullptr, carry_f,
                                                           grad_outer, nullptr,
                                                           layer_sums + s / kSumRows * z.sum_floats() + 3 * d, s,
                                                           s + kSumRows < chi ? s + kSumRows : chi, d, (float)real[4]);
                    if (sdu_f == kLerp || sdu_f == kMix) {  // through the mix: the carry's share, and the unit's
                        const float* pf = t.at(i, kSduF) + clo * 2 * d;
                        float* g = grad_sdu + clo * 2 * d;
                        const bool lerp = sdu_f == kLerp;
                        if (tail_backward(kLerp, (lerp ? grad_carry : grad_outer) + clo * d,
                                          (lerp ? y_a : t.at(i, kCarryF)) + clo * d, pf, 2 * d, pf + d, 2 * d,
                                          (lerp ? grad_a : grad_carry) + clo * d, g, 2 * d, g + d, 2 * d, chi - clo,
                                          d, 1))
                            *failed = 1;
                        if (!lerp)  // b2 was taken out of f's bias: its gradient loses f's share
                            add_block_column_sums(grad_sdu + d, clo, chi, d, 2 * d, layer_sums + 5 * d, z.sum_floats(),
                                                  -1.0f);
                    }
                    blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, f, d, grad_body_f + clo * d, d,
                                 packed.at(i, 4), f, 0.0f, grad_inner + clo * f, f);
                    for (int64_t s = clo; s < chi; s += kSumRows)
                        positive_scale_rows(t.bits(i, kPositive), grad_inner, grad_inner,
                                            layer_sums + s / kSumRows * z.sum_floats() + 6 * d, s,
                                            s + kSumRows < chi ? s + kSumRows : chi, f, (float)real[3]);
                    blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, d, f, grad_inner + clo * f, f,
                                 packed.at(i, 3), d, 1.0f, grad_a + clo * d, d);
                    if (grc_f)
                        blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, d, d, grad_sdu + clo * d, d,
                                     packed.at(i, 8), d, 1.0f, grad_a + clo * d, d);
                    if (sdu_f >= 0) {  // the unit on the FFN's input: its [a; b] gradients, then into y_a's
                        const float* pf = t.at(i, kSduF) + clo * 2 * d;
                        float* g = grad_sdu + clo * 2 * d;
                        if (sdu_f != kLerp && sdu_f != kMix
                            && tail_backward(sdu_f, grad_outer + clo * d, nullptr, pf, 2 * d, pf + d, 2 * d, nullptr, g,
                                             2 * d, g + d, 2 * d, chi - clo, d, 1))
                            *failed = 1;
                        blas.compute(kRowMajor, kNoTrans, kPacked, chi - clo, d, 2 * d, g, 2 * d, packed.at(i, 6), d,
                                     1.0f, grad_a + clo * d, d);
                        add_block_column_sums(grad_sdu, clo, chi, 2 * d, 2 * d, layer_sums + sdu_sums + 2 * d,
                                              z.sum_floats());
                    }
                }
                add_at_b(gemm, f, d, hi - lo, grad_inner + lo * f, f, y_a + lo * d, d, w_share + 4 * d * d);
                add_at_b(gemm, d, f, hi - lo, grad_body_f + lo * d, d, hidden + lo * f, f,
                         w_share + 4 * d * d + f * d);
                if (sdu_f >= 0)
                    add_at_b(gemm, 2 * d, d, hi - lo, grad_sdu + lo * 2 * d, 2 * d, y_a + lo * d, d,
                             w_share + sdu_weights + 2 * d * d);
                if (grc_f)
                    add_at_b(gemm, d, d, hi - lo, grad_sdu + lo * d, d, y_a + lo * d, d, w_share + grc_weights + d * d);
                float* carry_a = sdu_a == kLerp ? grad_carry : dx;
                if (grc_a) {
                    gated_norm_backward_rows(grad_a, t.at(i, kXhatA), t.at(i, kRstdA), t.at(i, kGammaA),
                                             t.bits(i, kKeepA), t.at(i, kGrcA), t.at(i, eau_a ? kEauOut : kCarryA),
                                             zeros.data(), carry_a,
                                             grad_projected, grad_sdu, layer_sums, layer_sums + grc_sums,
                                             z.sum_floats(), gated_sums.data(), lo, hi, d, (float)real[2]);
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, grad_sdu + lo * d, d, packed.at(i, 7), d,
                                 1.0f, dx + lo * d, d);
                    add_at_b(gemm, d, d, hi - lo, grad_sdu + lo * d, d, x + lo * d, d, w_share + grc_weights);
                } else {
                    for (int64_t s = lo; s < hi; s += kSumRows)  // whole sequences: a multiple of kSumRows
                        dropout_add_norm_backward_rows(grad_a, t.at(i, kXhatA), t.at(i, kRstdA), t.at(i, kGammaA),
                                                       t.bits(i, kKeepA), nullptr, nullptr, nullptr, carry_a,
                                                       grad_projected, nullptr,
                                                       layer_sums + s / kSumRows * z.sum_floats(), s,
                                                       s + kSumRows < hi ? s + kSumRows : hi, d, (float)real[2]);
                }
                if (sdu_a >= 0) {  // the unit on the attention's input: its [a; b] gradients, then into x's
                    const float* pa = t.at(i, kSduA) + lo * 2 * d;
                    float* g = grad_sdu + lo * 2 * d;
                    const int failed_tail = sdu_a == kLerp
                        ? tail_backward(kLerp, grad_carry + lo * d, x + lo * d, pa, 2 * d, pa + d, 2 * d, dx + lo * d,
                                        g, 2 * d, g + d, 2 * d, hi - lo, d, 1)
                        : sdu_a == kMix
                        ? tail_backward(kLerp, grad_projected + lo * d, t.at(i, kCarryA) + lo * d, pa, 2 * d, pa + d,
                                        2 * d, grad_carry + lo * d, g, 2 * d, g + d, 2 * d, hi - lo, d, 1)
                        : tail_backward(sdu_a, grad_projected + lo * d, nullptr, pa, 2 * d, pa + d, 2 * d, nullptr, g,
                                        2 * d, g + d, 2 * d, hi - lo, d, 1);
                    if (failed_tail) *failed = 1;
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, 2 * d, g, 2 * d, packed.at(i, 5), d, 1.0f,
                                 dx + lo * d, d);
                    add_block_column_sums(grad_sdu, lo, hi, 2 * d, 2 * d, layer_sums + sdu_sums, z.sum_floats());
                    add_at_b(gemm, 2 * d, d, hi - lo, g, 2 * d, x + lo * d, d, w_share + sdu_weights);
                }
                const float* grad_body_a = sdu_a == kMix ? grad_carry : grad_projected;
                if (eau_a) {  // through the EAU: s's gradient is the output's, plus its products'
                    const float* sr = t.at(i, kCarryA) + lo * d;
                    const float* h = t.at(i, kEauH) + lo * eh;
                    float* de = grad_eau + lo * 2 * d;
                    float* dh = grad_hidden + lo * eh;
                    float* ds = grad_carry + lo * d;
                    if (tail_backward(kEau, grad_projected + lo * d, nullptr, t.at(i, kEauE) + lo * d, d,
                                      t.at(i, kEauAdj) + lo * d, d, nullptr, de, 2 * d, de + d, 2 * d, hi - lo, d, 1))
                        *failed = 1;
                    for (int64_t c = 0; c < (hi - lo) * d; ++c) ds[c] = grad_projected[lo * d + c];
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, de + d, 2 * d, packed.at(i, 11), d, 1.0f,
                                 ds, d);
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, eh, d, de, 2 * d, packed.at(i, 10), eh, 0.0f,
                                 dh, eh);
                    for (int64_t c = 0; c < (hi - lo) * eh; ++c) dh[c] = h[c] > 0.0f ? dh[c] : 0.0f;
                    blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, eh, dh, eh, packed.at(i, 9), d, 1.0f, ds, d);
                    add_at_b(gemm, eh, d, hi - lo, dh, eh, sr, d, w_share + eau_weights);
                    add_at_b(gemm, d, eh, hi - lo, de, 2 * d, h, eh, w_share + eau_weights + eh * d);
                    add_at_b(gemm, d, d, hi - lo, de + d, 2 * d, sr, d, w_share + eau_weights + 2 * eh * d);
                    add_block_column_sums(grad_hidden, lo, hi, eh, eh, layer_sums + eau_sums, z.sum_floats());
                    add_block_column_sums(grad_eau, lo, hi, d, 2 * d, layer_sums + eau_sums + eh, z.sum_floats());
                    add_block_column_sums(grad_eau + d, lo, hi, d, 2 * d, layer_sums + eau_sums + eh + d,
                                          z.sum_floats());
                    grad_body_a = grad_carry;
                }
                blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, grad_body_a + lo * d, d, packed.at(i, 2), d,
                             0.0f, grad_attended + lo * d, d);
                const float* q = t.at(i, kQkv) + lo * 3 * d;
                float* gq = grad_qkv + lo * 3 * d;
                const float* kv_mem = M > 0 ? t.at(i, kMemoryKv) + s0 * M * 2 * d : q + d;
                float* gkv_mem = M > 0 ? grad_memory_kv + s0 * M * 2 * d : gq + d;
                if (attend_back(q, L * 3 * d, 3 * d, kv_mem, M * 2 * d, 2 * d, q + d, L * 3 * d, 3 * d, t.at(i, kR),
                                t.at(i, kU), t.at(i, kPb), t.at(i, kAttended) + lo * d, grad_attended + lo * d,
                                t.at(i, kLse) + s0 * z.heads * L, gq, gkv_mem, gq + d, grad_r + s0 * K * d,
                                grad_u + s0 * d, grad_pb + s0 * d, s1 - s0, L, M, z.heads, z.head(), softmax_scale, 1))
                    *failed = 1;
                blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, d, gq, 3 * d, packed.at(i, 0), d, 1.0f,
                             dx + lo * d, d);
                blas.compute(kRowMajor, kNoTrans, kPacked, hi - lo, d, 2 * d, gq + d, 3 * d, packed.at(i, 1), d, 1.0f,
                             dx + lo * d, d);
                add_at_b(gemm, d, d, hi - lo, grad_body_a + lo * d, d, t.at(i, kAttended) + lo * d, d, w_share);
                add_at_b(gemm, 3 * d, d, hi - lo, gq, 3 * d, x + lo * d, d, w_share + d * d);
                if (M > 0)
                    add_at_b(gemm, 2 * d, d, (s1 - s0) * M, gkv_mem, 2 * d, t.at(i, kMemory) + s0 * M * d, d,
                             w_share + 2 * d * d);
                for (int64_t s = s0; s < s1; ++s) {  // the block's sequences' shares of r, u and the position bias
                    const float* gr = grad_r + s * K * d;
                    for (int64_t k = 0; k < K * d; ++k) r_share[k] += gr[k];
                    for (int64_t k = 0; k < d; ++k) r_share[K * d + k] += grad_u[s * d + k];
                    for (int64_t k = 0; k < d; ++k) r_share[K * d + d + k] += grad_pb[s * d + k];
                }
            }
        }
        stream_barrier();  // every thread's shares and column sums are in
        // Added up with each thread taking a slice of the columns (one thread alone took about a fiftieth of the
        // two-thread call), every column in the order one thread would add it: the same sums whatever the threads.
        add_shares(weight_shares, nt, z.layers * z.weight_floats(), weights, th, nt);
        add_shares(small_shares, nt, z.layers * z.small_floats(), small, th, nt);
        const int64_t sf = z.sum_floats();
        for (int64_t i = 0; i < z.layers; ++i) {
            const int64_t lo = column_slice(sf, th, nt), hi = column_slice(sf, th + 1, nt);
            for (int64_t c = lo; c < hi; ++c) {
                float total = 0.0f;
                for (int64_t b = 0; b < sum_blocks_n; ++b) total += partials[(i * sum_blocks_n + b) * sf + c];
                sums[i * sf + c] = total;
            }
        }
    });
}

// Floats of relative_stack_backward's scratch.
int64_t stack_scratch_floats(const StackShape& z, int64_t threads) {
    const int64_t rows = z.rows(), d = z.d;
    return padded16(rows * d) * 6 + padded16(rows * z.f) + padded16(rows * 3 * d) + padded16(z.batch * z.mem * 2 * d)
        + padded16(z.batch * z.keys() * d) + 2 * padded16(z.batch * d)
        + (z.gated ? 2 * padded16(rows * 2 * d) + padded16(rows * d) + padded16(rows * z.eau()) : 0)
        + threads * z.layers * (z.weight_floats() + z.small_floats())
        + z.layers * ((rows + kSumRows - 1) / kSumRows) * z.sum_floats();
}

}  // namespace

extern "C" {
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
void dropout_add_norm_f32(const float* base, const float* h, const float* bias, const float* gate, float* xhat,
                          const float* gamma, const float* beta, float* y, float* rstd, uint32_t* keep_bits,
                          int64_t rows, int64_t cols, double eps, uint64_t seed, uint32_t keep_below, double scale,
                          int64_t threads) {
    dropout_add_norm(base, h, bias, gate, xhat, gamma, beta, y, rstd, keep_bits, rows, cols, (float)eps, seed,
                     keep_below, (float)scale, threads);
}
void dropout_add_norm_backward_f32(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                                   const uint32_t* keep_bits, const float* gate, const float* h, const float* bias,
                                   float* dv, float* dh, float* dgate, float* sums, int64_t rows, int64_t cols,
                                   double scale, int64_t threads) {
    dropout_add_norm_backward(dy, xhat, rstd, gamma, keep_bits, gate, h, bias, dv, dh, dgate, sums, rows, cols,
                              (float)scale, threads);
}
int ffn_forward_f32(const void* pack, const void* compute, const void* local_threads, const float* x,
                     const float* w1, const float* b1, const float* w2, const float* b2, const float* gamma,
                     const float* beta, int64_t packed_w1t_floats, int64_t packed_w2t_floats, float* hidden,
                     uint32_t* positive,
                     float* xhat, float* y, float* rstd, uint32_t* keep_bits, int64_t rows, int64_t d, int64_t f,
                     double eps, uint64_t inner_seed, uint32_t inner_keep, double inner_scale, uint64_t outer_seed,
                     uint32_t outer_keep, double outer_scale, int64_t block_rows, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    PackedPair packed(packed_w1t_floats, packed_w2t_floats);
    if (!packed.ok()) return 1;
    ffn_forward(blas, x, w1, b1, w2, b2, gamma, beta, packed.first, packed.second, hidden, positive, xhat, y, rstd,
                keep_bits, rows, d, f, (float)eps, inner_seed, inner_keep, (float)inner_scale, outer_seed, outer_keep,
                (float)outer_scale, block_rows, threads);
    return 0;
}
int ffn_backward_f32(const void* pack, const void* compute, const void* local_threads, const void* gemm,
                     const float* x, const float* hidden, float* grad_weights, const float* dy,
                      const float* xhat, const float* rstd, const float* gamma, const uint32_t* keep_bits,
                      const uint32_t* positive, const float* w1, const float* w2, int64_t packed_w2_floats,
                      int64_t packed_w1_floats,
                      float* grad_x, float* grad_outer, float* grad_inner, float* sums, int64_t rows, int64_t d,
                      int64_t f, double outer_scale, double inner_scale, int64_t block_rows, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    PackedPair packed(packed_w2_floats, packed_w1_floats);
    if (!packed.ok()) return 1;
    ffn_backward(blas, (FortranGemmFn)gemm, x, hidden, grad_weights, dy, xhat, rstd, gamma, keep_bits, positive, w1, w2,
                 packed.first, packed.second, grad_x, grad_outer, grad_inner, sums, rows, d, f, (float)outer_scale,
                 (float)inner_scale, block_rows, threads);
    return 0;
}
int attention_sublayer_forward_f32(const void* pack, const void* compute, const void* local_threads,
                                    const void* attend, const float* x, const float* w_qkv, const float* b_qkv,
                                    const float* w_out, const float* b_out, const float* gamma, const float* beta,
                                    int64_t packed_qkv_floats, int64_t packed_out_floats, float* qkv,
                                    float* attended, float* lse,
                                    float* xhat, float* y, float* rstd, uint32_t* keep_bits, int64_t batch,
                                    int64_t length, int64_t heads, int64_t d, double eps, uint64_t seed,
                                    uint32_t keep, double scale, int64_t block_sequences, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    PackedPair packed(packed_qkv_floats, packed_out_floats);
    if (!packed.ok()) return 1;
    attention_sublayer_forward(blas, (AttentionForwardFn)attend, x, w_qkv, b_qkv, w_out, b_out, gamma, beta,
                               packed.first, packed.second, qkv, attended, lse, xhat, y, rstd, keep_bits, batch,
                               length, heads, d, (float)eps, seed, keep, (float)scale, block_sequences, threads);
    return 0;
}
int attention_sublayer_backward_f32(const void* pack, const void* compute, const void* local_threads,
                                     const void* attend_back, const float* dy, const float* xhat, const float* rstd,
                                     const float* gamma, const uint32_t* keep_bits, const float* qkv,
                                     const float* b_qkv, const float* attended, const float* lse, const float* w_qkv,
                                     const float* w_out, int64_t packed_out_floats, int64_t packed_qkv_floats,
                                     float* grad_x,
                                     float* grad_projected, float* grad_attended, float* grad_qkv, float* grad_b_qkv,
                                     float* sums, int64_t batch, int64_t length, int64_t heads, int64_t d,
                                     double scale, int64_t block_sequences, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    PackedPair packed(packed_out_floats, packed_qkv_floats);
    if (!packed.ok()) return 1;
    attention_sublayer_backward(blas, (AttentionBackwardFn)attend_back, dy, xhat, rstd, gamma, keep_bits, qkv, b_qkv,
                                attended, lse, w_qkv, w_out, packed.first, packed.second, grad_x, grad_projected,
                                grad_attended, grad_qkv, grad_b_qkv, sums, batch, length, heads, d, (float)scale,
                                block_sequences, threads);
    return 0;
}
// Returns 1 where the packed weights could not be allocated, 2 where the attention kernel refused its shapes.
int relative_sublayer_forward_f32(const void* pack, const void* compute, const void* local_threads,
                                  const void* attend, const float* x, const float* memory, const float* r,
                                  const float* u, const float* pb, const float* w_q, const float* w_kv,
                                  const float* w_out, const float* bias, const float* gamma, const float* beta,
                                  int64_t packed_q_floats, int64_t packed_kv_floats, int64_t packed_out_floats,
                                  float* qkv, float* memory_kv, float* attended, float* lse, float* xhat, float* y,
                                  float* rstd, uint32_t* keep_bits, int64_t batch, int64_t length, int64_t mem,
                                  int64_t heads, int64_t d, double eps, uint64_t seed, uint32_t keep, double scale,
                                  int64_t block_sequences, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    PackedPair packed(packed_q_floats, packed_kv_floats), packed_out(packed_out_floats, 0);
    if (!packed.ok() || !packed_out.ok()) return 1;
    int failed = 0;
    relative_sublayer_forward(blas, (RelativeForwardFn)attend, x, memory, r, u, pb, w_q, w_kv, w_out, bias, gamma,
                              beta, packed.first, packed.second, packed_out.first, qkv, memory_kv, attended, lse, xhat,
                              y, rstd, keep_bits, RelativeShape{batch, length, mem, heads, d}, (float)eps, seed, keep,
                              (float)scale, block_sequences, threads, &failed);
    return failed ? 2 : 0;
}
int relative_sublayer_backward_f32(const void* pack, const void* compute, const void* local_threads,
                                   const void* gemm, const float* x, const float* memory, float* grad_weights,
                                   const void* attend_back, const float* dy, const float* xhat, const float* rstd,
                                   const float* gamma, const uint32_t* keep_bits, const float* qkv,
                                   const float* memory_kv, const float* r, const float* u, const float* pb,
                                   const float* attended, const float* lse, const float* w_q, const float* w_kv,
                                   const float* w_out, int64_t packed_out_floats, int64_t packed_q_floats,
                                   int64_t packed_kv_floats, float* grad_x, float* grad_projected,
                                   float* grad_attended, float* grad_qkv, float* grad_memory_kv, float* grad_r,
                                   float* grad_u, float* grad_pb, float* sums, int64_t batch, int64_t length,
                                   int64_t mem, int64_t heads, int64_t d, double scale, int64_t block_sequences,
                                   int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    PackedPair packed(packed_out_floats, packed_q_floats), packed_kv(packed_kv_floats, 0);
    if (!packed.ok() || !packed_kv.ok()) return 1;
    int failed = 0;
    relative_sublayer_backward(blas, (RelativeBackwardFn)attend_back, (FortranGemmFn)gemm, x, memory, grad_weights, dy,
                               xhat, rstd, gamma, keep_bits, qkv, memory_kv,
                               r, u, pb, attended, lse, w_q, w_kv, w_out, packed.first, packed.second,
                               packed_kv.first, grad_x, grad_projected, grad_attended, grad_qkv, grad_memory_kv,
                               grad_r, grad_u, grad_pb, sums, RelativeShape{batch, length, mem, heads, d},
                               (float)scale, block_sequences, threads, &failed);
    return failed ? 2 : 0;
}
// Returns 1 where the packed weights could not be allocated, 2 where the attention kernel refused its
// shapes. sizes: layers, batch, length, mem, heads, d, f, block_sequences, ffn_rows, gated (whether any gate).
int relative_stack_forward_f32(const void* pack, const void* compute, const void* local_threads, const void* attend,
                               const void* tail_forward, const void* bias_sigmoid, const int64_t* table,
                               const double* reals, const uint64_t* seeds, const uint32_t* keeps, const float* zero,
                               const int64_t* packed_floats, const int64_t* sizes, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    const StackShape z{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], sizes[6], sizes[7], sizes[8],
                       sizes[9]};
    PackedLayers packed{packed_floats, nullptr};
    packed.base = kept_pack_room(z.layers * packed.per_layer());
    if (packed.base == nullptr) return 1;
    int failed = 0;
    relative_stack_forward(blas, (RelativeForwardFn)attend, (TailForwardFn)tail_forward, (BiasSigmoidFn)bias_sigmoid,
                           LayerTable{table}, reals, seeds, keeps, zero, packed, z, threads, &failed);
    return failed ? 2 : 0;
}
// The floats of relative_stack_backward_f32's scratch, which the caller allocates (so that it is counted as a tensor).
int64_t relative_stack_scratch_floats(const int64_t* sizes, int64_t threads) {
    const StackShape z{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], sizes[6], sizes[7], sizes[8],
                       sizes[9]};
    return stack_scratch_floats(z, threads) + 16;  // room to align it to 64 bytes
}
int relative_stack_backward_f32(const void* pack, const void* compute, const void* local_threads, const void* gemm,
                                const void* attend_back, const void* tail_backward, const int64_t* table,
                                const double* reals, const float* grad, float* grad_input, float* weights,
                                float* small, float* sums, float* scratch, const int64_t* packed_floats,
                                const int64_t* sizes, int64_t threads) {
    const Blas blas{(PackFn)pack, (ComputeFn)compute, (LocalThreadsFn)local_threads};
    const StackShape z{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], sizes[6], sizes[7], sizes[8],
                       sizes[9]};
    PackedLayers packed{packed_floats, nullptr};
    packed.base = kept_pack_room(z.layers * packed.per_layer());
    if (packed.base == nullptr) return 1;
    int failed = 0;
    relative_stack_backward(blas, (RelativeBackwardFn)attend_back, (TailBackwardFn)tail_backward, (FortranGemmFn)gemm,
                            LayerTable{table}, reals,
                            grad, grad_input, packed, weights, small, sums, PackedPair::aligned(scratch), z, threads,
                            &failed);
    return failed ? 2 : 0;
}
}
#include "common.h"
