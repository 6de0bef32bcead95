"""Highway-gated combination of a sublayer's input and its attention output."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size


class GatedMHDPA(nn.Module):
    r"""Gated multi-head dot-product attention output.

    .. math::

        T(X) = \sigma(X W_1 + b_1), \qquad f(X) = X W_2 + b_2, \qquad
        o = (1 - T(X)) \odot \mathrm{Att} + T(X) \odot f(X)

    From Chai et al., "Highway Transformer: Self-Gating Enhanced Self-Attentive Networks",
    ACL 2020. ``X`` is the sublayer input and ``Att`` the attention (or feed-forward) output
    computed from it; the gate decides per feature how much of ``Att`` to replace by a linear
    map of the input itself.

    ``T`` and ``f`` come out of one ``Linear(d, 2d)`` (first half: gate, second half: transform),
    so the unit adds ``2 * d * (d + 1)`` parameters. Biases start at zero.

    Call as ``gated(x, att)`` with both of shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "gated_mhdpa"

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.proj = nn.Linear(d_model, 2 * d_model)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor, att: Tensor) -> Tensor:
        pre_gate, transformed = self.proj(x).chunk(2, dim=-1)
        t = torch.sigmoid(pre_gate)
        # lerp needs one dtype; under autocast the body's output and the projection may differ.
        dtype = torch.promote_types(att.dtype, transformed.dtype)
        # att + t * (f - att) == (1 - t) att + t f.
        return torch.lerp(att.to(dtype), transformed.to(dtype), t.to(dtype))

    def gate_activation(self, x: Tensor) -> Tensor:
        """``T(X) = sigmoid(X W1 + b1)`` for sublayer input ``x``."""
        d = self.d_model
        return torch.sigmoid(nn.functional.linear(x, self.proj.weight[:d], self.proj.bias[:d]))

    @property
    def gate_bias(self) -> Tensor:
        """``b1``: a detached view that shares storage with the fused bias parameter."""
        return self.proj.bias.detach()[: self.d_model]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
