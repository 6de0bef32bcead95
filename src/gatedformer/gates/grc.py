"""Gated Residual Connection."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size
from ._product import add_product


class GatedResidual(nn.Module):
    r"""Gated Residual Connection.

    .. math::

        g = \sigma(W_g r + b_g), \qquad y = r + g \odot s

    where ``r`` is the residual stream (the sublayer input) and ``s`` the sublayer output.
    From Dhayalkar, "Evaluator Adjuster Unit and Gated Residual Connections", 2024. The gate is
    a function of the residual stream, so the block decides how much of each feature of the
    sublayer's output to add from what it already carries.

    Adds ``d * (d + 1)`` parameters. The bias starts at zero. Call as ``grc(r, s)`` with both of
    shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "grc"

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.gate_proj = nn.Linear(d_model, d_model)
        nn.init.zeros_(self.gate_proj.bias)

    def gate_activation(self, x: Tensor) -> Tensor:
        """``g = sigmoid(Wg x + bg)`` with ``x`` as the residual stream."""
        return torch.sigmoid(self.gate_proj(x))

    def forward(self, r: Tensor, s: Tensor) -> Tensor:
        return add_product(r, self.gate_activation(r), s)  # r + g ⊙ s

    @property
    def gate_bias(self) -> Tensor:
        """``bg``, detached but sharing storage with the parameter."""
        return self.gate_proj.bias.detach()

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
