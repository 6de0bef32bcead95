"""Highway gate from the Highway Transformer."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._transform_gate import TransformGate


class HighwayGate(TransformGate):
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

    def forward(self, x: Tensor) -> Tensor:
        return self._mix(x, x)
