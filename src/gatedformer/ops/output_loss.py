"""A language model's output layer and its cross-entropy loss as one function.

``F.cross_entropy(F.linear(h, W, b), targets)`` materialises the logits, then ``log_softmax`` writes a second
copy, and the backward pass a zero-filled third (``nll_loss``) and a fourth (``log_softmax``'s gradient), each
streamed through memory: with a 10k-word vocabulary that is most of a small model's training step.
:func:`linear_cross_entropy` computes the same loss and gradients with one ``(rows, V)`` buffer: the logits'
product (MKL, no bias), then the cross-entropy kernel (:mod:`gatedformer.kernels.cross_entropy`) adds the
bias and turns each row into its loss and, in place, its gradient while the row is in cache, then the two
gradient products. As in fused linear cross-entropy losses elsewhere, the gradients are computed in the forward
pass (when autograd will want them) and the backward pass only scales them by the loss's own gradient; a block
of rows at a time where the logits would be large, so memory stays bounded whatever the batch.

It applies to float32 CPU tensors outside autocast, with the kernel available (under ``torch.compile`` as the
custom operator ``gatedformer::linear_cross_entropy``); everything else takes ``F.linear`` then
``F.cross_entropy``, the same numbers up to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from gatedformer.kernels.build import kernel_threads
from gatedformer.kernels.cross_entropy import KERNEL
from gatedformer.ops.explain import declined, explaining, first_reason
from gatedformer.ops.operators import FunctionOperator, call, runs_native

__all__ = ["LOGITS_BUDGET", "fused_loss_applies", "linear_cross_entropy", "logits_cross_entropy", "row_blocks"]

LOGITS_BUDGET = 1 << 22
"""Logits (floats) computed at once: rows are taken in blocks of at most about ``LOGITS_BUDGET // V`` (16 MB of
logits), small enough to stay in the last-level cache between the kernel and the two gradient products, which a
single block of every row would not. The blocks are of equal size (see :func:`row_blocks`)."""

_REDUCTIONS = ("mean", "sum")


def fused_loss_applies(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`linear_cross_entropy` runs the fused computation for these operands."""
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    applies = (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
               and not torch.is_autocast_enabled("cpu") and runs_native(KERNEL, hidden.device))
    if not applies and explaining():
        declined("ops.output_loss.linear_cross_entropy", first_reason(tensors, kernels=(KERNEL,)) or "")
    return applies


def row_blocks(rows: int, vocab: int, budget: int | None = None) -> int:
    """Rows per block of logits: the fewest blocks of at most ``budget // vocab`` rows (``LOGITS_BUDGET`` by default),
    then the rows shared out evenly among them. A short last block would cost nearly a whole block's time: the
    weight's gradient, ``(V, d)``, is read and written once per block whatever its rows (at ``wikitext2-gcnn-tiny``'s
    size, 512 rows of a 33k vocabulary, a last block of 8 rows after four of 126 took 5 % of the training step)."""
    most = max(1, (LOGITS_BUDGET if budget is None else budget) // max(vocab, 1))
    blocks = -(-rows // most) if rows > 0 else 1
    return max(1, -(-rows // blocks))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=..., reduction=...,
    label_smoothing=...)`` over every position: ``hidden`` ``(..., d)``, ``weight`` ``(V, d)``, ``targets`` of
    ``hidden``'s leading shape; ``reduction`` ``"mean"`` (over the targets that are not ``ignore_index``) or
    ``"sum"``. Without the logits tensor and its copies (see the module)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match hidden states of shape "
                         f"{tuple(hidden.shape)}: one target per position")
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if not fused_loss_applies(hidden, weight, bias):
        return logits_cross_entropy(F.linear(rows, weight, bias), flat_targets, ignore_index, reduction,
                                    label_smoothing)
    # the gradients are made in the forward pass only where autograd records it (inside it, it never does)
    return call(LINEAR_CROSS_ENTROPY, rows, weight, bias, flat_targets, ignore_index, reduction == "mean",
                                     float(label_smoothing), torch.is_grad_enabled())


def logits_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str,
                         label_smoothing: float) -> Tensor:
    """``F.cross_entropy`` over the rows of ``logits``, half-precision ones (autocast's) taken in float32."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # type: ignore[override]
                ignore_index: int, mean: bool, smoothing: float, recorded: bool) -> Tensor:
        hidden, weight = hidden.contiguous(), weight.contiguous()
        targets = targets.to(torch.int64).contiguous()
        rows, vocab = hidden.shape[0], weight.shape[0]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        want_grad = recorded and (need_hidden or need_weight or need_bias)
        need_hidden, need_weight, need_bias = (want_grad and need for need in (need_hidden, need_weight, need_bias))
        counted = int((targets != ignore_index).sum()) if mean else 1
        scale = 1.0 / counted if counted else float("nan")  # as cross_entropy: a mean over no targets is NaN
        losses = hidden.new_empty(rows)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The first block's product writes the weight's gradient (no rows: no block, a zero gradient).
        grad_weight = (torch.empty_like(weight) if rows else torch.zeros_like(weight)) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=torch.float32) if need_bias else None
        col_sums = hidden.new_empty(vocab) if want_grad else None
        bias = None if bias is None else bias.contiguous()  # held: a temporary copy would be freed before the call
        bias_ptr = None if bias is None else bias.data_ptr()
        library = KERNEL.library()
        block = row_blocks(rows, vocab)
        buffer = hidden.new_empty(block, vocab)  # one block's logits, reused by every block
        for start in range(0, rows, block):
            stop = min(start + block, rows)
            chunk = hidden[start:stop]
            logits = torch.mm(chunk, weight.t(), out=buffer[:stop - start])
            bad = library.softmax_cross_entropy_f32(
                logits.data_ptr(), bias_ptr, targets[start:].data_ptr(), stop - start, vocab, ignore_index, smoothing,
                losses[start:].data_ptr(), int(want_grad), 0.0 if scale != scale else scale,
                None if col_sums is None else col_sums.data_ptr(), kernel_threads(logits.numel()))
            if bad >= 0:
                target = int(targets[start + bad])
                raise IndexError(f"target {target} is out of bounds for a vocabulary of {vocab} "
                                 f"(and is not the ignored index {ignore_index})")
            if grad_hidden is not None:
                torch.mm(logits, weight, out=grad_hidden[start:stop])
            if grad_weight is not None and start == 0:
                torch.mm(logits.t(), chunk, out=grad_weight)
            elif grad_weight is not None:
                grad_weight.addmm_(logits.t(), chunk)
            if grad_bias is not None:
                grad_bias += col_sums
        if want_grad and scale != scale:  # no target counted: NaN gradients, as the unfused mean gives
            for grad in (grad_hidden, grad_weight, grad_bias):
                if grad is not None:
                    grad.fill_(float("nan"))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return losses.sum() * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = ctx.saved_tensors
        factor = float(grad_loss)
        if factor != 1.0:
            grads = tuple(None if g is None else g * factor for g in grads)
        return (*grads, None, None, None, None, None)


def _loss(hidden: Tensor, *_: object) -> list[Tensor]:
    return [hidden.new_empty(())]


LINEAR_CROSS_ENTROPY = FunctionOperator(
    "linear_cross_entropy", _LinearCrossEntropy, "Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, "
    "int ignore_index, bool mean, float smoothing, bool recorded", _loss)
"""The loss as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""
