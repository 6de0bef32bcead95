"""The Transformer language model of the Highway Transformer paper, with gates placed by spec."""

from __future__ import annotations

import math

from torch import Tensor, nn

from gatedformer.config import Backbone, ModelConfig, register_backbone
from gatedformer.gates.spec import SublayerGates, resolve_placement
from gatedformer.nn.attention import CausalSelfAttention, sinusoidal_positions
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.sru import SRU
from gatedformer.nn.sublayer import Sublayer, check_lm_sizes, make_ffn
from gatedformer.ops.embedding import embed_tokens
from gatedformer.ops.output_loss import logits_or_loss

_POSITIONS_CACHED = 1024
"""Rows of the sinusoidal table built with the model (a longer input extends it)."""


class SRUBody(nn.Module):
    """A one-layer SRU over the window, batch-first in and out, as a Transformer sublayer body."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.sru = SRU(d_model, d_model, num_layers=1)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.sru(x.transpose(0, 1))
        return h.transpose(0, 1)


class TransformerLayer(nn.Module):
    """Attention sublayer then feed-forward sublayer: ``U = LN(X + Att(X))``, ``O = LN(U + FFN(U))``.

    With ``sru_sublayer`` an SRU sublayer sits between them (the SRU paper's "Transformer w/ SRU").
    """

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float,
                 norm: str, ffn: str, attn_gates, ffn_gates, sru_sublayer: bool = False) -> None:
        super().__init__()
        self.attn = Sublayer(CausalSelfAttention(d_model, n_heads, attn_dropout), d_model, attn_gates,
                             dropout, norm)
        self.recurrent = Sublayer(SRUBody(d_model), d_model, SublayerGates(), dropout, norm) if sru_sublayer else None
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, dropout), d_model, ffn_gates, dropout, norm)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn(x)
        if self.recurrent is not None:
            x = self.recurrent(x)
        return self.ffn(x)


class TransformerLM(nn.Module):
    """Token embedding + sinusoidal positions, ``n_layers`` causal Transformer layers, softmax output.

    ``forward(tokens (B, L)) -> (logits (B, L, V), None)``; the second value is the recurrent
    state every language model returns (this one has none). ``forward(tokens, targets=targets)`` returns the
    cross-entropy of those logits against ``targets (B, L)`` in their place (``reduction`` ``"mean"`` or ``"sum"``),
    computed without materialising them (:func:`~gatedformer.ops.output_loss.linear_cross_entropy`).
    """

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 3, n_heads: int = 4,
                 d_ffn: int = 512, dropout: float = 0.1, emb_dropout: float | None = None,
                 attn_dropout: float = 0.0, norm: str = "post", ffn: str = "relu",
                 tie_embeddings: bool = False, gates: str = "", sru_sublayer: bool = False) -> None:
        super().__init__()
        check_lm_sizes(vocab_size, d_model, n_layers, n_heads, d_ffn)
        placement = resolve_placement(gates, n_layers)
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.emb_dropout = Dropout(dropout if emb_dropout is None else emb_dropout)
        # The sinusoidal table, computed once (not saved in checkpoints); grown on demand for longer inputs.
        self.register_buffer("positions", sinusoidal_positions(_POSITIONS_CACHED, d_model), persistent=False)
        self.layers = nn.ModuleList(
            TransformerLayer(d_model, n_heads, d_ffn, dropout, attn_dropout, norm, ffn,
                             placement.at(i, "attn"), placement.at(i, "ffn"), sru_sublayer)
            for i in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(d_model) if norm == "pre" else None
        self.output = nn.Linear(d_model, vocab_size)
        if tie_embeddings:
            self.output.weight = self.embedding.weight

    def _positions(self, length: int) -> Tensor:
        if length > self.positions.shape[0]:
            self.positions = sinusoidal_positions(max(length, 2 * self.positions.shape[0]), self.d_model,
                                                  self.positions.device)
        return self.positions[:length]

    def forward(self, tokens: Tensor, state: object = None, *, targets: Tensor | None = None,
                reduction: str = "mean") -> tuple[Tensor, None]:
        x = embed_tokens(tokens, self.embedding, math.sqrt(self.d_model), self._positions(tokens.shape[1]),
                         self.emb_dropout)
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return logits_or_loss(self.output, x, targets, reduction=reduction), None


def _build(cfg: ModelConfig, vocab_size: int, sru_sublayer: bool = False) -> TransformerLM:
    return TransformerLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates, sru_sublayer=sru_sublayer,
    )


register_backbone(Backbone(
    "transformer", "lm", _build,
    "the Highway Transformer paper's LM: sinusoidal positions, causal MHDPA, ReLU (or GLU) FFN, post- or pre-LN"))
register_backbone(Backbone(
    "sru-transformer", "lm", lambda cfg, vocab_size: _build(cfg, vocab_size, sru_sublayer=True),
    "a Transformer with an SRU sublayer in every layer"))
