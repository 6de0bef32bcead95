"""The Transformer language model of the Highway Transformer paper, with gates placed by spec, and the SRU paper's
Transformer with an SRU in every feed-forward sublayer (``sru-transformer``)."""

from __future__ import annotations

import math

from torch import Tensor, nn

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.errors import ConfigError
from gatedformer.gates.spec import resolve_placement
from gatedformer.nn.attention import CausalSelfAttention, sinusoidal_positions
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sublayer import Sublayer, check_lm_sizes, make_ffn

_POSITIONS_CACHED = 1024
"""Rows of the sinusoidal table built with the model (a longer input extends it)."""
TRANSFORMER_FIELDS = ("d_model", "n_layers", "n_heads", "d_ffn", "dropout", "emb_dropout", "attn_dropout", "norm",
                      "ffn", "tie_embeddings", "gates")
"""The ``[model]`` fields a Transformer reads; the backbones built on its layers add their own."""
SRU_FFN_FIELDS = tuple(key for key in TRANSFORMER_FIELDS if key != "ffn")
"""With an SRU as every feed-forward's hidden layer, ``model.ffn`` has nothing to choose."""


class TransformerLayer(nn.Module):
    """Attention sublayer then feed-forward sublayer: ``U = LN(X + Att(X))``, ``O = LN(U + FFN(U))``.

    ``ffn="sru"`` gives the SRU paper's "Transformer w/ SRU": the feed-forward's hidden layer is an SRU
    (:class:`~gatedformer.nn.sru.SRUFeedForward`), ``O = LN(U + W2 · SRU(U) + b2)``.
    """

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float,
                 norm: str, ffn: str, attn_gates, ffn_gates) -> None:
        super().__init__()
        self.attn = Sublayer(CausalSelfAttention(d_model, n_heads, attn_dropout), d_model, attn_gates,
                             dropout, norm)
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, dropout), d_model, ffn_gates, dropout, norm)
        self.recurrent_ffn = ffn == "sru"

    def forward(self, x: Tensor, cache: dict[str, dict] | None = None) -> Tensor:
        """The layer on ``x``; with ``cache`` (from :func:`layer_cache`) on positions that follow the cached ones:
        the attention's keys and values, and an SRU feed-forward's cell, are carried in it."""
        if cache is None:
            return self.ffn(self.attn(x))
        x = self.attn(x, cache["attn"])
        return self.ffn(x, cache["ffn"]) if self.recurrent_ffn else self.ffn(x)


def layer_cache() -> dict[str, dict]:
    """An empty incremental-decoding cache of one Transformer-style layer: attention keys/values, SRU cell."""
    return {"attn": {}, "ffn": {}}


class TransformerLM(nn.Module):
    """Token embedding + sinusoidal positions, ``n_layers`` causal Transformer layers, softmax output.

    ``forward(tokens (B, L))`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of ``logits (B, L, V)`` and
    ``state``, the recurrent state every language model carries (this one has none: ``None``).
    ``forward(tokens, targets=targets)`` gives the cross-entropy of those logits against ``targets (B, L)`` as its
    ``loss`` in their place (``reduction`` ``"mean"`` or ``"sum"``; the output layer's
    :meth:`~gatedformer.nn.output.OutputLayer.loss`, which the fused model computes without the logits).
    """

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 3, n_heads: int = 4,
                 d_ffn: int = 512, dropout: float = 0.1, emb_dropout: float | None = None,
                 attn_dropout: float = 0.0, norm: str = "post", ffn: str = "relu",
                 tie_embeddings: bool = False, gates: str = "") -> None:
        super().__init__()
        check_lm_sizes(vocab_size, d_model, n_layers, n_heads, d_ffn)
        placement = resolve_placement(gates, n_layers)
        self.d_model = d_model
        self.embedding = TokenEmbedding(vocab_size, d_model)
        self.emb_dropout = Dropout(dropout if emb_dropout is None else emb_dropout)
        # The sinusoidal table, computed once (not saved in checkpoints); grown on demand for longer inputs.
        self.register_buffer("positions", sinusoidal_positions(_POSITIONS_CACHED, d_model), persistent=False)
        self.layers = nn.ModuleList(
            TransformerLayer(d_model, n_heads, d_ffn, dropout, attn_dropout, norm, ffn,
                             placement.at(i, "attn"), placement.at(i, "ffn"))
            for i in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(d_model) if norm == "pre" else None
        self.output = OutputLayer(d_model, vocab_size)
        if tie_embeddings:
            self.output.weight = self.embedding.weight

    def _positions(self, length: int) -> Tensor:
        if length > self.positions.shape[0]:
            self.positions = sinusoidal_positions(max(length, 2 * self.positions.shape[0]), self.d_model,
                                                  self.positions.device)
        return self.positions[:length]

    def forward(self, tokens: Tensor, state: object = None, *, targets: Tensor | None = None,
                reduction: str = "mean") -> ModelOutput:
        x = self.embedding(tokens, math.sqrt(self.d_model), self._positions(tokens.shape[1]), self.emb_dropout)
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if targets is None:
            return ModelOutput(logits=self.output(x))
        return ModelOutput(loss=self.output.loss(x, targets, reduction=reduction))

    def new_cache(self, state: object = None) -> dict:
        """An empty incremental-decoding cache for :meth:`step` (``state``: what ``forward`` carries, ``None``)."""
        return {"length": 0, "layers": [layer_cache() for _ in self.layers]}

    def step(self, tokens: Tensor, cache: dict) -> Tensor:
        """Logits ``(B, L, V)`` of ``tokens (B, L)`` that follow the tokens already fed through ``cache``: the
        logits ``forward`` gives at those positions for the whole sequence, computed from each layer's cached keys
        and values (a key/value cache) in ``O(L · (past + L))`` attention work, not the whole prefix's."""
        start = cache["length"]
        positions = self._positions(start + tokens.shape[1])[start:]
        x = self.embedding(tokens, math.sqrt(self.d_model), positions, self.emb_dropout)
        for layer, layer_state in zip(self.layers, cache["layers"], strict=True):
            x = layer(x, layer_state)
        if self.final_norm is not None:
            x = self.final_norm(x)
        cache["length"] = start + tokens.shape[1]
        return self.output(x)

    def cache_state(self, cache: dict) -> None:
        """What ``forward`` would carry after the tokens fed through ``cache``: nothing."""
        return None


@register_backbone(
    "transformer", task="lm", fields=TRANSFORMER_FIELDS,
    description="the Highway Transformer paper's LM: sinusoidal positions, causal MHDPA, ReLU (or GLU) FFN, post- or "
    "pre-LN")
def _build(cfg: ModelConfig, vocab_size: int, ffn: str | None = None) -> TransformerLM:
    return TransformerLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=ffn or cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates,
    )


def check_sru_ffn(cfg: ModelConfig) -> None:
    """The SRU takes the place of the feed-forward's hidden layer: ``model.ffn`` has nothing left to choose."""
    if cfg.ffn != "relu":
        raise ConfigError(f"model.backbone={cfg.backbone} puts an SRU in place of the feed-forward's hidden layer, so "
                          f"model.ffn={cfg.ffn!r} does not apply; leave model.ffn at relu or use model.backbone="
                          "transformer")


@register_backbone(
    "sru-transformer", task="lm", check=check_sru_ffn, fields=SRU_FFN_FIELDS,
    description="the SRU paper's Transformer w/ SRU: every feed-forward's hidden layer is an SRU of model.d_ffn units "
    "(no highway term) before the output projection")
def _build_sru(cfg: ModelConfig, vocab_size: int) -> TransformerLM:
    return _build(cfg, vocab_size, ffn="sru")
