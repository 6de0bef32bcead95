"""The binding of ``csrc/sru.cpp`` (its C API in ``csrc/sru.h``): the element-wise SRU recurrence and its backward
pass (back-propagation through time) on the CPU, for float32 and float64, the batch rows split between threads.

:mod:`gatedformer.ops.sru` says what the recurrence computes and holds the autograd function that runs it on this
kernel, on the Triton kernels (:mod:`gatedformer.kernels.triton.sru`) or as PyTorch loops
(``GATEDFORMER_SRU_BACKEND``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gatedformer.kernels.build import NativeKernel, kernel_threads

__all__ = ["KERNEL", "backward", "forward", "split_streams"]


# -ffast-math is safe for this code: its sigmoid never overflows, and NaNs still propagate.
KERNEL = NativeKernel(
    "sru", abi_version=4, env_var="GATEDFORMER_SRU_BACKEND",
    description="the compiled SRU recurrence", fallback="PyTorch loops over time, which are several times slower",
    fast_math=True, avx512=True,
)


# --------------------------------------------------------------------------------------------------
# Shapes used below: U (L, B, D, K, H) with K = 3 streams [x~, f~, r~] or K = 4 with the skip stream
# W_s x last; skip (L, B, D, H) when K = 3; v_f, v_r, b_f, b_r (D, H); c0 (B, D, H).


def split_streams(U: Tensor, skip: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The streams ``x~, f~, r~`` of ``U`` and the skip input (``skip``, else ``U``'s fourth stream)."""
    return U[:, :, :, 0], U[:, :, :, 1], U[:, :, :, 2], (U[:, :, :, 3] if skip is None else skip)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def forward(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor,
    alpha: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``h`` and every step's cell ``c``, ``(L, B, D, H)`` each, and the cell after every direction's last step
    ``(B, D, H)`` (a tensor of its own), from contiguous operands of one dtype."""
    lib = KERNEL.library()
    assert lib is not None
    L, B, D, _, H = U.shape
    u, f, r, xs = split_streams(U, skip)
    h = torch.empty((L, B, D, H), dtype=U.dtype)
    c_all = torch.empty_like(h)
    c_last = torch.empty((B, D, H), dtype=U.dtype)
    fn = lib.sru_forward_f64 if U.dtype == torch.float64 else lib.sru_forward_f32
    fn(
        u.data_ptr(), f.data_ptr(), r.data_ptr(), *u.stride()[:3], xs.data_ptr(), *xs.stride()[:3],
        v_f.data_ptr(), v_r.data_ptr(), b_f.data_ptr(), b_r.data_ptr(), c0.data_ptr(), float(alpha),
        L, B, D, H, kernel_threads(h.numel()), h.data_ptr(), c_all.data_ptr(), c_last.data_ptr(),
    )  # fmt: skip
    return h, c_all, c_last


def backward(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
    alpha: float, c_all: Tensor, grad_h: Tensor, grad_c_last: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``U, skip, v_f, v_r, b_f, b_r, c0`` from those of :func:`forward`'s ``h`` and of the last
    cell (``None``: zero), given its inputs and every step's cell ``c_all``. Each is a tensor of its own (the kernel
    sums the parameters' gradients over the batch)."""
    lib = KERNEL.library()
    assert lib is not None
    L, B, D, _, H = U.shape
    u, f, r, xs = split_streams(U, skip)
    grad_U = torch.empty_like(U)
    gu, gf, gr, _ = split_streams(grad_U, skip)
    grad_skip = None if skip is None else torch.empty_like(skip)
    gxs = grad_U[:, :, :, 3] if skip is None else grad_skip
    g_vf, g_vr, g_bf, g_br = (torch.empty((D, H), dtype=U.dtype) for _ in range(4))
    grad_c0 = torch.empty((B, D, H), dtype=U.dtype)
    fn = lib.sru_backward_f64 if U.dtype == torch.float64 else lib.sru_backward_f32
    fn(
        u.data_ptr(), f.data_ptr(), r.data_ptr(), *u.stride()[:3], xs.data_ptr(), *xs.stride()[:3],
        v_f.data_ptr(), v_r.data_ptr(), b_f.data_ptr(), b_r.data_ptr(), c0.data_ptr(), float(alpha),
        L, B, D, H, kernel_threads(c_all.numel()), c_all.data_ptr(), grad_h.data_ptr(), _ptr(grad_c_last),
        gu.data_ptr(), gf.data_ptr(), gr.data_ptr(), gxs.data_ptr(), *gxs.stride()[:3],
        g_vf.data_ptr(), g_vr.data_ptr(), g_bf.data_ptr(), g_br.data_ptr(), grad_c0.data_ptr(),
    )  # fmt: skip
    return grad_U, grad_skip, g_vf, g_vr, g_bf, g_br, grad_c0
