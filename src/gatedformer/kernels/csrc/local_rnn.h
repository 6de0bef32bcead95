// The C API of local_rnn.cpp (the LocalRNN recurrence over blocks of windows): the functions that
// gatedformer/kernels/local_rnn.py calls. local_rnn.cpp includes this header, so the compiler rejects a definition that
// disagrees with its declaration, and gatedformer/kernels/build.py reads the declarations for the argument and result
// types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
int local_rnn_forward_f32(const void* pack, const void* compute, const void* local_threads, int64_t cell,
                          const float* gin, const float* pad, const float* w, const float* bias, int64_t packed_floats,
                          float* out, float* hs, float* cs, float* ghs, int64_t rows, int64_t length, int64_t d,
                          int64_t window, int64_t block_rows, int64_t threads);
int local_rnn_backward_f32(const void* pack, const void* compute, const void* local_threads, int64_t cell,
                           const float* gin, const float* pad, const float* w, const float* bias, const float* hs,
                           const float* cs, const float* ghs, const float* grad_out, int64_t packed_floats,
                           int64_t packed_h_floats, float* dgin, float* dpad, float* dweight, float* dbias,
                           int64_t rows, int64_t length, int64_t d, int64_t window, int64_t block_rows,
                           int64_t threads);
}
