// The C API of dropout.cpp (dropout with Philox4x32-10 masks): the functions that gatedformer/kernels/dropout.py calls.
// dropout.cpp includes this header, so the compiler rejects a definition that disagrees with its declaration, and
// gatedformer/kernels/build.py reads the declarations for the argument and result types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
int64_t embed_dropout_f32(const float* table, const int64_t* tokens, const float* positions, float* out, int64_t rows,
                          int64_t d, int64_t vocab, int64_t length, double scale, int64_t dropout, uint64_t seed,
                          uint32_t keep_below, double drop_scale, int64_t threads);
void embed_dropout_backward_f32(const float* grad, const int64_t* tokens, float* grad_table, int64_t rows, int64_t d,
                                double scale, int64_t dropout, uint64_t seed, uint32_t keep_below, double drop_scale,
                                int64_t threads);
void dropout_f32(const float* x, float* y, int64_t n, uint64_t seed, uint32_t keep_below, double scale,
                 int64_t threads);
void dropout_add_f32(const float* base, const float* x, float* y, int64_t n, uint64_t seed, uint32_t keep_below,
                     double scale, int64_t threads);
void relu_dropout_f32(const float* x, float* y, int64_t n, uint64_t seed, uint32_t keep_below, double scale,
                      int64_t threads);
void positive_scale_f32(const float* y, const float* g, float* out, int64_t n, double scale, int64_t threads);
void dropout_f64(const double* x, double* y, int64_t n, uint64_t seed, uint32_t keep_below, double scale,
                 int64_t threads);
void dropout_add_f64(const double* base, const double* x, double* y, int64_t n, uint64_t seed, uint32_t keep_below,
                     double scale, int64_t threads);
void relu_dropout_f64(const double* x, double* y, int64_t n, uint64_t seed, uint32_t keep_below, double scale,
                      int64_t threads);
void positive_scale_f64(const double* y, const double* g, double* out, int64_t n, double scale, int64_t threads);
void dropout_tile_words(uint64_t tile, uint64_t seed, uint32_t* words);
}
