"""The fused paths of the Transformer sublayer and its bodies (:mod:`gatedformer.nn.sublayer`,
:mod:`gatedformer.nn.attention`).

A :class:`~gatedformer.nn.sublayer.Sublayer` computes, in the fewest passes that apply:

* with post-LN, the whole sublayer as one autograd function (``add_norm`` of its body:
  :func:`~gatedformer.ops.fused_linear.feed_forward_add_norm`, :func:`~gatedformer.ops.fused_linear.attention_add_norm`,
  Transformer-XL's relative attention), with the gates those functions list
  (:func:`~gatedformer.ops.fused_linear.whole_sublayer_takes`);
* else, with no gate between the body's last linear layer and the residual add, that layer, the dropout, the add
  and (post-LN) the LayerNorm as one pass (:mod:`gatedformer.ops.fused_linear`);
* else the body, then each gate with its element-wise end in one pass (:mod:`gatedformer.ops.fused_gates`), then the
  dropout, residual add and LayerNorm in one.

Each path checks its case at every call and falls through to the next; the last is the reference's order of
operations. The numbers are the reference's up to float rounding.
"""

from __future__ import annotations

from torch import Tensor, nn

from gatedformer.fused.registry import implements
from gatedformer.gates.kinds import GATE_KINDS
from gatedformer.nn.attention import CausalSelfAttention
from gatedformer.nn.sublayer import FeedForward, Sublayer
from gatedformer.ops import fused_gates
from gatedformer.ops.attention import causal_attention_packed
from gatedformer.ops.explain import declined, explaining
from gatedformer.ops.fused_linear import (
    attention_add_norm,
    dropout_add_layer_norm,
    feed_forward_add_norm,
    linear_dropout,
    linear_dropout_add,
    linear_dropout_add_norm,
    linear_relu_dropout,
    whole_sublayer_takes,
)


def _plan(sub: Sublayer) -> None:
    """Work out once, from the sublayer's structure, which of the paths above can apply (forward passes them on
    several times per step)."""
    by_role = {role: [(GATE_KINDS[name], getattr(sub, name)) for name in sub.kinds if GATE_KINDS[name].role == role]
               for role in ("heads", "output", "branch", "blend", "stream", "residual")}
    sub._by_role = by_role
    unit = next((u for role in ("branch", "blend", "stream") for _, u in by_role[role]), None)
    sub._fused_gates = (next((u for _, u in by_role["residual"]), None), unit,
                        next((u for _, u in by_role["output"]), None))
    # A body kind (a GLU-variant feed-forward) is the body itself, no gate between it and the residual add.
    roles = {GATE_KINDS[name].role for name in sub.kinds} - {"body"}
    body = sub.body
    # With no gate between the body's last linear layer and the residual add (a gate on the stream only changes
    # what is added to; an attention output gate acts on the heads, before that layer), the two can be one pass.
    splits = hasattr(body, "features") and hasattr(body, "output_projection")
    sub.fuse_linear = roles <= {"stream", "heads"} and splits
    # Elsewhere an attention output gate runs with the body as the reference has it (Sublayer.run_body).
    heads = [name for name in sub.kinds if GATE_KINDS[name].role == "heads"]
    sub._heads_why = (f"an attention output gate ({heads[0]}) sits between the heads and the output projection, and "
                      "a gate other than a stream gate after it" if heads and splits and not sub.fuse_linear else None)
    # A GLU-variant body has no fused function of its own: its products run as written (its output projection, which
    # has no bias, then goes with the dropout and residual add where the fused tail takes it).
    bodies = [name for name in sub.kinds if GATE_KINDS[name].role == "body"]
    sub._body_why = f"no fused function computes the {bodies[0]} feed-forward; it runs as written" if bodies else None
    # With post-LN, a body whose fused implementation offers add_norm computes the whole sublayer in one autograd
    # function (the residual's gradient then joins x's inside the matrix products), with the gates that function
    # lists; the body's add_norm may still return None for a case it declines.
    whole_body = not sub.pre_norm and hasattr(body, "add_norm")
    sub.fuse_sublayer = whole_body and whole_sublayer_takes(sub.kinds)
    sub._unfused_why = (f"its gates ({', '.join(sub.kinds)}) are not all kinds the whole-sublayer functions list, "
                        "or an EAU sits beside a unit" if whole_body and not sub.fuse_sublayer else None)
    # With pre-LN, before a gated residual connection alone only the body's last layer and the dropout can be one
    # pass.
    sub.fuse_dropout = roles == {"residual"} and splits and sub.pre_norm


@implements(Sublayer, "fused_gates")
def sublayer_fused_gates(self: Sublayer) -> tuple[nn.Module | None, nn.Module | None, nn.Module | None]:
    """The gates as the whole-sublayer functions take them: the residual gate, the unit (a branch, blend or stream
    gate) and the output gate, each ``None`` where there is none (what :mod:`gatedformer.ops.layer_stack` reads)."""
    return self._fused_gates


@implements(Sublayer, prepare=_plan)
def sublayer_forward(self: Sublayer, x: Tensor, *body_args: object) -> Tensor:
    if self.fuse_sublayer:
        whole = self.body.add_norm(x, self.dropout.p, self.norm, *self._fused_gates, *body_args)
        if whole is not None:
            return whole
    elif self._unfused_why is not None and explaining():
        declined("nn.Sublayer (as one function)", self._unfused_why)
    if self._body_why is not None and explaining():
        declined("nn.Sublayer (its body)", self._body_why)
    h = self.norm(x) if self.pre_norm else x
    stream = x
    for kind, unit in self._by_role["stream"]:
        stream = fused_gates.apply_stream(kind, unit, stream)
    if self.fuse_linear:  # stream + dropout(W f(h) + b), then the LayerNorm with post-LN
        features = self.body.features(h, *body_args)
        for _, gate in self._by_role["heads"]:  # the attention output gate on the heads' outputs, before W_O
            features = gate(h, features)
        projection = self.body.output_projection
        if self.pre_norm:
            return linear_dropout_add(stream, features, projection, self.dropout.p, self.training)
        return linear_dropout_add_norm(stream, features, projection, self.dropout.p, self.norm, self.training)
    if self._heads_why is not None and explaining():
        declined("nn.Sublayer (output projection, dropout and residual add as one pass)", self._heads_why)
    residual = next(iter(self._by_role["residual"]), None)
    if self.fuse_dropout:
        dropped = linear_dropout(self.body.features(h, *body_args), self.body.output_projection, self.dropout.p,
                                 self.training)
        return fused_gates.apply_residual(*residual, stream, dropped)
    s = self.run_body(h, *body_args)  # with an attention output gate, W_O (Y ⊙ σ(h W_θ)) as the reference has it
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


@implements(FeedForward, "features")
def feed_forward_features(self: FeedForward, x: Tensor) -> Tensor:
    """``Dropout(ReLU(W1 x + b1))`` in one pass each way."""
    return linear_relu_dropout(x, self.inner, self.dropout.p, self.training)


@implements(FeedForward, "add_norm")
def feed_forward_add_norm_method(self: FeedForward, x: Tensor, p: float, norm: nn.LayerNorm,
                                 gate: nn.Module | None = None, unit: nn.Module | None = None,
                                 eau: nn.Module | None = None) -> Tensor | None:
    """``norm(x + dropout(self(x), p))`` (with a gated residual connection ``gate`` and an SDU branch ``unit``:
    ``norm(gate(x, dropout(self(x) + unit(x), p)))``; with a highway gate ``unit``: ``norm(unit(x) + dropout(self(x),
    p))``; an ``eau`` on the output first) as one autograd function where that applies
    (:func:`~gatedformer.ops.fused_linear.feed_forward_add_norm`), else ``None``."""
    return feed_forward_add_norm(x, self.inner, self.outer, self.dropout.p, p, norm, self.training, gate, unit, eau)


@implements(CausalSelfAttention, "features")
def causal_attention_features(self: CausalSelfAttention, x: Tensor,
                              cache: dict[str, Tensor] | None = None) -> Tensor:
    """The heads' outputs by the compiled CPU kernel that reads Q, K and V straight from the projection's output
    (:func:`~gatedformer.ops.attention.causal_attention_packed`, which takes
    :func:`torch.nn.functional.scaled_dot_product_attention` where the kernel does not apply); the reference's
    key/value cache path with a ``cache``."""
    if cache is not None:
        return CausalSelfAttention.features(self, x, cache)
    return causal_attention_packed(self.qkv(x), self.n_heads, self.dropout if self.training else 0.0)


@implements(CausalSelfAttention, "add_norm")
def causal_attention_add_norm(self: CausalSelfAttention, x: Tensor, p: float, norm: nn.LayerNorm,
                              gate: nn.Module | None = None, unit: nn.Module | None = None,
                              eau: nn.Module | None = None, cache: dict[str, Tensor] | None = None) -> Tensor | None:
    """``norm(x + dropout(self(x), p))``, with the gates as :func:`feed_forward_add_norm_method`, as one autograd
    function (:func:`~gatedformer.ops.fused_linear.attention_add_norm`) where that applies, else ``None`` (always
    with a ``cache``: the incremental path is ``features``)."""
    if cache is not None:
        return None
    return attention_add_norm(x, self.qkv, self.out, self.n_heads, self.dropout if self.training else 0.0, p,
                              norm, self.training, gate, unit, eau)
