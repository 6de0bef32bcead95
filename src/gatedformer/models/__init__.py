"""The models. Each module defines one backbone and registers its build function with the task it serves, by the
decorator beside it (``@register_backbone(name, task=..., fields=...)``, :func:`gatedformer.config.register_backbone`);
the table in :mod:`gatedformer.config` is the one list of backbones, and importing this package fills it.

Every model's ``forward`` returns a :class:`~gatedformer.nn.outputs.ModelOutput`: its ``logits``, or given
``targets`` its ``loss``, and for a language model (``forward(tokens (B, L), state)``) the ``state`` it carries from
one window to the next (``None`` for most; the Transformer-XL memory; the SRU cell states). Models are the plain
PyTorch reference: :func:`gatedformer.fused.fuse` plugs the fused paths in. Models know nothing about how they are
trained.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gatedformer.config import ModelConfig, backbone_names, get_backbone
from gatedformer.errors import ConfigError
from gatedformer.gates.spec import parse_gate_spec, resolve_placement
from gatedformer.nn.sru import SRU

# isort: off
# In this order, so that the table lists the backbones as the README does (the Transformer first).
from gatedformer.models.transformer import TransformerLM
from gatedformer.models.gcnn import GatedConvLM
from gatedformer.models.rtransformer import RTransformerLM
from gatedformer.models.transformer_xl import TransformerXLLM
from gatedformer.models.sru import SRULanguageModel
from gatedformer.models.seq2seq import Seq2SeqTransformer
from gatedformer.models.convs2s import ConvS2S
from gatedformer.models.bert import BertForMaskedLM, BertForSequenceClassification
from gatedformer.models.sentclass import SentenceClassifier
from gatedformer.models.reader import DocumentReader
# isort: on


def build_backbone(cfg: ModelConfig, task: str, *sizes: Any) -> nn.Module:
    """The network ``cfg.backbone`` registered for ``task``, built with the sizes the task knows (its vocabulary,
    classes, ...); a value its modules reject is one ConfigError naming the backbone."""
    backbone = get_backbone(cfg.backbone, task)
    try:
        return backbone.build(cfg, *sizes)
    except ValueError as err:
        # The modules check their own arguments; a rejected value is the user's config, not a bug.
        raise ConfigError(f"model config rejected by backbone {cfg.backbone}: {err}; change that model field") from None


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Instantiate the language model ``cfg.backbone`` for a vocabulary of ``vocab_size``."""
    return build_backbone(cfg, "lm", vocab_size)


__all__ = [
    "SRU",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "ConvS2S",
    "DocumentReader",
    "GatedConvLM",
    "RTransformerLM",
    "SRULanguageModel",
    "SentenceClassifier",
    "Seq2SeqTransformer",
    "TransformerLM",
    "TransformerXLLM",
    "backbone_names",
    "build_backbone",
    "build_model",
    "parse_gate_spec",
    "resolve_placement",
]
