r"""Sentence classification with a stack of Simple Recurrent Units (Lei et al., EMNLP 2018, §4.1 and appendix B.1).

.. math::

    e_t = \mathrm{Dropout}(E[w_t]), \qquad h = \mathrm{SRU}^{(n)}(e_1 \ldots e_T), \qquad
    \mathrm{logits} = W\,\mathrm{Dropout}(h_T) + b

``E`` holds word vectors (pretrained word2vec or GloVe ones where given, the others uniform in [-0.25, 0.25] as in
Kim 2014), ``h_T`` is the last layer's state at the sentence's last word, and the SRU stack applies the same dropout
between its layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.errors import ConfigError
from gatedformer.gates._checks import check_size
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sru import SRU, _dropout_arg

__all__ = ["UNKNOWN_RANGE", "SentenceClassifier"]

UNKNOWN_RANGE = 0.25
"""Word vectors without a pretrained one start uniform in [-0.25, 0.25] (Kim 2014, as the SRU paper)."""


class SentenceClassifier(nn.Module):
    """Word embeddings, a stack of SRUs, dropout and a linear layer over the last word's state.

    ``forward(tokens (B, L), lengths (B,))`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of ``logits
    (B, num_labels)``; id 0 is padding, after each sentence's
    ``lengths`` words. ``freeze_embeddings`` keeps the word vectors fixed.
    """

    def __init__(self, vocab_size: int, num_labels: int, embedding_dim: int = 300, hidden_size: int = 128,
                 n_layers: int = 2, dropout: float = 0.5, highway_bias: float = 0.0, rescale: bool = True,
                 layer_norm: bool = False, freeze_embeddings: bool = False) -> None:
        super().__init__()
        check_size("vocab_size", vocab_size, 2)
        check_size("num_labels", num_labels, 2)
        self.embedding = nn.Embedding(vocab_size, check_size("embedding_dim", embedding_dim), padding_idx=0)
        with torch.no_grad():
            self.embedding.weight.uniform_(-UNKNOWN_RANGE, UNKNOWN_RANGE)
            self.embedding.weight[0].zero_()
        self.embedding.weight.requires_grad_(not freeze_embeddings)
        self.dropout = Dropout(_dropout_arg(dropout))
        self.sru = SRU(embedding_dim, hidden_size, num_layers=n_layers, dropout=dropout, highway_bias=highway_bias,
                       rescale=rescale, layer_norm=layer_norm)
        self.output = nn.Linear(hidden_size, num_labels)

    def forward(self, tokens: Tensor, lengths: Tensor) -> ModelOutput:
        states, _ = self.sru(self.dropout(self.embedding(tokens)).transpose(0, 1))
        last = states[lengths.to(states.device) - 1, torch.arange(tokens.shape[0], device=states.device)]
        return ModelOutput(logits=self.output(self.dropout(last)))


def _check(cfg: ModelConfig) -> None:
    if cfg.projection_size:
        raise ConfigError("model.projection_size does not apply to the sentence classifier; leave it at 0")


@register_backbone(
    "sru", task="sentclass", gated=False, check=_check,
    description="word vectors, a stack of SRUs (model.d_model units, model.n_layers layers) and a linear layer over "
    "the last word's state",
    fields=("d_model", "n_layers", "dropout", "highway_bias", "rescale", "sru_layer_norm"))
def build_classifier(cfg: ModelConfig, vocab_size: int, num_labels: int, embedding_dim: int = 300,
                     freeze_embeddings: bool = False) -> SentenceClassifier:
    return SentenceClassifier(vocab_size, num_labels, embedding_dim, cfg.d_model, cfg.n_layers, cfg.dropout,
                              cfg.highway_bias, cfg.rescale, cfg.sru_layer_norm, freeze_embeddings)
