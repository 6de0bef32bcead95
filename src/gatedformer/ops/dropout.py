"""Dropout whose random mask is cheap on the CPU.

On the CPU, ``torch.nn.functional.dropout`` draws its mask with ``bernoulli_``, one Mersenne-Twister draw
per element, then multiplies and keeps the mask for the backward pass: in a small Transformer LM on a
few CPU cores that is about a fifth of a training step. :class:`Dropout` draws the same Bernoulli(1 - p)
mask from Philox4x32-10, a counter-based generator, and applies it in the same pass
(:mod:`gatedformer.kernels.dropout`). Because the mask is a function of a seed and each
element's index, the backward pass draws it again instead of storing it.

Reproducibility is that of torch: each call takes its 64-bit seed from torch's default CPU generator,
so ``torch.manual_seed`` fixes the masks and a checkpoint that stores torch's RNG state resumes them bit
for bit. The keep probability is rounded to a multiple of ``2**-32`` (finer than the ``2**-24`` steps of
a float32 uniform) and kept elements are scaled by the inverse of the rounded value, so the expectation
is preserved.

Under ``torch.compile`` the fused functions are custom operators (:mod:`gatedformer.ops.operators`) and the seeds
are drawn by one of their own, so a compiled step draws the masks of the eager one. Anything else takes
``torch.nn.functional.dropout`` unchanged: tensors not on the CPU (CUDA has a fused dropout kernel),
``inplace=True``, non-floating-point inputs, ``p`` of 0 or 1, and machines where the kernel cannot be
built or ``GATEDFORMER_DROPOUT_BACKEND=torch`` turns it off (the NumPy reference of the kernel's masks
would be several times slower than PyTorch's own dropout, so it only serves as the tests' oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from gatedformer.kernels.dropout import (
    KERNEL,
    apply_dropout,
    apply_dropout_add,
    apply_relu_dropout,
    scale_where_positive,
)
from gatedformer.ops.operators import TRACED_SEED, FunctionOperator, call, native

__all__ = ["dropout", "dropout_add", "keep_mask", "relu_dropout"]

_INT32_VALUES = 2 ** 32


def _draw_seed() -> int:
    """A mask's seed from torch's generator; under ``torch.compile``, :data:`~gatedformer.ops.operators.TRACED_SEED`
    (the fused operator that takes it draws it, in the same order)."""
    if torch.compiler.is_compiling():
        return TRACED_SEED  # type: ignore[return-value]
    return int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))


def _draw_seeds(count: int) -> list[int]:
    """``count`` seeds in one call: those that ``count`` calls of ``_draw_seed`` would give, leaving torch's generator
    where they would (it draws a tensor's elements one after the other)."""
    return torch.randint(0, 2 ** 63 - 1, (count,), dtype=torch.int64).tolist() if count else []


def _keep_below(p: float) -> int:
    """The number of the ``2**32`` uniform words that keep an element: ``1 - p`` rounded to ``2**-32``."""
    return round((1.0 - p) * _INT32_VALUES)


class _MaskedDropout(torch.autograd.Function):
    """``x`` times the mask of a seed; the backward pass applies the same mask to the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, seed: int, keep_below: int) -> Tensor:  # type: ignore[override]
        ctx.mask = (seed, keep_below, _INT32_VALUES / keep_below)
        return apply_dropout(x.contiguous(), *ctx.mask)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return apply_dropout(grad.contiguous(), *ctx.mask), None, None


class _MaskedDropoutAdd(torch.autograd.Function):
    """``base + x`` times the mask of a seed, in one pass (a residual connection around a dropped-out branch)."""

    @staticmethod
    def forward(ctx, base: Tensor, x: Tensor, seed: int, keep_below: int) -> Tensor:  # type: ignore[override]
        ctx.mask = (seed, keep_below, _INT32_VALUES / keep_below)
        return apply_dropout_add(base.contiguous(), x.contiguous(), *ctx.mask)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        return grad, apply_dropout(grad.contiguous(), *ctx.mask), None, None


class _MaskedReluDropout(torch.autograd.Function):
    """``relu(x)`` times the mask of a seed in one pass; the gradient flows where the output is positive."""

    @staticmethod
    def forward(ctx, x: Tensor, seed: int, keep_below: int) -> Tensor:  # type: ignore[override]
        ctx.scale = _INT32_VALUES / keep_below
        out = apply_relu_dropout(x.contiguous(), seed, keep_below, ctx.scale)
        ctx.save_for_backward(out)  # the next layer keeps it anyway: no memory of its own
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return scale_where_positive(out, grad, ctx.scale), None, None


def _same(x: Tensor, *_: object) -> list[Tensor]:
    return [torch.empty_like(x, memory_format=torch.contiguous_format)]


MASKED_DROPOUT = FunctionOperator("dropout", _MaskedDropout, "Tensor x, Seed seed, int keep_below", _same)
MASKED_DROPOUT_ADD = FunctionOperator("dropout_add", _MaskedDropoutAdd, "Tensor base, Tensor x, Seed seed, "
                                      "int keep_below", _same)
MASKED_RELU_DROPOUT = FunctionOperator("relu_dropout", _MaskedReluDropout, "Tensor x, Seed seed, int keep_below",
                                       _same)


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """A CPU tensor of ``shape`` holding ``1 / keep`` with probability ``keep ≈ 1 - p`` and 0 otherwise.

    ``keep`` is ``1 - p`` rounded to a multiple of ``2**-32``; the nonzero value is its inverse. The mask
    is the one :func:`dropout` would apply to a tensor of ``shape`` with the generator in the same state.
    """
    keep_below = _keep_below(p)
    if keep_below <= 0:
        return torch.zeros(shape, dtype=dtype)
    if keep_below >= _INT32_VALUES:
        return torch.ones(shape, dtype=dtype)
    seed = int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))  # as _draw_seed, in eager code too
    return apply_dropout(torch.ones(shape, dtype=dtype), seed, keep_below, _INT32_VALUES / keep_below)


def _mask_seed(keep_below: int) -> int:
    """The seed of a mask that keeps ``keep_below`` of the ``2**32`` words: drawn from torch's generator, except
    when every element is kept (``p`` 0), which draws nothing, as the unfused operations do not."""
    return _draw_seed() if keep_below < _INT32_VALUES else 0


def _fast_path(x: Tensor, p: float, inplace: bool = False, keep_all: bool = False) -> bool:
    """Whether the kernel takes ``x`` with dropout ``p`` (0 < p < 1; with ``keep_all``, as the fused layers that
    carry a dropout in their epilogue pass, p = 0 too)."""
    return (x.device.type == "cpu" and not inplace and _fast_rate(p, keep_all)
            and x.is_floating_point()
            and (native(KERNEL) if torch.compiler.is_compiling() else KERNEL.pick_backend(x.device) == "native"))


def _fast_rate(p: float, keep_all: bool = False) -> bool:
    """The rate's part of :func:`_fast_path`: whether the kernel's masks take dropout ``p``."""
    return 0 < _keep_below(p) <= (_INT32_VALUES if keep_all else _INT32_VALUES - 1)


def dropout(x: Tensor, p: float, training: bool = True, inplace: bool = False) -> Tensor:
    """``torch.nn.functional.dropout`` with the fast CPU mask of :func:`keep_mask` where it applies."""
    if not training or p == 0.0:
        return x
    if not _fast_path(x, p, inplace):
        return F.dropout(x, p, training, inplace)
    if x.dtype not in (torch.float32, torch.float64):  # half precision: computed in float32
        return call(MASKED_DROPOUT, x.float(), _draw_seed(), _keep_below(p)).to(x.dtype)
    return call(MASKED_DROPOUT, x, _draw_seed(), _keep_below(p))


def dropout_add(base: Tensor, x: Tensor, p: float, training: bool = True) -> Tensor:
    """``base + dropout(x, p)``, in one pass on the CPU fast path (``base`` and ``x`` of one shape and dtype)."""
    if not training or p == 0.0:
        return base + x
    if (not _fast_path(x, p) or base.shape != x.shape or base.dtype != x.dtype
            or x.dtype not in (torch.float32, torch.float64)):
        return base + dropout(x, p, training)
    return call(MASKED_DROPOUT_ADD, base, x, _draw_seed(), _keep_below(p))


def relu_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``dropout(relu(x))`` in one pass on the CPU fast path: one mask that also zeroes ``x <= 0``, so the
    ReLU needs no pass of its own forward or backward."""
    if not training or p == 0.0:
        return x.relu()
    if not _fast_path(x, p):
        return F.dropout(x.relu(), p, training)
    if x.dtype not in (torch.float32, torch.float64):
        return call(MASKED_RELU_DROPOUT, x.float(), _draw_seed(), _keep_below(p)).to(x.dtype)
    return call(MASKED_RELU_DROPOUT, x, _draw_seed(), _keep_below(p))
