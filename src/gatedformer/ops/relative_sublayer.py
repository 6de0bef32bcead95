"""Transformer-XL's post-LN attention sublayer, ``LN(h + dropout(RelAttn(h, memory) Woᵀ))``, as one autograd function.

Written with modules, the sublayer is five linear layers (queries, the window's and the memory's keys and
values, the position keys, the output projection), the relative attention kernel and the fused dropout, residual
add and LayerNorm: seven autograd nodes forward and as many backward, each with its own Python dispatch. At the
``enwik8`` recipes' widths (48-64) that overhead is a visible share of the step. Here, where PyTorch links MKL,
one call of the epilogue kernel (``relative_sublayer_streamed``) runs the whole sublayer in one parallel region,
each thread taking its own sequences through the projections (MKL's packed products), the relative attention
kernel, the output projection and the dropout, residual and LayerNorm, as the Transformer's attention sublayer
does; its backward pass likewise, the weights' gradients included (each thread adds its own rows' products to a
share of its own). Without MKL the products are plain ``mm`` calls around
:func:`~gatedformer.kernels.relative_attention.forward_kernel`. Either way the backward pass computes every
gradient in one function: the residual's and the queries' and keys' shares of ``h``'s gradient are added in its
products.

The sublayer's gates (a gated residual connection, an SDU branch, a highway gate, a gated MHDPA, an EAU on the
attention's output) end it as in the Transformer's whole-sublayer functions
(:mod:`gatedformer.ops.fused_linear`, whose tail and its backward pass this function shares).

It computes what the modules compute, with the same dropout masks for the same random state, and applies only
where they would run fused anyway: training, float32 on the CPU outside autocast, no attention dropout, no hooks,
a plain LayerNorm, gates that the fused tail takes and the compiled kernels available (under ``torch.compile`` it is
the custom operator ``gatedformer::relative_attention_add_norm``).
:func:`relative_attention_add_norm` (which the fused Transformer-XL attention's ``add_norm`` calls,
:mod:`gatedformer.fused.transformer_xl`) checks that and otherwise returns ``None`` (the sublayer then runs its
modules).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gatedformer.kernels import epilogue as _epilogue_kernel
from gatedformer.kernels.relative_attention import KERNEL as RELATIVE_KERNEL
from gatedformer.kernels.relative_attention import (
    MAX_HEAD_SIZE,
    backward_kernel,
    forward_kernel,
    kernel_addresses,
)
from gatedformer.ops import dropout as dropout_ops
from gatedformer.ops.explain import declined, explaining
from gatedformer.ops.fused_linear import (
    _add_branch_grads,
    _branch_parameters,
    _mask,
    _norm_tail,
    _norm_tail_backward,
    _plain_layer_norm,
    _streams,
    branches_fuse,
    inputs_fuse,
    registered,
    sublayer_reason,
    unhooked,
)
from gatedformer.ops.operators import FunctionOperator, call, runs_native

__all__ = ["RelativeAttentionAddNorm", "relative_attention_add_norm", "relative_fusion_applies", "relative_inputs_fuse",
           "relative_layers_fuse"]

_INT32_VALUES = 2 ** 32


class RelativeAttentionAddNorm(torch.autograd.Function):
    """``apply(h (B, L, d), memory (B, M, d) | None, pos (M+L, d), w_q, w_kv, w_r, w_out, u, v, gamma, beta, w_gate,
    b_gate, w_unit, b_unit, *eau (six), unit_tail, eps, n_heads, seed, keep_below)``: ``LN(h + dropout(attend(h,
    memory) Woᵀ))`` with the layer's weights (no biases) and the dropout mask of ``seed`` (``keep_below`` as the
    fused layers take it), its gates' parameters ``None`` where it has none (see
    :func:`~gatedformer.ops.fused_linear._norm_tail`). Returns ``(B, L, d)``."""

    @staticmethod
    def forward(ctx, h: Tensor, memory: Tensor | None, pos: Tensor, w_q: Tensor, w_kv: Tensor,  # type: ignore[override]
                w_r: Tensor, w_out: Tensor, u: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, w_gate: Tensor | None,
                b_gate: Tensor | None, w_unit: Tensor | None, b_unit: Tensor | None, *rest: object) -> Tensor:
        *eau, unit_tail, eps, n_heads, seed, keep_below = rest  # the EAU's six parameters (or Nones) first
        batch, length, width = h.shape
        rows = h.reshape(-1, width).contiguous()
        memory_rows = None if memory is None else memory.reshape(-1, width).contiguous()
        pos, u, v = pos.contiguous(), u.contiguous(), v.contiguous()
        ctx.scale, ctx.n_heads, ctx.unit_tail = _INT32_VALUES / keep_below, n_heads, unit_tail
        ctx.plain = w_gate is None and w_unit is None and eau[0] is None
        r = pos.mm(w_r.t())
        no_bias = r.new_zeros(width)  # the output projection has none; the tail takes one
        gates = (None if w_gate is None else (w_gate, b_gate), None if w_unit is None else (w_unit, b_unit, unit_tail),
                 None if eau[0] is None else tuple(eau))
        ctx.blas = _streams(w_q, w_out) if w_kv.is_contiguous() else None
        if ctx.blas is not None:
            # One parallel region: each thread runs its sequences through the products, the kernel and the tail.
            ctx.attend = kernel_addresses()
            norm = (gamma, beta, eps, (seed, keep_below), ctx.scale) if ctx.plain else None
            out, qkv, memory_kv, attended, lse, *tail = _epilogue_kernel.relative_sublayer_streamed(
                ctx.blas, ctx.attend[0], rows, memory_rows, r, u, v, w_q, w_kv, w_out, batch, n_heads, norm)
            if ctx.plain:
                tail += [None] * 7  # as _norm_tail's: no gate, carry, branch or EAU
            else:
                out, tail = _norm_tail(rows, out, no_bias, gamma, beta, eps, (seed, keep_below), ctx.scale, *gates)
        else:
            # The queries, keys and values of the window as one product; the kernel reads them where it leaves them.
            qkv = rows.mm(torch.cat([w_q, w_kv]).t())
            memory_kv = None if memory_rows is None else memory_rows.mm(w_kv.t())
            attended, lse = forward_kernel(qkv[:, :width].view(batch, length, -1),
                                           qkv[:, width:].view(batch, length, -1), r, u, v,
                                           None if memory_kv is None else memory_kv.view(batch, -1, 2 * width), n_heads)
            attended = attended.view(rows.shape[0], -1)
            out, tail = _norm_tail(rows, attended.mm(w_out.t()), no_bias, gamma, beta, eps, (seed, keep_below),
                                   ctx.scale, *gates)
        ctx.save_for_backward(rows, memory_rows, pos, qkv, memory_kv, r, attended, lse, w_q, w_kv, w_r, w_out, u, v,
                              gamma, no_bias, w_gate, w_unit, *eau, *tail)
        ctx.shape = (batch, length)
        return out.view(batch, length, width)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (rows, memory_rows, pos, qkv, memory_kv, r, attended, lse, w_q, w_kv, w_r, w_out, u, v, gamma, no_bias, w_gate,
         w_unit, *rest) = ctx.saved_tensors
        eau, tail = tuple(rest[:6]), tuple(rest[6:])
        needed = ctx.needs_input_grad
        batch, length = ctx.shape
        width = attended.shape[-1]
        grad_rows = grad.reshape(rows.shape)
        grad_gate = grad_b_gate = grad_branch = grad_eau = None
        grad_w_out = grad_w_qkv = None
        # The stream makes the weights' gradients too, each thread from its own rows while they are in cache.
        inputs = (rows, memory_rows) if needed[3] or needed[4] or needed[6] else None
        if ctx.blas is not None and ctx.plain:
            (grad_h, grad_projected, grad_qkv, grad_memory_kv, grad_r, grad_u, grad_v, grad_gamma,
             grad_beta, grad_w_out, grad_w_qkv) = _epilogue_kernel.relative_sublayer_streamed_backward(
                ctx.blas, ctx.attend[1], qkv, memory_kv, r, u, v, attended, lse, w_q, w_kv, w_out,
                norm=(grad_rows, tail[0], tail[1], gamma, tail[2], ctx.scale), inputs=inputs)
        else:
            # h's gradient through the residual and the gates' tail (their products' shares are added below)
            grad_h, grad_projected, grad_gate, grad_gamma, grad_beta, _, grad_b_gate, grad_branch, grad_eau = (
                _norm_tail_backward(grad_rows.contiguous(), tail, gamma, no_bias, ctx.scale, ctx.unit_tail, rows, eau))
            grad_h = grad_h.contiguous()
            if ctx.blas is not None:  # the body's share of h's gradient added in the stream's last products
                _, _, grad_qkv, grad_memory_kv, grad_r, grad_u, grad_v, _, _, grad_w_out, grad_w_qkv = (
                    _epilogue_kernel.relative_sublayer_streamed_backward(
                        ctx.blas, ctx.attend[1], qkv, memory_kv, r, u, v, attended, lse, w_q, w_kv, w_out,
                        grad_projected=grad_projected, grad_x=grad_h, inputs=inputs))
            else:
                grad_attended = grad_projected.mm(w_out).view(batch, length, width)
                grad_qkv = torch.empty_like(qkv)  # the kernel writes the queries' and the keys' and values' gradients
                queries, keys_values = qkv[:, :width].view(batch, length, -1), qkv[:, width:].view(batch, length, -1)
                _, _, grad_r, grad_u, grad_v, grad_memory_kv = backward_kernel(
                    grad_attended, queries, keys_values, r, u, v,
                    None if memory_kv is None else memory_kv.view(batch, -1, 2 * width),
                    attended.view(batch, length, width), lse, ctx.n_heads,
                    grad_qkv[:, :width].view(batch, length, -1), grad_qkv[:, width:].view(batch, length, -1))
                grad_memory_kv = None if grad_memory_kv is None else grad_memory_kv.view(-1, 2 * width)
                grad_h.addmm_(grad_qkv, torch.cat([w_q, w_kv]))  # the residual's share plus the queries' and keys'
        if grad_w_out is None and needed[6]:
            grad_w_out = grad_projected.t().mm(attended)
        if grad_w_qkv is None and (needed[3] or needed[4]):
            grad_w_qkv = grad_qkv.t().mm(rows)
            if grad_memory_kv is not None:
                grad_w_qkv[width:].addmm_(grad_memory_kv.t(), memory_rows)
        grad_w_q, grad_w_kv = (None, None) if grad_w_qkv is None else (grad_w_qkv[:width], grad_w_qkv[width:])
        grad_memory = None
        if needed[1] and grad_memory_kv is not None:
            grad_memory = grad_memory_kv.mm(w_kv).view(batch, -1, width)
        grad_w_gate, grad_w_unit, grad_b_unit = _add_branch_grads(grad_h, rows, grad_gate, w_gate, grad_branch, w_unit,
                                                                (needed[11], needed[13], needed[14]))
        grads = (grad_h.view(batch, length, width), grad_memory, grad_r.mm(w_r) if needed[2] else None,
                 grad_w_q, grad_w_kv, grad_r.t().mm(pos) if needed[5] else None, grad_w_out, grad_u, grad_v,
                 grad_gamma, grad_beta, grad_w_gate, grad_b_gate, grad_w_unit, grad_b_unit,
                 *(grad_eau or (None,) * 6))
        return (*(g if need else None for g, need in zip(grads, needed, strict=False)), None, None, None, None, None)


def _rows_of_h(h: Tensor, *_: object) -> list[Tensor]:
    return [h.new_empty(h.shape)]


RELATIVE_ATTENTION_ADD_NORM = FunctionOperator(
    "relative_attention_add_norm", RelativeAttentionAddNorm,
    "Tensor h, Tensor? memory, Tensor pos, Tensor w_q, Tensor w_kv, Tensor w_r, Tensor w_out, Tensor u, Tensor v, "
    "Tensor gamma, Tensor beta, Tensor? w_gate, Tensor? b_gate, Tensor? w_unit, Tensor? b_unit, Tensor? w_in, "
    "Tensor? b_in, Tensor? w_eval, Tensor? b_eval, Tensor? w_adj, Tensor? b_adj, str? unit_tail, float eps, "
    "int n_heads, Seed seed, int keep_below", _rows_of_h)
"""The sublayer as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def relative_attention_add_norm(attention: nn.Module, x: Tensor, p: float, norm: nn.LayerNorm,
                                gate: nn.Module | None = None, unit: nn.Module | None = None,
                                eau: nn.Module | None = None, memory: Tensor | None = None,
                                pos: Tensor | None = None) -> Tensor | None:
    """``norm(x + dropout(attention(x, memory, pos), p))`` for a
    :class:`~gatedformer.models.transformer_xl.RelativeMultiHeadAttention`, with its sublayer's gates (as
    :func:`~gatedformer.ops.fused_linear.attention_add_norm` takes them), by :class:`RelativeAttentionAddNorm`
    where that applies (see the module), else ``None``."""
    if pos is None:
        if explaining():
            declined("ops.relative_sublayer.relative_attention_add_norm", "no position encodings were given")
        return None
    memory = memory if memory is not None and memory.shape[1] > 0 else None
    if not relative_fusion_applies(attention, x, p, norm, gate, unit, eau, memory, pos):
        if explaining():
            declined("ops.relative_sublayer.relative_attention_add_norm",
                     sublayer_reason(x, (attention, norm), True, gate, unit, eau))
        return None
    k_len = x.shape[1] + (0 if memory is None else memory.shape[1])
    return call(RELATIVE_ATTENTION_ADD_NORM, x, memory, pos[pos.shape[0] - k_len :], attention.query.weight,
                                          attention.key_value.weight, attention.position.weight, attention.out.weight,
                                          attention.u, attention.v, norm.weight, norm.bias,
                                          *_branch_parameters(gate, unit, eau), norm.eps, attention.n_heads, *_mask(p))


def relative_fusion_applies(attention: nn.Module, x: Tensor, p: float, norm: nn.LayerNorm, gate: nn.Module | None,
                            unit: nn.Module | None, eau: nn.Module | None, memory: Tensor | None, pos: Tensor) -> bool:
    """Whether :class:`RelativeAttentionAddNorm` computes this sublayer (see the module); ``memory`` is ``None`` or
    has rows."""
    return (relative_inputs_fuse(x, (memory,), pos) and relative_layers_fuse(attention, p, norm, x.shape[-1])
            and branches_fuse(x, p, True, gate, unit, eau))


def relative_inputs_fuse(x: Tensor, memories: Sequence[Tensor | None], pos: Tensor) -> bool:
    """The inputs' half of :func:`relative_fusion_applies`, for sublayers that read ``x (B, L, d)``, the position
    encodings ``pos`` and one of ``memories`` each (``None`` or with rows): float32 CPU tensors, enough position rows,
    outside autocast, the kernels available. A stack of layers asks it once for all of them."""
    if x.dim() != 3 or not inputs_fuse(x):
        return False
    k_len = x.shape[1] + max([0] + [m.shape[1] for m in memories if m is not None])
    return (pos.shape[0] >= k_len
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (pos, *memories) if t is not None)
            and runs_native(RELATIVE_KERNEL, x.device))


def relative_layers_fuse(attention: nn.Module, p: float, norm: nn.Module, width: int) -> bool:
    """The modules' half of :func:`relative_fusion_applies` for inputs ``width`` wide (the gates' half is
    :func:`~gatedformer.ops.fused_linear.branches_fuse`): training, no attention dropout, plain bias-free float32
    CPU linear layers, no hooks, a plain LayerNorm, heads the kernel takes and a dropout rate the fused masks take."""
    if not (attention.training and unhooked(attention) and _plain_layer_norm(norm, width)):
        return False
    layers = [registered(attention, name) for name in ("query", "key_value", "position", "out")]
    if not all(type(layer) is nn.Linear and registered(layer, "bias") is None and unhooked(layer) for layer in layers):
        return False
    n_heads = attention.n_heads
    return (registered(attention, "dropout").p == 0.0 and dropout_ops._fast_rate(p, keep_all=True)
            and all(t.dtype == torch.float32 and t.device.type == "cpu"
                    for t in (registered(attention, "u"), registered(attention, "v"), registered(norm, "weight"),
                              *(registered(layer, "weight") for layer in layers)))
            and width % n_heads == 0 and width // n_heads <= MAX_HEAD_SIZE)
