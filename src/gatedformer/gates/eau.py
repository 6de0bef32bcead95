"""Evaluator Adjuster Unit."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size
from ._product import add_product


class EAU(nn.Module):
    r"""Evaluator Adjuster Unit.

    .. math::

        h = \mathrm{ReLU}(W_1 x + b_1), \quad
        e = \sigma(W_2 h + b_2), \quad
        a = \tanh(W_3 x + b_3), \quad
        y = x + a \odot e

    with :math:`W_1: d \to \lfloor d/2 \rfloor`, :math:`W_2: \lfloor d/2 \rfloor \to d`,
    :math:`W_3: d \to d`. From Dhayalkar, "Evaluator Adjuster Unit and Gated Residual
    Connections", 2024. The evaluator ``e`` scores each feature, the adjuster ``a`` proposes a
    bounded correction, and only the correction the evaluator lets through is added to ``x``.

    With ``k = d // 2`` it has ``d*k + k + k*d + d + d*d + d`` parameters. Biases start at zero.
    Works on tensors of shape ``(..., d_model)``; needs ``d_model >= 2`` so the bottleneck is
    not empty.
    """

    kind: ClassVar[str] = "eau"

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model, 2)
        self.d_hidden = d_model // 2
        self.evaluator_in = nn.Linear(d_model, self.d_hidden)
        self.evaluator_out = nn.Linear(self.d_hidden, d_model)
        self.adjuster = nn.Linear(d_model, d_model)
        for layer in (self.evaluator_in, self.evaluator_out, self.adjuster):
            nn.init.zeros_(layer.bias)

    def gate_activation(self, x: Tensor) -> Tensor:
        """The evaluator output ``e = sigmoid(W2 ReLU(W1 x + b1) + b2)``."""
        return torch.sigmoid(self.evaluator_out(torch.relu(self.evaluator_in(x))))

    def forward(self, x: Tensor) -> Tensor:
        return add_product(x, torch.tanh(self.adjuster(x)), self.gate_activation(x))  # x + a ⊙ e

    @property
    def gate_bias(self) -> Tensor:
        """``b2``, the bias inside the evaluator's sigmoid, detached but sharing storage."""
        return self.evaluator_out.bias.detach()

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_hidden={self.d_hidden}"
