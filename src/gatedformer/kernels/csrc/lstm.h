// The C API of lstm.cpp (one LSTM step from precomputed projections): the functions that gatedformer/kernels/lstm.py
// calls. lstm.cpp includes this header, so the compiler rejects a definition that disagrees with its declaration, and
// gatedformer/kernels/build.py reads the declarations for the argument and result types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
void lstm_forward_f32(const float* gi, int64_t sgi, const float* gh, int64_t sgh, const float* c, float* h_out,
                      float* c_out, int64_t rows, int64_t d, int64_t threads);
void lstm_backward_f32(const float* gi, int64_t sgi, const float* gh, int64_t sgh, const float* c, const float* grad_h,
                       const float* grad_c, float* da, float* dc, int64_t rows, int64_t d, int64_t threads);
void lstm_forward_f64(const double* gi, int64_t sgi, const double* gh, int64_t sgh, const double* c, double* h_out,
                      double* c_out, int64_t rows, int64_t d, int64_t threads);
void lstm_backward_f64(const double* gi, int64_t sgi, const double* gh, int64_t sgh, const double* c,
                       const double* grad_h, const double* grad_c, double* da, double* dc, int64_t rows, int64_t d,
                       int64_t threads);
}
