"""The gated residual sublayer shared by every Transformer-style backbone.

A Transformer layer is two sublayers, attention then feed-forward. Each is one :class:`Sublayer`:
a body (the attention, the FFN, or a recurrent unit) wrapped in its residual connection, its
LayerNorm and whatever gates the placement spec puts there. With post-LN (the papers' form):

* no gate:        ``Y = LN(X + F(X))``
* SDU branch:     ``Y = LN(X + F(X) + SDU(X))``                          (Highway Transformer)
* highway gate:   ``Y = LN(o(X) + F(X))``, ``o = (1-T)⊙X + T⊙f(X)``
* gated MHDPA:    ``Y = LN(o + X)``, ``o = (1-T(X))⊙F(X) + T(X)⊙f(X)``
* EAU:            ``F(X) ← EAU(F(X))`` on attention outputs                (Dhayalkar 2024)
* GRC:            ``X + S ← X + σ(Wg X + bg)⊙S`` for the residual sum

With pre-LN the body and the gates read ``LN(X)`` while the residual stream stays ``X``.
Sublayers that carry no gate hold no gate parameters.
"""

from __future__ import annotations

from torch import Tensor, nn

from gatedformer.backbones.dropout import Dropout
from gatedformer.backbones.fused_linear import linear_dropout_add, linear_dropout_add_norm, linear_relu_dropout
from gatedformer.backbones.placement import SublayerGates
from gatedformer.gates import EAU, SDU, GatedMHDPA, GatedResidual, GLUFeedForward, HighwayGate


class FeedForward(nn.Module):
    """Position-wise ``W2 · Dropout(ReLU(W1 x + b1)) + b2``.

    Like every sublayer body that ends in a linear layer, it offers ``features(x)`` (everything before that
    layer) and ``output_projection`` (the layer), so that :class:`Sublayer` can fuse the layer with its
    dropout and residual add (:mod:`gatedformer.backbones.fused_linear`).
    """

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.inner = nn.Linear(d_model, d_ffn)
        self.outer = nn.Linear(d_ffn, d_model)
        self.dropout = Dropout(dropout)

    @property
    def output_projection(self) -> nn.Linear:
        return self.outer

    def features(self, x: Tensor) -> Tensor:
        return linear_relu_dropout(x, self.inner, self.dropout.p, self.training)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.features(x))


def make_ffn(kind: str, d_model: int, d_ffn: int, dropout: float) -> nn.Module:
    if kind == "glu":
        return GLUFeedForward(d_model, d_ffn, dropout)
    return FeedForward(d_model, d_ffn, dropout)


class Sublayer(nn.Module):
    """A body in its residual connection, with LayerNorm and the gates a placement gives it."""

    def __init__(self, body: nn.Module, d_model: int, gates: SublayerGates, dropout: float = 0.0,
                 norm: str = "post") -> None:
        super().__init__()
        self.body = body
        self.pre_norm = norm == "pre"
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        # Only the gates the placement names exist, so an ungated sublayer has no gate parameters.
        self.sdu = SDU(d_model, gates.fn) if gates.unit == "sdu" else None
        self.highway = HighwayGate(d_model) if gates.unit == "highway" else None
        self.gated_mix = GatedMHDPA(d_model) if gates.unit == "gated_mhdpa" else None
        self.eau = EAU(d_model) if gates.eau else None
        self.residual_gate = GatedResidual(d_model) if gates.grc else None
        # With no gate between the body's last linear layer and the residual add, the two can be one pass.
        self.fuse_output = gates.empty and hasattr(body, "features") and hasattr(body, "output_projection")

    def forward(self, x: Tensor, *body_args: object) -> Tensor:
        h = self.norm(x) if self.pre_norm else x
        if self.fuse_output:  # x + dropout(W f(h) + b), then the LayerNorm with post-LN
            features = self.body.features(h, *body_args)
            if self.pre_norm:
                return linear_dropout_add(x, features, self.body.output_projection, self.dropout.p, self.training)
            return linear_dropout_add_norm(x, features, self.body.output_projection, self.dropout.p, self.norm,
                                           self.training)
        s = self.body(h, *body_args)
        if self.eau is not None:
            s = self.eau(s)
        if self.sdu is not None:
            s = self.sdu(h, add_to=s)  # s + SDU(h), the add fused into the SDU's product
        if self.gated_mix is not None:
            s = self.gated_mix(h, s)
        stream = self.highway(x) if self.highway is not None else x
        if self.residual_gate is not None:
            y = self.residual_gate(stream, self.dropout(s))
        else:
            y = self.dropout.add_to(stream, s)  # stream + dropout(s) in one pass
        return y if self.pre_norm else self.norm(y)
