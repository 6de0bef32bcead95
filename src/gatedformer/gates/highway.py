"""Highway gate from the Highway Transformer."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size


class HighwayGate(nn.Module):
    r"""Highway gate.

    .. math::

        T(X) = \sigma(X W_1 + b_1), \qquad f(X) = X W_2 + b_2, \qquad
        o = (1 - T(X)) \odot X + T(X) \odot f(X)

    From Chai et al., "Highway Transformer: Self-Gating Enhanced Self-Attentive Networks",
    ACL 2020 (the highway variant of the self-gating unit).

    ``T`` and ``f`` come out of one ``Linear(d, 2d)`` (first half: gate, second half: transform),
    so the unit adds ``2 * d * (d + 1)`` parameters. Biases start at zero, so the carry and
    transform paths start evenly weighted on average.

    Works on tensors of shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "highway"

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.proj = nn.Linear(d_model, 2 * d_model)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        pre_gate, transformed = self.proj(x).chunk(2, dim=-1)
        t = torch.sigmoid(pre_gate)
        # lerp needs one dtype; under autocast x (the residual stream) may be float32 and the projection bf16.
        dtype = torch.promote_types(x.dtype, transformed.dtype)
        # x + t * (f - x) is algebraically (1 - t) x + t f with one fewer elementwise op.
        return torch.lerp(x.to(dtype), transformed.to(dtype), t.to(dtype))

    def gate_activation(self, x: Tensor) -> Tensor:
        """``T(X) = sigmoid(X W1 + b1)``; computes only the gate half of the projection."""
        d = self.d_model
        return torch.sigmoid(nn.functional.linear(x, self.proj.weight[:d], self.proj.bias[:d]))

    @property
    def gate_bias(self) -> Tensor:
        """``b1``: a detached view that shares storage with the fused bias parameter."""
        return self.proj.bias.detach()[: self.d_model]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
