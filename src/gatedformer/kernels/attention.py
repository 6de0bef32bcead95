"""The binding of ``csrc/attention.cpp`` (its C API in ``csrc/attention.h``): causal multi-head attention for short
windows on the CPU, read straight from the fused QKV projection, forward and backward.

:mod:`gatedformer.ops.attention` says how the kernel works and holds its autograd function, the
``scaled_dot_product_attention`` path and the choice between them (``GATEDFORMER_ATTENTION_BACKEND``); the fused
sublayers of :mod:`gatedformer.ops.fused_linear` call :func:`packed_forward`, :func:`packed_backward` and the
kernel's addresses directly.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor

from gatedformer.kernels.build import KernelUnavailable, NativeKernel, constant_under_compile, kernel_threads

__all__ = ["KERNEL", "SUPPORTED_HEAD_SIZES", "kernel_addresses", "kernel_takes", "packed_backward", "packed_forward",
           "supported_head_sizes"]

SUPPORTED_HEAD_SIZES = (8, 16, 32, 64, 128)
"""Head sizes the kernel is written for; a build takes those that are whole vectors (the AVX-512 build: 16 up)."""


# -ffast-math is safe here: no infinity or NaN is ever produced on purpose (masked keys are skipped, not
# set to -inf), and it lets exp() vectorise.
KERNEL = NativeKernel(
    "attention", abi_version=3, env_var="GATEDFORMER_ATTENTION_BACKEND",
    description="the compiled causal attention kernel", fallback="scaled_dot_product_attention",
    fast_math=True, avx512=True,
)


def kernel_takes(width: int, n_heads: int, dropout: float, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled kernel takes packed projections ``width = 3·H·D`` wide of this device and dtype."""
    if device.type != "cpu" or dtype != torch.float32 or dropout > 0.0:
        return False
    head, rest = divmod(width, 3 * n_heads)
    return not rest and head in SUPPORTED_HEAD_SIZES and _takes_head(head)


@constant_under_compile
def _takes_head(head: int) -> bool:
    """Whether a build that takes heads of ``head`` runs; under ``torch.compile`` a constant of the graph, taken once
    while dynamo traces (the fused sublayers run there as custom operators; the check is Python not to trace)."""
    return KERNEL.pick_backend(torch.device("cpu")) == "native" and _library_for(head) is not None


def supported_head_sizes(lib: ctypes.CDLL | None = None) -> tuple[int, ...]:
    """The head sizes that ``lib`` takes, or without it those the kernel takes on this CPU (the loaded build's, and
    the heads narrower than its vectors that a narrower-vector build takes): empty without a kernel."""
    if lib is not None:
        return _sizes_of(lib)
    return tuple(h for h in SUPPORTED_HEAD_SIZES if _library_for(h) is not None)


@functools.lru_cache(maxsize=8)
def _sizes_of(lib: ctypes.CDLL) -> tuple[int, ...]:
    return tuple(h for h in SUPPORTED_HEAD_SIZES if lib.attention_head_supported(h))


_narrow_builds: dict[int, ctypes.CDLL | None] = {}


def _library_for(head: int) -> ctypes.CDLL | None:
    """The build that runs heads of ``head``: the loaded one, or where its vectors are wider than the head (heads of
    8 with AVX-512's 16 floats) the AVX2 build, whose vectors are 8 floats; ``None`` if neither takes it."""
    lib = KERNEL.library(warn=False)
    if lib is None:
        return None
    if head in _sizes_of(lib):
        return lib
    if KERNEL.isa != "avx512" or head % 8:
        return None
    key = id(lib)
    if key not in _narrow_builds:
        try:
            _narrow_builds[key] = KERNEL.library_for("avx2")
        except KernelUnavailable:
            raise
        except RuntimeError:
            _narrow_builds[key] = None
    narrow = _narrow_builds[key]
    return narrow if narrow is not None and head in _sizes_of(narrow) else None


def _library(head: int) -> ctypes.CDLL:
    lib = _library_for(head)
    if lib is None:
        raise RuntimeError(f"the attention kernel does not take heads of {head}")
    return lib


def kernel_addresses(head: int) -> tuple[int, int]:
    """The addresses of the compiled ``attention_forward_f32`` and ``attention_backward_f32`` that take heads of
    ``head``, for a kernel that calls them on its own threads (see ``_epilogue_kernel.attention_sublayer_streamed``)."""
    lib = _library(head)
    forward, backward = (ctypes.cast(fn, ctypes.c_void_p).value for fn in (lib.attention_forward_f32,
                                                                           lib.attention_backward_f32))
    return forward or 0, backward or 0


def packed_forward(qkv: Tensor, n_heads: int, keep_lse: bool = True,
                   bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The kernel's forward pass on contiguous ``(B, L, 3·H·D)`` projections (plus ``bias``, ``(3·H·D,)``, added as
    they are read, so the projection need not have copied it into every row): the ``(B, L, H·D)`` output and, with
    ``keep_lse``, the log-sum-exp of every row that :func:`packed_backward` needs."""
    batch, length, width = qkv.shape
    head = width // (3 * n_heads)
    out = qkv.new_empty(batch, length, n_heads * head)
    lse = qkv.new_empty(batch, n_heads, length) if keep_lse else None
    bias = None if bias is None else bias.contiguous()  # held: a temporary copy would be freed before the call
    failed = _library(head).attention_forward_f32(
        qkv.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), batch, length, n_heads, head, 1.0 / math.sqrt(head),
        kernel_threads(qkv.numel()),
    )
    if failed:
        raise RuntimeError(f"the attention kernel does not take heads of {head}")
    return out, lse


def packed_backward(qkv: Tensor, out: Tensor, grad_out: Tensor, lse: Tensor, n_heads: int,
                    bias: Tensor | None = None, bias_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """The gradients of the projections (and, with ``bias_grad``, of ``bias``: the sum of those over the rows) from
    that of :func:`packed_forward`'s output (any layout); ``qkv`` and ``bias`` as given to it."""
    batch, length, width = qkv.shape
    head = width // (3 * n_heads)
    grad_out = grad_out.contiguous()
    grad_qkv = torch.empty_like(qkv)
    per_sequence = qkv.new_empty(batch, width) if bias_grad else None  # each thread sums its own rows
    bias = None if bias is None else bias.contiguous()
    failed = _library(head).attention_backward_f32(
        qkv.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), grad_out.data_ptr(),
        lse.data_ptr(), grad_qkv.data_ptr(), None if per_sequence is None else per_sequence.data_ptr(),
        batch, length, n_heads, head, 1.0 / math.sqrt(head), kernel_threads(qkv.numel()),
    )
    if failed:
        raise RuntimeError(f"the attention kernel does not take heads of {head}")
    return grad_qkv, None if per_sequence is None else per_sequence.sum(0)
