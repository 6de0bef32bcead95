"""Highway-gated combination of a sublayer's input and its attention output."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._transform_gate import TransformGate


class GatedMHDPA(TransformGate):
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

    def forward(self, x: Tensor, att: Tensor) -> Tensor:
        return self._mix(att, x)
