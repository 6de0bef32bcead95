"""Causal multi-head attention for short windows on the CPU, read straight from the fused QKV projection: the
compiled kernel (:mod:`gatedformer.kernels.attention`) as an autograd function, and its PyTorch path.

``torch.nn.functional.scaled_dot_product_attention`` on the CPU runs a flash-attention kernel built from
small matrix products: at the sizes of the ``-tiny`` recipes (windows of 128, heads of 32) it reaches
15-20 % of the float32 matrix-product peak, and its inputs and gradients need transposed copies between
the ``(B, L, 3, H, D)`` layout of the projection and its ``(B, H, L, D)`` one. The kernel computes

.. math::

    P = \\operatorname{softmax}\\big(\\mathrm{mask}(s\\, Q K^\\top)\\big), \\qquad O = P V

for each (sequence, head) with register-blocked loops over the whole window at once (the window's keys
and values fit in the L1/L2 cache), 16-wide on CPUs with AVX-512 and 8-wide with AVX2, reading Q, K and V
from the projection's output (adding its bias as it reads them, if asked: one pass over the projection fewer)
and writing O in the ``(B, L, H·D)`` layout the output projection reads.
While it runs, denormal floats are flushed to zero (a peaked softmax produces them, and x86 computes on
them dozens of times slower). The backward pass recomputes ``P`` from the saved log-sum-exp of every row
(as flash attention does), so nothing of size ``L × L`` is kept: it takes the query rows 64 at a time,
computes their rows of ``P`` and ``dS`` (and ``dQ``) and then adds their share to ``dK`` and ``dV`` key
block by key block, with the accumulators in registers. It writes the three gradients into the
projection's layout (and their sums over the rows, the bias's gradient, if asked). Only the causal
(query, key) pairs are computed, in whole vectors.

It applies to float32 CPU tensors, head sizes 8 (not in the AVX-512 build), 16, 32, 64 or 128, and no
attention dropout; everything else takes ``scaled_dot_product_attention``. ``GATEDFORMER_ATTENTION_BACKEND``
picks ``native``, ``torch`` (always ``scaled_dot_product_attention``) or ``auto`` (the default). Under
``torch.compile`` the kernel is the custom operator ``gatedformer::causal_attention_packed``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from gatedformer.kernels.attention import kernel_takes, packed_backward, packed_forward
from gatedformer.ops.operators import FunctionOperator, call

__all__ = ["causal_attention_packed", "causal_attention_reference", "kernel_applies"]


def kernel_applies(qkv: Tensor, n_heads: int, dropout: float) -> bool:
    """Whether :func:`causal_attention_packed` runs the compiled kernel for this input."""
    return qkv.dim() == 3 and kernel_takes(qkv.shape[-1], n_heads, dropout, qkv.device, qkv.dtype)


class _PackedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, n_heads: int) -> Tensor:  # type: ignore[override]
        qkv = qkv.contiguous()
        out, lse = packed_forward(qkv, n_heads, keep_lse=ctx.needs_input_grad[0])
        if lse is not None:
            ctx.save_for_backward(qkv, out, lse)
        ctx.n_heads = n_heads
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        qkv, out, lse = ctx.saved_tensors
        return packed_backward(qkv, out, grad_out, lse, ctx.n_heads)[0], None


def _attended(qkv: Tensor, n_heads: int) -> list[Tensor]:
    return [qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)]


PACKED_CAUSAL_ATTENTION = FunctionOperator("causal_attention_packed", _PackedCausalAttention,
                                           "Tensor qkv, int n_heads", _attended)
"""The kernel as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def causal_attention_reference(qkv: Tensor, n_heads: int, dropout: float = 0.0) -> Tensor:
    """``(B, L, 3·H·D)`` packed projections -> ``(B, L, H·D)`` causal attention, by
    ``scaled_dot_product_attention``."""
    batch, length, width = qkv.shape
    # (B, L, 3, H, D) split on dim 2, heads moved by transposed views: the backward pass then writes the
    # three gradients straight into the (B, L, 3d) layout of the projection, with no permuted copy.
    q, k, v = (t.transpose(1, 2) for t in qkv.view(batch, length, 3, n_heads, -1).unbind(2))
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
    return attended.transpose(1, 2).reshape(batch, length, width // 3)


def causal_attention_packed(qkv: Tensor, n_heads: int, dropout: float = 0.0) -> Tensor:
    """Causal attention of packed ``(B, L, 3·H·D)`` projections (Q, K, V in that order), ``(B, L, H·D)`` out.

    The compiled kernel where :func:`kernel_applies`, else :func:`causal_attention_reference`.
    """
    if kernel_applies(qkv, n_heads, dropout):
        return call(PACKED_CAUSAL_ATTENTION, qkv, n_heads)
    return causal_attention_reference(qkv, n_heads, dropout)
