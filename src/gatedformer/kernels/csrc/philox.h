// The mask generator shared by the kernels that draw dropout masks (dropout.cpp and epilogue.cpp):
// gatedformer/kernels/dropout.py describes the layout, and philox_words there is its NumPy reference.
// Included right after parallel.h and the kernel's own header; it opens the anonymous namespace that the
// including source closes.
#pragma once

// Philox4x32-10 mask words; see gatedformer/kernels/dropout.py for the layout. It opens an
// anonymous namespace that the source after it closes. Compiled by gatedformer.
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kStep0 = 0x9E3779B9u, kStep1 = 0xBB67AE85u;
constexpr int64_t kLanes = 8, kTile = 4 * kLanes;

// An element is kept where its mask word is below keep_below (the number of the 2^32 words that keep it), that is
// where word <= keep_below - 1: in 32 bits a keep_below of 0 stands for 2^32, every element kept (p = 0).
inline uint32_t last_kept(uint32_t keep_below) { return keep_below - 1u; }

// The 32 words of tile `tile`: words[e * 8 + l] is word e of Philox4x32-10 at counter (8 tile + l, 0, 0).
#if defined(__AVX2__)
inline void mulhilo(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
    const __m256i even = _mm256_mul_epu32(a, m);                        // 64-bit products of lanes 0, 2, 4, 6
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // and of lanes 1, 3, 5, 7
    lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

inline void tile_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    const uint64_t first = tile * kLanes;  // a multiple of 8: the tile's blocks share their high word
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i c1 = _mm256_set1_epi32((int)(uint32_t)(first >> 32));
    __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
    const __m256i m0 = _mm256_set1_epi32((int)kM0), m1 = _mm256_set1_epi32((int)kM1);
    for (int round = 0; round < 10; ++round) {
        __m256i hi0, lo0, hi1, lo1;
        mulhilo(c0, m0, hi0, lo0);
        mulhilo(c2, m1, hi1, lo1);
        const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c1 = lo1; c3 = lo0; c0 = n0; c2 = n2;
        k0 += kStep0; k1 += kStep1;
    }
    _mm256_storeu_si256((__m256i*)(words + 0), c0);
    _mm256_storeu_si256((__m256i*)(words + 8), c1);
    _mm256_storeu_si256((__m256i*)(words + 16), c2);
    _mm256_storeu_si256((__m256i*)(words + 24), c3);
}
#else
inline void tile_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    for (int64_t l = 0; l < kLanes; ++l) {
        const uint64_t block = tile * kLanes + l;
        uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32), c2 = 0, c3 = 0, a = k0, b = k1;
        for (int round = 0; round < 10; ++round) {
            const uint64_t p0 = (uint64_t)kM0 * c0, p1 = (uint64_t)kM1 * c2;
            const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ a, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ b;
            c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
            a += kStep0; b += kStep1;
        }
        words[l] = c0; words[8 + l] = c1; words[16 + l] = c2; words[24 + l] = c3;
    }
}
#endif

#if defined(__AVX512F__)
// Sixteen blocks at once: the words of tiles `tile` (even) and `tile + 1`, one after the other.
constexpr int64_t kTilesPerDraw = 2;

inline void mulhilo(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
    const __m512i even = _mm512_mul_epu32(a, m);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// Chains x 16 blocks: tiles tile .. tile + 2 Chains - 1 (tile even), words[32 t + 8 e + l] word e of block l of
// tile + t. The chains are independent, so their rounds overlap: one chain alone waits on its multiplies.
template <int Chains>
inline void draw_chains(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    __m512i c0[Chains], c1[Chains], c2[Chains], c3[Chains];
    for (int q = 0; q < Chains; ++q) {
        const uint64_t first = (tile + 2 * q) * kLanes;  // a multiple of 16: the sixteen blocks share their high word
        c0[q] = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)first),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        c1[q] = _mm512_set1_epi32((int)(uint32_t)(first >> 32));
        c2[q] = c3[q] = _mm512_setzero_si512();
    }
    const __m512i m0 = _mm512_set1_epi32((int)kM0), m1 = _mm512_set1_epi32((int)kM1);
    for (int round = 0; round < 10; ++round) {
        const __m512i a = _mm512_set1_epi32((int)k0), b = _mm512_set1_epi32((int)k1);
        for (int q = 0; q < Chains; ++q) {
            __m512i hi0, lo0, hi1, lo1;
            mulhilo(c0[q], m0, hi0, lo0);
            mulhilo(c2[q], m1, hi1, lo1);
            const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[q]), a);
            const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[q]), b);
            c1[q] = lo1; c3[q] = lo0; c0[q] = n0; c2[q] = n2;
        }
        k0 += kStep0; k1 += kStep1;
    }
    for (int q = 0; q < Chains; ++q) {
        const __m512i c[4] = {c0[q], c1[q], c2[q], c3[q]};
        uint32_t* out = words + 2 * kTile * q;
        for (int e = 0; e < 4; ++e) {
            _mm256_storeu_si256((__m256i*)(out + 8 * e), _mm512_castsi512_si256(c[e]));
            _mm256_storeu_si256((__m256i*)(out + kTile + 8 * e), _mm512_extracti64x4_epi64(c[e], 1));
        }
    }
}

inline void draw_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    draw_chains<1>(tile, k0, k1, words);
}
// Bulk draws for the long masks: twice the words, two chains.
constexpr int64_t kDrawsPerBulk = 2;
inline void draw_bulk(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) {
    draw_chains<2>(tile, k0, k1, words);
}
#else
constexpr int64_t kTilesPerDraw = 1;

inline void draw_words(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) { tile_words(tile, k0, k1, words); }
constexpr int64_t kDrawsPerBulk = 1;
inline void draw_bulk(uint64_t tile, uint32_t k0, uint32_t k1, uint32_t* words) { tile_words(tile, k0, k1, words); }
#endif
constexpr int64_t kDraw = kTilesPerDraw * kTile;  // words drawn at once
constexpr int64_t kBulk = kDrawsPerBulk * kDraw;  // words of draw_bulk, whose tile must be a multiple of kBulk / kTile
