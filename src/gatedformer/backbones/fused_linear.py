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
  changed, so that no linear layer comes right before it.

The masks are those of :mod:`gatedformer.backbones.dropout` (Philox, keyed by a seed from torch's generator,
one draw per call), so a fused and an unfused model with the same seed train alike.

Each takes its fused path only where it applies: training with ``0 < p < 1``, float32 on the CPU outside
``torch.compile`` and autocast, the compiled dropout and epilogue kernels available
(:mod:`gatedformer.backbones._epilogue_kernel`), and a plain :class:`torch.nn.Linear`
with a bias and a plain :class:`torch.nn.LayerNorm`, without hooks (so that hooks on them still see every
call). Everything else is computed as written, unfused.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatedformer.backbones import dropout as dropout_ops
from gatedformer.backbones._dropout_kernel import apply_dropout
from gatedformer.backbones._epilogue_kernel import (
    KERNEL,
    bias_dropout_add_,
    bias_relu_dropout_,
    dropout_add_norm,
    dropout_add_norm_backward,
    scale_where_positive_with_sums,
)

__all__ = ["dropout_add_layer_norm", "fusion_applies", "linear_dropout", "linear_dropout_add",
           "linear_dropout_add_norm", "linear_relu_dropout"]

_INT32_VALUES = 2 ** 32


def unhooked(module: nn.Module) -> bool:
    """Whether ``module`` has no hooks of its own: only then may a fused path compute it without calling it."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def fusion_applies(x: Tensor, linear: nn.Module, p: float, training: bool) -> bool:
    """Whether :func:`linear_relu_dropout` / :func:`linear_dropout_add` take the fused path for these inputs."""
    return (training and type(linear) is nn.Linear and linear.bias is not None and unhooked(linear)
            and x.dtype == torch.float32 and linear.weight.dtype == torch.float32
            and linear.weight.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
            and dropout_ops._fast_path(x, p) and KERNEL.pick_backend(x.device) == "native")


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _on_rows(function: type[torch.autograd.Function], x: Tensor, linear: nn.Linear, p: float) -> Tensor:
    """``function`` of ``x``'s rows, ``linear``'s parameters and a fresh mask seed, back in ``x``'s shape."""
    out = function.apply(_rows(x), linear.weight, linear.bias, dropout_ops._draw_seed(), dropout_ops._keep_below(p))
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


def _plain_layer_norm(norm: nn.Module, width: int) -> bool:
    return (type(norm) is nn.LayerNorm and norm.normalized_shape == (width,) and norm.weight is not None
            and norm.bias is not None and norm.weight.dtype == torch.float32 and unhooked(norm))


def linear_relu_dropout(x: Tensor, linear: nn.Linear, p: float, training: bool = True) -> Tensor:
    """``dropout(relu(linear(x)), p)``, fused where :func:`fusion_applies`."""
    if not fusion_applies(x, linear, p, training):
        return dropout_ops.relu_dropout(linear(x), p, training)
    return _on_rows(_LinearReluDropout, x, linear, p)


def linear_dropout_add(base: Tensor, x: Tensor, linear: nn.Linear, p: float, training: bool = True) -> Tensor:
    """``base + dropout(linear(x), p)`` (a residual connection around a linear layer), fused where
    :func:`fusion_applies` and ``base`` has the output's shape."""
    if not fusion_applies(x, linear, p, training) or base.shape != (*x.shape[:-1], linear.out_features) \
            or base.dtype != x.dtype:
        return dropout_ops.dropout_add(base, linear(x), p, training)
    out = _LinearDropoutAdd.apply(_rows(base), _rows(x), linear.weight, linear.bias, dropout_ops._draw_seed(),
                                  dropout_ops._keep_below(p))
    return out.view(base.shape)


def linear_dropout_add_norm(base: Tensor, x: Tensor, linear: nn.Linear, p: float, norm: nn.LayerNorm,
                            training: bool = True) -> Tensor:
    """``norm(base + dropout(linear(x), p))``: a post-LN residual sublayer's tail, fused where
    :func:`fusion_applies` and ``norm`` is a plain :class:`torch.nn.LayerNorm` over the last dimension."""
    if not fusion_applies(x, linear, p, training) or base.shape != (*x.shape[:-1], linear.out_features) \
            or base.dtype != x.dtype or not _plain_layer_norm(norm, linear.out_features):
        return norm(linear_dropout_add(base, x, linear, p, training))
    out = _LinearDropoutAddNorm.apply(_rows(base), _rows(x), linear.weight, linear.bias, norm.weight, norm.bias,
                                      norm.eps, dropout_ops._draw_seed(), dropout_ops._keep_below(p))
    return out.view(base.shape)


def dropout_add_layer_norm(base: Tensor, x: Tensor, p: float, norm: nn.LayerNorm, training: bool = True) -> Tensor:
    """``norm(base + dropout(x, p))`` (a post-LN residual connection around any sublayer output ``x``), in one
    kernel each way where the dropout's fast path applies, outside autocast, for a plain
    :class:`torch.nn.LayerNorm` over the last dimension and ``base`` of ``x``'s shape."""
    if not (training and dropout_ops._fast_path(x, p) and KERNEL.pick_backend(x.device) == "native"
            and x.dtype == torch.float32 and base.shape == x.shape
            and base.dtype == x.dtype and not torch.is_autocast_enabled("cpu")
            and _plain_layer_norm(norm, x.shape[-1])):
        return norm(dropout_ops.dropout_add(base, x, p, training))
    out = _DropoutAddNorm.apply(_rows(base), _rows(x), norm.weight, norm.bias, norm.eps, dropout_ops._draw_seed(),
                                dropout_ops._keep_below(p))
    return out.view(base.shape)


def linear_dropout(x: Tensor, linear: nn.Linear, p: float, training: bool = True) -> Tensor:
    """``dropout(linear(x), p)``, fused where :func:`fusion_applies` (e.g. before a gated residual connection)."""
    if not fusion_applies(x, linear, p, training):
        return dropout_ops.dropout(linear(x), p, training)
    return _on_rows(_LinearDropout, x, linear, p)
