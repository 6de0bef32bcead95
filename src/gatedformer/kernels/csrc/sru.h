// The C API of sru.cpp (the element-wise SRU recurrence): the functions that gatedformer/kernels/sru.py calls. sru.cpp
// includes this header, so the compiler rejects a definition that disagrees with its declaration, and
// gatedformer/kernels/build.py reads the declarations for the argument and result types it gives ctypes.
// c_last (B, D, H): the cell after every row's last step. gvf, gvr, gbf, gbr (D, H): those gradients summed over the
// batch.
#pragma once
#include <cstdint>

extern "C" {
void sru_forward_f32(const float* u, const float* f, const float* r, int64_t st, int64_t sb, int64_t sd,
                     const float* xs, int64_t xt, int64_t xb, int64_t xd, const float* vf, const float* vr,
                     const float* bf, const float* br, const float* c0, double alpha, int64_t L, int64_t B, int64_t D,
                     int64_t H, int64_t threads, float* h, float* c_all, float* c_last);
void sru_backward_f32(const float* u, const float* f, const float* r, int64_t st, int64_t sb, int64_t sd,
                      const float* xs, int64_t xt, int64_t xb, int64_t xd, const float* vf, const float* vr,
                      const float* bf, const float* br, const float* c0, double alpha, int64_t L, int64_t B, int64_t D,
                      int64_t H, int64_t threads, const float* c_all, const float* grad_h, const float* grad_c_last,
                      float* gu, float* gf, float* gr, float* gxs, int64_t gxt, int64_t gxb, int64_t gxd, float* gvf,
                      float* gvr, float* gbf, float* gbr, float* gc);
void sru_forward_f64(const double* u, const double* f, const double* r, int64_t st, int64_t sb, int64_t sd,
                     const double* xs, int64_t xt, int64_t xb, int64_t xd, const double* vf, const double* vr,
                     const double* bf, const double* br, const double* c0, double alpha, int64_t L, int64_t B,
                     int64_t D, int64_t H, int64_t threads, double* h, double* c_all, double* c_last);
void sru_backward_f64(const double* u, const double* f, const double* r, int64_t st, int64_t sb, int64_t sd,
                      const double* xs, int64_t xt, int64_t xb, int64_t xd, const double* vf, const double* vr,
                      const double* bf, const double* br, const double* c0, double alpha, int64_t L, int64_t B,
                      int64_t D, int64_t H, int64_t threads, const double* c_all, const double* grad_h,
                      const double* grad_c_last, double* gu, double* gf, double* gr, double* gxs, int64_t gxt,
                      int64_t gxb, int64_t gxd, double* gvf, double* gvr, double* gbf, double* gbr, double* gc);
}
