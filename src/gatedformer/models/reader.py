r"""A document reader for extractive question answering: Chen, Fisch, Weston and Bordes, "Reading Wikipedia to Answer
Open-Domain Questions" (ACL 2017, DrQA's reader), with its recurrent layers SRUs as in Lei et al. (EMNLP 2018, §4.2
and appendix B.2) or DrQA's bi-LSTMs.

Paragraph words :math:`p_1 \ldots p_m` and question words :math:`q_1 \ldots q_l`, embedded by :math:`E`:

.. math::

    \tilde p_i &= [E(p_i);\ f_i;\ \textstyle\sum_j a_{ij} E(q_j)], \qquad
        a_{ij} \propto \exp(\mathrm{ReLU}(W_a E(p_i)) \cdot \mathrm{ReLU}(W_a E(q_j))) \\
    P &= \mathrm{RNN}_p(\tilde p_1 \ldots \tilde p_m), \qquad Q = \mathrm{RNN}_q(E(q_1) \ldots E(q_l)), \qquad
        q = \textstyle\sum_j b_j Q_j, \quad b_j \propto \exp(w \cdot Q_j) \\
    s^{start}_i &= P_i^\top W_s\, q, \qquad s^{end}_i = P_i^\top W_e\, q

:math:`f_i` are the paragraph features that need no tagger: whether :math:`p_i` occurs in the question as written and
lower-cased (DrQA's exact match; its lemma variant needs a lemmatiser and is left out), and :math:`p_i`'s term
frequency in the paragraph (the task computes them, :func:`gatedformer.tasks.qa`). Each RNN is bidirectional and
``n_layers`` deep; ``rnn="sru"`` stacks SRUs and reads the last layer alone (B.2: with highway connections the
concatenation is no longer needed), ``rnn="lstm"`` concatenates every layer's output as DrQA's bi-LSTM reader does.
Dropout: ``emb_dropout`` on the word embeddings (B.2: 0.5), ``dropout`` on every recurrent layer's input, one mask
for all the time steps of a sequence (B.2: 0.2; the SRU paper's variational dropout).

Padding is exact: a paragraph scores the same alone and in a padded batch. The LSTMs read packed sequences; an
SRU layer reads zeros at the padded steps (its backward direction then starts each sequence from a zero cell, as
unpadded), and each layer's output is zeroed there before the next reads it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.errors import ConfigError
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sru import SRU

__all__ = ["FEATURES", "RNN_KINDS", "DocumentReader", "StackedBiRNN"]

RNN_KINDS = ("sru", "lstm")
FEATURES = 3
"""Per paragraph word: exact match as written, exact match lower-cased, term frequency."""


def _check_unit(name: str, value: float) -> float:
    if isinstance(value, bool) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


class StackedBiRNN(nn.Module):
    """``num_layers`` bidirectional recurrent layers over padded sequences.

    ``forward(x (B, L, input_size), mask (B, L) true at words) -> (B, L, output_size)``, zero at padding: the last
    layer's output (``rnn="sru"``, ``output_size = 2 * hidden_size``) or every layer's, concatenated
    (``rnn="lstm"``, ``2 * hidden_size * num_layers``). ``dropout`` applies to each layer's input, one mask per
    sequence for all its steps.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, rnn: str = "sru", dropout: float = 0.0,
                 highway_bias: float = 0.0, rescale: bool = True) -> None:
        super().__init__()
        if rnn not in RNN_KINDS:
            raise ValueError(f"rnn must be one of {', '.join(RNN_KINDS)}, got {rnn!r}")
        if num_layers < 1 or hidden_size < 1:
            raise ValueError(f"num_layers and hidden_size must be positive, got {num_layers} and {hidden_size}")
        self.rnn = rnn
        self.dropout = _check_unit("dropout", dropout)
        layers: list[nn.Module] = []
        for i in range(num_layers):
            size = input_size if i == 0 else 2 * hidden_size
            if rnn == "sru":
                layers.append(SRU(size, hidden_size, num_layers=1, highway_bias=highway_bias, rescale=rescale,
                                  bidirectional=True))
            else:
                layers.append(nn.LSTM(size, hidden_size, num_layers=1, bidirectional=True))
        self.layers = nn.ModuleList(layers)
        self.output_size = 2 * hidden_size * (num_layers if rnn == "lstm" else 1)

    def _drop(self, x: Tensor) -> Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        keep = 1.0 - self.dropout
        return x * x.new_empty((1, *x.shape[1:])).bernoulli_(keep).div_(keep)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        steps = mask.transpose(0, 1).unsqueeze(-1).to(x.dtype)  # (L, B, 1)
        lengths = mask.sum(1).cpu()
        h = x.transpose(0, 1) * steps  # time-major, as the recurrent layers read it
        outputs = []
        for layer in self.layers:
            h = self._drop(h)
            if self.rnn == "sru":
                h = layer(h)[0] * steps
            else:
                packed = pack_padded_sequence(h, lengths.clamp(min=1), enforce_sorted=False)
                h = pad_packed_sequence(layer(packed)[0], total_length=h.shape[0])[0] * steps
            outputs.append(h)
        out = torch.cat(outputs, -1) if self.rnn == "lstm" else outputs[-1]
        return out.transpose(0, 1)


class DocumentReader(nn.Module):
    """DrQA's document reader (see the module docstring).

    ``forward(paragraph (B, M), features (B, M, 3), question (B, N), targets (B, 2) or None) -> ModelOutput``: word
    ids with 0 for padding (after each sequence's words); ``logits`` is ``(B, 2, M)``, the start scores
    ``logits[:, 0]`` and the end scores ``logits[:, 1]`` of every paragraph word (``-inf`` at padding), and ``loss``,
    given ``targets`` (the answer's first and last word), the mean over the batch of the start's and the end's
    cross-entropy. Rows of the embedding from ``fixed_from`` on are not trained (their gradient is zero): DrQA
    tunes only the most frequent question words of pretrained vectors; ``None`` trains every row.
    """

    def __init__(self, vocab_size: int, embedding_dim: int = 300, hidden_size: int = 128, n_layers: int = 3,
                 rnn: str = "sru", dropout: float = 0.2, emb_dropout: float = 0.5, highway_bias: float = 0.0,
                 rescale: bool = True, fixed_from: int | None = None) -> None:
        super().__init__()
        if vocab_size < 2 or embedding_dim < 1:
            raise ValueError(f"vocab_size must be at least 2 and embedding_dim positive, got {vocab_size} and "
                             f"{embedding_dim}")
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.fixed_from = fixed_from
        if fixed_from is not None and fixed_from < vocab_size:
            self.embedding.weight.register_hook(_FixRows(fixed_from))
        self.emb_dropout = nn.Dropout(_check_unit("emb_dropout", emb_dropout))
        self.align = nn.Linear(embedding_dim, embedding_dim)
        self.paragraph_rnn = StackedBiRNN(2 * embedding_dim + FEATURES, hidden_size, n_layers, rnn, dropout,
                                          highway_bias, rescale)
        self.question_rnn = StackedBiRNN(embedding_dim, hidden_size, n_layers, rnn, dropout, highway_bias, rescale)
        size = self.paragraph_rnn.output_size
        self.question_attention = nn.Linear(size, 1)
        self.start = nn.Linear(size, size)
        self.end = nn.Linear(size, size)

    def aligned_question(self, paragraph: Tensor, question: Tensor, question_mask: Tensor) -> Tensor:
        """Each paragraph word's attention-weighted question embedding, ``(B, M, embedding_dim)``."""
        scores = F.relu(self.align(paragraph)) @ F.relu(self.align(question)).transpose(1, 2)
        scores = scores.masked_fill(~question_mask.unsqueeze(1), float("-inf"))
        return scores.softmax(-1) @ question

    def forward(self, paragraph: Tensor, features: Tensor, question: Tensor, targets: Tensor | None = None
                ) -> ModelOutput:
        p_mask, q_mask = paragraph != 0, question != 0
        p_emb = self.emb_dropout(self.embedding(paragraph))
        q_emb = self.emb_dropout(self.embedding(question))
        aligned = self.aligned_question(p_emb, q_emb, q_mask)
        p = self.paragraph_rnn(torch.cat([p_emb, features.to(p_emb.dtype), aligned], -1), p_mask)
        q = self.question_rnn(q_emb, q_mask)
        weights = self.question_attention(q).squeeze(-1).masked_fill(~q_mask, float("-inf")).softmax(-1)
        pooled = (weights.unsqueeze(1) @ q).squeeze(1)  # (B, size)
        start = (p @ self.start(pooled).unsqueeze(-1)).squeeze(-1)
        end = (p @ self.end(pooled).unsqueeze(-1)).squeeze(-1)
        logits = torch.stack([start, end], 1).float().masked_fill(~p_mask.unsqueeze(1), float("-inf"))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits[:, 0], targets[:, 0]) + F.cross_entropy(logits[:, 1], targets[:, 1])
        return ModelOutput(logits=logits, loss=loss)


class _FixRows:
    """A gradient hook that zeroes the rows of an embedding's gradient from ``first`` on (a class, not a closure, so
    that a model with it deep-copies and pickles)."""

    def __init__(self, first: int) -> None:
        self.first = first

    def __call__(self, grad: Tensor) -> Tensor:
        grad = grad.clone()
        grad[self.first:] = 0
        return grad


def _check(cfg: ModelConfig) -> None:
    if cfg.rnn not in RNN_KINDS:
        raise ConfigError(f"model.rnn={cfg.rnn!r} is not one of {', '.join(RNN_KINDS)}; pick sru (the SRU paper's "
                          "reader) or lstm (DrQA's)")
    if cfg.rnn == "lstm" and (cfg.highway_bias != 0.0 or not cfg.rescale):
        raise ConfigError("model.highway_bias and model.rescale shape the SRU's highway; with model.rnn=lstm leave "
                          "them at their defaults")


@register_backbone(
    "reader", task="qa", gated=False, check=_check,
    description="DrQA's document reader: word embeddings, exact-match and term-frequency features, aligned question "
    "embedding, bidirectional model.rnn (sru: the last of model.n_layers layers read; lstm: all concatenated) of "
    "model.d_model units, self-attentive question pooling, bilinear start and end scores",
    fields=("d_model", "n_layers", "dropout", "emb_dropout", "highway_bias", "rescale", "rnn"))
def build_reader(cfg: ModelConfig, vocab_size: int, embedding_dim: int = 300,
                 fixed_from: int | None = None) -> DocumentReader:
    emb_dropout = cfg.dropout if cfg.emb_dropout is None else cfg.emb_dropout
    return DocumentReader(vocab_size, embedding_dim, cfg.d_model, cfg.n_layers, cfg.rnn, cfg.dropout, emb_dropout,
                          cfg.highway_bias, cfg.rescale, fixed_from)
