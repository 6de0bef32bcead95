"""The models gatedformer is measured against: plain PyTorch and x-transformers of the same size."""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch import Tensor, nn

from gatedformer.analysis.bench.options import BenchSize
from gatedformer.nn.attention import sinusoidal_positions
from gatedformer.nn.outputs import ModelOutput


class TorchReferenceLM(nn.Module):
    """The baseline Transformer LM written with ``torch.nn.TransformerEncoder`` only, as a speed reference.

    Same sizes, post-LN, ReLU, the same dropout sites and rates (attention-weight dropout = ``attn_dropout``),
    scaled embeddings plus a fixed sinusoidal table, a causal mask (``is_causal=True``) and an output layer
    with a bias: exactly the parameter count of :class:`~gatedformer.models.transformer.TransformerLM`.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ffn: int, dropout: float,
                 max_len: int, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.emb_dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ffn, dropout, activation="relu", batch_first=True,
                                           norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        for block in self.encoder.layers:
            block.self_attn.dropout = attn_dropout
        self.output = nn.Linear(d_model, vocab_size)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(max_len), persistent=False)

    def forward(self, tokens: Tensor, state: object = None) -> ModelOutput:
        length = tokens.shape[1]
        x = self.emb_dropout(self.embedding(tokens) * math.sqrt(self.d_model) + self.positions[:length])
        h = self.encoder(x, mask=self.mask[:length, :length], is_causal=True)
        return ModelOutput(logits=self.output(h))


class XTransformersLM(nn.Module):
    """x-transformers' ``TransformerWrapper`` + ``Decoder`` of the same size, as close to ours as it allows:
    post-LN, ReLU FFN, sinusoidal positions (with its learned scale), the same dropout sites, flash attention.
    It has no biases in the attention projections or the output layer and LayerNorms without bias."""

    def __init__(self, size: BenchSize) -> None:
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        self.net = TransformerWrapper(
            num_tokens=size.vocab, max_seq_len=size.seq_len, emb_dropout=size.dropout, scaled_sinu_pos_emb=True,
            attn_layers=Decoder(dim=size.d_model, depth=size.n_layers, heads=size.n_heads,
                                attn_dim_head=size.d_model // size.n_heads, pre_norm=False,
                                ff_mult=size.ffn / size.d_model, ff_custom_activation=nn.ReLU(),
                                ff_dropout=size.dropout, ff_sublayer_dropout=size.dropout,
                                attn_sublayer_dropout=size.dropout, attn_flash=True),
        )

    def forward(self, tokens: Tensor, state: object = None) -> ModelOutput:
        return ModelOutput(logits=self.net(tokens))


def import_quietly(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(name)
