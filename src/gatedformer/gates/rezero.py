"""ReZero: a residual branch scaled by a learned scalar that starts at zero."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size


class ReZero(nn.Module):
    r"""ReZero residual connection.

    .. math::

        y = x + \alpha\, F(x), \qquad \alpha = 0 \text{ at initialisation}

    From Bachlechner et al., "ReZero is All You Need: Fast Convergence at Large Depth", 2020. ``x`` is the
    residual stream and ``F(x)`` the sublayer's output; ``α`` is one learned scalar per residual connection (here
    per sublayer; the authors' Transformer code shares one between a layer's two sublayers), so every sublayer
    starts as the identity. One parameter.

    The paper also drops the LayerNorm; gatedformer keeps the model's (``model.norm``): with ``model.norm=pre``
    the residual stream is exactly ReZero's ``x + α F(LN(x))`` (the LayerNorm only on the branch's input, and the
    identity at initialisation), with post-LN the sum is normalised, ``LN(x + α F(x))``. Call as ``rezero(x, s)``
    with ``s`` the sublayer's output.
    """

    kind: ClassVar[str] = "rezero"

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, s: Tensor) -> Tensor:
        return x + self.alpha * s

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
