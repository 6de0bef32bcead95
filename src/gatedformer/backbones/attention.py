"""Causal multi-head dot-product attention (MHDPA)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t.

    Q, K and V come out of one fused projection; the attention itself is
    :func:`torch.nn.functional.scaled_dot_product_attention`, which picks the fastest kernel for
    the device (flash / memory-efficient on CUDA, a fused C++ kernel on CPU).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        batch, length, d_model = x.shape
        # (B, L, 3, H, dh) split on dim 2, heads moved by transposed views: the backward pass then writes the
        # three gradients straight into the (B, L, 3d) layout of the projection, with no permuted copy.
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(batch, length, 3, self.n_heads, -1).unbind(2))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(attended.transpose(1, 2).reshape(batch, length, d_model))


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
