"""Causal multi-head dot-product attention (MHDPA)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatedformer.ops.attention import causal_attention_packed
from gatedformer.ops.fused_linear import attention_add_norm


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t.

    Q, K and V come out of one fused projection. On the CPU the attention is a compiled kernel that reads
    them straight from the projection's output (:mod:`gatedformer.ops.attention`); elsewhere,
    and for what that kernel does not cover, it is :func:`torch.nn.functional.scaled_dot_product_attention`,
    which picks the fastest kernel for the device (flash / memory-efficient on CUDA).
    """

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

    def features(self, x: Tensor) -> Tensor:
        """The heads' outputs side by side, before the output projection."""
        dropout = self.dropout if self.training else 0.0
        return causal_attention_packed(self.qkv(x), self.n_heads, dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.features(x))

    def add_norm(self, x: Tensor, p: float, norm: nn.LayerNorm, gate: nn.Module | None = None,
                 unit: nn.Module | None = None, eau: nn.Module | None = None) -> Tensor | None:
        """``norm(x + dropout(self(x), p))`` (with a gated residual connection ``gate`` and an SDU branch ``unit``:
        ``norm(gate(x, dropout(self(x) + unit(x), p)))``; with a highway gate ``unit``:
        ``norm(unit(x) + dropout(self(x), p))``; an ``eau`` on the output first) as one autograd function where that
        applies
        (:func:`~gatedformer.ops.fused_linear.attention_add_norm`), else ``None``."""
        return attention_add_norm(x, self.qkv, self.out, self.n_heads, self.dropout if self.training else 0.0, p,
                                  norm, self.training, gate, unit, eau)


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
