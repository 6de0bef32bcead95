r"""The SRU language model: token embedding, a stack of Simple Recurrent Units (:mod:`gatedformer.nn.sru`), a final
LayerNorm and the output layer (Lei et al., EMNLP 2018)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.errors import ConfigError
from gatedformer.gates._checks import check_size
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sru import MAX_HIGHWAY_BIAS, SRU, _dropout_arg

__all__ = ["SRULanguageModel"]


class SRULanguageModel(nn.Module):
    r"""Token embedding, an :class:`SRU` stack, a final LayerNorm and a softmax output layer.

    ``forward(tokens (B, L), state=None)`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of ``logits
    (B, L, V)`` and ``state``, the cell of every layer after the last token, ``(n_layers, B, d_model)``; pass it to
    the next window to carry the recurrence on (detaching it between windows is the caller's job). Embeddings are
    scaled by :math:`\sqrt{d}` (initialised with standard deviation :math:`d^{-1/2}`, so the SRU sees unit-variance
    inputs and tied output weights start small); ``dropout`` applies to the embeddings, between SRU layers and before
    the output layer. The model is causal: logits at ``t`` depend on tokens ``<= t``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        dropout: float = 0.0,
        highway_bias: float = 0.0,
        rescale: bool = True,
        projection_size: int = 0,
        layer_norm: bool = False,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size = check_size("vocab_size", vocab_size, 1)
        self.d_model = check_size("d_model", d_model, 1)
        self.embedding = TokenEmbedding(vocab_size, d_model)
        self.dropout = Dropout(_dropout_arg(dropout))
        self.sru = SRU(
            d_model,
            d_model,
            num_layers=n_layers,
            dropout=dropout,
            highway_bias=highway_bias,
            rescale=rescale,
            projection_size=projection_size,
            layer_norm=layer_norm,
        )
        self.final_norm = nn.LayerNorm(d_model)
        self.output = OutputLayer(d_model, vocab_size)
        if tie_embeddings:
            self.output.weight = self.embedding.weight
        with torch.no_grad():
            nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
            self.output.bias.zero_()

    def forward(self, tokens: Tensor, state: Tensor | None = None, *, targets: Tensor | None = None,
                reduction: str = "mean") -> ModelOutput:
        """``logits (B, L, V)`` and ``state``, or with ``targets`` their cross-entropy as ``loss`` in place of the
        logits (see :class:`~gatedformer.models.transformer.TransformerLM`)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, L), got {tuple(tokens.shape)}")
        x = self.embedding(tokens.t(), math.sqrt(self.d_model), dropout=self.dropout)
        h, new_state = self.sru(x, state)
        hidden = self.dropout(self.final_norm(h))
        if targets is not None:  # time-major, as the hidden states
            return ModelOutput(loss=self.output.loss(hidden, targets.t(), reduction=reduction), state=new_state)
        return ModelOutput(logits=self.output(hidden).transpose(0, 1), state=new_state)

    def new_cache(self, state: Tensor | None = None) -> dict[str, Tensor | None]:
        """An incremental-decoding cache for :meth:`step`, starting from ``state`` (what ``forward`` returned)."""
        return {"state": state}

    def step(self, tokens: Tensor, cache: dict[str, Tensor | None]) -> Tensor:
        """Logits ``(B, L, V)`` of ``tokens (B, L)`` that follow the tokens already fed through ``cache``: the
        recurrence's cells are all it carries."""
        out = self(tokens, cache["state"])
        cache["state"] = out.state
        return out.logits

    def cache_state(self, cache: dict[str, Tensor | None]) -> Tensor | None:
        """The cell states ``forward`` would carry after the tokens fed through ``cache``."""
        return cache["state"]


def _check(cfg: ModelConfig) -> None:
    if not (math.isfinite(cfg.highway_bias) and cfg.highway_bias <= MAX_HIGHWAY_BIAS):
        raise ConfigError(f"model.highway_bias={cfg.highway_bias} must be a finite number of at most "
                          f"{MAX_HIGHWAY_BIAS:g} (alpha = sqrt(1 + 2e^b) overflows beyond); the SRU paper uses 0 or "
                          "below")


@register_backbone(
    "sru", task="lm", gated=False, check=_check,
    description="stacked SRU layers (model.highway_bias, model.rescale, model.projection_size)",
    fields=("d_model", "n_layers", "dropout", "highway_bias", "rescale", "projection_size", "sru_layer_norm",
            "tie_embeddings"))
def _build(cfg: ModelConfig, vocab_size: int) -> SRULanguageModel:
    return SRULanguageModel(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, dropout=cfg.dropout, highway_bias=cfg.highway_bias,
        rescale=cfg.rescale, projection_size=cfg.projection_size, layer_norm=cfg.sru_layer_norm,
        tie_embeddings=cfg.tie_embeddings,
    )
