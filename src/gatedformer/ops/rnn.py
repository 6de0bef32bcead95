"""The R-Transformer's LocalRNN on the compiled kernels: a GRU step, an LSTM step and the whole recurrence, each an
autograd function with a PyTorch path where its kernel does not apply.

**A GRU step** (:func:`gru_step`, kernel :mod:`gatedformer.kernels.gru`). With the input and hidden projections
already computed (``gi = W_ih x + b_ih``, ``gh = W_hh h + b_hh``, gate order r, z, n as in ``torch.nn.GRU``), a step
is element-wise::

    r = σ(gi_r + gh_r),  z = σ(gi_z + gh_z),  n = tanh(gi_n + r ⊙ gh_n),  h' = (1 - z) ⊙ n + z ⊙ h

In PyTorch operations that is a dozen passes over ``(rows, d)`` tensors forward and more backward, plus
concatenations to put the three gates' gradients back together, and autograd keeps about seven tensors
per step. Here the forward is one pass and keeps nothing but its inputs; the backward recomputes the
gates and writes the gradients of ``gi`` and ``gh`` straight into ``(rows, 3d)`` buffers.

**An LSTM step** (:func:`lstm_step`, kernel :mod:`gatedformer.kernels.lstm`). With the input and hidden projections
already computed (``gi = W_ih x + b_ih``, ``gh = W_hh h + b_hh``, gate order i, f, g, o as in ``torch.nn.LSTM``), a
step is element-wise::

    i = σ(a_i), f = σ(a_f), g = tanh(a_g), o = σ(a_o)   with a = gi + gh
    c' = f ⊙ c + i ⊙ g,   h' = o ⊙ tanh(c')

In PyTorch operations that is about ten passes over ``(rows, d)`` tensors forward, more backward, and a
concatenation to put the four gates' gradients back together; autograd keeps about eight tensors per step.
Here the forward is one pass that writes ``h'`` and ``c'`` and keeps nothing but its inputs; the backward
recomputes the gates and writes the gradient of the pre-activations ``a`` (that of ``gi`` and of ``gh``
alike) straight into one ``(rows, 4d)`` buffer, and that of ``c``.

Both steps take float32 or float64 on the CPU and share one switch,
``GATEDFORMER_GRU_BACKEND`` (``native``, ``torch`` or ``auto``, the default): both are the LocalRNN's step.

**The whole recurrence** (:func:`local_recurrence`, kernel :mod:`gatedformer.kernels.local_rnn`), one compiled call
each way, streamed by blocks of rows. :class:`~gatedformer.models.rtransformer.LocalRNN` runs ``M`` steps of a GRU,
LSTM or tanh RNN over the ``L·B`` windows at once. Step by step in PyTorch each step is a hidden-to-hidden product
and an element-wise pass over ``(L·B, G)`` tensors (``G`` = 3d, 4d or d), and the backward pass reads every step's
tensors back long after the forward pass wrote them, from memory rather than cache. Here each thread takes blocks of
rows (windows) through all ``M`` steps with MKL's packed products on one thread: a block's hidden state, its
product and its gates stay in cache from one step to the next, the backward pass walks each block's steps
back the same way, and one parallel region replaces ``M`` products and ``M`` element-wise passes per call.

The input projection ``W_ih x + b_ih`` stays outside (one product over the positions, read by every window
that contains them, ``(B, L, G)``). Windows are rows in batch-major order, as the output: row ``b·L + t`` reads,
at step ``j``, the projection of position ``t - (M-1) + j``, or ``b_ih`` (the projection of x = 0) before the
start, so nothing is padded or transposed. ``b_hh`` is added to the hidden product in the kernel, so the
product needs no bias pass of its own. For the backward pass the forward keeps, per window and step, the
hidden state, the LSTM's cell and the step's activations (in place of its hidden product): what the
step-by-step form keeps, in one tensor each. The backward pass returns the projection's gradient (each step's
added in place to the row it read), the pad's and ``b_hh``'s (summed per block of rows in order, so they do not
depend on the thread count), and ``W_hh``'s: each block's hidden-product gradients stay in its thread's scratch
for one product per block, so no tensor of them per window and step is ever made.

Float32 on the CPU where PyTorch links MKL (:func:`~gatedformer.kernels.local_rnn.streams` says where); it follows
the steps' switch, ``GATEDFORMER_GRU_BACKEND``. Under ``torch.compile`` each of the three is a custom operator
(:mod:`gatedformer.ops.operators`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.gates._product import add_product
from gatedformer.kernels import gru as _gru_kernel
from gatedformer.kernels import local_rnn as _local_rnn_kernel
from gatedformer.kernels import lstm as _lstm_kernel
from gatedformer.kernels.blas import PackedGemm
from gatedformer.kernels.gru import rows_view
from gatedformer.ops.operators import FunctionOperator, call, runs_native

__all__ = ["gru_step", "gru_step_reference", "local_recurrence", "lstm_step", "lstm_step_reference"]


# ---- the GRU step ----------------------------------------------------------------------------------------------

class _GRUStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:  # type: ignore[override]
        gi, gh = rows_view(gi), rows_view(gh)
        h = None if h is None else h.contiguous()
        out = _gru_kernel.forward(gi, gh, h)
        ctx.save_for_backward(gi, gh, h)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:  # type: ignore[override]
        gi, gh, h = ctx.saved_tensors
        return _gru_kernel.backward(gi, gh, h, grad.contiguous(), ctx.needs_input_grad[2])


def _gru_out(gi: Tensor, *_: object) -> list[Tensor]:
    return [gi.new_empty(gi.shape[0], gi.shape[1] // 3)]


GRU_STEP = FunctionOperator("gru_step", _GRUStep, "Tensor gi, Tensor gh, Tensor? h", _gru_out)
"""The step as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def gru_step_reference(gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:
    """The step in PyTorch operations: ``nn.GRU``'s equations; ``h=None`` is the zero state."""
    d = gi.shape[-1] // 3
    in_rz, in_n = gi.split([2 * d, d], dim=-1)
    h_rz, h_n = gh.split([2 * d, d], dim=-1)
    reset, update = torch.sigmoid(in_rz + h_rz).chunk(2, dim=-1)
    new = torch.tanh(add_product(in_n, reset, h_n))
    if h is None:
        return new - update * new
    return torch.lerp(new, h, update)


def gru_step(gi: Tensor, gh: Tensor, h: Tensor | None) -> Tensor:
    """One GRU step from ``gi`` ``(rows, 3d)``, ``gh`` ``(rows, 3d)`` or ``(3d,)`` (a bias for every row) and
    ``h`` ``(rows, d)`` or ``None``; the compiled pass on the CPU for float32/64, else PyTorch operations."""
    tensors = [t for t in (gi, gh, h) if t is not None]
    if (gi.dim() == 2 and gi.device.type == "cpu" and gi.dtype in _gru_kernel.DTYPES
            and all(t.dtype == gi.dtype for t in tensors) and runs_native(_gru_kernel.KERNEL, gi.device)):
        return call(GRU_STEP, gi, gh.expand(gi.shape[0], -1) if gh.dim() == 1 else gh, h)
    return gru_step_reference(gi, gh, h)


# ---- the LSTM step ---------------------------------------------------------------------------------------------

class _LSTMStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gi: Tensor, gh: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        gi, gh = rows_view(gi), rows_view(gh)
        c = None if c is None else c.contiguous()
        h_out, c_out = _lstm_kernel.forward(gi, gh, c)
        ctx.save_for_backward(gi, gh, c)
        return h_out, c_out

    @staticmethod
    def backward(ctx, grad_h: Tensor | None, grad_c: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        gi, gh, c = ctx.saved_tensors
        rows, d = gi.shape[0], gi.shape[1] // 4
        grad_h = gi.new_zeros(rows, d) if grad_h is None else grad_h.contiguous()
        grad_c = None if grad_c is None else grad_c.contiguous()
        grad_a, dc = _lstm_kernel.backward(gi, gh, c, grad_h, grad_c, ctx.needs_input_grad[2])
        # a = gi + gh: both take the same gradient (autograd sums a broadcast gh's rows).
        return grad_a, grad_a, dc


def _lstm_out(gi: Tensor, *_: object) -> list[Tensor]:
    d = gi.shape[1] // 4
    return [gi.new_empty(gi.shape[0], d), gi.new_empty(gi.shape[0], d)]


LSTM_STEP = FunctionOperator("lstm_step", _LSTMStep, "Tensor gi, Tensor gh, Tensor? c", _lstm_out, tuple_output=True)
"""The step as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def lstm_step_reference(gi: Tensor, gh: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor]:
    """The step in PyTorch operations: ``nn.LSTM``'s equations; ``c=None`` is the zero state. ``(h', c')``."""
    d = gi.shape[-1] // 4
    in_forget, cell, out = (gi + gh).split([2 * d, d, d], dim=-1)
    in_gate, forget = torch.sigmoid(in_forget).chunk(2, dim=-1)
    cell = torch.tanh(cell)
    c_new = in_gate * cell if c is None else add_product(forget * c, in_gate, cell)
    return torch.sigmoid(out) * torch.tanh(c_new), c_new


def lstm_step(gi: Tensor, gh: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor]:
    """One LSTM step from ``gi`` ``(rows, 4d)``, ``gh`` ``(rows, 4d)`` or ``(4d,)`` (a bias for every row) and the
    cell ``c`` ``(rows, d)`` or ``None``: ``(h', c')``; the compiled pass on the CPU for float32/64, else PyTorch
    operations."""
    tensors = [t for t in (gi, gh, c) if t is not None]
    if (gi.dim() == 2 and gi.device.type == "cpu" and gi.dtype in _lstm_kernel.DTYPES
            and all(t.dtype == gi.dtype for t in tensors) and runs_native(_lstm_kernel.KERNEL, gi.device)):
        return call(LSTM_STEP, gi, gh.expand(gi.shape[0], -1) if gh.dim() == 1 else gh, c)
    return lstm_step_reference(gi, gh, c)


# ---- the whole recurrence --------------------------------------------------------------------------------------

class _LocalRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates_in: Tensor, pad: Tensor, w_hh: Tensor, b_hh: Tensor, cell: str,  # type: ignore[override]
                window: int, blas: PackedGemm, training: bool) -> Tensor:
        gates_in, pad, w_hh, b_hh = (t.contiguous() for t in (gates_in, pad, w_hh, b_hh))
        keep = training and window > 1  # (needs_input_grad says True under no_grad too)
        out, hs, cs, ghs = _local_rnn_kernel.forward(blas, gates_in, pad, w_hh, b_hh, cell, window, keep)
        ctx.save_for_backward(gates_in, pad, w_hh, b_hh, hs, cs, ghs)
        ctx.cell, ctx.window, ctx.blas = cell, window, blas
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        gates_in, pad, w_hh, b_hh, hs, cs, ghs = ctx.saved_tensors
        grads = _local_rnn_kernel.backward(ctx.blas, gates_in, pad, w_hh, b_hh, hs, cs, ghs, grad_out.contiguous(),
                                           ctx.cell, ctx.window)
        return *grads, None, None, None, None


def _recurrence_out(gates_in: Tensor, pad: Tensor, w_hh: Tensor, *_: object) -> list[Tensor]:
    return [gates_in.new_empty(gates_in.shape[0], gates_in.shape[1], w_hh.shape[1])]


LOCAL_RECURRENCE = FunctionOperator(
    "local_recurrence", _LocalRecurrence,
    "Tensor gates_in, Tensor pad, Tensor w_hh, Tensor b_hh, str cell, int window, Blas blas, bool training",
    _recurrence_out)
"""The recurrence as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`): it finds MKL's
packed products itself when it runs (``Blas``), so the graph holds no function addresses."""


def local_recurrence(gates_in: Tensor, pad: Tensor, w_hh: Tensor, b_hh: Tensor, cell: str, window: int,
                     blas: PackedGemm) -> Tensor:
    """The last hidden state of every window, ``(B, L, d)``, from the input projection ``gates_in`` ``(B, L, G)``
    (``W_ih x + b_ih``), what positions before the start read in its place (``pad``, ``(G,)``: ``b_ih``, the
    projection of x = 0), and the cell's ``W_hh`` ``(G, d)`` and ``b_hh`` ``(G,)``; ``blas`` from
    :func:`gatedformer.kernels.local_rnn.streams`."""
    if cell not in _local_rnn_kernel.CELLS:
        raise ValueError(f"unknown cell {cell!r}; choose one of {', '.join(_local_rnn_kernel.CELLS)}")
    gates = _local_rnn_kernel.GATES[cell]
    if gates_in.shape[-1] != gates * w_hh.shape[1] or w_hh.shape[0] != gates_in.shape[-1]:
        raise ValueError(f"a {cell} of width {w_hh.shape[1]} takes {gates}·d gates, got "
                         f"{tuple(gates_in.shape)} and W_hh {tuple(w_hh.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    tensors = (gates_in, pad, w_hh, b_hh)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return call(LOCAL_RECURRENCE, *tensors, cell, window, blas, training)
