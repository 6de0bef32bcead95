// C++ for kernels that take the addresses of MKL's packed products (gatedformer/kernels/blas.py's
// PackedGemm), included inside the kernel's own namespace.
#pragma once

// MKL's packed products, by address (see gatedformer/kernels/blas.py): the pack and compute functions and the
// thread-local thread count, and stream_blocks, which runs a kernel's blocks of rows on OpenMP threads that each
// call MKL on one thread. Needs <cstdint> and, with OpenMP, <omp.h>.
typedef void (*PackFn)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                       int ld, float* dest);
typedef void (*ComputeFn)(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                          const float* b, int ldb, float beta, float* c, int ldc);
typedef int (*LocalThreadsFn)(int);
// The plain product through MKL's Fortran interface (column-major, arguments by pointer): PyTorch's copy of MKL
// exports no cblas_sgemm.
typedef void (*FortranGemmFn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                              const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                              const float* beta, float* c, const int* ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

struct Blas {
    PackFn pack;
    ComputeFn compute;
    LocalThreadsFn local_threads;
};

// c (m x n) += a^T b for a (k x m) and b (k x n), all row-major with leading dimensions lda, ldb and n: a weight's
// gradient from one block of rows. Row-major c is column-major c^T = b^T a, which is what the call computes.
inline void add_at_b(FortranGemmFn gemm, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                     int64_t ldb, float* c) {
    const int cm = (int)n, cn = (int)m, ck = (int)k, la = (int)ldb, lb = (int)lda, lc = (int)n;
    const float one = 1.0f;
    gemm("N", "T", &cm, &cn, &ck, &one, b, &la, a, &lb, &one, c, &lc);
}

// body(thread, threads, first_block, end_block) on `threads` OpenMP threads, each with MKL on one thread and a
// contiguous share of `blocks`.
template <typename Fn>
void stream_blocks(const Blas& blas, int64_t blocks, int64_t threads, Fn body) {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int saved = blas.local_threads(1);
        body(t, nt, t * blocks / nt, (t + 1) * blocks / nt);
        blas.local_threads(saved);
    }
#else
    (void)threads;
    const int saved = blas.local_threads(1);
    body(int64_t(0), int64_t(1), int64_t(0), blocks);
    blas.local_threads(saved);
#endif
}

inline void stream_barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}
