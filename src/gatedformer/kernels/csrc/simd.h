// C++ helpers shared by the compiled kernels: the vector type, masked lanes, exp, denormal flushing.
//
// Included inside a kernel's own anonymous namespace. It defines `kW` (floats per vector: 16 with AVX-512, else 8),
// `vec` and the small functions below; the kernel picks its own blocking. Needs <cmath>, <cstdint>, <vector> and,
// on x86, <immintrin.h> (<xmmintrin.h> without AVX2), included before it.
#pragma once

#if defined(__AVX512F__)
constexpr int kW = 16;          // floats per vector: one AVX-512 register
#else
constexpr int kW = 8;           // one AVX2 register (or two SSE ones)
#endif
typedef float vec __attribute__((vector_size(4 * kW), aligned(4), may_alias));
typedef int32_t ivec __attribute__((vector_size(4 * kW)));

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec x) { *reinterpret_cast<vec*>(p) = x; }
inline vec splat(float x) { return vec{} + x; }  // a scalar operand is broadcast to every lane
inline vec vmin(vec a, vec b) { return a < b ? a : b; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline float hmax(vec x) {
    float top = x[0];
    for (int k = 1; k < kW; ++k) top = x[k] > top ? x[k] : top;
    return top;
}
inline float hsum(vec x) {
    float sum = 0.0f;
    for (int k = 0; k < kW; ++k) sum += x[k];
    return sum;
}
// Lanes whose index jb + lane is below `valid` keep x; the others get `fill`.
inline vec below(vec x, int64_t jb, int64_t valid, float fill) {
    ivec lane;
    for (int k = 0; k < kW; ++k) lane[k] = k;
    return lane < ivec{} + (int32_t)(valid - jb) ? x : splat(fill);
}
// The first n < kW floats at p in the low lanes, zeros above (masked: nothing past p + n is read), and back.
inline vec load_first(const float* p, int64_t n) {
#if defined(__AVX512F__)
    return (vec)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#elif defined(__AVX2__)
    ivec lane;
    for (int k = 0; k < kW; ++k) lane[k] = k;
    return (vec)_mm256_maskload_ps(p, (__m256i)(lane < ivec{} + (int32_t)n));
#else
    vec x = splat(0);
    for (int64_t k = 0; k < n; ++k) x[k] = p[k];
    return x;
#endif
}
inline void store_first(float* p, vec x, int64_t n) {
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)x);
#elif defined(__AVX2__)
    ivec lane;
    for (int k = 0; k < kW; ++k) lane[k] = k;
    _mm256_maskstore_ps(p, (__m256i)(lane < ivec{} + (int32_t)n), (__m256)x);
#else
    for (int64_t k = 0; k < n; ++k) p[k] = x[k];
#endif
}
// exp of every lane for arguments x <= 0 (a softmax's), inline: a call into a vector maths library would make
// the loop around it save and restore every vector register. exp(x) = 2^n exp(t) with n = round(x / ln 2) and
// t = x - n ln 2 in [-ln 2 / 2, ln 2 / 2], where the Taylor series to t^6 is within 2e-7 of exp(t); x is held
// above -87 so that 2^n stays a normal float.
#if defined(__AVX512F__) || defined(__AVX2__)
inline vec vexp(vec x) {
    x = vmax(x, splat(-87.0f));
#if defined(__AVX512F__)
    const vec n = (vec)_mm512_roundscale_ps((__m512)(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vec n = (vec)_mm256_round_ps((__m256)(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const vec t = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts: t stays exact
    vec p = splat(1.0f / 720);
    p = p * t + 1.0f / 120;
    p = p * t + 1.0f / 24;
    p = p * t + 1.0f / 6;
    p = p * t + 0.5f;
    p = p * t + 1.0f;
    p = p * t + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;  // 2^n built in the exponent field
    return p * (vec)bits;
}
#else
inline vec vexp(vec x) {
    for (int k = 0; k < kW; ++k) x[k] = std::exp(x[k]);
    return x;
}
#endif
// The logistic sigmoid and tanh of every lane from exp(-|x|) (never overflows).
inline vec vsigmoid(vec x) {
    const vec e = vexp(vmin(x, -x));
    const vec inv = 1.0f / (1.0f + e);
    return x >= 0.0f ? inv : e * inv;
}
inline vec vtanh(vec x) {
    const vec e = vexp(2.0f * vmin(x, -x));
    const vec t = (1.0f - e) / (1.0f + e);
    return x >= 0.0f ? t : -t;
}
// Flush denormal floats to zero while a thread runs the kernel (restored after): a peaked softmax gives
// probabilities below 2^-126, and arithmetic on them is dozens of times slower on x86.
struct FlushDenormals {
#if defined(__SSE__) || defined(__x86_64__)
    unsigned int saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // flush-to-zero and denormals-are-zero
    ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};
#if defined(__AVX512F__)
// 16 rows of 16 floats transposed in registers: out[k] is column k of the rows x (whole-row loads and stores
// instead of 16-lane gathers or 256 scalar stores). x is overwritten.
inline void transpose16(__m512 x[16], __m512 out[16]) {
    __m512 t[16];
    for (int k = 0; k < 16; k += 2) {  // pairs of rows interleaved
        t[k] = _mm512_unpacklo_ps(x[k], x[k + 1]);
        t[k + 1] = _mm512_unpackhi_ps(x[k], x[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {  // then quads
        x[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44);
        x[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
        x[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44);
        x[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {  // 128-bit lanes of quads 0/1 and 2/3
        t[k] = _mm512_shuffle_f32x4(x[k], x[k + 4], 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(x[k], x[k + 4], 0xDD);
        t[k + 8] = _mm512_shuffle_f32x4(x[k + 8], x[k + 12], 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(x[k + 8], x[k + 12], 0xDD);
    }
    for (int k = 0; k < 8; ++k) {  // and of the two halves: column k, then k + 8
        out[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        out[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xDD);
    }
}
#endif
// `n` floats of `work` starting on a 64-byte boundary.
inline float* aligned_work(std::vector<float>& work, int64_t n) {
    work.resize(n + 16);
    const uintptr_t at = reinterpret_cast<uintptr_t>(work.data());
    return work.data() + ((64 - at % 64) % 64) / sizeof(float);
}
