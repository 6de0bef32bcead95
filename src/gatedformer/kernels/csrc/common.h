// Included last by every kernel's source: the ABI check and the CPU probes that decide whether a build for AVX2
// or AVX-512 may load, as <name>_abi_version, <name>_cpu_has_avx2_fma and <name>_cpu_has_avx512.
// gatedformer/kernels/build.py defines the kernel's name and ABI version on the command line.
#pragma once
#if !defined(GATEDFORMER_KERNEL_NAME) || !defined(GATEDFORMER_KERNEL_ABI)
#error "compile with -DGATEDFORMER_KERNEL_NAME=<kernel> -DGATEDFORMER_KERNEL_ABI=<version>, as build.py does"
#endif
#define GATEDFORMER_PASTE_(name, suffix) name##_##suffix
#define GATEDFORMER_PASTE(name, suffix) GATEDFORMER_PASTE_(name, suffix)
#define GATEDFORMER_EXPORT(suffix) GATEDFORMER_PASTE(GATEDFORMER_KERNEL_NAME, suffix)

extern "C" {
int GATEDFORMER_EXPORT(abi_version)() { return GATEDFORMER_KERNEL_ABI; }
int GATEDFORMER_EXPORT(cpu_has_avx2_fma)() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}
int GATEDFORMER_EXPORT(cpu_has_avx512)() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}
}
