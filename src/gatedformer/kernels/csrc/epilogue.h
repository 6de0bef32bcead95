// The C API of epilogue.cpp (linear-layer epilogues, streamed sublayers and layer stacks): the functions that
// gatedformer/kernels/epilogue.py calls. epilogue.cpp includes this header, so the compiler rejects a definition that
// disagrees with its declaration, and gatedformer/kernels/build.py reads the declarations for the argument and result
// types it gives ctypes.
#pragma once
#include <cstdint>

extern "C" {
void bias_relu_dropout_f32(float* h, const float* bias, int64_t n, int64_t cols, uint64_t seed, uint32_t keep_below,
                           double scale, int64_t threads, uint32_t* positive);
void bias_dropout_add_f32(const float* base, float* h, const float* bias, int64_t n, int64_t cols, uint64_t seed,
                          uint32_t keep_below, double scale, int64_t threads);
void positive_scale_colsum_f32(const uint32_t* positive, const float* g, float* out, float* colsum, int64_t rows,
                               int64_t cols, double scale, int64_t threads);
void dropout_add_norm_f32(const float* base, const float* h, const float* bias, const float* gate, float* xhat,
                          const float* gamma, const float* beta, float* y, float* rstd, uint32_t* keep_bits,
                          int64_t rows, int64_t cols, double eps, uint64_t seed, uint32_t keep_below, double scale,
                          int64_t threads);
void dropout_add_norm_backward_f32(const float* dy, const float* xhat, const float* rstd, const float* gamma,
                                   const uint32_t* keep_bits, const float* gate, const float* h, const float* bias,
                                   float* dv, float* dh, float* dgate, float* sums, int64_t rows, int64_t cols,
                                   double scale, int64_t threads);
int ffn_forward_f32(const void* pack, const void* compute, const void* local_threads, const float* x, const float* w1,
                    const float* b1, const float* w2, const float* b2, const float* gamma, const float* beta,
                    int64_t packed_w1t_floats, int64_t packed_w2t_floats, float* hidden, uint32_t* positive,
                    float* xhat, float* y, float* rstd, uint32_t* keep_bits, int64_t rows, int64_t d, int64_t f,
                    double eps, uint64_t inner_seed, uint32_t inner_keep, double inner_scale, uint64_t outer_seed,
                    uint32_t outer_keep, double outer_scale, int64_t block_rows, int64_t threads);
int ffn_backward_f32(const void* pack, const void* compute, const void* local_threads, const void* gemm, const float* x,
                     const float* hidden, float* grad_weights, const float* dy, const float* xhat, const float* rstd,
                     const float* gamma, const uint32_t* keep_bits, const uint32_t* positive, const float* w1,
                     const float* w2, int64_t packed_w2_floats, int64_t packed_w1_floats, float* grad_x,
                     float* grad_outer, float* grad_inner, float* sums, int64_t rows, int64_t d, int64_t f,
                     double outer_scale, double inner_scale, int64_t block_rows, int64_t threads);
int attention_sublayer_forward_f32(const void* pack, const void* compute, const void* local_threads, const void* attend,
                                   const float* x, const float* w_qkv, const float* b_qkv, const float* w_out,
                                   const float* b_out, const float* gamma, const float* beta, int64_t packed_qkv_floats,
                                   int64_t packed_out_floats, float* qkv, float* attended, float* lse, float* xhat,
                                   float* y, float* rstd, uint32_t* keep_bits, int64_t batch, int64_t length,
                                   int64_t heads, int64_t d, double eps, uint64_t seed, uint32_t keep, double scale,
                                   int64_t block_sequences, int64_t threads);
int attention_sublayer_backward_f32(const void* pack, const void* compute, const void* local_threads,
                                    const void* attend_back, const float* dy, const float* xhat, const float* rstd,
                                    const float* gamma, const uint32_t* keep_bits, const float* qkv, const float* b_qkv,
                                    const float* attended, const float* lse, const float* w_qkv, const float* w_out,
                                    int64_t packed_out_floats, int64_t packed_qkv_floats, float* grad_x,
                                    float* grad_projected, float* grad_attended, float* grad_qkv, float* grad_b_qkv,
                                    float* sums, int64_t batch, int64_t length, int64_t heads, int64_t d, double scale,
                                    int64_t block_sequences, int64_t threads);
int relative_sublayer_forward_f32(const void* pack, const void* compute, const void* local_threads, const void* attend,
                                  const float* x, const float* memory, const float* r, const float* u, const float* pb,
                                  const float* w_q, const float* w_kv, const float* w_out, const float* bias,
                                  const float* gamma, const float* beta, int64_t packed_q_floats,
                                  int64_t packed_kv_floats, int64_t packed_out_floats, float* qkv, float* memory_kv,
                                  float* attended, float* lse, float* xhat, float* y, float* rstd, uint32_t* keep_bits,
                                  int64_t batch, int64_t length, int64_t mem, int64_t heads, int64_t d, double eps,
                                  uint64_t seed, uint32_t keep, double scale, int64_t block_sequences, int64_t threads);
int relative_sublayer_backward_f32(const void* pack, const void* compute, const void* local_threads, const void* gemm,
                                   const float* x, const float* memory, float* grad_weights, const void* attend_back,
                                   const float* dy, const float* xhat, const float* rstd, const float* gamma,
                                   const uint32_t* keep_bits, const float* qkv, const float* memory_kv, const float* r,
                                   const float* u, const float* pb, const float* attended, const float* lse,
                                   const float* w_q, const float* w_kv, const float* w_out, int64_t packed_out_floats,
                                   int64_t packed_q_floats, int64_t packed_kv_floats, float* grad_x,
                                   float* grad_projected, float* grad_attended, float* grad_qkv, float* grad_memory_kv,
                                   float* grad_r, float* grad_u, float* grad_pb, float* sums, int64_t batch,
                                   int64_t length, int64_t mem, int64_t heads, int64_t d, double scale,
                                   int64_t block_sequences, int64_t threads);
int relative_stack_forward_f32(const void* pack, const void* compute, const void* local_threads, const void* attend,
                               const void* tail_forward, const void* bias_sigmoid, const int64_t* table,
                               const double* reals, const uint64_t* seeds, const uint32_t* keeps, const float* zero,
                               const int64_t* packed_floats, const int64_t* sizes, int64_t threads);
int64_t relative_stack_scratch_floats(const int64_t* sizes, int64_t threads);
int relative_stack_backward_f32(const void* pack, const void* compute, const void* local_threads, const void* gemm,
                                const void* attend_back, const void* tail_backward, const int64_t* table,
                                const double* reals, const float* grad, float* grad_input, float* weights, float* small,
                                float* sums, float* scratch, const int64_t* packed_floats, const int64_t* sizes,
                                int64_t threads);
}
