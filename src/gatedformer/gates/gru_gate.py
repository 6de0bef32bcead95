"""GRU-type gating of a residual connection (GTrXL)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size


class GRUGate(nn.Module):
    r"""GRU-type gating layer in place of a residual connection.

    .. math::

        r = \sigma(W_r y + U_r x), \quad z = \sigma(W_z y + U_z x - b_g), \quad
        \hat h = \tanh(W_g y + U_g (r \odot x)), \quad g(x, y) = (1 - z) \odot x + z \odot \hat h

    From Parisotto et al., "Stabilizing Transformers for Reinforcement Learning", 2019 (GTrXL), with ``x`` the
    residual stream and ``y = ReLU(S)``, ``S`` the sublayer's output: GTrXL feeds the gate the ReLU of the
    attention's or the MLP's output (its equations for ``Y`` and ``E``). ``b_g`` is a learned vector that starts
    at ``bias`` (2 in the paper's experiments), so ``z`` starts near ``σ(-2)``: the layer starts close to the
    identity ``g ≈ x``, which the paper credits for the stability. No other biases, as the paper writes it:
    ``6 d²`` weights and ``d`` for ``b_g``.

    The paper's other ingredient, the identity map reordering (LayerNorm on the sublayer's input only, none on the
    residual stream), is pre-LN: ``model.norm=pre``. ``W_r, W_z, W_g`` are one projection ``w`` of ``y``
    ``(d -> 3d)``, ``U_r, U_z`` one projection ``u`` of ``x`` ``(d -> 2d)``, each in that order. Call as
    ``gate(x, s)`` with both of shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "gru_gate"

    def __init__(self, d_model: int, bias: float = 2.0) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.w = nn.Linear(d_model, 3 * d_model, bias=False)
        self.u = nn.Linear(d_model, 2 * d_model, bias=False)
        self.u_g = nn.Linear(d_model, d_model, bias=False)
        self.b_g = nn.Parameter(torch.full((d_model,), float(bias)))

    def forward(self, x: Tensor, s: Tensor) -> Tensor:
        y = torch.relu(s)
        w_r, w_z, w_g = self.w(y).chunk(3, dim=-1)
        u_r, u_z = self.u(x).chunk(2, dim=-1)
        r = torch.sigmoid(w_r + u_r)
        z = torch.sigmoid(w_z + u_z - self.b_g)
        h = torch.tanh(w_g + self.u_g(r * x))
        return (1 - z) * x + z * h

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
