"""The element-wise SRU recurrence on a GPU: two Triton kernels, one launch for the forward pass, one for the backward.

The same recurrence as the C++ kernel of :mod:`gatedformer.kernels.sru` (the equations are in
:mod:`gatedformer.ops.sru`). Every (batch, direction, unit) column is an independent scalar recurrence, so one Triton
program takes ``BLOCK`` columns and walks them through all time steps in registers: the forward pass
is one launch, and the backward pass (back-propagation through time) another, where a loop of
PyTorch operations would launch about ten kernels per step.

Triton compiles the kernels for the device on first use and caches them on disk; nothing is compiled
at import, and Triton itself is imported only when a kernel is first needed (:mod:`._triton`).

Layouts (all contiguous, as :class:`~gatedformer.ops.sru._SRURecurrence` passes them):
``U (L, B, D, K, H)``, the skip stream ``(L, B, D, H)`` or ``U[:, :, :, 3]``, ``v_f, v_r, b_f, b_r (D, H)``,
``c0 (B, D, H)``; outputs ``h`` and every step's cell ``(L, B, D, H)``. Direction 1 runs from the last
step to the first.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from gatedformer.kernels import triton as _triton
from gatedformer.kernels.triton import available

__all__ = ["available", "load_kernels", "triton_backward", "triton_forward"]

_KERNELS_MODULE = "gatedformer.kernels.triton.sru_kernels"

# Columns and warps per program, and the depth of the loop's software pipeline. The loop over time is bound
# by the latency of its loads: many small programs beat a few large ones (on an H100, 32 columns and one
# warp were 1.5x as fast as 128 and four), and loads four steps ahead another 2x (benchmarks/README.md).
_BLOCK = 32
_WARPS = 1
_STAGES = 4


def load_kernels(interpreted: bool = False) -> ModuleType:
    """The module of the two kernels (see :func:`gatedformer.kernels.triton.load_kernels`)."""
    return _triton.load_kernels(_KERNELS_MODULE, interpreted)


def _kernels() -> ModuleType:
    return load_kernels()


def _grid(columns: int) -> tuple[int]:
    return ((columns + _BLOCK - 1) // _BLOCK,)


def _skip_stream(U: Tensor, skip: Tensor | None) -> Tensor:
    return U[:, :, :, 3] if skip is None else skip


def triton_forward(U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
                   alpha: float, kernels: ModuleType | None = None) -> tuple[Tensor, Tensor]:
    """``h`` and every step's cell ``c``, both ``(L, B, D, H)``."""
    kernels = kernels or _kernels()
    L, B, D, _, H = U.shape
    xs = _skip_stream(U, skip)
    h = torch.empty((L, B, D, H), dtype=U.dtype, device=U.device)
    c_all = torch.empty_like(h)
    if h.numel():
        kernels.sru_forward_kernel[_grid(B * D * H)](
            U, xs, v_f, v_r, b_f, b_r, c0, h, c_all, U.stride(0), U.stride(1), U.stride(2), U.stride(3),
            xs.stride(0), xs.stride(1), xs.stride(2), float(alpha), L, B, D, H,
            BLOCK=_BLOCK, STAGES=_STAGES, num_warps=_WARPS)
    return h, c_all


def triton_backward(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
    alpha: float, c_all: Tensor, grad_h: Tensor, grad_c_last: Tensor | None, kernels: ModuleType | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients of ``U``, ``skip``, ``v_f``, ``v_r``, ``b_f``, ``b_r`` and ``c0``."""
    kernels = kernels or _kernels()
    L, B, D, _, H = U.shape
    xs = _skip_stream(U, skip)
    grad_U = torch.empty_like(U)
    grad_skip = None if skip is None else torch.empty_like(skip)
    gxs = _skip_stream(grad_U, grad_skip)
    partial = torch.empty((4, B, D, H), dtype=U.dtype, device=U.device)
    grad_c0 = torch.empty((B, D, H), dtype=U.dtype, device=U.device)
    if grad_c0.numel():
        kernels.sru_backward_kernel[_grid(B * D * H)](
            U, xs, v_f, v_r, b_f, b_r, c0, c_all, grad_h, grad_c0 if grad_c_last is None else grad_c_last,
            grad_U, gxs, partial, grad_c0, U.stride(0), U.stride(1), U.stride(2), U.stride(3),
            xs.stride(0), xs.stride(1), xs.stride(2), gxs.stride(0), gxs.stride(1), gxs.stride(2), float(alpha),
            L, B, D, H, HAS_GRAD_C=grad_c_last is not None, BLOCK=_BLOCK, STAGES=_STAGES, num_warps=_WARPS)
    g_vf, g_vr, g_bf, g_br = partial.sum(dim=1).unbind(0)
    return grad_U, grad_skip, g_vf, g_vr, g_bf, g_br, grad_c0
