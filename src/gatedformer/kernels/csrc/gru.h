// The C API of gru.cpp (one GRU step from precomputed projections): the functions that gatedformer/kernels/gru.py
// calls. gru.cpp includes this header, so the compiler rejects a definition that disagrees with its declaration, and
// gatedformer/kernels/build.py reads the declarations for the argument and result types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
void gru_forward_f32(const float* gi, int64_t sgi, const float* gh, int64_t sgh, const float* h, float* out,
                     int64_t rows, int64_t d, int64_t threads);
void gru_backward_f32(const float* gi, int64_t sgi, const float* gh, int64_t sgh, const float* h, const float* grad,
                      float* dgi, float* dgh, float* dh, int64_t rows, int64_t d, int64_t threads);
void gru_forward_f64(const double* gi, int64_t sgi, const double* gh, int64_t sgh, const double* h, double* out,
                     int64_t rows, int64_t d, int64_t threads);
void gru_backward_f64(const double* gi, int64_t sgi, const double* gh, int64_t sgh, const double* h, const double* grad,
                      double* dgi, double* dgh, double* dh, int64_t rows, int64_t d, int64_t threads);
}
