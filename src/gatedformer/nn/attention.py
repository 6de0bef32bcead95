"""Multi-head dot-product attention (MHDPA): causal for the language models, bidirectional with a padding mask for
the encoders (BERT)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class _PackedHeads(nn.Module):
    """What both self-attentions hold: Q, K and V from one projection ``qkv`` (rows in that order), the heads'
    outputs through ``out`` (the ``output_projection``, which a fused path joins to the sublayer's dropout, residual
    and norm)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    @property
    def output_projection(self) -> nn.Linear:
        return self.out


class CausalSelfAttention(_PackedHeads):
    """Multi-head self-attention where position t sees positions <= t:
    ``softmax(Q Kᵀ / √d_head + causal mask) V`` per head, the heads side by side through ``out``.

    Q, K and V come out of one projection. The attention is :func:`torch.nn.functional.scaled_dot_product_attention`,
    which picks the fastest kernel for the device (flash / memory-efficient on CUDA); on the CPU a fused model reads
    Q, K and V straight from the projection's output in a compiled kernel (:mod:`gatedformer.fused.sublayer`).
    """

    def features(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        """The heads' outputs side by side, before the output projection.

        With ``cache`` (a dict, empty at the first call) ``x`` holds the positions that follow those of earlier
        calls: their keys and values are kept in the cache, and each new position attends to every earlier one and
        to the new ones up to itself, as it would in one call over the whole sequence (incremental decoding)."""
        if cache is not None:
            return self._cached_features(x, cache)
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)
        return attended.transpose(1, 2).reshape(batch, length, width)

    def _cached_features(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        if "k" in cache:
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
        cache["k"], cache["v"] = k, v
        mask = None
        if length > 1:  # new position i (after `past` cached ones) sees keys 0 .. past + i
            past = k.shape[2] - length
            mask = torch.ones(length, k.shape[2], dtype=torch.bool, device=x.device).tril(past)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=self.dropout if self.training else 0.0)
        return attended.transpose(1, 2).reshape(batch, length, width)

    def forward(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        return self.out(self.features(x, cache))


class BidirectionalSelfAttention(_PackedHeads):
    """Multi-head self-attention where every position sees every real (unpadded) one: an encoder's attention.

    Q, K and V come out of one fused projection ``qkv`` (rows in that order), the heads' outputs go through ``out``.
    ``features(x, key_mask=None, context=None)`` is everything before ``out`` (where a fused
    path joins ``out`` to the sublayer's dropout, residual add and LayerNorm): ``x``
    ``(B, Lq, d)`` gives the queries, ``context`` ``(B, Lk, d)`` the keys and values (``x`` itself by default: an
    encoder's last layer may ask for a few query rows only, e.g. the masked positions of masked language modelling,
    and read keys and values from every row), ``key_mask`` ``(B, Lk)`` is True at the real tokens. The attention is
    :func:`torch.nn.functional.scaled_dot_product_attention`.
    """

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2)

    def features(self, x: Tensor, key_mask: Tensor | None = None, context: Tensor | None = None) -> Tensor:
        """The heads' outputs side by side, before the output projection: ``(B, Lq, d)``."""
        batch, length, width = x.shape
        if context is None:
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(batch, length, 3, self.n_heads, -1).unbind(2))
        else:
            weight, bias = self.qkv.weight, self.qkv.bias
            q = self._heads(F.linear(x, weight[:width], bias[:width]))
            k, v = (t.transpose(1, 2) for t in F.linear(context, weight[width:], bias[width:])
                    .view(batch, context.shape[1], 2, self.n_heads, -1).unbind(2))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=self.dropout if self.training else 0.0)
        return attended.transpose(1, 2).reshape(batch, length, width)

    def forward(self, x: Tensor, key_mask: Tensor | None = None, context: Tensor | None = None) -> Tensor:
        return self.out(self.features(x, key_mask, context))


def sinusoidal_positions(length: int, d_model: int, device: torch.device | None = None,
                         dtype: torch.dtype = torch.float32, offset: int = 0) -> Tensor:
    """The fixed sinusoidal encoding of Vaswani et al.: ``(length, d_model)``."""
    position = torch.arange(offset, offset + length, device=device, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(
        torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-torch.log(torch.tensor(10000.0)) / d_model)
    )
    table = torch.zeros(length, d_model, device=device, dtype=torch.float32)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : d_model // 2]
    return table.to(dtype)
