"""A language model's input layer, ``dropout(embedding(tokens) * scale + positions)``, in one pass on the CPU.

Written as PyTorch operations, the look-up, the scaling, the positions and the dropout each make a pass over the
whole ``(B, L, d)`` activation and an autograd node, and their backward passes four more: about 2 % of the
bench Transformer's training step. :func:`embed_tokens` computes the same values in one pass of the dropout
kernel with the same mask (:mod:`gatedformer.ops.dropout`: the seed drawn from torch's generator as
``Dropout`` draws it), and its backward pass adds the gradient into the table's rows in one more, the columns
split between the threads.

Anything else takes the PyTorch operations: tensors not on the CPU or not float32, an embedding with
``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, ``sparse`` or hooks, a subclass of either module (but an
embedding whose class says its look-up is plain, ``lookup_is_plain``, as
:class:`~gatedformer.nn.embedding.TokenEmbedding` does),
positions that require a gradient, a dropout module other than :class:`~gatedformer.ops.dropout.Dropout`
(or in place, hooked or of ``p`` 1), or no compiled kernel. Under ``torch.compile`` the pass is the custom operator
``gatedformer::embed_dropout``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatedformer.kernels.dropout import KERNEL, embed_dropout, embed_dropout_backward
from gatedformer.ops.dropout import _draw_seed, _keep_below
from gatedformer.ops.explain import declined, explaining, first_reason
from gatedformer.ops.fused_linear import unhooked
from gatedformer.ops.operators import FunctionOperator, call, runs_native

__all__ = ["embed_tokens", "fused_embed_tokens"]

_INT32_VALUES = 2 ** 32


class _EmbedDropout(torch.autograd.Function):
    """``(table[tokens] * scale + positions)`` times the mask of a seed (or no mask)."""

    @staticmethod
    def forward(ctx, table: Tensor, tokens: Tensor, positions: Tensor | None, scale: float,  # type: ignore[override]
                mask: tuple[int, int, float] | None) -> Tensor:
        ctx.scale, ctx.mask, ctx.vocab = scale, mask, table.shape[0]
        ctx.save_for_backward(tokens)
        return embed_dropout(table, tokens, positions, scale, mask)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:  # type: ignore[override]
        (tokens,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return embed_dropout_backward(grad.contiguous(), tokens, ctx.vocab, ctx.scale, ctx.mask), None, None, None, None


def _embedded(table: Tensor, tokens: Tensor, *_: object) -> list[Tensor]:
    return [table.new_empty(*tokens.shape, table.shape[1])]


EMBED_DROPOUT = FunctionOperator("embed_dropout", _EmbedDropout,
                                 "Tensor table, Tensor tokens, Tensor? positions, float scale, Mask? mask", _embedded)
"""The pass as a custom operator, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def _plain_embedding(embedding: nn.Module) -> bool:
    # A subclass may look up otherwise, unless its class says its look-up is nn.Embedding's (TokenEmbedding's is).
    plain_class = type(embedding) is nn.Embedding or getattr(type(embedding), "lookup_is_plain", False)
    return (plain_class and embedding.padding_idx is None and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse and unhooked(embedding))


def _dropout_p(dropout: nn.Module | None) -> float | None:
    """The ``p`` the fused pass applies for ``dropout`` (0 when it is off), or ``None`` if it cannot."""
    if dropout is None:
        return 0.0
    if not getattr(dropout, "counter_masks", False) or dropout.inplace or not unhooked(dropout) or dropout.p >= 1.0:
        return None
    if not dropout.training or dropout.p == 0.0:
        return 0.0
    return dropout.p if 0 < _keep_below(dropout.p) < _INT32_VALUES else None  # else torch's own dropout


def _fuses(tokens: Tensor, embedding: nn.Module, positions: Tensor | None) -> bool:
    table = embedding.weight
    return (_plain_embedding(embedding) and table.dtype == torch.float32 and table.device.type == "cpu"
            and table.is_contiguous() and tokens.device.type == "cpu" and tokens.dtype in (torch.int64, torch.int32)
            and tokens.dim() >= 1 and tokens.numel() > 0
            and (positions is None or (positions.dtype == torch.float32 and positions.device.type == "cpu"
                                       and not positions.requires_grad
                                       and positions.shape == (tokens.shape[-1], table.shape[1])))
            and runs_native(KERNEL, table.device))


def fused_embed_tokens(tokens: Tensor, embedding: nn.Embedding, scale: float = 1.0, positions: Tensor | None = None,
                       dropout: nn.Module | None = None) -> Tensor | None:
    """:func:`embed_tokens` in one pass of the kernel where it applies (see the module's docstring), else ``None``
    (saying why with ``GATEDFORMER_EXPLAIN_FUSION=1``): the caller then computes it with PyTorch operations."""
    p = _dropout_p(dropout)
    if p is None or not _fuses(tokens, embedding, positions):
        if explaining() and torch.is_grad_enabled():
            declined("ops.embedding.embed_tokens", first_reason((embedding.weight, positions), (embedding, dropout),
                                                                (KERNEL,))
                     or "an embedding, dropout or token layout it does not take")
        return None
    keep_below = _keep_below(p)
    mask = None if keep_below >= _INT32_VALUES else (_draw_seed(), keep_below, _INT32_VALUES / keep_below)
    return call(EMBED_DROPOUT, embedding.weight, tokens.to(torch.int64).contiguous(),
                               None if positions is None else positions.contiguous(), scale, mask)


def embed_tokens(tokens: Tensor, embedding: nn.Embedding, scale: float = 1.0, positions: Tensor | None = None,
                 dropout: nn.Module | None = None) -> Tensor:
    """``dropout(embedding(tokens) * scale + positions)``: ``positions`` ``(L, d)`` (or ``None``) is added to
    every sequence of ``tokens`` ``(..., L)``; ``dropout`` a :class:`~gatedformer.nn.dropout.Dropout` (or
    ``None``). One pass forward and one backward where the kernel applies (see the module's docstring), with the
    mask the module would draw; the same operations one by one elsewhere."""
    fused = fused_embed_tokens(tokens, embedding, scale, positions, dropout)
    if fused is not None:
        return fused
    x = embedding(tokens) * scale
    if positions is not None:
        x = x + positions.to(x.dtype)
    return x if dropout is None else dropout(x)
