r"""Transformer-XL's relative-position attention for short windows on the CPU: the compiled kernel
(:mod:`gatedformer.kernels.relative_attention`) as an autograd function.

For each (sequence, head), with ``L`` queries that follow ``M`` memory positions and ``K = M + L`` keys,

.. math::

    s_{ij} = \tfrac{1}{\sqrt{D}}\big((q_i + u)^\top k_j + (q_i + v)^\top r_{L-1-i+j}\big), \quad j \le M + i,
    \qquad P = \operatorname{softmax}(s), \qquad O = P V,

where ``r_c`` is the projected encoding of distance ``K - 1 - c``. Written with PyTorch operations this is
two batched products with heads of 8-32 (a quarter of the matrix-product peak at best), the relative shift,
the causal mask, the softmax and their backward passes, each a pass over ``(B, H, L, K)`` scores in memory.
Here each (sequence, head) is one task whose keys, values and position keys fit in the L1/L2 cache: the
content and position products are register-blocked over eight query rows at a time, the shift is an offset
into the position products' row, and the softmax and the product with ``V`` follow while the rows are in cache.
Q, K, V and the position keys are read straight from the projections' outputs (``(B, L, H·D)``,
``(B, K, 2·H·D)``, ``(K, H·D)``) and the output is written in the ``(B, L, H·D)`` layout of the output
projection. The backward pass recomputes ``P`` from the saved log-sum-exp of every row (as flash attention
does) and writes the gradients of the four inputs and of ``u`` and ``v``; ``r``'s gradient, shared by the
sequences of the batch, is written per sequence and summed after. Heads of any size up to 128 are taken
(padded with zeros inside to a whole number of vectors).

It applies to float32 CPU tensors without attention dropout (under ``torch.compile`` as the custom operator
``gatedformer::relative_attention``); everything else takes the PyTorch operations. It shares the attention
kernel's switch, ``GATEDFORMER_ATTENTION_BACKEND`` (``native``, ``torch`` or ``auto``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.kernels.relative_attention import backward_kernel, forward_kernel
from gatedformer.ops.operators import FunctionOperator, call

__all__ = ["relative_attention"]


class _RelativeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, r: Tensor, u: Tensor, pos_bias: Tensor,  # type: ignore[override]
                memory_kv: Tensor | None, n_heads: int, recorded: bool) -> Tensor:
        q, kv, r, u, pos_bias = (t.contiguous() for t in (q, kv, r, u, pos_bias))
        memory_kv = None if memory_kv is None else memory_kv.contiguous()
        out, lse = forward_kernel(q, kv, r, u, pos_bias, memory_kv, n_heads, keep_lse=recorded)
        if lse is not None:
            ctx.save_for_backward(q, kv, r, u, pos_bias, memory_kv, out, lse)
        ctx.n_heads = n_heads
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*backward_kernel(grad_out, *ctx.saved_tensors, ctx.n_heads), None, None)


def _attended(q: Tensor, *_: object) -> list[Tensor]:
    return [q.new_empty(q.shape)]


RELATIVE_ATTENTION = FunctionOperator(
    "relative_attention", _RelativeAttention,
    "Tensor q, Tensor kv, Tensor r, Tensor u, Tensor pos_bias, Tensor? memory_kv, int n_heads, bool recorded",
    _attended)
"""The kernel as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def relative_attention(q: Tensor, kv: Tensor, r: Tensor, u: Tensor, pos_bias: Tensor, n_heads: int,
                       memory_kv: Tensor | None = None) -> Tensor:
    """Causal relative-position attention by the compiled kernel (see the module docstring; check
    :func:`~gatedformer.kernels.relative_attention.kernel_takes` first).

    ``q (B, L, H·D)`` queries; ``kv (B, M+L, 2·H·D)`` keys then values over ``[memory ∘ current]``, or ``kv (B, L,
    2·H·D)`` the current window's with ``memory_kv (B, M, 2·H·D)`` the memory's (two projections' outputs, read where
    they are); ``r (M+L, H·D)`` the projected encodings of the distances ``M+L-1, ..., 0``; ``u`` and ``pos_bias``
    ``(H, D)`` the content and position biases. Returns ``(B, L, H·D)``, the heads side by side.
    """
    # Whether autograd records this call, asked here: Function.forward itself runs with grad mode off.
    tensors = (q, kv, r, u, pos_bias) + (() if memory_kv is None else (memory_kv,))
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return call(RELATIVE_ATTENTION, q, kv, r, u, pos_bias, memory_kv, n_heads, recorded)
