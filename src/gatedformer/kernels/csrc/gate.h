// The C API of gate.cpp (the gates' element-wise tails): the functions that gatedformer/kernels/gate.py calls. gate.cpp
// includes this header, so the compiler rejects a definition that disagrees with its declaration, and
// gatedformer/kernels/build.py reads the declarations for the argument and result types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
void gate_bias_sigmoid(float* x, const float* bias, int64_t rows, int64_t cols, int64_t threads);
int gate_tail_forward(int tail, const float* c, const float* a, int64_t a_row, const float* b, int64_t b_row,
                      float* out, int64_t rows, int64_t cols, int64_t threads);
int gate_tail_backward(int tail, const float* dout, const float* c, const float* a, int64_t a_row, const float* b,
                       int64_t b_row, float* dc, float* da, int64_t da_row, float* db, int64_t db_row, int64_t rows,
                       int64_t cols, int64_t threads);
}
