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
from torch.nn import functional as F

from gatedformer.gates import GLUFeedForward
from gatedformer.gates._checks import check_size
from gatedformer.gates.kinds import GATE_KINDS
from gatedformer.gates.spec import SublayerGates
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.sru import SRUFeedForward
from gatedformer.ops import fused_gates
from gatedformer.ops.explain import declined, explaining
from gatedformer.ops.fused_linear import (
    dropout_add_layer_norm,
    feed_forward_add_norm,
    linear_dropout,
    linear_dropout_add,
    linear_dropout_add_norm,
    linear_relu_dropout,
    whole_sublayer_takes,
)


class _TwoLayers(nn.Module):
    """What the position-wise feed-forwards hold: ``inner`` (d -> d_ffn), ``outer`` (d_ffn -> d, the
    ``output_projection`` a sublayer fuses) and the dropout between them."""

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.inner = nn.Linear(d_model, d_ffn)
        self.outer = nn.Linear(d_ffn, d_model)
        self.dropout = Dropout(dropout)

    @property
    def output_projection(self) -> nn.Linear:
        return self.outer


class FeedForward(_TwoLayers):
    """Position-wise ``W2 · Dropout(ReLU(W1 x + b1)) + b2``.

    Like every sublayer body that ends in a linear layer, it offers ``features(x)`` (everything before that
    layer) and ``output_projection`` (the layer), so that :class:`Sublayer` can fuse the layer with its
    dropout and residual add (:mod:`gatedformer.ops.fused_linear`).
    """

    activation = "relu"
    """What the fused paths that read the layers themselves (:mod:`gatedformer.ops.layer_stack`) check for."""

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


class GELUFeedForward(_TwoLayers):
    """Position-wise ``W2 · Dropout(GELU(W1 x + b1)) + b2``, GELU the exact (erf) one: BERT's feed-forward (which has
    no dropout inside, ``dropout=0``). Offers ``features`` and ``output_projection`` as :class:`FeedForward` does."""

    activation = "gelu"

    def features(self, x: Tensor) -> Tensor:
        return self.dropout(F.gelu(self.inner(x)))

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.features(x))


def check_lm_sizes(vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ffn: int) -> None:
    """A ValueError naming the first size of a Transformer-style language model that is not an integer >= 1,
    before any layer is built (an empty vocabulary would otherwise build and fail at the first forward)."""
    for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                        ("n_heads", n_heads), ("d_ffn", d_ffn)):
        check_size(name, value)


def make_ffn(kind: str, d_model: int, d_ffn: int, dropout: float) -> nn.Module:
    """The feed-forward body ``kind`` names: ``relu`` (:class:`FeedForward`), ``gelu`` (:class:`GELUFeedForward`),
    ``glu`` (:class:`~gatedformer.gates.GLUFeedForward`) or ``sru`` (:class:`~gatedformer.nn.sru.SRUFeedForward`,
    the SRU paper's Transformer w/ SRU)."""
    if kind == "glu":
        return GLUFeedForward(d_model, d_ffn, dropout)
    if kind == "sru":
        return SRUFeedForward(d_model, d_ffn, dropout)
    if kind == "gelu":
        return GELUFeedForward(d_model, d_ffn, dropout)
    return FeedForward(d_model, d_ffn, dropout)


class Sublayer(nn.Module):
    """A body in its residual connection, with LayerNorm and the gates a placement gives it.

    Each gate kind of :data:`~gatedformer.gates.kinds.GATE_KINDS` the placement names is a child module named after
    the kind (``self.sdu``, ``self.highway``, ``self.gated_mhdpa``, ``self.eau``, ``self.grc``; ``None`` where the
    sublayer has none), applied where its role says (see :mod:`gatedformer.gates.kinds`).
    """

    def __init__(self, body: nn.Module, d_model: int, gates: SublayerGates, dropout: float = 0.0,
                 norm: str = "post") -> None:
        super().__init__()
        self.body = body
        self.pre_norm = norm == "pre"
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        # Only the gates the placement names exist, so an ungated sublayer has no gate parameters.
        for name, kind in GATE_KINDS.items():
            setattr(self, name, kind.build(d_model, gates.kinds[name]) if gates.has(name) else None)
        self.kinds = tuple(gates.kinds)
        """The names of the gate kinds it carries, in the table's order."""
        self._by_role = {role: [(GATE_KINDS[name], getattr(self, name)) for name in self.kinds
                                if GATE_KINDS[name].role == role]
                         for role in ("output", "branch", "blend", "stream", "residual")}
        # Worked out once: forward passes them on several times per step.
        unit = next((u for role in ("branch", "blend", "stream") for _, u in self._by_role[role]), None)
        self._fused_gates = (next((u for _, u in self._by_role["residual"]), None), unit,
                             next((u for _, u in self._by_role["output"]), None))
        roles = {GATE_KINDS[name].role for name in self.kinds}
        # With no gate between the body's last linear layer and the residual add (a gate on the stream only changes
        # what is added to), the two can be one pass (gatedformer.ops.fused_linear).
        splits = hasattr(body, "features") and hasattr(body, "output_projection")
        self.fuse_linear = roles <= {"stream"} and splits
        # With post-LN, a body that offers add_norm computes the whole sublayer in one autograd function (the
        # residual's gradient then joins x's inside the matrix products), with the gates that function lists
        # (whole_sublayer_takes); the body's add_norm may still return None for a case it declines.
        self.fuse_sublayer = not self.pre_norm and hasattr(body, "add_norm") and whole_sublayer_takes(self.kinds)
        whole_body = not self.pre_norm and hasattr(body, "add_norm")
        self._unfused_why = (f"its gates ({', '.join(self.kinds)}) are not all kinds the whole-sublayer functions "
                             "list, or an EAU sits beside a unit" if whole_body and not self.fuse_sublayer else None)
        # With pre-LN, before a gated residual connection alone only the body's last layer and the dropout can be one
        # pass.
        self.fuse_dropout = roles == {"residual"} and splits and self.pre_norm

    def fused_gates(self) -> tuple[nn.Module | None, nn.Module | None, nn.Module | None]:
        """The gates as the whole-sublayer functions take them: the residual gate, the unit (a branch, blend or stream
        gate) and the output gate, each ``None`` where there is none. Only for the kinds
        :func:`~gatedformer.ops.fused_linear.whole_sublayer_takes` accepts."""
        return self._fused_gates

    def forward(self, x: Tensor, *body_args: object) -> Tensor:
        # The gates are applied through gatedformer.ops.fused_gates: their own forward, with the element-wise end in
        # one pass where that applies.
        if self.fuse_sublayer:
            whole = self.body.add_norm(x, self.dropout.p, self.norm, *self._fused_gates, *body_args)
            if whole is not None:
                return whole
        elif self._unfused_why is not None and explaining():
            declined("nn.Sublayer (as one function)", self._unfused_why)
        h = self.norm(x) if self.pre_norm else x
        stream = x
        for kind, unit in self._by_role["stream"]:
            stream = fused_gates.apply_stream(kind, unit, stream)
        if self.fuse_linear:  # stream + dropout(W f(h) + b), then the LayerNorm with post-LN
            features = self.body.features(h, *body_args)
            projection = self.body.output_projection
            if self.pre_norm:
                return linear_dropout_add(stream, features, projection, self.dropout.p, self.training)
            return linear_dropout_add_norm(stream, features, projection, self.dropout.p, self.norm, self.training)
        residual = next(iter(self._by_role["residual"]), None)
        if self.fuse_dropout:
            dropped = linear_dropout(self.body.features(h, *body_args), self.body.output_projection, self.dropout.p,
                                     self.training)
            return fused_gates.apply_residual(*residual, stream, dropped)
        s = self.body(h, *body_args)
        for kind, unit in self._by_role["output"]:
            s = fused_gates.apply_output(kind, unit, s)
        for kind, unit in self._by_role["branch"]:
            s = fused_gates.apply_branch(kind, unit, h, s)  # s + unit(h)
        for kind, unit in self._by_role["blend"]:
            s = fused_gates.apply_blend(kind, unit, h, s)
        if residual is not None:
            if self.pre_norm:
                return fused_gates.apply_residual(*residual, stream, self.dropout(s))
            return fused_gates.residual_dropout_norm(*residual, stream, s, self.dropout.p, self.norm, self.training)
        if self.pre_norm:
            return self.dropout.add_to(stream, s)  # stream + dropout(s) in one pass
        return dropout_add_layer_norm(stream, s, self.dropout.p, self.norm, self.training)
