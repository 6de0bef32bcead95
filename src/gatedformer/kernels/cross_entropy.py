"""Softmax cross-entropy over rows of logits, in place: what :mod:`gatedformer.ops.output_loss` computes with.

For each row ``x`` of a ``(rows, V)`` block of logits (the output layer's product, its bias added here as the
row is read) the kernel computes the log-sum-exp and the row's loss ``lse(x) - Σ_j q_j x_j`` against the target
distribution ``q = (1 - ε) onehot(target) + ε / V`` (label smoothing ``ε``, 0 by default: ``lse(x) - x[target]``)
and, when asked, writes the loss's gradient over the row, ``scale · (softmax(x) - q)`` (zero for a row whose
target is the ignored index), and sums those rows per column for the bias's gradient. A row of a 10k-word vocabulary
(40 KB) stays in the core's cache through its three passes (bias and maximum; the exponentials, kept in place, and
their sum; the gradient from them), where ``log_softmax``, ``nll_loss`` and their backward passes would each stream
the whole block through memory.

The column sums are taken in fixed blocks of rows and then added in block order, so they do not depend on
the number of threads. The exponential is evaluated inline on 16 (AVX-512) or 8 (AVX2) lanes, within 2e-7 of
``exp``; NaN and infinite logits give a NaN or infinite loss, as ``cross_entropy`` does.
Its source is ``csrc/cross_entropy.cpp`` (C API: ``csrc/cross_entropy.h``), which takes :data:`ROW_BLOCK` as
``-DCROSS_ENTROPY_ROW_BLOCK``. ``GATEDFORMER_CROSS_ENTROPY_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the
default).
"""

from __future__ import annotations

from gatedformer.kernels.build import NativeKernel

__all__ = ["KERNEL", "ROW_BLOCK"]

ROW_BLOCK = 32
"""Rows whose gradients are summed together for the bias's gradient (the partial sums the kernel adds in order)."""


KERNEL = NativeKernel(
    "cross_entropy", abi_version=3, env_var="GATEDFORMER_CROSS_ENTROPY_BACKEND",
    description="the compiled cross-entropy kernel", fallback="linear then cross_entropy", avx512=True,
    extra_cflags=(f"-DCROSS_ENTROPY_ROW_BLOCK={ROW_BLOCK}",),
)
