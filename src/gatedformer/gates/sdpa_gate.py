"""The attention output gate of gated attention: a sigmoid gate on each head's attention output."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._checks import check_size


class SDPAGate(nn.Module):
    r"""Attention output gate, elementwise.

    .. math::

        Y' = Y \odot \sigma(X W_\theta), \qquad W_\theta \in \mathbb{R}^{d \times d}

    From Qiu et al., "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
    Attention-Sink-Free", NeurIPS 2025 (their G1 position, elementwise). ``Y`` is the heads' scaled
    dot-product attention output side by side ``(..., d_model)``, before the output projection ``W_O``, and
    ``X`` the attention sublayer's input (``LN(X)`` with pre-LN, the decoder's stream for a cross-attention):
    one score per feature of every head, so each head's output is gated by the query position's own
    state. As the paper writes it, the gate has no bias: ``d * d`` parameters.

    Call as ``gate(x, y)`` with both of shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "sdpa_gate"

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def gate_activation(self, x: Tensor) -> Tensor:
        """The scores ``σ(X W_θ)``: ``(..., d_model)``."""
        return torch.sigmoid(self.proj(x))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return y * self.gate_activation(x)  # Y ⊙ σ(X W_θ)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"


class HeadwiseSDPAGate(nn.Module):
    r"""Attention output gate, headwise: one score per head.

    .. math::

        Y'_h = Y_h \odot \sigma(X w_{\theta,h}), \qquad W_\theta = [w_{\theta,1} \dots w_{\theta,H}]
        \in \mathbb{R}^{d \times H}

    From Qiu et al., "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
    Attention-Sink-Free", NeurIPS 2025 (G1, headwise). ``Y_h`` is head ``h``'s attention output (its
    ``d_model / n_heads`` columns of ``Y``, the heads side by side before the output projection), ``X`` the
    sublayer's input: the whole head is scaled by one score of the position. ``d * n_heads`` parameters, no bias.

    Call as ``gate(x, y)`` with both of shape ``(..., d_model)``.
    """

    kind: ClassVar[str] = "sdpa_gate_headwise"

    def __init__(self, d_model: int, n_heads: int = 1) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.n_heads = check_size("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.proj = nn.Linear(d_model, n_heads, bias=False)

    def gate_activation(self, x: Tensor) -> Tensor:
        """The scores ``σ(X W_θ)``: ``(..., n_heads)``."""
        return torch.sigmoid(self.proj(x))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        heads = y.unflatten(-1, (self.n_heads, self.d_model // self.n_heads))  # (..., H, d_head)
        return (heads * self.gate_activation(x).unsqueeze(-1)).flatten(-2)  # Y_h ⊙ σ(X w_θ,h)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}"
