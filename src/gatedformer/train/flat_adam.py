"""Adam and AdamW over flat buffers: one fused update per parameter group instead of one per tensor.

PyTorch's fused Adam still visits every parameter tensor: a 12-layer model of width 48 has 171 of them, most a
few hundred floats, and at that size the update, its step counters, ``zero_grad`` and gradient clipping cost
several milliseconds a step in per-tensor overhead, more than the arithmetic. :class:`FlatAdam` keeps each
parameter group's weights, moments and gradients in one contiguous buffer (the parameters become views into
it), so the update is one call of the same fused kernel, clipping is one norm, and the step counters are one
tensor.

The arithmetic is PyTorch's own (``torch._fused_adam_`` and ``torch._fused_adamw_``), and the state keeps
PyTorch's per-parameter layout (``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts load both ways between
:class:`FlatAdam` and ``torch.optim.Adam``/``AdamW``. A parameter without a gradient is skipped as PyTorch
skips it: that step takes the per-tensor path, and the flat one resumes when the step counters agree again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["FLAT_DTYPES", "FlatAdam", "flat_eligible"]

FLAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
"""The dtypes PyTorch's fused Adam kernels take."""
_ALIGN = 16


def flat_eligible(params: Iterable[Tensor]) -> bool:
    """Whether ``params`` can share one flat buffer: dense, one dtype the fused kernels take, one CPU or CUDA
    device."""
    params = list(params)
    if not params:
        return True
    first = params[0]
    return all(p.layout == torch.strided and p.dtype == first.dtype and p.device == first.device for p in params) and (
        first.dtype in FLAT_DTYPES and first.device.type in ("cpu", "cuda"))


@dataclass
class _Flat:
    """One group's buffers and the parameters' views into them."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    steps: Tensor
    """Each parameter's step count (its state's ``step`` is a view of one entry)."""
    grad_views: list[Tensor]
    addresses: list[int]
    """Where each parameter's data was put: a parameter moved since (``model.to``) is flattened again."""
    uniform: bool
    """Whether every parameter has taken the same number of steps (else the per-tensor path runs)."""


class FlatAdam(torch.optim.Optimizer):
    r"""Adam (Kingma and Ba, 2015) or, with ``decoupled_weight_decay=True``, AdamW (Loshchilov and Hutter, 2019),
    updating each parameter group as one flat tensor.

    .. math::

        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
        \theta_t = \theta_{t-1} - \eta \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}

    with ``g`` plus ``weight_decay · θ`` for Adam, or ``θ`` first scaled by ``1 - η · weight_decay`` for AdamW.

    Building it moves each group's parameters into one buffer (they stay the same ``Parameter`` objects, now views);
    a group must hold dense tensors of one dtype that PyTorch's fused kernels take, on one CPU or CUDA device
    (:func:`flat_eligible`). :meth:`clip_grad_norm_` clips the gradients on the flat buffers.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = False) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "decoupled_weight_decay": decoupled_weight_decay}
        self._flats: list[_Flat | None] = []
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if any(p.is_sparse or not p.requires_grad for p in group["params"]) or not flat_eligible(group["params"]):
            self.param_groups.pop()
            raise ValueError("FlatAdam takes dense parameters that require gradients, of one float dtype on one CPU or "
                             "CUDA device per group; use torch.optim.Adam for others")
        self._flats.append(None)
        with torch.no_grad():
            self._flatten(len(self.param_groups) - 1)

    @torch.no_grad()
    def _flatten(self, index: int) -> _Flat | None:
        """Move group ``index``'s parameters and state into fresh flat buffers, keeping their values."""
        params = self.param_groups[index]["params"]
        if not params:
            return None
        like = params[0]
        # Each tensor starts on a 64-byte boundary, as one allocated on its own would: the gaps stay zero.
        offsets, end = [], 0
        for p in params:
            offsets.append(end)
            end += -(-p.numel() // _ALIGN) * _ALIGN
        flat_param, exp_avg, exp_avg_sq, grad = (torch.zeros(end, dtype=like.dtype, device=like.device)
                                                 for _ in range(4))
        steps = torch.zeros(len(params), dtype=torch.float32, device=like.device)

        def views(buffer: Tensor) -> list[Tensor]:
            return [buffer[o : o + p.numel()].view_as(p) for o, p in zip(offsets, params, strict=True)]

        param_views, grad_views = views(flat_param), views(grad)
        torch._foreach_copy_(param_views, [p.detach() for p in params])
        for j, (p, m, v, g) in enumerate(zip(params, views(exp_avg), views(exp_avg_sq), grad_views, strict=True)):
            state = self.state.get(p)
            if state and "exp_avg" in state:  # loaded or already stepped: carry it over
                m.copy_(state["exp_avg"])
                v.copy_(state["exp_avg_sq"])
                steps[j] = float(state["step"])
            self.state[p] = {"step": steps[j], "exp_avg": m, "exp_avg_sq": v}
            if p.grad is not None:  # keep a gradient already there, now in the flat buffer
                g.copy_(p.grad)
            p.data = param_views[j]
            if p.grad is not None:
                p.grad = g
        flat = _Flat(flat_param, grad, exp_avg, exp_avg_sq, steps, grad_views, [p.data_ptr() for p in params],
                     bool((steps == steps[0]).all()))
        self._flats[index] = flat
        return flat

    def _current(self, index: int) -> _Flat | None:
        flat = self._flats[index]
        params = self.param_groups[index]["params"]
        if flat is None or [p.data_ptr() for p in params] != flat.addresses:
            return self._flatten(index)
        return flat

    @staticmethod
    def _gather(flat: _Flat, params: list[Tensor]) -> bool:
        """Put the group's gradients in its flat buffer (the parameters' ``.grad`` become views of it); ``False``
        if some parameter has none."""
        grads = [p.grad for p in params]
        if all(g is view for g, view in zip(grads, flat.grad_views, strict=True)):
            return True  # already there (accumulated in place, or gathered by clip_grad_norm_)
        if any(g is None for g in grads):
            return False
        torch._foreach_copy_(flat.grad_views, grads)
        for p, view in zip(params, flat.grad_views, strict=True):
            p.grad = view
        return True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimiser's parameters: scales every gradient by
        ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is their global L2 norm, which it returns."""
        flats = [self._current(i) for i in range(len(self.param_groups))]
        pairs = [(flat, group["params"]) for flat, group in zip(flats, self.param_groups, strict=True) if flat]
        if not all(self._gather(flat, params) for flat, params in pairs):
            return torch.nn.utils.clip_grad_norm_([p for _, params in pairs for p in params], max_norm)
        if not pairs:
            return torch.zeros(())
        norms = [flat.grad.norm() for flat, _ in pairs]
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for flat, _ in pairs:
            flat.grad.mul_(scale.to(flat.grad.dtype))
        return total

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        for index, group in enumerate(self.param_groups):
            flat = self._flats[index]
            params = group["params"]
            if set_to_none:
                for p in params:
                    p.grad = None
            elif flat is not None and all(p.grad is view for p, view in zip(params, flat.grad_views, strict=True)):
                flat.grad.zero_()
            else:
                for p in params:
                    if p.grad is not None:
                        p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            flat = self._current(index)
            if flat is not None:
                self._update(group, flat)
        return loss

    def _update(self, group: dict[str, Any], flat: _Flat) -> None:
        beta1, beta2 = group["betas"]
        update = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        options = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"],
                   "eps": group["eps"], "amsgrad": False, "maximize": False}
        params = group["params"]
        if flat.uniform and self._gather(flat, params):
            flat.steps.add_(1)
            update([flat.param], [flat.grad], [flat.exp_avg], [flat.exp_avg_sq], [], [flat.steps[:1]], **options)
            return
        # Some parameter has no gradient (PyTorch skips it), or the counts differ since one had none: per tensor.
        taken = [j for j, p in enumerate(params) if p.grad is not None]
        if not taken:
            return
        state = [self.state[params[j]] for j in taken]
        steps = [s["step"] for s in state]
        torch._foreach_add_(steps, 1.0)
        update([params[j] for j in taken], [params[j].grad for j in taken], [s["exp_avg"] for s in state],
               [s["exp_avg_sq"] for s in state], [], steps, **options)
        flat.uniform = bool((flat.steps == flat.steps[0]).all())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.Adam``/``AdamW`` (the same per-parameter layout)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        with torch.no_grad():
            for index in range(len(self.param_groups)):
                self._flatten(index)
