"""Causal 1-D convolution on channels-last input as matrix products over shifted windows (GCNN, ConvS2S).

``conv1d`` of the input padded by ``k - 1`` zeros on the left, without the transposes to and from the channels-first
layout: forward one product of the ``k`` shifted windows of every position with the weight, backward two products and
``k - 1`` shifted sums. On the CPU that beats a channels-first ``nn.Conv1d``, whose backward pass is most of a GCNN
step (``gatedformer bench --sections models`` times both; benchmarks/README.md).

The windows are tap-major (each tap a contiguous run of channels): the Conv1d weight's own channel-major order would
make building them a transpose, a strided copy both eagerly and as ``torch.compile`` writes it. The function is
PyTorch operations only, so ``torch.compile`` traces it like any other code: no custom operator, since an operator's
dispatch costs more than the copies and sums Inductor writes for it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["causal_conv1d"]


class _CausalConv1d(torch.autograd.Function):
    """:func:`causal_conv1d` with a backward pass of two matrix products and ``k - 1`` shifted sums."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        batch, length, channels = x.shape
        out_channels, _, width = weight.shape
        # Row (b, i) of `windows` holds x[b, i - k + 1 .. i] (zeros before the start), tap-major (see the module).
        if width == 1:
            windows = x.reshape(batch * length, channels)
        else:
            windows = (F.pad(x, (0, 0, width - 1, 0)).unfold(1, width, 1).transpose(2, 3)
                       .reshape(batch * length, width * channels))
        taps = _tap_major(weight)
        out = windows.mm(taps.t()) if bias is None else torch.addmm(bias, windows, taps.t())
        ctx.save_for_backward(windows, taps)
        ctx.has_bias = bias is not None
        ctx.weight_shape = weight.shape
        return out.view(batch, length, out_channels)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        windows, taps = ctx.saved_tensors
        batch, length, out_channels = grad_out.shape
        _, channels, width = ctx.weight_shape
        grad = grad_out.reshape(batch * length, out_channels).to(windows.dtype)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad.t().mm(windows).view(out_channels, width, channels).transpose(1, 2)
                           .contiguous().to(taps.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0).to(taps.dtype)
        if ctx.needs_input_grad[0]:
            if width == 1:
                grad_x = grad.mm(taps.to(grad.dtype)).view(batch, length, channels)
            else:
                # Input j reaches output j + k - 1 - t through tap t: one product gives every tap's share of every
                # output row (rows past the end are zero), then each tap's share is read back shifted into place.
                padded = F.pad(grad.view(batch, length, out_channels), (0, 0, 0, width - 1))
                shares = padded.view(-1, out_channels).mm(taps.to(grad.dtype))
                shares = shares.view(batch, length + width - 1, width, channels)
                grad_x = shares[:, width - 1 : width - 1 + length, 0].clone()
                for tap in range(1, width):
                    grad_x += shares[:, width - 1 - tap : width - 1 - tap + length, tap]
        return grad_x, grad_weight, grad_bias


def _tap_major(weight: Tensor) -> Tensor:
    """A Conv1d weight ``(C_out, C_in, k)`` as the matrix ``(C_out, k·C_in)`` of the windows' tap-major rows."""
    out_channels, channels, width = weight.shape
    if width == 1:
        return weight.reshape(out_channels, channels)
    return weight.transpose(1, 2).reshape(out_channels, width * channels)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""Causal 1-D convolution on channels-last input: ``x (B, L, C_in)``, ``weight (C_out, C_in, k)`` as in
    ``nn.Conv1d`` -> ``(B, L, C_out)`` with

    .. math::

        y_{b,i} = \text{bias} + \sum_{t=0}^{k-1} W_{:,:,t}\, x_{b,\,i-k+1+t} \qquad (x_{b,j} = 0 \text{ for } j < 0),

    i.e. ``conv1d`` of the input padded by ``k - 1`` zeros on the left (see the module).
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"causal_conv1d takes x (B, L, C_in) and weight (C_out, C_in, k); got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    return _CausalConv1d.apply(x, weight, bias)
