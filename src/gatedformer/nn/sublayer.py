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

With pre-LN the body reads ``LN(X)`` while the residual stream stays ``X``: ``Y = X + F(LN(X))``. SDU and
gated MHDPA read ``LN(X)`` too; the highway gate carries the residual stream itself, so ``T``, ``f`` and the
carry read the raw ``X``: ``Y = o(X) + F(LN(X))``.
Sublayers that carry no gate hold no gate parameters.
"""

from __future__ import annotations

from torch import Tensor, nn

from gatedformer.gates import EAU, SDU, GatedMHDPA, GatedResidual, GLUFeedForward, HighwayGate
from gatedformer.gates._checks import check_size
from gatedformer.gates.spec import SublayerGates
from gatedformer.nn.dropout import Dropout
from gatedformer.ops.fused_gates import (
    apply_eau,
    apply_grc,
    apply_highway,
    apply_sdu,
    gated_mix,
    grc_dropout_norm,
)
from gatedformer.ops.fused_linear import (
    dropout_add_layer_norm,
    feed_forward_add_norm,
    linear_dropout,
    linear_dropout_add,
    linear_dropout_add_norm,
    linear_relu_dropout,
)


class FeedForward(nn.Module):
    """Position-wise ``W2 · Dropout(ReLU(W1 x + b1)) + b2``.

    Like every sublayer body that ends in a linear layer, it offers ``features(x)`` (everything before that
    layer) and ``output_projection`` (the layer), so that :class:`Sublayer` can fuse the layer with its
    dropout and residual add (:mod:`gatedformer.ops.fused_linear`).
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

    def add_norm(self, x: Tensor, p: float, norm: nn.LayerNorm, gate: nn.Module | None = None,
                 unit: nn.Module | None = None, eau: nn.Module | None = None) -> Tensor | None:
        """``norm(x + dropout(self(x), p))`` (with a gated residual connection ``gate`` and an SDU branch ``unit``:
        ``norm(gate(x, dropout(self(x) + unit(x), p)))``; with a highway gate ``unit``:
        ``norm(unit(x) + dropout(self(x), p))``; an ``eau`` on the output first) as one autograd function where that
        applies
        (:func:`~gatedformer.ops.fused_linear.feed_forward_add_norm`), else ``None``."""
        return feed_forward_add_norm(x, self.inner, self.outer, self.dropout.p, p, norm, self.training, gate, unit, eau)


def check_lm_sizes(vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ffn: int) -> None:
    """A ValueError naming the first size of a Transformer-style language model that is not an integer >= 1,
    before any layer is built (an empty vocabulary would otherwise build and fail at the first forward)."""
    for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                        ("n_heads", n_heads), ("d_ffn", d_ffn)):
        check_size(name, value)


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
        # With no gate on the body's output between its last linear layer and the residual add (a highway gate
        # only changes the stream), the two can be one pass (gatedformer.ops.fused_linear).
        splits = hasattr(body, "features") and hasattr(body, "output_projection")
        self.fuse_linear = gates.unit in (None, "highway") and not gates.eau and not gates.grc and splits
        # With post-LN, a body that offers add_norm computes the whole sublayer in one autograd function (the
        # residual's gradient then joins x's inside the matrix products), with the gates it takes (it returns None
        # for others): the Transformer's any one gate unit or an EAU, and a GRC; Transformer-XL's none.
        self.fuse_sublayer = (not (gates.eau and gates.unit is not None) and not self.pre_norm
                              and hasattr(body, "add_norm"))
        # With pre-LN, before a gated residual connection only the body's last layer and the dropout can be one pass.
        self.fuse_dropout = gates.unit is None and not gates.eau and gates.grc and splits and self.pre_norm

    def forward(self, x: Tensor, *body_args: object) -> Tensor:
        # The gates are applied through gatedformer.ops.fused_gates: their own forward, with the
        # element-wise end in one pass where that applies.
        if self.fuse_sublayer:
            unit = next((u for u in (self.sdu, self.highway, self.gated_mix) if u is not None), None)
            whole = self.body.add_norm(x, self.dropout.p, self.norm, self.residual_gate, unit, self.eau, *body_args)
            if whole is not None:
                return whole
        h = self.norm(x) if self.pre_norm else x
        stream = apply_highway(self.highway, x) if self.highway is not None else x
        if self.fuse_linear:  # stream + dropout(W f(h) + b), then the LayerNorm with post-LN
            features = self.body.features(h, *body_args)
            projection = self.body.output_projection
            if self.pre_norm:
                return linear_dropout_add(stream, features, projection, self.dropout.p, self.training)
            return linear_dropout_add_norm(stream, features, projection, self.dropout.p, self.norm, self.training)
        if self.fuse_dropout:
            dropped = linear_dropout(self.body.features(h, *body_args), self.body.output_projection, self.dropout.p,
                                     self.training)
            return apply_grc(self.residual_gate, stream, dropped)
        s = self.body(h, *body_args)
        if self.eau is not None:
            s = apply_eau(self.eau, s)
        if self.sdu is not None:
            s = apply_sdu(self.sdu, h, add_to=s)  # s + SDU(h)
        if self.gated_mix is not None:
            s = gated_mix(self.gated_mix, s, h)
        if self.residual_gate is not None:
            if self.pre_norm:
                return apply_grc(self.residual_gate, stream, self.dropout(s))
            return grc_dropout_norm(self.residual_gate, stream, s, self.dropout.p, self.norm, self.training)
        if self.pre_norm:
            return self.dropout.add_to(stream, s)  # stream + dropout(s) in one pass
        return dropout_add_layer_norm(stream, s, self.dropout.p, self.norm, self.training)
