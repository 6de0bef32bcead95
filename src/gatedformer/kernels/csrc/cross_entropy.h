// The C API of cross_entropy.cpp (softmax cross-entropy over rows of logits): the functions that
// gatedformer/kernels/cross_entropy.py calls. cross_entropy.cpp includes this header, so the compiler rejects a
// definition that disagrees with its declaration, and gatedformer/kernels/build.py reads the declarations for the
// argument and result types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
int64_t softmax_cross_entropy_f32(float* logits, const float* bias, const int64_t* targets, int64_t rows, int64_t V,
                                  int64_t ignore_index, double smoothing, float* losses, int want_grad, double scale,
                                  float* col_sums, int64_t threads);
}
