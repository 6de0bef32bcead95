// The C API of relative_attention.cpp (relative-position causal attention (Transformer-XL)): the functions that
// gatedformer/kernels/relative_attention.py calls. relative_attention.cpp includes this header, so the compiler rejects
// a definition that disagrees with its declaration, and gatedformer/kernels/build.py reads the declarations for the
// argument and result types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
int relative_attention_forward_f32(const float* q, int64_t q_batch, int64_t q_row, const float* kv_mem,
                                   int64_t kv_mem_batch, int64_t kv_mem_row, const float* kv_cur, int64_t kv_cur_batch,
                                   int64_t kv_cur_row, const float* r, const float* u, const float* pb, float* out,
                                   float* lse, int64_t B, int64_t L, int64_t M, int64_t H, int64_t D, double scale,
                                   int64_t threads);
int relative_attention_backward_f32(const float* q, int64_t q_batch, int64_t q_row, const float* kv_mem,
                                    int64_t kv_mem_batch, int64_t kv_mem_row, const float* kv_cur, int64_t kv_cur_batch,
                                    int64_t kv_cur_row, const float* r, const float* u, const float* pb,
                                    const float* out, const float* grad_out, const float* lse, float* gq,
                                    float* gkv_mem, float* gkv_cur, float* gr, float* gu, float* gpb, int64_t B,
                                    int64_t L, int64_t M, int64_t H, int64_t D, double scale, int64_t threads);
}
