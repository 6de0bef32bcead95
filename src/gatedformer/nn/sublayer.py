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
* SDPA gate:      ``F(X) = W_O (Y ⊙ σ(X W_θ))``, ``Y`` the heads' outputs    (Qiu et al. 2025; headwise: a score per
  head)
* GLU variants:   ``F(X) = (act(XW) ⊙ XV) W2`` in place of the ReLU/GELU FFN (Shazeer 2020: SwiGLU, GEGLU, ...)
* GRU gate:       ``X + S ← (1-z)⊙X + z⊙ĥ`` of ``X`` and ``ReLU(S)``          (Parisotto et al. 2019, GTrXL)
* ReZero:         ``X + S ← X + α S``, ``α`` a scalar that starts at 0     (Bachlechner et al. 2020)

With pre-LN the body reads ``LN(X)`` while the residual stream stays ``X``: ``Y = X + F(LN(X))``. SDU and
gated MHDPA read ``LN(X)`` too; the highway gate carries the residual stream itself, so ``T``, ``f`` and the
carry read the raw ``X``: ``Y = o(X) + F(LN(X))``. Pre-LN with the GRU gate is GTrXL's identity map reordering,
``Y = g(X, ReLU(F(LN(X))))``; pre-LN with ReZero is ReZero's ``Y = X + α F(LN(X))`` (the paper drops the LayerNorm
altogether; here the branch keeps it on its input).
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
    layer) and ``output_projection`` (the layer), where a fused path joins that layer to the sublayer's dropout and
    residual add (:mod:`gatedformer.fused.sublayer`).
    """

    activation = "relu"
    """What the fused paths that read the layers themselves (:mod:`gatedformer.ops.layer_stack`) check for."""

    def features(self, x: Tensor) -> Tensor:
        return self.dropout(F.relu(self.inner(x)))

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.features(x))


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
    """A body in its residual connection, with LayerNorm and the gates a placement gives it (the module docstring's
    equations).

    Each gate kind of :data:`~gatedformer.gates.kinds.GATE_KINDS` the placement names is a child module named after
    the kind (``self.sdu``, ``self.highway``, ``self.gated_mhdpa``, ``self.eau``, ``self.grc``, ...; ``None`` where
    the sublayer has none), applied where its role says (see :mod:`gatedformer.gates.kinds`). A kind whose role is
    ``body`` (a GLU-variant feed-forward) is no unit beside the body but the body itself: it replaces the body the
    model passed, at its width, and its slot stays ``None``.
    """

    def __init__(self, body: nn.Module, d_model: int, gates: SublayerGates, dropout: float = 0.0,
                 norm: str = "post") -> None:
        super().__init__()
        for name in gates.kinds:
            if GATE_KINDS[name].role == "body":  # SwiGLU & co. in place of the model's feed-forward
                body = GATE_KINDS[name].build(d_model, body=body)
        self.body = body
        self.pre_norm = norm == "pre"
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        # Only the gates the placement names exist, so an ungated sublayer has no gate parameters.
        for name, kind in GATE_KINDS.items():
            unit = gates.has(name) and kind.role != "body"
            setattr(self, name, kind.build(d_model, gates.kinds[name], body) if unit else None)
        self.kinds = tuple(gates.kinds)
        """The names of the gate kinds it carries, in the table's order."""

    def _gates(self, role: str) -> list[nn.Module]:
        """The gate units of ``role`` it carries, in the table's order."""
        return [getattr(self, name) for name in self.kinds if GATE_KINDS[name].role == role]

    def forward(self, x: Tensor, *body_args: object) -> Tensor:
        """``LN(X + F(X) + its gates)``; ``body_args`` go to the body (a key/value cache, Transformer-XL's memory)."""
        h = self.norm(x) if self.pre_norm else x  # pre-LN: the body and the gates beside it read LN(X)
        carry = x
        for gate in self._gates("stream"):  # highway gate: o(X) = (1-T)⊙X + T⊙f(X) in place of X
            carry = gate(carry)
        s = self.run_body(h, *body_args)  # F(X)
        for gate in self._gates("output"):  # EAU(F(X))
            s = gate(s)
        for gate in self._gates("branch"):  # F(X) + SDU(X)
            s = s + gate(h)
        for gate in self._gates("blend"):  # gated MHDPA: (1-T(X))⊙F(X) + T(X)⊙f(X)
            s = gate(h, s)
        s = self.dropout(s)
        residual = self._gates("residual")
        y = residual[0](carry, s) if residual else carry + s  # GRC: X + σ(Wg X + bg)⊙S (GRU gate, ReZero), else X + S
        return y if self.pre_norm else self.norm(y)

    def run_body(self, h: Tensor, *body_args: object) -> Tensor:
        """``F(h)``: the body on ``h``. With an attention output gate, ``W_O · gate(h, Y)``: the gate between the
        attention body's ``features`` (``Y``, the heads' outputs side by side) and its output projection ``out``."""
        heads = self._gates("heads")
        if not heads:
            return self.body(h, *body_args)
        return self.body.out(heads[0](h, self.body.features(h, *body_args)))  # W_O (Y ⊙ σ(h W_θ))
