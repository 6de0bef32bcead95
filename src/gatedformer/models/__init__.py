"""The models. Each backbone is built from a :class:`~gatedformer.config.ModelConfig` by name.

Every language model here has the same interface, ``forward(tokens (B, L), state) -> (logits, state)``,
where ``state`` is whatever the model carries from one window to the next (``None`` for most; the
Transformer-XL memory; the SRU cell states). Models know nothing about how they are trained.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gatedformer.config import ModelConfig
from gatedformer.errors import ConfigError
from gatedformer.gates.spec import parse_gate_spec, resolve_placement
from gatedformer.models.gcnn import GatedConvLM
from gatedformer.models.rtransformer import RTransformerLM
from gatedformer.models.sru import SRULanguageModel
from gatedformer.models.transformer import TransformerLM
from gatedformer.models.transformer_xl import TransformerXLLM
from gatedformer.nn.sru import SRU


def _transformer(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return TransformerLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates,
    )


def _sru_transformer(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return TransformerLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates, sru_sublayer=True,
    )


def _sru(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return SRULanguageModel(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, dropout=cfg.dropout, highway_bias=cfg.highway_bias,
        rescale=cfg.rescale, projection_size=cfg.projection_size, layer_norm=cfg.sru_layer_norm,
        tie_embeddings=cfg.tie_embeddings,
    )


def _gcnn(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return GatedConvLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, kernel_size=cfg.kernel_size, dropout=cfg.dropout,
        bottleneck=cfg.bottleneck, weight_norm=cfg.weight_norm, tie_embeddings=cfg.tie_embeddings,
    )


def _rtransformer(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return RTransformerLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates, rnn_type=cfg.rnn_type,
        rnn_window=cfg.rnn_window, rnn_recompute=cfg.rnn_recompute,
    )


def _transformer_xl(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    return TransformerXLLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates, mem_len=cfg.mem_len,
    )


BUILDERS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "transformer": _transformer,
    "gcnn": _gcnn,
    "rtransformer": _rtransformer,
    "transformer-xl": _transformer_xl,
    "sru": _sru,
    "sru-transformer": _sru_transformer,
}


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Instantiate the language model ``cfg.backbone`` for a vocabulary of ``vocab_size``."""
    builder = BUILDERS.get(cfg.backbone)
    if builder is None:
        raise ConfigError(
            f"model.backbone={cfg.backbone!r} is not available; choose one of {', '.join(sorted(BUILDERS))}"
        )
    try:
        return builder(cfg, vocab_size)
    except ValueError as err:
        # The modules check their own arguments; a rejected value is the user's config, not a bug.
        raise ConfigError(f"model config rejected by backbone {cfg.backbone}: {err}; change that model field") from None


__all__ = [
    "BUILDERS",
    "GatedConvLM",
    "RTransformerLM",
    "SRU",
    "SRULanguageModel",
    "TransformerLM",
    "TransformerXLLM",
    "build_model",
    "parse_gate_spec",
    "resolve_placement",
]
