"""The element-wise SRU recurrence: a fast path (compiled, Triton or PyTorch loops) and a pure-PyTorch reference.

Everything an SRU layer computes with matrices happens before this module is called, in one matrix
product over all time steps. What is left is the element-wise recurrence

.. math::

    f_t &= \\sigma(\\tilde f_t + v_f \\odot c_{t-1} + b_f) \\\\
    r_t &= \\sigma(\\tilde r_t + v_r \\odot c_{t-1} + b_r) \\\\
    c_t &= f_t \\odot c_{t-1} + (1 - f_t) \\odot \\tilde x_t \\\\
    h_t &= r_t \\odot c_t + (1 - r_t) \\odot \\alpha\\, s_t

with :math:`\\tilde x_t = W x_t`, :math:`\\tilde f_t = W_f x_t`, :math:`\\tilde r_t = W_r x_t` and
:math:`s_t` the skip input (``x_t`` itself, or :math:`W_s x_t`). Every (batch, direction, unit)
column is an independent scalar recurrence, so the cost is a few flops per element and per step: the
time loop must not run in Python.

:func:`sru_recurrence` runs it as a :class:`torch.autograd.Function` with a hand-written backward
(back-propagation through time over the element-wise recurrence). On the CPU its loops run in a small C++
library, ``csrc/sru.cpp`` (:mod:`gatedformer.kernels.sru`), built on first use and never at import (see
:mod:`gatedformer.kernels.build`). The batch rows are split between ``torch.get_num_threads()``
threads. If no compiler is found or the build fails, a warning is given once and the same forward and
backward run as vectorised PyTorch loops over time (slower, same results). The environment variable
``GATEDFORMER_SRU_BACKEND`` picks ``native``, ``torch`` or ``auto`` (the default).

On a CUDA GPU the same recurrence runs as two Triton kernels (:mod:`gatedformer.kernels.triton.sru`),
one launch for the forward pass and one for the backward; without Triton, and on other devices, it
runs as the PyTorch loops. Half-precision inputs are computed in float32
and cast back; float64 inputs are computed in float64 (for ``gradcheck``).

:func:`sru_recurrence_reference` is a plain PyTorch implementation differentiated by autograd; it is
the oracle the tests check the fast path against.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from gatedformer.kernels import sru as _sru_kernel
from gatedformer.kernels.build import BACKENDS
from gatedformer.kernels.sru import split_streams
from gatedformer.kernels.triton import sru as _sru_triton
from gatedformer.ops.operators import FunctionOperator, call

__all__ = ["kernel_backend", "sru_recurrence", "sru_recurrence_reference"]


def kernel_backend(device: torch.device | str = "cpu") -> str:
    """Which implementation :func:`sru_recurrence` uses on ``device``: ``"native"`` (the C++ kernel, on
    the CPU), ``"triton"`` (the Triton kernels, on a GPU) or ``"torch"``.

    Building the native kernel, if that has not happened yet, happens here.
    """
    return _pick_backend(torch.device(device))


_warned_no_triton = False


def _pick_backend(device: torch.device, backend: str | None = None) -> str:
    if device.type == "cpu":
        return _sru_kernel.KERNEL.pick_backend(device, backend)
    requested = backend or _sru_kernel.KERNEL.requested_backend()
    if requested not in BACKENDS:
        raise ValueError(f"backend must be auto, native or torch, got {requested!r}")
    if requested == "torch" or device.type != "cuda":
        return "torch"
    if _sru_triton.available():
        return "triton"
    if requested == "native":
        raise RuntimeError("the SRU recurrence on a GPU needs Triton (pip install triton); "
                           "or set GATEDFORMER_SRU_BACKEND=torch")
    global _warned_no_triton
    if not _warned_no_triton:
        _warned_no_triton = True
        warnings.warn("Triton is not installed, so the SRU recurrence runs on the GPU as PyTorch loops over time, "
                      "which are many times slower; pip install triton", stacklevel=3)
    return "torch"


# --------------------------------------------------------------------------------------------------
# Shapes used below: U (L, B, D, K, H) with K = 3 streams [x~, f~, r~] or K = 4 with the skip stream
# W_s x last; skip (L, B, D, H) when K = 3; v_f, v_r, b_f, b_r (D, H); c0 (B, D, H).


def _time_major_per_direction(t: Tensor) -> Tensor:
    """Reverse time for direction 1 of a (L, B, D, ...) tensor, so that every column runs t = 0, 1, ..."""
    if t.shape[2] == 1:
        return t
    return torch.stack((t[:, :, 0], t[:, :, 1].flip(0)), dim=2)


def _torch_forward(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor,
    alpha: float,
) -> tuple[Tensor, Tensor]:
    u, f, r, xs = (_time_major_per_direction(s) for s in split_streams(U, skip))
    f = f + b_f
    r = r + b_r
    hs, cs = [], []
    c = c0
    for t in range(U.shape[0]):
        ft = torch.sigmoid(torch.addcmul(f[t], v_f, c))
        rt = torch.sigmoid(torch.addcmul(r[t], v_r, c))
        c = torch.lerp(u[t], c, ft)
        ax = alpha * xs[t]
        hs.append(torch.lerp(ax, c, rt))
        cs.append(c)
    return _time_major_per_direction(torch.stack(hs)), _time_major_per_direction(torch.stack(cs))


def _torch_backward(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor,
    alpha: float, c_all: Tensor, grad_h: Tensor, grad_c_last: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    flip = _time_major_per_direction
    u, f, r, xs = (flip(s) for s in split_streams(U, skip))
    cs, gh = flip(c_all), flip(grad_h)
    f = f + b_f
    r = r + b_r
    L = U.shape[0]
    g_u, g_f, g_r, g_x = (torch.empty_like(cs) for _ in range(4))
    g_vf, g_vr, g_bf, g_br = (torch.zeros_like(c0) for _ in range(4))
    gc = torch.zeros_like(c0) if grad_c_last is None else grad_c_last.clone()
    for t in range(L - 1, -1, -1):
        c_prev = cs[t - 1] if t > 0 else c0
        ft = torch.sigmoid(torch.addcmul(f[t], v_f, c_prev))
        rt = torch.sigmoid(torch.addcmul(r[t], v_r, c_prev))
        g_c = torch.addcmul(gc, gh[t], rt)
        g_pr = gh[t] * (cs[t] - alpha * xs[t]) * rt * (1 - rt)
        g_pf = g_c * (c_prev - u[t]) * ft * (1 - ft)
        g_u[t] = g_c * (1 - ft)
        g_f[t] = g_pf
        g_r[t] = g_pr
        g_x[t] = gh[t] * (1 - rt) * alpha
        g_vf += g_pf * c_prev
        g_vr += g_pr * c_prev
        g_bf += g_pf
        g_br += g_pr
        gc = g_c * ft + g_pf * v_f + g_pr * v_r
    streams = [flip(g_u), flip(g_f), flip(g_r)]
    if skip is None:
        streams.append(flip(g_x))
    grad_U = torch.stack(streams, dim=3)
    grad_skip = None if skip is None else flip(g_x)
    return grad_U, grad_skip, g_vf.sum(0), g_vr.sum(0), g_bf.sum(0), g_br.sum(0), gc


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def _last_cell(c_all: Tensor) -> Tensor:
    """c after the last step of every direction: t = L - 1 forwards, t = 0 backwards. (B, D, H)."""
    if c_all.shape[2] == 1:
        return c_all[-1]
    return torch.stack((c_all[-1, :, 0], c_all[0, :, 1]), dim=1)


def _with_last_cell(forward):  # noqa: ANN001, ANN202
    """``forward``, returning the last cell beside ``h`` and ``c_all`` as the native kernel does."""

    def run(*args):  # noqa: ANN002, ANN202
        h, c_all = forward(*args)
        return h, c_all, _last_cell(c_all)

    return run


def _triton_forward(*args):  # noqa: ANN002, ANN202
    return _sru_triton.triton_forward(*args)


def _triton_backward(*args):  # noqa: ANN002, ANN202
    return _sru_triton.triton_backward(*args)


_FORWARD = {"native": _sru_kernel.forward, "torch": _with_last_cell(_torch_forward),
            "triton": _with_last_cell(_triton_forward)}
"""Each backend's forward pass: ``h``, every step's cell and the last cell."""
_BACKWARD = {"native": _sru_kernel.backward, "torch": _torch_backward, "triton": _triton_backward}


class _SRURecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, U, skip, v_f, v_r, b_f, b_r, c0, alpha, backend):  # type: ignore[override]
        if backend not in _FORWARD:  # "" or "auto": picked here, where the recurrence runs (see RECURRENCE)
            backend = _pick_backend(U.device, backend or None)
        dtype = _compute_dtype(U, skip, v_f, v_r, b_f, b_r, c0)
        args = [None if t is None else t.to(dtype).contiguous() for t in (U, skip, v_f, v_r, b_f, b_r, c0)]
        h, c_all, c_last = _FORWARD[backend](*args, alpha)
        ctx.save_for_backward(*args, c_all)
        ctx.alpha, ctx.backend = alpha, backend
        ctx.dtypes = [None if t is None else t.dtype for t in (U, skip, v_f, v_r, b_f, b_r, c0)]
        return h.to(U.dtype), c_last.to(U.dtype)

    @staticmethod
    def backward(ctx, grad_h, grad_c_last):  # type: ignore[override]
        U, skip, v_f, v_r, b_f, b_r, c0, c_all = ctx.saved_tensors
        dtype = c_all.dtype
        grad_h = torch.zeros_like(c_all) if grad_h is None else grad_h.to(dtype).contiguous()
        grad_c_last = None if grad_c_last is None else grad_c_last.to(dtype).contiguous()
        grads = _BACKWARD[ctx.backend](U, skip, v_f, v_r, b_f, b_r, c0, ctx.alpha, c_all, grad_h, grad_c_last)
        out = [
            None if g is None or not need else g.to(dt)
            for g, need, dt in zip(grads, ctx.needs_input_grad[:7], ctx.dtypes, strict=True)
        ]
        return (*out, None, None)


def _like_recurrence(U: Tensor, *_: object) -> list[Tensor]:
    L, B, D, _, H = U.shape
    return [U.new_empty((L, B, D, H)), U.new_empty((B, D, H))]


RECURRENCE = FunctionOperator(
    "sru_recurrence", _SRURecurrence,
    "Tensor U, Tensor? skip, Tensor v_f, Tensor v_r, Tensor b_f, Tensor b_r, Tensor c0, float alpha, str backend",
    _like_recurrence, tuple_output=True)
"""The recurrence as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`): dynamo can neither
trace into the kernels' Python (a ctypes call, the build's lock) nor should it split the graph around them. The
backend is picked where the operator runs (``""``: as ``$GATEDFORMER_SRU_BACKEND`` says)."""


def _check_shapes(
    U: Tensor, skip: Tensor | None, v_f: Tensor, v_r: Tensor, b_f: Tensor, b_r: Tensor, c0: Tensor | None
) -> Tensor:
    if U.dim() != 5 or U.shape[3] not in (3, 4):
        raise ValueError(f"U must have shape (L, B, D, 3 or 4, H), got {tuple(U.shape)}")
    L, B, D, K, H = U.shape
    # two tests, not `(K == 3) != (skip is not None)`: dynamo fails on that for a symbolic K
    if (skip is None and K == 3) or (skip is not None and K == 4):
        raise ValueError("pass skip (L, B, D, H) exactly when U has 3 streams; with 4 the last is the skip")
    if skip is not None and tuple(skip.shape) != (L, B, D, H):
        raise ValueError(f"skip must have shape {(L, B, D, H)}, got {tuple(skip.shape)}")
    for name, p in (("v_f", v_f), ("v_r", v_r), ("b_f", b_f), ("b_r", b_r)):
        if tuple(p.shape) != (D, H):
            raise ValueError(f"{name} must have shape {(D, H)}, got {tuple(p.shape)}")
    if c0 is None:
        return U.new_zeros((B, D, H))
    if tuple(c0.shape) != (B, D, H):
        raise ValueError(f"c0 must have shape {(B, D, H)}, got {tuple(c0.shape)}")
    return c0


def sru_recurrence(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor | None = None,
    alpha: float = 1.0,
    *,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the element-wise SRU recurrence over all time steps and directions.

    ``U`` is the fused input projection, shape ``(L, B, D, K, H)`` (``D`` directions of ``H`` units):
    streams ``[W x, W_f x, W_r x]`` and, when ``K == 4``, the projected skip ``W_s x``; when ``K == 3`` the
    skip input comes as ``skip`` of shape ``(L, B, D, H)``. ``v_f, v_r, b_f, b_r`` have shape ``(D, H)``
    and ``c0`` ``(B, D, H)`` (zeros if ``None``). Direction 1 runs backwards in time. ``alpha`` scales the
    skip input. ``backend`` overrides ``$GATEDFORMER_SRU_BACKEND`` (``auto``, ``native`` or ``torch``).

    Returns ``h`` of shape ``(L, B, D, H)`` and the last cell ``c`` of every direction, ``(B, D, H)``,
    both in the dtype of ``U``. Differentiable in every tensor argument.
    """
    c0 = _check_shapes(U, skip, v_f, v_r, b_f, b_r, c0)
    chosen = (backend or "") if torch.compiler.is_compiling() else _pick_backend(U.device, backend)
    return call(RECURRENCE, U, skip, v_f, v_r, b_f, b_r, c0, float(alpha), chosen)  # type: ignore[return-value]


def sru_recurrence_reference(
    U: Tensor,
    skip: Tensor | None,
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor | None = None,
    alpha: float = 1.0,
    cells: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain PyTorch version of :func:`sru_recurrence` (same arguments and results), one step at a time
    and differentiated by autograd. Slow; it is the oracle that the fast path is tested against. Given a list as
    ``cells``, it also receives the cell state of every step, ``(L, B, D, H)`` (e.g. to measure its variance)."""
    c0 = _check_shapes(U, skip, v_f, v_r, b_f, b_r, c0)
    L, _, D, _, _ = U.shape
    x_tilde, f_tilde, r_tilde, s = split_streams(U, skip)
    h_dirs, c_dirs, c_alls = [], [], []
    for d in range(D):
        c = c0[:, d]
        hs: list[Tensor] = [U.new_empty(0)] * L
        cs: list[Tensor] = [U.new_empty(0)] * L
        for t in range(L) if d == 0 else range(L - 1, -1, -1):
            f = torch.sigmoid(f_tilde[t, :, d] + v_f[d] * c + b_f[d])
            r = torch.sigmoid(r_tilde[t, :, d] + v_r[d] * c + b_r[d])
            c = f * c + (1 - f) * x_tilde[t, :, d]
            hs[t], cs[t] = r * c + (1 - r) * s[t, :, d] * alpha, c
        h_dirs.append(torch.stack(hs))
        c_dirs.append(c)
        c_alls.append(torch.stack(cs))
    if cells is not None:
        cells.append(torch.stack(c_alls, dim=2))
    return torch.stack(h_dirs, dim=2), torch.stack(c_dirs, dim=1)
