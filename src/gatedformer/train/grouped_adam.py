"""Adam and AdamW with one fused kernel call and one step counter per parameter group.

PyTorch's fused Adam still does Python work for every parameter tensor each step: it gathers the tensors and
their state into lists, increments one step counter per tensor, and groups them by device and dtype. A 12-layer
model of width 48 has 171 parameter tensors, most a few hundred floats, and there that bookkeeping, ``zero_grad``
and gradient clipping cost more than the arithmetic. :class:`GroupedAdam`
keeps each group's tensor lists ready, counts the group's steps in one tensor, and hands the lists to the same
fused kernel in one call; :meth:`GroupedAdam.clip_grad_norm_` clips with two multi-tensor calls.

The arithmetic is PyTorch's own (``torch._fused_adam_`` and ``torch._fused_adamw_``), and the state keeps
PyTorch's per-parameter layout (``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts load both ways between
:class:`GroupedAdam` and ``torch.optim.Adam``/``AdamW``. A parameter without a gradient is skipped as PyTorch skips
it: that step updates the others one by one, and the shared counter resumes once every count agrees again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["FUSED_DTYPES", "GroupedAdam", "groupable"]

FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
"""The dtypes PyTorch's fused Adam kernels take."""


def groupable(params: Iterable[Tensor]) -> bool:
    """Whether ``params`` can be one group of :class:`GroupedAdam`: dense tensors of one dtype that the fused kernels
    take, on one CPU or CUDA device."""
    params = list(params)
    if not params:
        return True
    first = params[0]
    return all(p.layout == torch.strided and p.dtype == first.dtype and p.device == first.device for p in params) and (
        first.dtype in FUSED_DTYPES and first.device.type in ("cpu", "cuda"))


@dataclass
class _Lists:
    """One group's state, as the lists the fused kernel takes."""

    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: Tensor
    """Each parameter's step count; its state's ``step`` is a view of one entry."""
    shared_step: list[Tensor]
    """The first count once per parameter: what the kernel reads while every count is the same."""
    uniform: bool


class GroupedAdam(torch.optim.Optimizer):
    r"""Adam (Kingma and Ba, 2015) or, with ``decoupled_weight_decay=True``, AdamW (Loshchilov and Hutter, 2019),
    one fused kernel call per parameter group.

    .. math::

        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
        \theta_t = \theta_{t-1} - \eta \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}

    with ``g`` plus ``weight_decay · θ`` for Adam, or ``θ`` first scaled by ``1 - η · weight_decay`` for AdamW.

    Each group must hold dense tensors of one dtype that PyTorch's fused kernels take, on one CPU or CUDA device
    (:func:`groupable`). :meth:`clip_grad_norm_` clips the gradients of every group at once.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = False) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "decoupled_weight_decay": decoupled_weight_decay}
        self._lists: list[_Lists | None] = []
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if any(p.is_sparse or not p.requires_grad for p in group["params"]) or not groupable(group["params"]):
            self.param_groups.pop()
            raise ValueError("GroupedAdam takes dense parameters that require gradients, of one float dtype on one CPU "
                             "or CUDA device per group; use torch.optim.Adam for others")
        self._lists.append(self._state_lists(group["params"]))

    @torch.no_grad()
    def _state_lists(self, params: list[Tensor]) -> _Lists | None:
        """The group's state as lists, starting it (zero moments, no steps) where a parameter has none, and moving
        each step count into one tensor."""
        if not params:
            return None
        steps = torch.zeros(len(params), dtype=torch.float32, device=params[0].device)
        for j, p in enumerate(params):
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                steps[j] = float(state["step"])
            state["step"] = steps[j]
        first = steps[0]
        return _Lists([self.state[p]["exp_avg"] for p in params], [self.state[p]["exp_avg_sq"] for p in params], steps,
                      [first] * len(params), bool((steps == first).all()))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimiser's parameters: scales every gradient by
        ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is their global L2 norm, which it returns."""
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        if not groupable(grads):  # groups of several dtypes or devices: PyTorch's own sorts them
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        norms = torch._foreach_norm(grads)
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(grads[0].dtype))
        return total

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, lists in zip(self.param_groups, self._lists, strict=True):
            if lists is not None:
                self._update(group, lists)
        return loss

    def _update(self, group: dict[str, Any], lists: _Lists) -> None:
        beta1, beta2 = group["betas"]
        update = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        options = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"],
                   "eps": group["eps"], "amsgrad": False, "maximize": False}
        params = group["params"]
        grads = [p.grad for p in params]
        if lists.uniform and all(g is not None for g in grads):
            lists.steps.add_(1)
            update(params, grads, lists.exp_avgs, lists.exp_avg_sqs, [], lists.shared_step, **options)
            return
        # Some parameter has no gradient (PyTorch skips it), or the counts differ since one had none: each its own.
        taken = [j for j, g in enumerate(grads) if g is not None]
        if not taken:
            return
        steps = [self.state[params[j]]["step"] for j in taken]
        torch._foreach_add_(steps, 1.0)
        update([params[j] for j in taken], [grads[j] for j in taken], [lists.exp_avgs[j] for j in taken],
               [lists.exp_avg_sqs[j] for j in taken], [], steps, **options)
        lists.uniform = bool((lists.steps == lists.steps[0]).all())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.Adam``/``AdamW`` (the same per-parameter layout)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._lists = [self._state_lists(group["params"]) for group in self.param_groups]
