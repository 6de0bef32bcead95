"""Dropout whose random mask is cheap on the CPU.

On the CPU, ``torch.nn.functional.dropout`` draws its mask with ``bernoulli_``, one Mersenne-Twister draw
per element: in a small Transformer LM on a few CPU cores that draw alone takes about a fifth of a
training step. :class:`Dropout` draws the same Bernoulli(1 - p) mask from numpy's PCG64 generator, whose
raw 64-bit output gives two 32-bit uniform integers per draw (about ten times faster), and scales the kept
elements by ``1 / (1 - p)`` as usual.

Reproducibility is that of torch: each call seeds the PCG64 generator with one 63-bit integer drawn from
torch's default CPU generator, so ``torch.manual_seed`` fixes the masks and a checkpoint that stores
torch's RNG state resumes them bit for bit. The keep probability is rounded to a multiple of
``2**-32`` (finer than the ``2**-24`` steps of a float32 uniform) and kept elements are scaled by the
inverse of the rounded value, so the expectation is preserved.

Anything else takes ``torch.nn.functional.dropout`` unchanged: tensors not on the CPU (CUDA has a fused
dropout kernel), code being traced by ``torch.compile`` (Inductor generates its own random numbers),
``inplace=True``, non-floating-point inputs and ``p`` of 0 or 1.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["Dropout", "dropout", "keep_mask", "relu_dropout"]

_INT32_VALUES = 2 ** 32


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """A CPU tensor of ``shape`` holding ``1 / keep`` with probability ``keep ≈ 1 - p`` and 0 otherwise.

    ``keep`` is ``1 - p`` rounded to a multiple of ``2**-32``; the nonzero value is its inverse.
    """
    kept_values = round((1.0 - p) * _INT32_VALUES)
    if kept_values <= 0:
        return torch.zeros(shape, dtype=dtype)
    if kept_values >= _INT32_VALUES:
        return torch.ones(shape, dtype=dtype)
    return _scaled(_keep(shape, kept_values), kept_values, dtype)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _keep(shape: torch.Size | tuple[int, ...], kept_values: int) -> np.ndarray:
    """Boolean numpy mask of ``shape``: each element True with probability ``kept_values / 2**32``."""
    count = math.prod(shape)
    seed = int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))
    raw = np.random.PCG64(seed).random_raw((count + 1) // 2)  # two uniform int32 per 64-bit draw
    uniform = raw.view(np.int32)[:count].reshape(shape)
    # ``uniform`` is uniform over the 2**32 int32 values; exactly ``kept_values`` of them lie below the bound.
    return np.less(uniform, kept_values - _INT32_VALUES // 2)


def _scaled(keep: np.ndarray, kept_values: int, dtype: torch.dtype) -> Tensor:
    """``keep`` as a ``dtype`` tensor of 0 and ``2**32 / kept_values``."""
    scale = _INT32_VALUES / kept_values
    if dtype in _NUMPY_DTYPES:
        # One numpy pass converts and scales (torch would take a conversion and a multiplication), into memory
        # torch allocates, so that torch's memory accounting sees the mask.
        np_dtype = _NUMPY_DTYPES[dtype]
        out = torch.empty(keep.shape, dtype=dtype)
        np.multiply(keep, np_dtype(scale), out=out.numpy(), dtype=np_dtype)
        return out
    return torch.from_numpy(keep).to(dtype).mul_(scale)


def _fast_path(x: Tensor, p: float, inplace: bool = False) -> bool:
    return (x.device.type == "cpu" and not inplace and 0.0 < p < 1.0 and x.is_floating_point()
            and not torch.compiler.is_compiling())


def dropout(x: Tensor, p: float, training: bool = True, inplace: bool = False) -> Tensor:
    """``torch.nn.functional.dropout`` with the fast CPU mask of :func:`keep_mask` where it applies."""
    if not training or p == 0.0:
        return x
    if not _fast_path(x, p, inplace):
        return F.dropout(x, p, training, inplace)
    return x * keep_mask(x.shape, p, x.dtype)


def relu_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``dropout(relu(x))`` in fewer passes on the CPU fast path: one mask that also zeroes ``x <= 0``, so the
    ReLU needs no pass of its own forward or backward (the gradient is the same mask times the incoming one)."""
    if not training or p == 0.0:
        return x.relu()
    if not _fast_path(x, p):
        return F.dropout(x.relu(), p, training)
    kept_values = round((1.0 - p) * _INT32_VALUES)
    if not 0 < kept_values < _INT32_VALUES:
        return x.relu() * keep_mask(x.shape, p, x.dtype)
    keep = _keep(x.shape, kept_values)
    values = x.detach()
    if x.dtype in _NUMPY_DTYPES and values.is_contiguous():
        np.logical_and(keep, values.numpy() > 0, out=keep)
    else:
        keep = (torch.from_numpy(keep) & (values > 0)).numpy()
    return x * _scaled(keep, kept_values, x.dtype)


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` (same arguments, same ``p``) drawing its CPU masks with :func:`keep_mask`."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training, self.inplace)

    def after_relu(self, x: Tensor) -> Tensor:
        """``self(relu(x))``, fused as in :func:`relu_dropout`."""
        return relu_dropout(x, self.p, self.training)
