"""The fused paths of Transformer-XL (:mod:`gatedformer.models.transformer_xl`).

* The relative attention by the compiled CPU kernel, which reads the projections in their own layouts
  (:func:`~gatedformer.ops.relative_attention.relative_attention`, where
  :func:`~gatedformer.kernels.relative_attention.kernel_takes` says it applies), in ``features`` and in the cached
  incremental path.
* The post-LN attention sublayer, gates included, as one autograd function: the attention's ``add_norm``
  (:func:`~gatedformer.ops.relative_sublayer.relative_attention_add_norm`), which the fused
  :class:`~gatedformer.nn.sublayer.Sublayer` calls where its body offers one.
* All the layers as one autograd function (:func:`~gatedformer.ops.layer_stack.layer_stack`): the model's
  ``run_layers``.

Each checks its case at every call and otherwise computes what the reference computes, in the reference's order of
operations; where the kernels apply the numbers are the reference's up to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatedformer.fused.registry import implements, reference
from gatedformer.kernels.relative_attention import kernel_takes
from gatedformer.models.transformer_xl import RelativeMultiHeadAttention, TransformerXLLM
from gatedformer.ops.layer_stack import layer_stack
from gatedformer.ops.relative_attention import relative_attention
from gatedformer.ops.relative_sublayer import relative_attention_add_norm

__all__ = ["relative_attention_add_norm_method", "relative_attention_cached", "relative_attention_features",
           "transformer_xl_layers"]


@implements(RelativeMultiHeadAttention, "features")
def relative_attention_features(self: RelativeMultiHeadAttention, h: Tensor, memory: Tensor | None, pos: Tensor,
                                cache: dict[str, Tensor] | None = None) -> Tensor:
    """The heads' outputs before ``out`` (what a sublayer with an attention output gate reads) by the compiled
    kernel where it applies, else the reference's."""
    if cache is not None:
        return reference(self, "features")(h, memory, pos, cache)
    q, kv, memory_kv, r = self._projections_apart(h, memory, pos)
    taken = (q, kv, r, self.u, self.v) + (() if memory_kv is None else (memory_kv,))
    if kernel_takes(taken, self.n_heads, self.dropout.p if self.training else 0.0):
        return relative_attention(q, kv, r, self.u, self.v, self.n_heads, memory_kv)
    return self.attend(*self._heads(q, kv if memory_kv is None else torch.cat([memory_kv, kv], dim=1), r))


@implements(RelativeMultiHeadAttention, "_cached_features")
def relative_attention_cached(self: RelativeMultiHeadAttention, h: Tensor, memory: Tensor | None, pos: Tensor,
                              cache: dict[str, Tensor]) -> Tensor:
    """The reference's incremental path, with the kernel where it applies."""
    q, kv, past, r = self._cached_projections(h, memory, pos, cache)
    taken = (q, kv, r, self.u, self.v) + (() if past is None else (past,))
    if kernel_takes(taken, self.n_heads, self.dropout.p if self.training else 0.0):
        return relative_attention(q, kv, r, self.u, self.v, self.n_heads, past)
    return self.attend(*self._heads(q, cache["kv"], r))


@implements(RelativeMultiHeadAttention, "add_norm")
def relative_attention_add_norm_method(self: RelativeMultiHeadAttention, x: Tensor, p: float, norm: nn.LayerNorm,
                                       gate: nn.Module | None = None, unit: nn.Module | None = None,
                                       eau: nn.Module | None = None, memory: Tensor | None = None,
                                       pos: Tensor | None = None,
                                       cache: dict[str, Tensor] | None = None) -> Tensor | None:
    """``norm(x + dropout(self(x, memory, pos), p))``, the post-LN sublayer, as one autograd function
    (:class:`~gatedformer.ops.relative_sublayer.RelativeAttentionAddNorm`) where that applies (see its
    module), else ``None``. With a gated residual connection ``gate``, an SDU branch, highway gate or gated
    MHDPA ``unit`` and an ``eau`` on the output, as the Transformer's attention's ``add_norm``
    (:mod:`gatedformer.fused.sublayer`). Always ``None`` with a ``cache`` (the incremental path is ``forward``'s)."""
    if cache is not None:
        return None
    return relative_attention_add_norm(self, x, p, norm, gate, unit, eau, memory, pos)


@implements(TransformerXLLM, "run_layers")
def transformer_xl_layers(self: TransformerXLLM, x: Tensor, memories: list[Tensor] | None,
                          pos: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The layers as one autograd function where they can (the same arithmetic and masks, less overhead), else one
    by one."""
    stacked = layer_stack(self.layers, x, memories, pos)
    if stacked is not None:
        return stacked
    return reference(self, "run_layers")(x, memories, pos)
