"""The binding of ``csrc/relative_attention.cpp`` (its C API in ``csrc/relative_attention.h``): Transformer-XL's
relative-position attention for short windows on the CPU, forward and backward.

:mod:`gatedformer.ops.relative_attention` says how the kernel works and holds its autograd function
(:func:`~gatedformer.ops.relative_attention.relative_attention`); the fused sublayers of
:mod:`gatedformer.ops.relative_sublayer` call :func:`forward_kernel`, :func:`backward_kernel` and the kernel's
addresses directly. It shares the attention kernel's switch, ``GATEDFORMER_ATTENTION_BACKEND``.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gatedformer.kernels.build import NativeKernel, constant_under_compile, kernel_threads

__all__ = ["KERNEL", "MAX_HEAD_SIZE", "backward_kernel", "forward_kernel", "kernel_addresses", "kernel_takes"]

MAX_HEAD_SIZE = 128


KERNEL = NativeKernel(
    "relative_attention", abi_version=5, env_var="GATEDFORMER_ATTENTION_BACKEND",
    description="the compiled relative-position attention kernel", fallback="PyTorch operations",
    fast_math=True, avx512=True,
)


def kernel_addresses() -> tuple[int, int]:
    """The addresses of the compiled ``relative_attention_forward_f32`` and ``relative_attention_backward_f32``, for a
    kernel that calls them on its own threads (see ``_epilogue_kernel.relative_sublayer_streamed``)."""
    lib = KERNEL.library()
    forward, backward = (ctypes.cast(fn, ctypes.c_void_p).value for fn in (lib.relative_attention_forward_f32,
                                                                           lib.relative_attention_backward_f32))
    return forward or 0, backward or 0


def kernel_takes(tensors: Sequence[Tensor], n_heads: int, dropout: float) -> bool:
    """Whether :func:`~gatedformer.ops.relative_attention.relative_attention` may run the compiled kernel on these
    inputs (``q, kv, r, u, pos_bias`` and any ``memory_kv``, as it takes them): float32 CPU tensors (none cast by
    autocast), no attention dropout, heads of at most 128."""
    if dropout > 0.0 or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    width = tensors[0].shape[-1]
    return width % n_heads == 0 and width // n_heads <= MAX_HEAD_SIZE and _runs()


@constant_under_compile
def _runs() -> bool:
    """Whether the kernel runs; under ``torch.compile`` a constant of the graph, taken once while dynamo traces (the
    attention runs there as a custom operator; the check is Python not to trace)."""
    return KERNEL.pick_backend(torch.device("cpu")) == "native"


def _rows_apart(t: Tensor) -> bool:
    """Whether the kernel can read ``t`` (B, rows, width) where it is: each row's floats side by side."""
    return t.stride(-1) == 1 or t.shape[-1] == 1


def _key_values(kv: Tensor, memory_kv: Tensor | None, length: int) -> tuple[int, list[int]]:
    """The memory's rows, then the addresses and strides the kernel takes for the keys and values, ``[memory's
    address, its sequences' stride, its rows', the window's address, ...]``: the memory's keys and values are
    ``memory_kv`` or, without it, the rows of ``kv`` before the window's ``length``."""
    if memory_kv is None:
        memory = kv.shape[1] - length
        window_at = kv.data_ptr() + memory * kv.stride(1) * kv.element_size()
        return memory, [kv.data_ptr(), kv.stride(0), kv.stride(1), window_at, kv.stride(0), kv.stride(1)]
    return memory_kv.shape[1], [memory_kv.data_ptr(), memory_kv.stride(0), memory_kv.stride(1), kv.data_ptr(),
                                kv.stride(0), kv.stride(1)]


def forward_kernel(q: Tensor, kv: Tensor, r: Tensor, u: Tensor, pos_bias: Tensor, memory_kv: Tensor | None,
                   n_heads: int, keep_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """The kernel's forward pass outside autograd, for functions that hold it inside their own (contiguous
    float32 CPU operands, as :func:`~gatedformer.ops.relative_attention.relative_attention` takes them): the output
    and, with ``keep_lse``, each row's log-sum-exp for :func:`backward_kernel`."""
    batch, length, width = q.shape
    memory = kv.shape[1] - length if memory_kv is None else memory_kv.shape[1]
    head = width // n_heads
    inputs = (q, kv, r, u, pos_bias) + (() if memory_kv is None else (memory_kv,))
    shapes_fit = memory >= 0 and kv.shape == (batch, length + (memory if memory_kv is None else 0), 2 * width) \
        and (memory_kv is None or memory_kv.shape == (batch, memory, 2 * width)) \
        and r.shape == (memory + length, width) and u.shape == (n_heads, head) and pos_bias.shape == u.shape \
        and all(_rows_apart(t) for t in inputs[:2] + inputs[5:]) and all(t.is_contiguous() for t in inputs[2:5])
    if not shapes_fit or not kernel_takes(inputs, n_heads, 0.0):
        raise ValueError("relative_attention takes float32 CPU tensors q (B, L, H·D), kv (B, M+L, 2·H·D) or kv "
                         "(B, L, 2·H·D) with memory_kv (B, M, 2·H·D), r (M+L, H·D), u and pos_bias (H, D) with "
                         f"D <= {MAX_HEAD_SIZE}; got " + ", ".join(f"{tuple(t.shape)} {t.dtype} on {t.device}"
                                                                  for t in inputs))
    out = q.new_empty(batch, length, width)
    lse = q.new_empty(batch, n_heads, length) if keep_lse else None
    failed = KERNEL.library().relative_attention_forward_f32(
        q.data_ptr(), q.stride(0), q.stride(1), *_key_values(kv, memory_kv, length)[1], r.data_ptr(), u.data_ptr(),
        pos_bias.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(), batch, length, memory, n_heads,
        head, 1.0 / math.sqrt(head), kernel_threads(batch * (memory + length) * 2 * width * length),
    )
    if failed:
        raise RuntimeError(f"the relative attention kernel does not take heads of {head}")
    return out, lse


def backward_kernel(grad_out: Tensor, q: Tensor, kv: Tensor, r: Tensor, u: Tensor, pos_bias: Tensor,
                    memory_kv: Tensor | None, out: Tensor, lse: Tensor, n_heads: int,
                    grad_q: Tensor | None = None, grad_kv: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """The gradients of :func:`forward_kernel`'s ``q, kv, r, u, pos_bias, memory_kv`` (``None`` for no memory)
    from the output's, ``out`` and ``lse`` being what it returned. ``grad_q`` and ``grad_kv``, where given, are
    written (e.g. views of one buffer for the queries', keys' and values' product); they must have the strides of
    ``q`` and ``kv``."""
    batch, length, width = q.shape
    head = width // n_heads
    grad_out = grad_out.contiguous()
    grad_q = torch.empty_like(q) if grad_q is None else grad_q
    grad_kv = torch.empty_like(kv) if grad_kv is None else grad_kv
    grad_memory_kv = None if memory_kv is None else torch.empty_like(memory_kv)
    if grad_q.stride() != q.stride() or grad_kv.stride() != kv.stride() or (
            memory_kv is not None and grad_memory_kv.stride() != memory_kv.stride()):
        raise ValueError("the gradients of q, kv and memory_kv must have their strides")
    grad_r = r.new_empty(batch, *r.shape)  # each sequence's share, summed below
    grad_u, grad_pos_bias = u.new_empty(batch, *u.shape), u.new_empty(batch, *u.shape)
    memory, key_values = _key_values(kv, memory_kv, length)
    _, grad_key_values = _key_values(grad_kv, grad_memory_kv, length)  # the same strides: only the addresses differ
    failed = KERNEL.library().relative_attention_backward_f32(
        q.data_ptr(), q.stride(0), q.stride(1), *key_values, r.data_ptr(), u.data_ptr(), pos_bias.data_ptr(),
        out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(), grad_q.data_ptr(), grad_key_values[0],
        grad_key_values[3], grad_r.data_ptr(), grad_u.data_ptr(), grad_pos_bias.data_ptr(), batch, length, memory,
        n_heads, head, 1.0 / math.sqrt(head), kernel_threads(batch * (memory + length) * 2 * width * length),
    )
    if failed:
        raise RuntimeError(f"the relative attention kernel does not take heads of {head}")
    return grad_q, grad_kv, grad_r.sum(0), grad_u.sum(0), grad_pos_bias.sum(0), grad_memory_kv
