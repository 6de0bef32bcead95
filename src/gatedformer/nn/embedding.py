"""A model's input layer: token embeddings, scaled, plus positions, through dropout."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["TokenEmbedding"]


class TokenEmbedding(nn.Embedding):
    """A table of token vectors (an :class:`torch.nn.Embedding`: the same parameter, ``weight``, and options such as
    ``padding_idx``) whose ``forward`` is the whole input layer of a sequence model,
    ``dropout(table[tokens] * scale + positions)``; :mod:`gatedformer.fused.embedding` computes it in one pass."""

    lookup_is_plain = True
    """Its look-up is ``F.embedding`` of its own weight and options, which :mod:`gatedformer.ops.embedding` may fuse
    (a subclass that looks up otherwise sets this to ``False``)."""

    def forward(self, tokens: Tensor, scale: float = 1.0, positions: Tensor | None = None,
                dropout: nn.Module | None = None) -> Tensor:
        """``dropout(table[tokens] * scale + positions)``: ``tokens`` ``(..., L)``; ``positions`` ``(L, d)`` (or
        ``None``) added to every sequence; ``dropout`` a dropout module (or ``None``)."""
        x = F.embedding(tokens, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                        self.scale_grad_by_freq, self.sparse) * scale
        if positions is not None:
            x = x + positions.to(x.dtype)
        return x if dropout is None else dropout(x)
