"""The fused input layer: :class:`~gatedformer.nn.embedding.TokenEmbedding`'s look-up, scaling, positions and
dropout in one pass of the dropout kernel (:func:`gatedformer.ops.embedding.fused_embed_tokens`)."""

from __future__ import annotations

from torch import Tensor, nn

from gatedformer.fused.registry import implements, reference
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.ops.embedding import fused_embed_tokens

__all__ = ["token_embedding"]


@implements(TokenEmbedding)
def token_embedding(self: TokenEmbedding, tokens: Tensor, scale: float = 1.0, positions: Tensor | None = None,
                    dropout: nn.Module | None = None) -> Tensor:
    """One pass of the kernel, with the mask ``dropout`` would draw; the reference where it declines."""
    fused = fused_embed_tokens(tokens, self, scale, positions, dropout)
    return reference(self)(tokens, scale, positions, dropout) if fused is None else fused
