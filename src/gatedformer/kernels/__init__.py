"""Compiled kernels: the build helper (:mod:`~gatedformer.kernels.build`), the C++ sources it compiles (``csrc/``,
package data: one ``<kernel>.cpp`` and its C API ``<kernel>.h`` per CPU kernel, and the headers they share), one small
binding module per CPU kernel (it loads the library and wraps its functions as tensors in, tensors out), and the
Triton kernels for GPUs (:mod:`gatedformer.kernels.triton`). Nothing here knows a model; the autograd functions and
the choice between a kernel and its PyTorch fallback are in :mod:`gatedformer.ops`."""
