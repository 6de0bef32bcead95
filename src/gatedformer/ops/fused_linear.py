"""Linear layers fused with what follows them in a Transformer sublayer, for CPU training.

A sublayer's linear layers are each followed by element-wise work: the FFN's first layer by its ReLU and
dropout, the last layer of attention and of the FFN by dropout, the residual add and (post-LN) the
LayerNorm. Written as ``F.linear`` then the element-wise operations, every step reads and writes the whole
activation again (``addmm`` itself first copies the broadcast bias into its output), and each is one more
autograd node. On the CPU these passes cost as much as a fifth of a small model's matrix products. Here one
autograd function per linear layer computes the matrix product without the bias, then adds the bias and
applies the ReLU, the dropout mask, the residual and the LayerNorm in one pass over the product, in place
(the product is a temporary no one else sees):

* :func:`linear_relu_dropout`: ``dropout(relu(linear(x)))``; keeps one bit per element (where the result is
  positive) for the backward pass, which also sums the bias gradient;
* :func:`linear_dropout_add_norm`: ``norm(base + dropout(linear(x)))``, row by row; keeps the normalised rows,
  ``1/std`` per row and the mask as bits;
* :func:`linear_dropout_add` (pre-LN) and :func:`linear_dropout` (before a gated residual): the mask is
  drawn again in the backward pass;
* :func:`dropout_add_layer_norm`: ``norm(base + dropout(s))`` for a sublayer output ``s`` that a gate has
  changed, so that no linear layer comes right before it;
* :func:`feed_forward_add_norm` and :func:`attention_add_norm`: a whole post-LN sublayer,
  ``norm(x + dropout(F(x)))`` for the FFN and for attention on the compiled kernel (which also adds the QKV
  projection's bias and sums its gradient), as one autograd function;
  with a gated residual connection ``norm(x + σ(Wg x + bg) ⊙ dropout(F(x)))``, the gate's bias and sigmoid in
  one pass over its product and its product with the dropped output inside the LayerNorm's pass; with an SDU
  branch ``norm(x + dropout(F(x) + Ψ(x W1 + b1) ⊙ (x W2 + b2)))``, the branch added by the gate kernel's tail;
  with a highway gate ``norm((1 - T) ⊙ x + T ⊙ f(x) + dropout(F(x)))`` and with a gated MHDPA
  ``norm(x + dropout((1 - T) ⊙ F(x) + T ⊙ f(x)))``, the mix made by that tail; with an EAU on the body's output
  (and a GRC or not), its three products and its tail inside the function too. Besides
  saving the graph nodes between the pieces, it adds the residual's gradient to x's in the products that
  compute the body's (and the gate's) share (``addmm`` into them), where autograd would add them in passes of
  their own. Where PyTorch links MKL (:mod:`gatedformer.kernels.blas`), a plain FFN sublayer (no gate, unit or
  EAU) runs up to its weights' gradients in the epilogue kernel's ``feed_forward_streamed``: each thread streams
  its own blocks of rows through both products (packed weights) and both epilogues, in one parallel region each
  way instead of one per operation, the hidden rows still in cache between them; attention likewise, by blocks
  of whole sequences (``attention_sublayer_streamed``). A gated sublayer streams its body the same way up to
  the last product (``feed_forward_body_streamed``, ``attention_body_streamed``) and its gates follow.

The masks are those of :mod:`gatedformer.ops.dropout` (Philox, keyed by a seed from torch's generator,
one draw per call), so a fused and an unfused model with the same seed train alike. With ``p = 0`` the mask keeps
every element and no seed is drawn, as the unfused operations draw none, so a model without dropout trains on the
same fused path.

Each takes its fused path only where it applies: training with ``0 <= p < 1``, float32 on the CPU outside
autocast, the compiled dropout and epilogue kernels available
(:mod:`gatedformer.kernels.epilogue`), and a plain :class:`torch.nn.Linear`
with a bias and a plain :class:`torch.nn.LayerNorm`, without hooks (so that hooks on them still see every
call). Everything else is computed as written, unfused. Under ``torch.compile`` each autograd function is a
custom operator each way (:mod:`gatedformer.ops.operators`), so compiled code keeps the fused paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gatedformer.gates.kinds import GATE_KINDS, kind_of
from gatedformer.kernels import attention as _attention_kernel
from gatedformer.kernels import blas as _blas
from gatedformer.kernels import gate as _gate_kernel
from gatedformer.kernels.blas import PackedGemm
from gatedformer.kernels.dropout import apply_dropout
from gatedformer.kernels.epilogue import (
    KERNEL,
    attention_body_streamed,
    attention_body_streamed_backward,
    attention_sublayer_streamed,
    attention_sublayer_streamed_backward,
    bias_dropout_add_,
    bias_relu_dropout_,
    dropout_add_norm,
    dropout_add_norm_backward,
    feed_forward_body_streamed,
    feed_forward_body_streamed_backward,
    feed_forward_streamed,
    feed_forward_streamed_backward,
    gated_dropout_add_norm_backward,
    scale_where_positive_with_sums,
)
from gatedformer.kernels.gate import tail_backward, tail_forward
from gatedformer.ops import dropout as dropout_ops
from gatedformer.ops.explain import declined, explaining, first_reason
from gatedformer.ops.operators import FunctionOperator, call, native, runs_native

__all__ = ["attention_add_norm", "dropout_add_layer_norm", "feed_forward_add_norm", "feed_forward_fusion_applies",
           "fusion_applies", "linear_dropout", "linear_dropout_add", "linear_dropout_add_norm", "linear_relu_dropout"]

_INT32_VALUES = 2 ** 32


def registered(module: nn.Module, name: str) -> Any:
    """``getattr(module, name)`` for a submodule or parameter that ``module`` registers under ``name`` (``None``
    where it registers none), read from its own tables. ``nn.Module`` finds these only after an ordinary attribute
    lookup has failed, with an exception raised and caught, several times the cost of a dictionary read; the fused
    paths' checks read a few hundred of them each step."""
    found = module._modules.get(name)
    return found if found is not None else module._parameters.get(name)


def unhooked(module: nn.Module) -> bool:
    """Whether ``module`` has no hooks of its own: only then may a fused path compute it without calling it."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def fusion_applies(x: Tensor, linear: nn.Module, p: float, training: bool) -> bool:
    """Whether :func:`linear_relu_dropout` / :func:`linear_dropout_add` take the fused path for these inputs."""
    return linear_fuses(linear, p, training) and inputs_fuse(x)


def inputs_fuse(x: Tensor) -> bool:
    """The input's half of :func:`fusion_applies`: float32 on the CPU, outside autocast, with the dropout and epilogue
    kernels available. A stack of layers asks it once for all of them."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")):
        return False
    if torch.compiler.is_compiling():  # the functions run as operators (see _FEED_FORWARD_ADD_NORM and the others)
        return native(dropout_ops.KERNEL) and native(KERNEL)
    return dropout_ops.KERNEL.pick_backend(x.device) == "native" and KERNEL.pick_backend(x.device) == "native"


def linear_fuses(linear: nn.Module, p: float, training: bool) -> bool:
    """The layer's half of :func:`fusion_applies`: training, a plain float32 CPU :class:`torch.nn.Linear` with a bias
    and no hooks, and a dropout rate the fused masks take."""
    if not (training and type(linear) is nn.Linear and unhooked(linear)):
        return False
    weight = registered(linear, "weight")
    return (registered(linear, "bias") is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and dropout_ops._fast_rate(p, keep_all=True))


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _on_rows(operator: FunctionOperator, x: Tensor, linear: nn.Linear, p: float) -> Tensor:
    """``operator``'s function of ``x``'s rows, ``linear``'s parameters and a fresh mask seed, in ``x``'s shape."""
    out = call(operator, _rows(x), linear.weight, linear.bias, *_mask(p))
    return out.view(*x.shape[:-1], out.shape[-1])


def _linear_grads(needed: tuple[bool, ...], grad_pre: Tensor, x: Tensor, weight: Tensor,
                  grad_bias: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """Gradients of ``x @ weight.T + bias`` for those of (x, weight, bias) ``needed``, from that of its output
    (and the bias gradient when it is already summed)."""
    need_x, need_w, need_b = needed
    return (grad_pre.mm(weight) if need_x else None,
            grad_pre.t().mm(x) if need_w else None,
            (grad_pre.sum(0) if grad_bias is None else grad_bias) if need_b else None)


class _LinearReluDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, seed: int, keep_below: int) -> Tensor:  # type: ignore[override]
        ctx.scale = _INT32_VALUES / keep_below
        out, positive = bias_relu_dropout_(x.mm(weight.t()), bias, seed, keep_below, ctx.scale)
        ctx.save_for_backward(x, weight, positive)  # a bit per element: the output's pass is not read again
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, positive = ctx.saved_tensors
        grad_pre, grad_bias = scale_where_positive_with_sums(positive, grad, ctx.scale)  # bias gradient: same pass
        return (*_linear_grads(ctx.needs_input_grad[:3], grad_pre, x, weight, grad_bias), None, None)


class _LinearDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: Tensor, x: Tensor, weight: Tensor, bias: Tensor, seed: int,  # type: ignore[override]
                keep_below: int) -> Tensor:
        ctx.mask = (seed, keep_below, _INT32_VALUES / keep_below)
        out = bias_dropout_add_(x.mm(weight.t()), base.contiguous(), bias, *ctx.mask)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_pre = apply_dropout(grad, *ctx.mask)
        grads = _linear_grads(ctx.needs_input_grad[1:4], grad_pre, x, weight)
        return (grad if ctx.needs_input_grad[0] else None, *grads, None, None)


class _LinearDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, seed: int, keep_below: int) -> Tensor:  # type: ignore[override]
        ctx.mask = (seed, keep_below, _INT32_VALUES / keep_below)
        out = bias_dropout_add_(x.mm(weight.t()), None, bias, *ctx.mask)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_pre = apply_dropout(grad.contiguous(), *ctx.mask)
        return (*_linear_grads(ctx.needs_input_grad[:3], grad_pre, x, weight), None, None)


class _LinearDropoutAddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: Tensor, x: Tensor, weight: Tensor, bias: Tensor, gamma: Tensor,  # type: ignore[override]
                beta: Tensor, eps: float, seed: int, keep_below: int) -> Tensor:
        ctx.scale = _INT32_VALUES / keep_below
        out, xhat, rstd, keep_bits = dropout_add_norm(x.mm(weight.t()), base.contiguous(), bias, gamma, beta, eps,
                                                      seed, keep_below, ctx.scale, in_place=True)
        ctx.save_for_backward(x, weight, gamma, xhat, rstd, keep_bits)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, gamma, xhat, rstd, keep_bits = ctx.saved_tensors
        grad_base, grad_pre, grad_gamma, grad_beta, grad_bias = dropout_add_norm_backward(grad, xhat, rstd, gamma,
                                                                                          keep_bits, ctx.scale)
        grads = _linear_grads(ctx.needs_input_grad[1:4], grad_pre, x, weight, grad_bias)
        return (grad_base if ctx.needs_input_grad[0] else None, *grads,
                grad_gamma if ctx.needs_input_grad[4] else None, grad_beta if ctx.needs_input_grad[5] else None,
                None, None, None)


class _DropoutAddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: Tensor, x: Tensor, gamma: Tensor, beta: Tensor, eps: float, seed: int,  # type: ignore[override]
                keep_below: int) -> Tensor:
        ctx.scale = _INT32_VALUES / keep_below
        out, xhat, rstd, keep_bits = dropout_add_norm(x.contiguous(), base.contiguous(), None, gamma, beta, eps, seed,
                                                      keep_below, ctx.scale)
        ctx.save_for_backward(gamma, xhat, rstd, keep_bits)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        gamma, xhat, rstd, keep_bits = ctx.saved_tensors
        grad_base, grad_x, grad_gamma, grad_beta, _ = dropout_add_norm_backward(grad, xhat, rstd, gamma, keep_bits,
                                                                                ctx.scale)
        needed = ctx.needs_input_grad
        return (grad_base if needed[0] else None, grad_x if needed[1] else None,
                grad_gamma if needed[2] else None, grad_beta if needed[3] else None, None, None, None)


def _eau_forward(s: Tensor, w_in: Tensor, b_in: Tensor, w_eval: Tensor, b_eval: Tensor, w_adj: Tensor,
                 b_adj: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """An EAU on the rows ``s``: ``s + σ(W2 relu(W1 s + b1) + b2) ⊙ tanh(W3 s + b3)`` (the gate kernel's tail), and
    what :func:`_eau_backward` needs."""
    hidden = torch.addmm(b_in, s, w_in.t()).relu_()
    evaluated = torch.addmm(b_eval, hidden, w_eval.t())
    adjusted = torch.addmm(b_adj, s, w_adj.t())
    width = s.shape[1]
    return tail_forward("eau", s, evaluated, width, adjusted, width), (s, hidden, evaluated, adjusted)


def _eau_backward(grad: Tensor, saved: tuple[Tensor, ...], w_in: Tensor, w_eval: Tensor,
                  w_adj: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The gradient of :func:`_eau_forward`'s input (written over ``grad``, a temporary of the caller's) and of its
    six parameters."""
    s, hidden, evaluated, adjusted = saved
    width = s.shape[1]
    grad_evaluated, grad_adjusted = torch.empty_like(evaluated), torch.empty_like(adjusted)
    tail_backward("eau", grad, None, evaluated, width, adjusted, width, grad_evaluated, width, grad_adjusted, width)
    # through the ReLU: one pass (where hidden > 0), not a comparison then a masked fill
    grad_hidden = torch.ops.aten.threshold_backward(grad_evaluated.mm(w_eval), hidden, 0.0)
    parameters = (grad_hidden.t().mm(s), grad_hidden.sum(0), grad_evaluated.t().mm(hidden), grad_evaluated.sum(0),
                  grad_adjusted.t().mm(s), grad_adjusted.sum(0))
    return grad.addmm_(grad_adjusted, w_adj).addmm_(grad_hidden, w_in), parameters


def _norm_tail(x: Tensor, projected: Tensor, bias: Tensor, gamma: Tensor, beta: Tensor, eps: float,
               mask: tuple[int, int], scale: float, gate: tuple[Tensor, Tensor] | None,
               unit: tuple[Tensor, Tensor, str] | None,
               eau: tuple[Tensor, ...] | None = None) -> tuple[Tensor, tuple[Tensor | None, ...]]:
    """The end of a whole sublayer: ``norm(x + [g ⊙] dropout(projected + bias [+ SDU(x)]))``, with ``g = σ(x Wg +
    bg)`` for a gated residual connection (``gate = (Wg, bg)``) and an SDU branch ``Ψ(x W1 + b1) ⊙ (x W2 + b2)``
    (``unit = (W, b, tail)``, its two projections in one); for a highway gate (``tail`` "lerp"),
    ``norm((1 - T) ⊙ x + T ⊙ f(x) + dropout(projected + bias))`` with ``T = σ(x W1 + b1)`` and ``f(x) = x W2 + b2``;
    for a gated MHDPA (``tail`` "blend"), ``norm(x + dropout((1 - T) ⊙ (projected + bias) + T ⊙ f(x)))``. With
    ``eau`` (its six parameters; no ``unit`` then), ``projected + bias`` goes through the EAU first.
    Returns the output and what :func:`_norm_tail_backward` needs."""
    branch, base, carried, eau_saved = None, x, None, (None,) * 4
    if eau is not None:  # the EAU takes the body's output with its bias; the LayerNorm pass then adds none
        projected, eau_saved = _eau_forward(projected.add_(bias), *eau)
        bias = torch.zeros_like(bias)
    if unit is not None:
        weight, branch_bias, tail = unit
        width = branch_bias.shape[0]
        if tail == "blend":
            # (1 - T) ⊙ (p + bias) + T ⊙ f = lerp(p, f - bias, T) + bias: with the body's bias taken out of f's, the
            # LayerNorm's pass adds it as for the other sublayers.
            branch_bias = torch.cat([branch_bias[: width // 2], branch_bias[width // 2:] - bias])
        branch = torch.addmm(branch_bias, x, weight.t())
        if tail == "lerp":  # the residual stream carries the highway gate's mix
            base = tail_forward(tail, x, branch, width, branch[:, width // 2:], width)
        elif tail == "blend":
            carried = projected
            projected = tail_forward("lerp", carried, branch, width, branch[:, width // 2:], width)
        else:  # projected + Ψ(a) ⊙ b in one pass over the branch's product
            projected = tail_forward(tail, projected, branch, width, branch[:, width // 2:], width)
    if gate is None:
        out, xhat, rstd, keep_bits = dropout_add_norm(projected, base, bias, gamma, beta, eps, *mask, scale,
                                                      in_place=True)
        return out, (xhat, rstd, keep_bits, None, carried, branch, *eau_saved)
    g = _gate_kernel.bias_sigmoid_(x.mm(gate[0].t()), gate[1])  # (not with a highway gate or a gated MHDPA)
    out, xhat, rstd, keep_bits = dropout_add_norm(projected, x, bias, gamma, beta, eps, *mask, scale, gate=g)
    return out, (xhat, rstd, keep_bits, g, projected, branch, *eau_saved)


def _norm_tail_backward(grad: Tensor, saved: tuple[Tensor | None, ...], gamma: Tensor, bias: Tensor, scale: float,
                        unit_tail: str | None, x: Tensor,
                        eau: tuple[Tensor | None, ...] = (None,) * 6) -> tuple[Tensor | None, ...]:
    """``(grad_x, grad_projected, grad_gate_pre, grad_gamma, grad_beta, grad_bias, grad_b_gate, grad_branch,
    grad_eau)`` of :func:`_norm_tail` (``None`` for what it did not have; ``grad_x`` without the shares that go
    through the products of ``x``; ``grad_eau`` the EAU's six parameters' gradients); ``eau``: its parameters."""
    xhat, rstd, keep_bits, g, projected, branch, *eau_saved = saved  # projected: the GRC's input or the MHDPA's carry
    if eau[0] is not None:
        grads = _norm_tail_backward(grad, (xhat, rstd, keep_bits, g, projected, branch, None, None, None, None),
                                    gamma, torch.zeros_like(bias), scale, unit_tail, x)
        grad_s, grad_eau = _eau_backward(grads[1], tuple(eau_saved), eau[0], eau[2], eau[4])
        return (grads[0], grad_s, grads[2], grads[3], grads[4], grad_s.sum(0), grads[6], grads[7], grad_eau)
    if g is None:
        grad_x, grad_projected, grad_gamma, grad_beta, grad_bias = dropout_add_norm_backward(grad, xhat, rstd, gamma,
                                                                                             keep_bits, scale)
        grads = (grad_x, grad_projected, None, grad_gamma, grad_beta, grad_bias, None)
    else:
        grads = gated_dropout_add_norm_backward(grad, xhat, rstd, gamma, keep_bits, scale, g, projected, bias)
    if branch is None:
        return (*grads, None, None)
    width = branch.shape[1]
    grad_branch = torch.empty_like(branch)  # both halves' gradients side by side
    if unit_tail == "lerp":  # through the highway gate's mix: x's share as the carry, and the branch's
        grad_x = tail_backward(unit_tail, grads[0], x, branch, width, branch[:, width // 2:], width, grad_branch, width,
                               grad_branch[:, width // 2:], width)
        return (grad_x, *grads[1:], grad_branch, None)
    if unit_tail == "blend":  # through the gated MHDPA's blend: the body's share as the carry, and the branch's
        grad_carried = tail_backward("lerp", grads[1], projected, branch, width, branch[:, width // 2:], width,
                                     grad_branch, width, grad_branch[:, width // 2:], width)
        grad_bias = grads[5] - grad_branch[:, width // 2:].sum(0)  # the bias was taken out of f's (see _norm_tail)
        return (grads[0], grad_carried, grads[2], grads[3], grads[4], grad_bias, grads[6], grad_branch, None)
    tail_backward(unit_tail, grads[1], None, branch, width, branch[:, width // 2:], width, grad_branch, width,
                  grad_branch[:, width // 2:], width)
    return (*grads, grad_branch, None)


def _add_branch_grads(grad_x: Tensor | None, x: Tensor, grad_gate: Tensor | None, w_gate: Tensor | None,
                      grad_branch: Tensor | None, w_unit: Tensor | None,
                      needed: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """Adds the GRC's and the SDU's (or highway gate's) shares to ``grad_x`` (in the products) and returns their
    parameters' gradients, ``(w_gate, w_unit, b_unit)`` (``needed``: whether each is asked for)."""
    grad_w_gate = grad_w_unit = grad_b_unit = None
    if grad_gate is not None:
        if grad_x is not None:
            grad_x.addmm_(grad_gate, w_gate)
        grad_w_gate = grad_gate.t().mm(x) if needed[0] else None
    if grad_branch is not None:
        if grad_x is not None:
            grad_x.addmm_(grad_branch, w_unit)
        grad_w_unit = grad_branch.t().mm(x) if needed[1] else None
        grad_b_unit = grad_branch.sum(0) if needed[2] else None
    return grad_w_gate, grad_w_unit, grad_b_unit


def _wide_weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    """``gradᵀ x``, the gradient of a weight with more outputs than inputs: MKL makes ``(xᵀ grad)ᵀ`` faster, even
    with the copy into the weight's layout (2 % of the bench Transformer's step on one thread, 1 % on two)."""
    return x.t().mm(grad).t().contiguous()


def _streams(w1: Tensor, w2: Tensor) -> PackedGemm | None:
    """MKL's packed products where a sublayer's body can stream its rows through the epilogue kernel's
    ``feed_forward_streamed`` or ``attention_sublayer_streamed`` (a plain sublayer, its LayerNorm too) or their
    ``_body_`` forms (gates after them), else ``None``."""
    if not (w1.is_contiguous() and w2.is_contiguous()):
        return None
    return _blas.packed_gemm()


class _FeedForwardAddNorm(torch.autograd.Function):
    """``norm(x + [g ⊙] dropout(W2 dropout(relu(W1 x + b1)) + b2 [+ SDU(x)]))``: the two functions above in one
    (with a gated residual connection's gate ``g``, an SDU branch or a highway gate as in :func:`_norm_tail`)."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, gamma: Tensor,  # type: ignore[override]
                beta: Tensor, w_gate: Tensor | None, b_gate: Tensor | None, w_unit: Tensor | None,
                b_unit: Tensor | None, *rest: object) -> Tensor:
        *eau, unit_tail, eps, inner_mask, outer_mask = rest  # the EAU's six parameters (or Nones) first
        ctx.scales, ctx.unit_tail = (_INT32_VALUES / inner_mask[1], _INT32_VALUES / outer_mask[1]), unit_tail
        x = x.contiguous()
        ctx.blas = _streams(w1, w2)
        ctx.plain = w_gate is None and w_unit is None and eau[0] is None
        if ctx.blas is not None and ctx.plain:
            out, hidden, positive, *tail = feed_forward_streamed(ctx.blas, x, w1, b1, w2, b2, gamma, beta, eps,
                                                                 inner_mask, ctx.scales[0], outer_mask, ctx.scales[1])
            tail += [None] * 7  # as _norm_tail's: no gate, carry, branch or EAU
        else:
            if ctx.blas is not None:
                projected, hidden, positive = feed_forward_body_streamed(ctx.blas, x, w1, b1, w2, inner_mask,
                                                                         ctx.scales[0])
            else:
                hidden, positive = bias_relu_dropout_(x.mm(w1.t()), b1, *inner_mask, ctx.scales[0])
                projected = hidden.mm(w2.t())
            out, tail = _norm_tail(x, projected, b2, gamma, beta, eps, outer_mask, ctx.scales[1],
                                   None if w_gate is None else (w_gate, b_gate),
                                   None if w_unit is None else (w_unit, b_unit, unit_tail),
                                   None if eau[0] is None else tuple(eau))
        ctx.save_for_backward(x, w1, positive, hidden, w2, b2, gamma, w_gate, w_unit, *eau, *tail)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w1, positive, hidden, w2, b2, gamma, w_gate, w_unit, *rest = ctx.saved_tensors
        eau, tail = tuple(rest[:6]), tuple(rest[6:])
        needed = ctx.needs_input_grad
        # The stream makes the weights' gradients too, each thread from its own rows.
        inputs = (x, hidden) if needed[1] or needed[3] else None
        if ctx.blas is not None and ctx.plain:
            grad_x, grad_outer, grad_inner, grad_gamma, grad_beta, grad_b2, grad_b1, grad_w1, grad_w2 = (
                feed_forward_streamed_backward(ctx.blas, grad, *tail[:2], gamma, tail[2], positive, w1, w2,
                                               *ctx.scales, inputs=inputs))
            if grad_w1 is None and needed[1]:
                grad_w1 = _wide_weight_grad(grad_inner, x)
            if grad_w2 is None and needed[3]:
                grad_w2 = grad_outer.t().mm(hidden)
            grads = (grad_x, grad_w1, grad_b1, grad_w2, grad_b2, grad_gamma, grad_beta)
            return (*(g if need else None for g, need in zip(grads, needed, strict=False)), *(None,) * 14)
        grad_x, grad_outer, grad_gate, grad_gamma, grad_beta, grad_b2, grad_b_gate, grad_branch, grad_eau = (
            _norm_tail_backward(grad, tail, gamma, b2, ctx.scales[1], ctx.unit_tail, x, eau))
        if not needed[0]:
            grad_x = None
        grad_w1 = grad_w2 = None
        if ctx.blas is not None:  # the body's share of x's gradient added in the stream's last product
            grad_x = torch.zeros_like(x) if grad_x is None else grad_x.contiguous()
            grad_inner, grad_b1, grad_w1, grad_w2 = feed_forward_body_streamed_backward(
                ctx.blas, grad_outer, grad_x, positive, w1, w2, ctx.scales[0], inputs=inputs)
            grad_x = grad_x if needed[0] else None
        else:
            grad_inner, grad_b1 = scale_where_positive_with_sums(positive, grad_outer.mm(w2), ctx.scales[0],
                                                                 in_place=True)
            if grad_x is not None:  # the residual's gradient plus the body's (and the gates'), in the products
                grad_x.addmm_(grad_inner, w1)
        grad_w_gate, grad_w_unit, grad_b_unit = _add_branch_grads(grad_x, x, grad_gate, w_gate, grad_branch, w_unit,
                                                                (needed[7], needed[9], needed[10]))
        if grad_w1 is None and needed[1]:
            grad_w1 = _wide_weight_grad(grad_inner, x)
        if grad_w2 is None and needed[3]:
            grad_w2 = grad_outer.t().mm(hidden)
        grads = (grad_x, grad_w1, grad_b1, grad_w2, grad_b2, grad_gamma, grad_beta, grad_w_gate, grad_b_gate,
                 grad_w_unit, grad_b_unit, *(grad_eau or (None,) * 6))
        return (*(g if need else None for g, need in zip(grads, needed, strict=False)), None, None, None, None)


class _AttentionAddNorm(torch.autograd.Function):
    """``norm(x + [g ⊙] dropout(Wo attention(Wqkv x + bqkv) + bo [+ SDU(x)]))`` with the compiled attention kernel
    (``g``, the SDU branch and the highway gate as in :class:`_FeedForwardAddNorm`)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_qkv: Tensor, b_qkv: Tensor, w_out: Tensor, b_out: Tensor,  # type: ignore[override]
                gamma: Tensor, beta: Tensor, w_gate: Tensor | None, b_gate: Tensor | None, w_unit: Tensor | None,
                b_unit: Tensor | None, *rest: object) -> Tensor:
        *eau, unit_tail, eps, batch, n_heads, mask = rest  # the EAU's six parameters (or Nones) first
        ctx.scale, ctx.n_heads, ctx.unit_tail = _INT32_VALUES / mask[1], n_heads, unit_tail
        x = x.contiguous()
        ctx.blas = _streams(w_qkv, w_out)
        if ctx.blas is not None:  # the build that takes these heads (its forward and backward functions)
            ctx.attend = _attention_kernel.kernel_addresses(w_qkv.shape[0] // (3 * n_heads))
        ctx.plain = w_gate is None and w_unit is None and eau[0] is None
        if ctx.blas is not None and ctx.plain:
            out, qkv, attended, lse, *tail = attention_sublayer_streamed(
                ctx.blas, ctx.attend[0], x, batch, n_heads, w_qkv, b_qkv, w_out, b_out,
                gamma, beta, eps, mask, ctx.scale)
            qkv = qkv.view(batch, -1, w_qkv.shape[0])
            tail += [None] * 7  # as _norm_tail's: no gate, carry, branch or EAU
        else:
            if ctx.blas is not None:
                projected, qkv, attended, lse = attention_body_streamed(
                    ctx.blas, ctx.attend[0], x, batch, n_heads, w_qkv, b_qkv, w_out)
                qkv = qkv.view(batch, -1, w_qkv.shape[0])
            else:
                # The bias is added by the kernel as it reads Q, K and V (addmm would first copy it into every row).
                qkv = x.mm(w_qkv.t()).view(batch, -1, w_qkv.shape[0])
                attended, lse = _attention_kernel.packed_forward(qkv, n_heads, bias=b_qkv)
                attended = attended.view(x.shape[0], -1)
                projected = attended.mm(w_out.t())
            out, tail = _norm_tail(x, projected, b_out, gamma, beta, eps, mask, ctx.scale,
                                   None if w_gate is None else (w_gate, b_gate),
                                   None if w_unit is None else (w_unit, b_unit, unit_tail),
                                   None if eau[0] is None else tuple(eau))
        ctx.save_for_backward(x, w_qkv, b_qkv, qkv, attended, lse, w_out, b_out, gamma, w_gate, w_unit, *eau, *tail)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w_qkv, b_qkv, qkv, attended, lse, w_out, b_out, gamma, w_gate, w_unit, *rest = ctx.saved_tensors
        eau, tail = tuple(rest[:6]), tuple(rest[6:])
        needed = ctx.needs_input_grad
        if ctx.blas is not None and ctx.plain:
            grad_x, grad_projected, grad_qkv, grad_b_qkv, grad_gamma, grad_beta, grad_b_out = (
                attention_sublayer_streamed_backward(ctx.blas, ctx.attend[1], grad,
                                                     *tail[:2], gamma, tail[2], qkv.view(x.shape[0], -1), b_qkv,
                                                     attended, lse, w_qkv, w_out, ctx.scale, needed[2]))
            grads = (grad_x, _wide_weight_grad(grad_qkv, x) if needed[1] else None, grad_b_qkv,
                     grad_projected.t().mm(attended) if needed[3] else None, grad_b_out, grad_gamma, grad_beta)
            return (*(g if need else None for g, need in zip(grads, needed, strict=False)), *(None,) * 15)
        grad_x, grad_projected, grad_gate, grad_gamma, grad_beta, grad_b_out, grad_b_gate, grad_branch, grad_eau = (
            _norm_tail_backward(grad, tail, gamma, b_out, ctx.scale, ctx.unit_tail, x, eau))
        if not needed[0]:
            grad_x = None
        if ctx.blas is not None:  # the body's share of x's gradient added in the stream's last product
            grad_x = torch.zeros_like(x) if grad_x is None else grad_x.contiguous()
            grad_qkv, grad_b_qkv = attention_body_streamed_backward(
                ctx.blas, ctx.attend[1], grad_projected, grad_x, qkv.view(x.shape[0], -1),
                b_qkv, attended, lse, w_qkv, w_out, needed[2])
            grad_x = grad_x if needed[0] else None
        else:
            grad_attended = grad_projected.mm(w_out).view(qkv.shape[0], qkv.shape[1], -1)
            grad_qkv, grad_b_qkv = _attention_kernel.packed_backward(qkv, attended.view(grad_attended.shape),
                                                                     grad_attended, lse, ctx.n_heads, bias=b_qkv,
                                                                     bias_grad=needed[2])
            grad_qkv = grad_qkv.view(x.shape[0], -1)
            if grad_x is not None:  # the residual's gradient plus the body's (and the gates'), in the products
                grad_x.addmm_(grad_qkv, w_qkv)
        grad_w_gate, grad_w_unit, grad_b_unit = _add_branch_grads(grad_x, x, grad_gate, w_gate, grad_branch, w_unit,
                                                                (needed[7], needed[9], needed[10]))
        grad_w_qkv = _wide_weight_grad(grad_qkv, x) if needed[1] else None
        grad_w_out = grad_projected.t().mm(attended) if needed[3] else None
        grads = (grad_x, grad_w_qkv, grad_b_qkv, grad_w_out, grad_b_out, grad_gamma, grad_beta, grad_w_gate,
                 grad_b_gate, grad_w_unit, grad_b_unit, *(grad_eau or (None,) * 6))
        return (*(g if need else None for g, need in zip(grads, needed, strict=False)), None, None, None, None, None)


def _linear_rows(x: Tensor, weight: Tensor, *_: object) -> list[Tensor]:
    return [x.new_empty(x.shape[0], weight.shape[0])]


def _linear_rows_after_base(base: Tensor, x: Tensor, weight: Tensor, *_: object) -> list[Tensor]:
    return _linear_rows(x, weight)


def _rows_like(x: Tensor, *_: object) -> list[Tensor]:
    return [x.new_empty(x.shape)]


def _rows_like_second(base: Tensor, x: Tensor, *_: object) -> list[Tensor]:
    return [x.new_empty(x.shape)]


_BRANCHES = ("Tensor? w_gate, Tensor? b_gate, Tensor? w_unit, Tensor? b_unit, Tensor? w_in, Tensor? b_in, "
             "Tensor? w_eval, Tensor? b_eval, Tensor? w_adj, Tensor? b_adj, str? unit_tail, float eps")

# Each function as a custom operator for torch.compile (gatedformer.ops.operators), called through `call`.
_LINEAR_RELU_DROPOUT = FunctionOperator(
    "linear_relu_dropout", _LinearReluDropout, "Tensor x, Tensor weight, Tensor bias, Seed seed, int keep_below",
    _linear_rows)
_LINEAR_DROPOUT_ADD = FunctionOperator(
    "linear_dropout_add", _LinearDropoutAdd,
    "Tensor base, Tensor x, Tensor weight, Tensor bias, Seed seed, int keep_below", _linear_rows_after_base)
_LINEAR_DROPOUT = FunctionOperator(
    "linear_dropout", _LinearDropout, "Tensor x, Tensor weight, Tensor bias, Seed seed, int keep_below", _linear_rows)
_LINEAR_DROPOUT_ADD_NORM = FunctionOperator(
    "linear_dropout_add_norm", _LinearDropoutAddNorm,
    "Tensor base, Tensor x, Tensor weight, Tensor bias, Tensor gamma, Tensor beta, float eps, Seed seed, "
    "int keep_below", _linear_rows_after_base)
_DROPOUT_ADD_NORM = FunctionOperator(
    "dropout_add_norm", _DropoutAddNorm,
    "Tensor base, Tensor x, Tensor gamma, Tensor beta, float eps, Seed seed, int keep_below", _rows_like_second)
_FEED_FORWARD_ADD_NORM = FunctionOperator(
    "feed_forward_add_norm", _FeedForwardAddNorm,
    f"Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor gamma, Tensor beta, {_BRANCHES}, "
    "Mask inner_mask, Mask outer_mask", _rows_like)
_ATTENTION_ADD_NORM = FunctionOperator(
    "attention_add_norm", _AttentionAddNorm,
    f"Tensor x, Tensor w_qkv, Tensor b_qkv, Tensor w_out, Tensor b_out, Tensor gamma, Tensor beta, {_BRANCHES}, "
    "int batch, int n_heads, Mask mask", _rows_like)


def _plain_layer_norm(norm: nn.Module, width: int) -> bool:
    if type(norm) is not nn.LayerNorm or norm.normalized_shape != (width,) or not unhooked(norm):
        return False
    weight = registered(norm, "weight")
    return weight is not None and registered(norm, "bias") is not None and weight.dtype == torch.float32


def linear_relu_dropout(x: Tensor, linear: nn.Linear, p: float, training: bool = True) -> Tensor:
    """``dropout(relu(linear(x)), p)``, fused where :func:`fusion_applies`."""
    if not fusion_applies(x, linear, p, training):
        return dropout_ops.relu_dropout(linear(x), p, training)
    return _on_rows(_LINEAR_RELU_DROPOUT, x, linear, p)


def linear_dropout_add(base: Tensor, x: Tensor, linear: nn.Linear, p: float, training: bool = True) -> Tensor:
    """``base + dropout(linear(x), p)`` (a residual connection around a linear layer), fused where
    :func:`fusion_applies` and ``base`` has the output's shape."""
    if not fusion_applies(x, linear, p, training) or base.shape != (*x.shape[:-1], linear.out_features) \
            or base.dtype != x.dtype:
        return dropout_ops.dropout_add(base, linear(x), p, training)
    out = call(_LINEAR_DROPOUT_ADD, _rows(base), _rows(x), linear.weight, linear.bias, *_mask(p))
    return out.view(base.shape)


def linear_dropout_add_norm(base: Tensor, x: Tensor, linear: nn.Linear, p: float, norm: nn.LayerNorm,
                            training: bool = True) -> Tensor:
    """``norm(base + dropout(linear(x), p))``: a post-LN residual sublayer's tail, fused where
    :func:`fusion_applies` and ``norm`` is a plain :class:`torch.nn.LayerNorm` over the last dimension."""
    if not fusion_applies(x, linear, p, training) or base.shape != (*x.shape[:-1], linear.out_features) \
            or base.dtype != x.dtype or not _plain_layer_norm(norm, linear.out_features):
        return norm(linear_dropout_add(base, x, linear, p, training))
    out = call(_LINEAR_DROPOUT_ADD_NORM, _rows(base), _rows(x), linear.weight, linear.bias, norm.weight,
               norm.bias, norm.eps, *_mask(p))
    return out.view(base.shape)


def dropout_add_layer_norm(base: Tensor, x: Tensor, p: float, norm: nn.LayerNorm, training: bool = True) -> Tensor:
    """``norm(base + dropout(x, p))`` (a post-LN residual connection around any sublayer output ``x``), in one
    kernel each way where the dropout's fast path applies, outside autocast, for a plain
    :class:`torch.nn.LayerNorm` over the last dimension and ``base`` of ``x``'s shape."""
    if not (training and dropout_ops._fast_path(x, p, keep_all=True) and runs_native(KERNEL, x.device)
            and x.dtype == torch.float32 and base.shape == x.shape
            and base.dtype == x.dtype and not torch.is_autocast_enabled("cpu")
            and _plain_layer_norm(norm, x.shape[-1])):
        return norm(dropout_ops.dropout_add(base, x, p, training))
    out = call(_DROPOUT_ADD_NORM, _rows(base), _rows(x), norm.weight, norm.bias, norm.eps, *_mask(p))
    return out.view(base.shape)


def linear_dropout(x: Tensor, linear: nn.Linear, p: float, training: bool = True) -> Tensor:
    """``dropout(linear(x), p)``, fused where :func:`fusion_applies` (e.g. before a gated residual connection)."""
    if not fusion_applies(x, linear, p, training):
        return dropout_ops.dropout(linear(x), p, training)
    return _on_rows(_LINEAR_DROPOUT, x, linear, p)


def _mask(p: float) -> tuple[int, int]:
    """A dropout mask's seed and ``keep_below`` (``2**32`` for p = 0: no seed drawn, every element kept)."""
    keep_below = dropout_ops._keep_below(p)
    return dropout_ops._mask_seed(keep_below), keep_below


WHOLE_SUBLAYER_KINDS = ("sdu", "highway", "gated_mhdpa", "eau", "grc")
"""The gate kinds (:data:`~gatedformer.gates.kinds.GATE_KINDS`) the whole-sublayer functions compute, each in its
slot: the residual gate (``gate``), the unit beside or around the body (``unit``) and the gate on its output
(``eau``)."""


def whole_sublayer_takes(kinds: Sequence[str]) -> bool:
    """Whether the whole-sublayer functions compute a sublayer carrying the gate kinds ``kinds``: only kinds of
    :data:`WHOLE_SUBLAYER_KINDS`, at most one unit, and no output gate beside a unit (the unit would read or change
    what the output gate sees). Each function may still decline a case at run time (it then returns ``None``)."""
    if not set(kinds) <= set(WHOLE_SUBLAYER_KINDS):
        return False
    roles = [GATE_KINDS[name].role for name in kinds]
    units = sum(role in ("branch", "blend", "stream") for role in roles)
    return units <= 1 and not (units and "output" in roles)


def _gate_fuses(gate: nn.Module | None, x: Tensor, p: float, training: bool) -> bool:
    """Whether a gated residual connection (or none) can be part of a whole sublayer's function."""
    if gate is None:
        return True
    projection = getattr(gate, "gate_proj", None)
    return (kind_of(gate) is GATE_KINDS["grc"] and unhooked(gate) and isinstance(projection, nn.Linear)
            and fusion_applies(x, projection, p, training)
            and projection.in_features == projection.out_features == x.shape[-1]
            and runs_native(_gate_kernel.KERNEL, x.device))


def _unit_fuses(unit: nn.Module | None, gate: nn.Module | None, x: Tensor, p: float, training: bool) -> bool:
    """Whether an SDU branch, a highway gate or a gated MHDPA (or none of them) can be part of a whole sublayer's
    function (the last two only without a gated residual connection, which placements do not combine with them)."""
    if unit is None:
        return True
    kind = kind_of(unit)
    projection = getattr(unit, "proj", None)
    return (kind is not None and kind.name in WHOLE_SUBLAYER_KINDS and kind.role in ("branch", "blend", "stream")
            and unhooked(unit) and isinstance(projection, nn.Linear) and fusion_applies(x, projection, p, training)
            and projection.in_features == x.shape[-1] and projection.out_features == 2 * x.shape[-1]
            and not (kind.replaces_residual and gate is not None)
            and runs_native(_gate_kernel.KERNEL, x.device))


def _unit_tail(unit: nn.Module) -> str:
    """How the whole functions end a unit: ``blend`` for a gated MHDPA, else its tail in the gate kernel (``lerp``
    for the highway gate's stream, ``sdu-sigmoid`` or ``sdu-tanh`` for an SDU)."""
    kind = kind_of(unit)
    return "blend" if kind.role == "blend" else kind.tail(unit)


def _eau_fuses(eau: nn.Module | None, unit: nn.Module | None, x: Tensor, p: float, training: bool) -> bool:
    """Whether an EAU on the body's output (or none) can be part of a whole sublayer's function (not with an SDU,
    a highway gate or a gated MHDPA, which would read or change what it sees)."""
    if eau is None:
        return True
    layers = [getattr(eau, name, None) for name in ("evaluator_in", "evaluator_out", "adjuster")]
    plain = all(isinstance(layer, nn.Linear) and fusion_applies(x, layer, p, training) for layer in layers)
    return (kind_of(eau) is GATE_KINDS["eau"] and unit is None and unhooked(eau) and plain
            and layers[0].in_features == layers[2].in_features == layers[2].out_features == x.shape[-1]
            and layers[1].in_features == layers[0].out_features and layers[1].out_features == x.shape[-1]
            and runs_native(_gate_kernel.KERNEL, x.device))


def _branch_parameters(gate: nn.Module | None, unit: nn.Module | None,
                       eau: nn.Module | None) -> tuple[Tensor | str | None, ...]:
    """The gate's, the unit's and the EAU's parameters, then the unit's tail, as the whole functions take them."""
    layers = () if eau is None else (eau.evaluator_in, eau.evaluator_out, eau.adjuster)
    return ((None, None) if gate is None else (gate.gate_proj.weight, gate.gate_proj.bias)) + (
        (None, None) if unit is None else (unit.proj.weight, unit.proj.bias)) + (
        tuple(t for layer in layers for t in (layer.weight, layer.bias)) or (None,) * 6) + (
        None if unit is None else _unit_tail(unit),)


def feed_forward_add_norm(x: Tensor, inner: nn.Linear, outer: nn.Linear, inner_p: float, p: float,
                          norm: nn.LayerNorm, training: bool = True, gate: nn.Module | None = None,
                          unit: nn.Module | None = None, eau: nn.Module | None = None) -> Tensor | None:
    """``norm(x + dropout(outer(dropout(relu(inner(x)), inner_p)), p))``, a post-LN FFN sublayer, as one autograd
    function where both linear layers fuse (:func:`fusion_applies`) and ``norm`` is a plain LayerNorm; ``None``
    where it does not apply. With a gated residual connection ``gate`` (:class:`~gatedformer.gates.GatedResidual`)
    ``norm(gate(x, dropout(...)))``; with an SDU branch (``unit`` an :class:`~gatedformer.gates.SDU`)
    ``norm(x + dropout(FFN(x) + unit(x)))``, with a highway gate (``unit`` a :class:`~gatedformer.gates.HighwayGate`,
    and no ``gate``) ``norm(unit(x) + dropout(FFN(x)))``, with a gated MHDPA (``unit`` a
    :class:`~gatedformer.gates.GatedMHDPA`, no ``gate``) ``norm(x + dropout(unit(x, FFN(x))))``; with an ``eau``
    (:class:`~gatedformer.gates.EAU`, no ``unit``) on the body's output ``norm([gate](x, dropout(eau(FFN(x)))))``;
    each only without hooks. The masks are drawn in the order of the unfused sublayer."""
    if not feed_forward_fusion_applies(x, inner, outer, inner_p, p, norm, training, gate, unit, eau):
        if explaining():
            declined("ops.fused_linear.feed_forward_add_norm",
                     sublayer_reason(x, (inner, outer, norm), training, gate, unit, eau))
        return None
    inner_mask = _mask(inner_p)
    out = call(_FEED_FORWARD_ADD_NORM, _rows(x), inner.weight, inner.bias, outer.weight, outer.bias,
               norm.weight, norm.bias, *_branch_parameters(gate, unit, eau), norm.eps, inner_mask, _mask(p))
    return out.view(x.shape)


def feed_forward_fusion_applies(x: Tensor, inner: nn.Linear, outer: nn.Linear, inner_p: float, p: float,
                                norm: nn.LayerNorm, training: bool = True, gate: nn.Module | None = None,
                                unit: nn.Module | None = None, eau: nn.Module | None = None) -> bool:
    """Whether :func:`feed_forward_add_norm` computes this sublayer as one function (it returns ``None`` where not)."""
    return (inputs_fuse(x) and feed_forward_layers_fuse(x.shape[-1], inner, outer, inner_p, p, norm, training)
            and branches_fuse(x, p, training, gate, unit, eau))


def feed_forward_layers_fuse(width: int, inner: nn.Module, outer: nn.Module, inner_p: float, p: float,
                             norm: nn.Module, training: bool) -> bool:
    """The layers' half of :func:`feed_forward_fusion_applies` for inputs ``width`` wide (the input's half is
    :func:`inputs_fuse`, the gates' :func:`branches_fuse`)."""
    return (linear_fuses(inner, inner_p, training) and linear_fuses(outer, p, training)
            and outer.in_features == inner.out_features and outer.out_features == width
            and _plain_layer_norm(norm, width))


def branches_fuse(x: Tensor, p: float, training: bool, gate: nn.Module | None, unit: nn.Module | None,
                  eau: nn.Module | None) -> bool:
    """Whether a sublayer's gated residual connection, unit and EAU (each may be ``None``) can be part of its whole
    function."""
    return (_gate_fuses(gate, x, p, training) and _unit_fuses(unit, gate, x, p, training)
            and _eau_fuses(eau, unit, x, p, training))


def attention_add_norm(x: Tensor, qkv: nn.Linear, out: nn.Linear, n_heads: int, attention_dropout: float, p: float,
                       norm: nn.LayerNorm, training: bool = True, gate: nn.Module | None = None,
                       unit: nn.Module | None = None, eau: nn.Module | None = None) -> Tensor | None:
    """``norm(x + dropout(out(attention(qkv(x))), p))``, a post-LN causal self-attention sublayer on ``(B, L, d)``
    rows, as one autograd function where both linear layers fuse (:func:`fusion_applies`), the compiled
    attention kernel takes the heads and ``norm`` is a plain LayerNorm; ``None`` where it does not apply.
    ``gate``, ``unit`` and ``eau``: as in :func:`feed_forward_add_norm`."""
    if not (x.dim() == 3 and fusion_applies(x, qkv, p, training) and fusion_applies(x, out, p, training)
            and out.out_features == x.shape[-1] and qkv.out_features == 3 * out.in_features
            and _attention_kernel.kernel_takes(qkv.out_features, n_heads, attention_dropout, x.device, x.dtype)
            and _plain_layer_norm(norm, x.shape[-1]) and branches_fuse(x, p, training, gate, unit, eau)):
        if explaining():
            declined("ops.fused_linear.attention_add_norm", sublayer_reason(
                x, (qkv, out, norm), training, gate, unit, eau,
                extra=None if _attention_kernel.kernel_takes(qkv.out_features, n_heads, attention_dropout, x.device,
                                                              x.dtype)
                else f"the attention kernel does not take {n_heads} heads of width {out.in_features // n_heads} "
                     f"with attention dropout {attention_dropout}"))
        return None
    result = call(_ATTENTION_ADD_NORM, _rows(x), qkv.weight, qkv.bias, out.weight, out.bias, norm.weight,
                  norm.bias, *_branch_parameters(gate, unit, eau), norm.eps, x.shape[0], n_heads, _mask(p))
    return result.view(x.shape)


def sublayer_reason(x: Tensor, layers: tuple[nn.Module, ...], training: bool, gate: nn.Module | None,
                    unit: nn.Module | None, eau: nn.Module | None, extra: str | None = None) -> str:
    """Why a whole-sublayer function declined (for :mod:`gatedformer.ops.explain`; worked out only then)."""
    gates = [g for g in (gate, unit, eau) if g is not None]
    kinds = [kind_of(g) for g in gates]
    unlisted = [type(g).__name__ for g, k in zip(gates, kinds, strict=True)
                if k is None or k.name not in WHOLE_SUBLAYER_KINDS]
    if unlisted:
        return f"it lists no gate kind for {', '.join(unlisted)} (WHOLE_SUBLAYER_KINDS)"
    common = first_reason((x,), (*layers, *gates), (dropout_ops.KERNEL, KERNEL, _gate_kernel.KERNEL), training)
    if common is not None:
        return common
    if extra is not None:
        return extra
    if unit is not None and (eau is not None or (gate is not None and kind_of(unit).replaces_residual)):
        return "a unit beside an EAU or a GRC is computed in pieces"
    return "a layer or shape it does not take (a LayerNorm over more than the last dimension, no bias, p = 1)"
