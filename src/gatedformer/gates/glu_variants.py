"""The GLU-variant feed-forwards of Shazeer, "GLU Variants Improve Transformer", 2020."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ._checks import check_size


def glu_hidden(d_ffn: int) -> int:
    """The hidden width of a GLU variant standing in for a feed-forward of ``d_ffn``: ``round(2/3 · d_ffn)``, so that
    its three ``d × hidden`` matrices hold about the two ``d × d_ffn`` of the ReLU feed-forward (the paper's
    parameter match)."""
    return max(1, round(2 * d_ffn / 3))


class GLUVariantFeedForward(nn.Module):
    r"""A feed-forward whose hidden layer is a gated linear unit.

    .. math::

        \mathrm{FFN}_{act}(x) = \big(act(x W) \odot x V\big)\, W_2, \qquad
        W, V \in \mathbb{R}^{d \times h},\ W_2 \in \mathbb{R}^{h \times d}

    From Shazeer, "GLU Variants Improve Transformer", 2020: GLU (``act`` the sigmoid), Bilinear (none), ReGLU
    (ReLU), GEGLU (GELU) and SwiGLU (Swish with β = 1, i.e. SiLU), each a subclass. As in the paper there are no
    biases, and the hidden width is ``h = 2/3 · d_ffn`` (:func:`glu_hidden`) so the ``3 d h`` parameters match the
    ``2 d d_ffn`` of the ReLU feed-forward it replaces. Dropout, where the model has it, falls on the gated hidden
    layer, as the ReLU feed-forward's falls on its hidden layer.

    A spec places them (``+SwiGLU``, ``+GEGLU L1-2``), not ``model.ffn``: so they are variants of one comparison
    beside the other gates, combine with them (``+SwiGLU+SDPA gate``) and may go on some layers only; on a sublayer
    the unit is the body, in place of the ReLU or GELU feed-forward the model built (role ``body`` in
    :mod:`gatedformer.gates.kinds`).

    ``W`` and ``V`` are one projection ``inner`` ``(d -> 2h)``, ``W`` its first half; ``outer`` is ``W_2``. Like
    :class:`~gatedformer.nn.sublayer.FeedForward` it offers ``features`` (everything before ``W_2``) and
    ``output_projection``. Works on tensors of shape ``(..., d_model)``.
    """

    kind: ClassVar[str]
    act: ClassVar[Callable[[Tensor], Tensor]]

    def __init__(self, d_model: int, d_ffn: int | None = None, dropout: float = 0.0, hidden: int | None = None) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.d_ffn = check_size("d_ffn", 4 * d_model if d_ffn is None else d_ffn)
        self.hidden = check_size("hidden", glu_hidden(self.d_ffn) if hidden is None else hidden)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.inner = nn.Linear(d_model, 2 * self.hidden, bias=False)
        self.outer = nn.Linear(self.hidden, d_model, bias=False)
        self.dropout = nn.Dropout(float(dropout))

    @property
    def output_projection(self) -> nn.Linear:
        return self.outer

    def features(self, x: Tensor) -> Tensor:
        """``Dropout(act(x W) ⊙ x V)``."""
        gate, value = self.inner(x).chunk(2, dim=-1)
        return self.dropout(self.act(gate) * value)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.features(x))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, hidden={self.hidden}"


def _identity(x: Tensor) -> Tensor:
    return x


class FFNGLU(GLUVariantFeedForward):
    """``(σ(xW) ⊙ xV) W_2``: Shazeer's FFN_GLU (the GLU of Dauphin et al. 2017 in the feed-forward, at 2/3 the
    width; :class:`~gatedformer.gates.GLUFeedForward`, ``model.ffn=glu``, is the full-width form with biases)."""

    kind = "ffn_glu"
    act = staticmethod(torch.sigmoid)


class FFNBilinear(GLUVariantFeedForward):
    """``(xW ⊙ xV) W_2``: Shazeer's FFN_Bilinear (no activation)."""

    kind = "ffn_bilinear"
    act = staticmethod(_identity)


class FFNReGLU(GLUVariantFeedForward):
    """``(ReLU(xW) ⊙ xV) W_2``: Shazeer's FFN_ReGLU."""

    kind = "ffn_reglu"
    act = staticmethod(F.relu)


class FFNGEGLU(GLUVariantFeedForward):
    """``(GELU(xW) ⊙ xV) W_2``: Shazeer's FFN_GEGLU (the exact, erf GELU)."""

    kind = "ffn_geglu"
    act = staticmethod(F.gelu)


class FFNSwiGLU(GLUVariantFeedForward):
    """``(Swish_1(xW) ⊙ xV) W_2``, ``Swish_1(z) = z σ(z)``: Shazeer's FFN_SwiGLU."""

    kind = "ffn_swiglu"
    act = staticmethod(F.silu)
