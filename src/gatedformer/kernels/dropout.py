"""Dropout masks from a counter-based generator, drawn and applied in one pass by a small C++ kernel.

Every mask element is a 32-bit uniform word of Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
random numbers: as easy as 1, 2, 3", SC 2011; the generator behind cuRAND and PyTorch's CUDA dropout)
under a 64-bit key, the *seed*: element ``i`` lies in tile ``t = i // 32`` at ``j = i % 32`` and reads
word ``j // 8`` of the block whose counter is ``(8t + j % 8, 0, 0)`` (the 64-bit block number in the first
two words). An element is kept when its word is below ``keep_below`` (``2**32`` times the keep
probability), so a mask is a pure function of the seed and the element's index:

* the backward pass regenerates the mask instead of storing it (plain dropout saves nothing);
* the threads of a call may split the elements any way they like and still draw the same mask;
* the vectorised kernel (AVX2: eight blocks at once, AVX-512: sixteen) and :func:`philox_words`, the NumPy
  reference the tests check it against, give identical masks;
* other kernels that include the generator, ``csrc/philox.h`` (the fused linear epilogues of
  :mod:`gatedformer.kernels.epilogue`), draw the very same masks.

The kernel's source is ``csrc/dropout.cpp`` (C API: ``csrc/dropout.h``).
``GATEDFORMER_DROPOUT_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the default). Without the kernel
the functions here compute the same masks with the NumPy reference (several times slower), and
:mod:`gatedformer.ops.dropout` uses PyTorch's own dropout instead.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gatedformer.kernels.build import HEAVY_ELEMENT, NativeKernel, kernel_threads

__all__ = ["KERNEL", "apply_dropout", "apply_dropout_add", "apply_relu_dropout", "keep_word",
           "philox4x32_10", "philox_words", "scale_where_positive"]

_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_LANES = 8
_TILE = 4 * _LANES


_NO_FMA = ("-ffp-contract=off",)
"""No fused multiply-add, so that ``base + x * scale`` rounds as PyTorch's two operations do."""

KERNEL = NativeKernel(
    "dropout", abi_version=9, env_var="GATEDFORMER_DROPOUT_BACKEND",
    description="the compiled dropout kernel", fallback="PyTorch's own dropout",
    # No fused multiply-add, so that ``base + x * scale`` rounds as PyTorch's two operations do.
    extra_cflags=_NO_FMA, avx512=True,
)

_NATIVE_DTYPES = {torch.float32: "f32", torch.float64: "f64"}


# ---- the NumPy reference ---------------------------------------------------------------------------


def philox4x32_10(counter: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                  key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of each counter (four arrays of 32-bit words) under ``key`` (two 32-bit words)."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.uint64(k) for k in key)
    m0, m1 = (np.uint64(m) for m in _MULTIPLIERS)
    s0, s1 = (np.uint64(s) for s in _KEY_STEPS)
    for _ in range(10):
        p0, p1 = c0 * m0, c2 * m1  # < 2**64: no wrap-around
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + s0) & mask, (k1 + s1) & mask
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def philox_words(count: int, seed: int, start: int = 0) -> np.ndarray:
    """The uniform 32-bit words of elements ``start .. start + count - 1`` under ``seed``, in element order."""
    first_tile, end_tile = start // _TILE, -(-(start + count) // _TILE)
    blocks = np.arange(first_tile * _LANES, end_tile * _LANES, dtype=np.uint64)
    zeros = np.zeros_like(blocks)
    words = philox4x32_10((blocks & np.uint64(0xFFFFFFFF), blocks >> np.uint64(32), zeros, zeros),
                          (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    # (4 words, tiles, 8 lanes) -> tile-major, then word-major within a tile.
    flat = np.stack(words).reshape(4, end_tile - first_tile, _LANES).transpose(1, 0, 2).reshape(-1)
    offset = start - first_tile * _TILE
    return flat[offset:offset + count]


# ---- the operations (contiguous CPU tensors) --------------------------------------------------------


def keep_word(keep_below: int) -> int:
    """``keep_below`` as the kernels' 32-bit argument: ``2**32`` (``p`` 0, every element kept) becomes 0, which they
    read as ``2**32`` (see ``last_kept`` in ``csrc/philox.h``)."""
    return keep_below % 2 ** 32


def _native_ok(x: Tensor) -> bool:
    return x.dtype in _NATIVE_DTYPES and KERNEL.pick_backend(x.device) == "native"


def _reference_keep(x: Tensor, seed: int, keep_below: int) -> Tensor:
    return torch.from_numpy(philox_words(x.numel(), seed).astype(np.int64) < keep_below).view(x.shape)


def apply_dropout(x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``x`` times the mask of ``seed`` (``scale`` where kept, 0 elsewhere); ``x`` contiguous on the CPU."""
    if _native_ok(x):
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"dropout_{_NATIVE_DTYPES[x.dtype]}")
        fn(x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_word(keep_below), scale,
           kernel_threads(x.numel(), cost=HEAVY_ELEMENT))
        return out
    return x * _reference_keep(x, seed, keep_below).to(x.dtype).mul_(scale)


def apply_dropout_add(base: Tensor, x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``base + apply_dropout(x, ...)`` in one pass; both contiguous on the CPU, of one shape and dtype."""
    if _native_ok(x) and base.dtype == x.dtype:
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"dropout_add_{_NATIVE_DTYPES[x.dtype]}")
        fn(base.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_word(keep_below), scale,
           kernel_threads(x.numel(), cost=HEAVY_ELEMENT))
        return out
    return base + x * _reference_keep(x, seed, keep_below).to(x.dtype).mul_(scale)


def apply_relu_dropout(x: Tensor, seed: int, keep_below: int, scale: float) -> Tensor:
    """``relu(x)`` times the mask of ``seed``, in one pass; ``x`` contiguous on the CPU."""
    if _native_ok(x):
        out = torch.empty_like(x)
        fn = getattr(KERNEL.library(), f"relu_dropout_{_NATIVE_DTYPES[x.dtype]}")
        fn(x.data_ptr(), out.data_ptr(), x.numel(), seed, keep_word(keep_below), scale,
           kernel_threads(x.numel(), cost=HEAVY_ELEMENT))
        return out
    return x * (_reference_keep(x, seed, keep_below) & (x > 0)).to(x.dtype).mul_(scale)


def scale_where_positive(y: Tensor, grad: Tensor, scale: float) -> Tensor:
    """``grad * scale`` where ``y > 0``, else 0: the gradient of relu-then-dropout, read from its output."""
    if _native_ok(y) and grad.dtype == y.dtype:
        grad = grad.contiguous()
        out = torch.empty_like(y)
        fn = getattr(KERNEL.library(), f"positive_scale_{_NATIVE_DTYPES[y.dtype]}")
        fn(y.data_ptr(), grad.data_ptr(), out.data_ptr(), y.numel(), scale, kernel_threads(y.numel()))
        return out
    return grad * (y > 0).to(grad.dtype).mul_(scale)


def embed_dropout(table: Tensor, tokens: Tensor, positions: Tensor | None, scale: float,
                  mask: tuple[int, int, float] | None) -> Tensor:
    """``(table[tokens] * scale + positions)`` times the mask ``(seed, keep_below, drop scale)`` (none: no dropout)
    in one pass, the mask :func:`apply_dropout` would give the sum. ``table`` ``(V, d)`` and ``positions``
    ``(L, d)`` contiguous float32, ``tokens`` ``(..., L)`` contiguous int64; needs the compiled kernel."""
    vocab, width = table.shape
    length = tokens.shape[-1]
    out = table.new_empty(*tokens.shape, width)
    seed, keep_below, drop_scale = mask or (0, 0, 1.0)
    bad = KERNEL.library().embed_dropout_f32(
        table.data_ptr(), tokens.data_ptr(), None if positions is None else positions.data_ptr(), out.data_ptr(),
        tokens.numel(), width, vocab, length, scale, mask is not None, seed, keep_below, drop_scale,
        kernel_threads(out.numel()))
    if bad:
        raise IndexError(f"index out of range in self: {bad} token ids outside [0, {vocab}) for an embedding of "
                         f"{vocab} rows")
    return out


def embed_dropout_backward(grad: Tensor, tokens: Tensor, vocab: int, scale: float,
                           mask: tuple[int, int, float] | None) -> Tensor:
    """The table's gradient for :func:`embed_dropout`'s output gradient ``grad`` (contiguous float32)."""
    width = grad.shape[-1]
    grad_table = grad.new_zeros(vocab, width)
    seed, keep_below, drop_scale = mask or (0, 0, 1.0)
    KERNEL.library().embed_dropout_backward_f32(
        grad.data_ptr(), tokens.data_ptr(), grad_table.data_ptr(), tokens.numel(), width, scale, mask is not None,
        seed, keep_below, drop_scale, kernel_threads(grad.numel()))
    return grad_table
