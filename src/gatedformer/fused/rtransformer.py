"""The fused paths of the R-Transformer (:mod:`gatedformer.models.rtransformer`): its LocalRNN's windows.

Where MKL's packed products are there (:func:`~gatedformer.kernels.local_rnn.streams`), every step of every window
is one compiled call each way (:func:`~gatedformer.ops.rnn.local_recurrence`); else the steps run one by one as in
the reference, each GRU or LSTM step one compiled pass on the CPU (:func:`~gatedformer.ops.rnn.gru_step`,
:func:`~gatedformer.ops.rnn.lstm_step`), the steps' inputs views whose gradients are summed back in one buffer
(:class:`_ShiftedViews`). The numbers are the reference's up to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from gatedformer.fused.registry import implements
from gatedformer.kernels import local_rnn as _local_rnn_kernel
from gatedformer.models.rtransformer import LocalRNN
from gatedformer.ops.rnn import gru_step, local_recurrence, lstm_step

__all__ = ["local_rnn_windows"]


@implements(LocalRNN, "_windows")
def local_rnn_windows(self: LocalRNN, x: Tensor) -> Tensor:
    """The reference's windows on the kernels (see the module)."""
    batch, length, d_model = x.shape
    rnn = self.rnn
    w_hh, b_hh = rnn.weight_hh_l0, rnn.bias_hh_l0
    # Input projection of every position, once.
    gates_in = F.linear(x, rnn.weight_ih_l0, rnn.bias_ih_l0)
    blas = _local_rnn_kernel.streams(gates_in, w_hh, b_hh, rnn.bias_ih_l0)
    if blas is not None:  # every step of every window in one compiled call each way
        return local_recurrence(gates_in, rnn.bias_ih_l0, w_hh, b_hh, self.rnn_type, self.window, blas)
    gates_in = gates_in.transpose(0, 1)  # time-major: (L, B, G)
    if self.window > 1:
        # Positions before the start read x = 0, whose projection is the bias alone.
        pad = rnn.bias_ih_l0.to(gates_in.dtype).expand(self.window - 1, batch, gates_in.shape[-1])
        gates_in = torch.cat([pad, gates_in], dim=0)
    else:
        gates_in = gates_in.contiguous()
    # Step j of the window ending at t reads position t - (M-1) + j: padded index t + j. Each step
    # is a view of (L·B, G) rows; their gradients are summed back in one pass (see _ShiftedViews).
    steps = _ShiftedViews.apply(gates_in, length, self.window)
    h: Tensor | None = None
    c: Tensor | None = None
    for step_in in steps:
        gates_h = b_hh.to(step_in.dtype) if h is None else F.linear(h, w_hh, b_hh)
        if self.rnn_type == "gru":
            h = gru_step(step_in, gates_h, h)  # one fused pass on the CPU (see ops.rnn)
        elif self.rnn_type == "lstm":
            h, c = lstm_step(step_in, gates_h, c)  # likewise
        else:
            h = torch.tanh(step_in + gates_h)
    assert h is not None
    return h.view(length, batch, d_model).transpose(0, 1).contiguous()


class _ShiftedViews(torch.autograd.Function):
    """The ``M`` windows ``padded[j : j + L]`` (``j < M``) of a time-major ``(L + M - 1, B, G)`` tensor,
    each as ``(L·B, G)`` rows without a copy.

    Plain slicing would give the same forward, but each slice's backward fills a zero tensor the size
    of ``padded`` — ``M`` full-size buffers per call. Here the backward adds the ``M`` gradients into
    one buffer.
    """

    @staticmethod
    def forward(ctx, padded: Tensor, length: int, window: int) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.shape = padded.shape
        ctx.length = length
        rows = length * padded.shape[1]
        return tuple(padded[j : j + length].view(rows, -1) for j in range(window))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor, None, None]:  # type: ignore[override]
        total = grads[0].new_zeros(ctx.shape) if grads[0] is not None else None
        for j, grad in enumerate(grads):
            if grad is None:
                continue
            if total is None:
                total = grad.new_zeros(ctx.shape)
            total[j : j + ctx.length].add_(grad.view(ctx.length, *ctx.shape[1:]))
        return total, None, None
