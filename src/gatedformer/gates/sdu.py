"""Self-Dependency Unit from the Highway Transformer."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size
from ._product import add_product

_GATE_FNS: dict[str, Callable[[Tensor], Tensor]] = {"sigmoid": torch.sigmoid, "tanh": torch.tanh}




class SDU(nn.Module):
    r"""Self-Dependency Unit.

    .. math::

        \mathrm{SDU}(X) = \Psi(X W_1 + b_1) \odot (X W_2 + b_2),
        \qquad W_1, W_2 \in \mathbb{R}^{d \times d}

    where :math:`\Psi` is the sigmoid or tanh. From Chai et al., "Highway Transformer:
    Self-Gating Enhanced Self-Attentive Networks", ACL 2020.

    Both projections come out of one ``Linear(d, 2d)``: the first half of its output is the gate
    pre-activation :math:`X W_1 + b_1`, the second half the value :math:`X W_2 + b_2`. Adds exactly
    ``2 * d * (d + 1)`` parameters. Biases start at zero, so the gate starts at :math:`\Psi(X W_1)`.

    Works on tensors of shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "sdu"
    gate_names: ClassVar[tuple[str, ...]] = tuple(_GATE_FNS)

    def __init__(self, d_model: int, gate: str = "sigmoid") -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        if gate not in _GATE_FNS:
            allowed = ", ".join(repr(name) for name in _GATE_FNS)
            raise ValueError(f"unknown SDU gate {gate!r}; allowed values are {allowed}")
        self.gate = gate
        self._psi = _GATE_FNS[gate]
        # One fused matmul instead of two: half the kernel launches for the same FLOPs.
        self.proj = nn.Linear(d_model, 2 * d_model)
        nn.init.zeros_(self.proj.bias)

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        pre_gate, value = self.proj(x).chunk(2, dim=-1)
        return pre_gate, value

    def forward(self, x: Tensor, add_to: Tensor | None = None) -> Tensor:
        """``SDU(x)``, or ``add_to + SDU(x)`` when ``add_to`` is given (one multiply-add without gradients)."""
        pre_gate, value = self._split(x)
        if add_to is None:
            return self._psi(pre_gate) * value
        return add_product(add_to, self._psi(pre_gate), value)

    def gate_activation(self, x: Tensor) -> Tensor:
        """``Psi(X W1 + b1)`` for input ``x``; computes only the gate half of the projection."""
        d = self.d_model
        return self._psi(nn.functional.linear(x, self.proj.weight[:d], self.proj.bias[:d]))

    @property
    def gate_bias(self) -> Tensor:
        """``b1``: a detached view that shares storage with the fused bias parameter."""
        return self.proj.bias.detach()[: self.d_model]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, gate={self.gate}"
