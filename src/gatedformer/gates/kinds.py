"""The one table of gate kinds: everything the rest of the package needs to know about a gate, in one place.

A :class:`GateKind` says how a spec names the gate (``words``), what it does to a sublayer (``role``), which other
gates it excludes, where it may be placed, how a report labels it, the module that computes it, its parameters and
FLOPs, and the name of its element-wise end in the gate kernel (``tail``). The spec grammar
(:mod:`gatedformer.gates.spec`), the sublayer (:class:`gatedformer.nn.sublayer.Sublayer`), the fused paths
(:mod:`gatedformer.ops`), the parameter and FLOP counts and the gate figures all read this table; a new gate is a new
row here plus its unit module, and every fused path that does not list the new kind declines sublayers that carry
it, so training and evaluation always compute the same thing.

The roles, where :class:`~gatedformer.nn.sublayer.Sublayer` applies a gate (``X`` the residual stream, ``h`` the
body's input: ``X`` post-LN, ``LN(X)`` pre-LN, ``S`` the body's output ``F(h)``):

* ``output``: ``S ← unit(S)`` (EAU, after attention);
* ``branch``: ``S ← S + unit(h)`` (SDU);
* ``blend``: ``S ← unit(h, S)`` (gated MHDPA: ``(1 − T(h)) ⊙ S + T(h) ⊙ f(h)``);
* ``stream``: ``X ← unit(X)`` before the residual add (highway gate: ``(1 − T(X)) ⊙ X + T(X) ⊙ f(X)``);
* ``residual``: the residual add ``X + S`` becomes ``unit(X, S)`` (GRC: ``X + σ(Wg X + bg) ⊙ S``; the GRU gate;
  ReZero: ``X + α S``).

in that order, after the two that act inside the body:

* ``body``: the unit is the body (the GLU-variant feed-forwards, in place of the model's ReLU or GELU one);
* ``heads``: ``S ← W_O · unit(h, Y)``, ``Y`` the heads' attention outputs before the output projection ``W_O``
  (the attention output gate: ``Y ⊙ σ(h W_θ)``).

Gates are leaves: this module imports nothing of the package outside ``gates`` but its errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from gatedformer.errors import ConfigError

from .eau import EAU
from .gated_mhdpa import GatedMHDPA
from .glu import GLUFeedForward
from .glu_variants import FFNGEGLU, FFNGLU, FFNBilinear, FFNReGLU, FFNSwiGLU, glu_hidden
from .grc import GatedResidual
from .gru_gate import GRUGate
from .highway import HighwayGate
from .rezero import ReZero
from .sdpa_gate import HeadwiseSDPAGate, SDPAGate
from .sdu import SDU

ROLES = ("body", "heads", "output", "branch", "blend", "stream", "residual")
"""What a gate does to its sublayer, in the order the sublayer applies them (see the module docstring)."""
SUBLAYERS = ("attn", "ffn", "cross")
"""Sublayer kinds: self-attention, feed-forward and (encoder-decoder models) the decoder's cross-attention."""
GATE_FNS = ("sigmoid", "tanh")
"""The SDU's gate functions Ψ."""


@dataclass(frozen=True)
class GateKind:
    """One kind of gate (see the module docstring)."""

    name: str
    """The one name of the gate in code, specs, saved statistics and reports' keys; also the attribute of
    :class:`~gatedformer.nn.sublayer.Sublayer` that holds its unit (so parameter names read ``attn.sdu.proj``)."""
    label: str
    """How reports and figures print it."""
    unit: type[nn.Module]
    """The module that computes it (in :mod:`gatedformer.gates`)."""
    words: tuple[str, ...]
    """The spec words that name it (lower case; a two-word name joined by ``-``: ``highway-gate``)."""
    role: str
    """One of :data:`ROLES`."""
    sublayers: tuple[str, ...]
    """The sublayers it may go on; an item of a spec that names none gates all of these."""
    paper: str
    """Where the gate comes from."""
    equation: str
    """Its equation, as the papers write it."""
    where: str = "on any sublayer"
    """Where it goes, as an error names it (``after multi-head attention``)."""
    exclusive: bool = False
    """At most one exclusive gate per sublayer: they all reshape what the body's output becomes."""
    replaces_residual: bool = False
    """It changes the residual connection itself; two such gates cannot share a sublayer."""
    takes_fn: bool = False
    """It takes a gate function Ψ (σ or tanh) from the spec."""
    parameters: Callable[[int, int, int], int] = lambda d, f, h: 0
    """Its parameter count at width ``d`` in a model of feed-forward width ``f`` and ``h`` heads (only the kinds
    sized by their body read the last two)."""
    matmul_flops: Callable[[int, int, int], int] = lambda d, f, h: 0
    """The FLOPs of its matrix products per token at width ``d``, feed-forward width ``f`` and ``h`` heads
    (forward)."""
    tail: Callable[[nn.Module], str] = lambda unit: ""
    """The name of the unit's element-wise end among the gate kernel's tails
    (:data:`gatedformer.kernels.gate.TAILS`)."""
    sized_by: Callable[[nn.Module], dict[str, object]] | None = None
    """For a unit whose size is the body's as well as ``d``'s (the headwise gate's heads, a GLU variant's width):
    the unit's keyword arguments read off the sublayer's body (a ValueError for a body it does not fit)."""

    def build(self, d_model: int, fn: str = "sigmoid", body: nn.Module | None = None) -> nn.Module:
        """A fresh unit of width ``d_model`` (``fn``: the SDU's Ψ) for a sublayer around ``body`` (without one, a
        unit sized by its body takes its own defaults)."""
        sizes = self.sized_by(body) if self.sized_by is not None and body is not None else {}
        return self.unit(d_model, fn, **sizes) if self.takes_fn else self.unit(d_model, **sizes)


def _eau_parameters(d: int) -> int:
    k = d // 2
    return d * k + k + k * d + d + d * d + d


def _heads_of(body: nn.Module) -> dict[str, object]:
    """The headwise gate's heads: its attention's."""
    return {"n_heads": body.n_heads}


def _feed_forward_of(body: nn.Module, label: str) -> dict[str, object]:
    """A GLU variant's ``d_ffn`` and dropout: those of the position-wise feed-forward it stands in for. A body that
    is not one (an SRU or a GLU feed-forward: ``model.ffn`` sru or glu) is refused, as both would replace it."""
    activation = getattr(body, "activation", None)
    if activation not in ("relu", "gelu"):
        what = ("a GLU one (model.ffn=glu)" if isinstance(body, GLUFeedForward)
                else "an SRU one (model.ffn=sru, or the sru-transformer backbone)" if activation == "sru"
                else f"a {type(body).__name__}")
        raise ConfigError(f"+{label} is a feed-forward of its own, in place of a ReLU or GELU one, not of {what}; "
                          f"drop +{label} from model.gates or use the ReLU feed-forward (model.ffn=relu)")
    return {"d_ffn": body.inner.out_features, "dropout": body.dropout.p}


def _glu_variant(cls: type[nn.Module], label: str, words: tuple[str, ...], act: str) -> GateKind:
    return GateKind(
        cls.kind, label, cls, words, "body", ("ffn",), "Shazeer, GLU Variants Improve Transformer, 2020",
        f"FFN_{label}(x) = ({act}(xW) ⊙ xV) W2, W, V: d × 2/3·d_ffn", where="on feed-forward sublayers",
        parameters=lambda d, f, h: 3 * d * glu_hidden(f), matmul_flops=lambda d, f, h: 6 * d * glu_hidden(f),
        sized_by=lambda body: _feed_forward_of(body, label))


GATE_KINDS: dict[str, GateKind] = {kind.name: kind for kind in (
    GateKind(
        "sdu", "SDU", SDU, ("sdu",), "branch", ("attn", "ffn", "cross"),
        "Chai et al., Highway Transformer, ACL 2020", "SDU(X) = Ψ(XW1+b1) ⊙ (XW2+b2), U = LN(X + F(X) + SDU(X))",
        exclusive=True, takes_fn=True, parameters=lambda d, f, h: 2 * d * (d + 1),
        matmul_flops=lambda d, f, h: 4 * d * d,
        tail=lambda unit: f"sdu-{unit.gate}"),
    GateKind(
        "highway", "highway gate", HighwayGate, ("highway", "highway-gate", "highway_gate"), "stream",
        ("attn", "ffn", "cross"), "Chai et al., Highway Transformer, ACL 2020",
        "o = (1−T(X))⊙X + T(X)⊙f(X), U = LN(o + F(X))",
        exclusive=True, replaces_residual=True, parameters=lambda d, f, h: 2 * d * (d + 1),
        matmul_flops=lambda d, f, h: 4 * d * d, tail=lambda unit: "lerp"),
    GateKind(
        "gated_mhdpa", "gated MHDPA", GatedMHDPA, ("gated-mhdpa", "gated_mhdpa", "gmhdpa"), "blend",
        ("attn", "ffn", "cross"), "Chai et al., Highway Transformer, ACL 2020",
        "o = (1−T(X))⊙F(X) + T(X)⊙f(X), U = LN(o + X)",
        exclusive=True, replaces_residual=True, parameters=lambda d, f, h: 2 * d * (d + 1),
        matmul_flops=lambda d, f, h: 4 * d * d, tail=lambda unit: "lerp"),
    GateKind(
        "eau", "EAU", EAU, ("eau",), "output", ("attn", "cross"),
        "Dhayalkar, Evaluator Adjuster Unit and Gated Residual Connections, 2024",
        "y = x + tanh(W3x+b3) ⊙ σ(W2·ReLU(W1x+b1)+b2)", where="after multi-head attention",
        parameters=lambda d, f, h: _eau_parameters(d), matmul_flops=lambda d, f, h: 2 * (2 * d * (d // 2) + d * d),
        tail=lambda unit: "eau"),
    GateKind(
        "grc", "GRC", GatedResidual, ("grc",), "residual", ("attn", "ffn", "cross"),
        "Dhayalkar, Evaluator Adjuster Unit and Gated Residual Connections, 2024", "y = r + σ(Wg r + bg) ⊙ s",
        replaces_residual=True, parameters=lambda d, f, h: d * (d + 1), matmul_flops=lambda d, f, h: 2 * d * d,
        tail=lambda unit: "sdu-sigmoid"),
    GateKind(
        "sdpa_gate", "SDPA gate", SDPAGate, ("sdpa-gate", "sdpa_gate"), "heads", ("attn", "cross"),
        "Qiu et al., Gated Attention for Large Language Models, NeurIPS 2025", "Y' = Y ⊙ σ(X W_θ), W_θ: d × d",
        where="on multi-head attention", parameters=lambda d, f, h: d * d, matmul_flops=lambda d, f, h: 2 * d * d),
    GateKind(
        "sdpa_gate_headwise", "SDPA gate headwise", HeadwiseSDPAGate, ("sdpa-gate-headwise", "sdpa_gate_headwise"),
        "heads", ("attn", "cross"), "Qiu et al., Gated Attention for Large Language Models, NeurIPS 2025",
        "Y'_h = Y_h ⊙ σ(X w_θ,h), W_θ: d × heads", where="on multi-head attention",
        parameters=lambda d, f, h: d * h, matmul_flops=lambda d, f, h: 2 * d * h, sized_by=_heads_of),
    _glu_variant(FFNGLU, "GLU", ("glu", "ffn-glu"), "σ"),
    _glu_variant(FFNBilinear, "Bilinear", ("bilinear",), ""),
    _glu_variant(FFNReGLU, "ReGLU", ("reglu",), "ReLU"),
    _glu_variant(FFNGEGLU, "GEGLU", ("geglu",), "GELU"),
    _glu_variant(FFNSwiGLU, "SwiGLU", ("swiglu",), "Swish"),
    GateKind(
        "gru_gate", "GRU gate", GRUGate, ("gru-gate", "gru_gate", "gru"), "residual", ("attn", "ffn", "cross"),
        "Parisotto et al., Stabilizing Transformers for Reinforcement Learning, 2019",
        "r = σ(W_r y + U_r x), z = σ(W_z y + U_z x − b_g), ĥ = tanh(W_g y + U_g(r⊙x)), g = (1−z)⊙x + z⊙ĥ",
        replaces_residual=True, parameters=lambda d, f, h: 6 * d * d + d, matmul_flops=lambda d, f, h: 12 * d * d),
    GateKind(
        "rezero", "ReZero", ReZero, ("rezero",), "residual", ("attn", "ffn", "cross"),
        "Bachlechner et al., ReZero is All You Need, 2020", "y = x + α F(x), α = 0 at initialisation",
        replaces_residual=True, parameters=lambda d, f, h: 1),
)}
"""Every gate kind, in the order their slots are listed (and reports show them)."""

def kind_of(unit: nn.Module) -> GateKind | None:
    """The kind whose unit ``unit`` is (exact type), or ``None`` for anything else."""
    return _BY_UNIT.get(type(unit))


def kind_in_name(qualified: str) -> GateKind | None:
    """The kind whose slot appears in a qualified name (``layers.0.attn.sdu`` → SDU)."""
    for part in qualified.split("."):
        if part in GATE_KINDS:
            return GATE_KINDS[part]
    return None


_BY_UNIT = {kind.unit: kind for kind in GATE_KINDS.values()}

__all__ = ["GATE_FNS", "GATE_KINDS", "ROLES", "SUBLAYERS", "GateKind", "kind_in_name", "kind_of"]
