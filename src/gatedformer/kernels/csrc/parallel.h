// Included first by every kernel's source: the helper that splits work between threads.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

namespace gatedformer {
// Calls fn(lo, hi) in parallel on at most `threads` contiguous chunks of [0, n) whose bounds are multiples of
// `grain`. Built with OpenMP, the chunks run on the OpenMP thread pool that PyTorch itself uses (the process
// loads one libgomp.so.1), so the kernel adds no threads that would compete with PyTorch's for the cores.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t threads, int64_t grain, Fn fn) {
    const int64_t units = (n + grain - 1) / grain;
    if (threads > units) threads = units;
    if (threads <= 1) {
        fn(int64_t(0), n);
        return;
    }
    const int64_t per = (units + threads - 1) / threads * grain;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < threads; ++k) {
        const int64_t lo = k * per, hi = lo + per < n ? lo + per : n;
        // A private copy of the closure: through the shared one the compiler must assume that every store
        // may change the captured pointers, which stops vectorisation (measured 10x slower).
        Fn local = fn;
        if (lo < hi) local(lo, hi);
    }
#else
    std::vector<std::thread> pool;
    for (int64_t lo = per; lo < n; lo += per) pool.emplace_back(fn, lo, lo + per < n ? lo + per : n);
    fn(int64_t(0), per < n ? per : n);
    for (auto& th : pool) th.join();
#endif
}
}  // namespace gatedformer
