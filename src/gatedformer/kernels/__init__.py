"""Compiled kernels: the build helper (:mod:`~gatedformer.kernels.build`), one small binding module per CPU
kernel, and the Triton kernels for GPUs (:mod:`gatedformer.kernels.triton`). Nothing here knows a model."""
