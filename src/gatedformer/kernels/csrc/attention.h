// The C API of attention.cpp (causal attention over packed QKV rows): the functions that
// gatedformer/kernels/attention.py calls. attention.cpp includes this header, so the compiler rejects a definition that
// disagrees with its declaration, and gatedformer/kernels/build.py reads the declarations for the argument and result
// types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
int attention_head_supported(int64_t D);
int attention_forward_f32(const float* qkv, const float* bias, float* out, float* lse, int64_t B, int64_t L, int64_t H,
                          int64_t D, double scale, int64_t threads);
int attention_backward_f32(const float* qkv, const float* bias, const float* out, const float* grad_out,
                           const float* lse, float* grad_qkv, float* grad_bias, int64_t B, int64_t L, int64_t H,
                           int64_t D, double scale, int64_t threads);
}
