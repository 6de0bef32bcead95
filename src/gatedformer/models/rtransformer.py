r"""The R-Transformer language model, with gates placed by spec on its attention and FFN sublayers.

From Wang, Li, Ding and Tang, "R-Transformer: Recurrent Neural Network Enhanced Transformer" (2019,
arXiv:1907.05572). Every layer is three residual sublayers::

    H = LN(X + LocalRNN(X))
    U = LN(H + Att(H))          (gated by the placement spec, as on the vanilla Transformer)
    O = LN(U + FFN(U))          (likewise)

``LocalRNN`` runs a small recurrent network over the window of the ``M`` positions ending at each
position (positions ``t-M+1 .. t``, zeros before the start of the sequence) and returns the last
hidden state of each window. It captures local order, so the model has no positional encoding.

This module is the reference; fused (:mod:`gatedformer.fused.rtransformer`), every step of every window of a LocalRNN
is one compiled call each way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.gates.spec import SublayerGates, resolve_placement
from gatedformer.models.transformer import TRANSFORMER_FIELDS
from gatedformer.nn.attention import CausalSelfAttention
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sublayer import Sublayer, check_lm_sizes, make_ffn

__all__ = ["RNN_TYPES", "LocalRNN", "RTransformerLM", "RTransformerLayer", "RecurrentWeights"]

RNN_TYPES = {"gru": nn.GRU, "lstm": nn.LSTM, "rnn": nn.RNN}
_GATES = {"gru": 3, "lstm": 4, "rnn": 1}


class RecurrentWeights(nn.Module):
    """The parameters of a one-layer ``nn.GRU``, ``nn.LSTM`` or (tanh) ``nn.RNN`` of width ``d``: the same names
    (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``), shapes, gate order and initialisation
    (the same random draws in the same order), so state dicts and seeded models are those of the module itself.

    The LocalRNN only reads these weights; it never runs the module. Holding the module would cost ``torch.compile``
    the whole model: dynamo refuses to trace code that touches an RNN module and runs the frame eagerly.
    :meth:`reference` gives the module, sharing these parameters, for checking against.
    """

    def __init__(self, rnn_type: str, d: int) -> None:
        super().__init__()
        if rnn_type not in RNN_TYPES:
            raise ValueError(f"unknown rnn_type {rnn_type!r}; choose one of {', '.join(RNN_TYPES)}")
        self.rnn_type, self.d = rnn_type, d
        rows = _GATES[rnn_type] * d
        self.weight_ih_l0 = nn.Parameter(torch.empty(rows, d))
        self.weight_hh_l0 = nn.Parameter(torch.empty(rows, d))
        self.bias_ih_l0 = nn.Parameter(torch.empty(rows))
        self.bias_hh_l0 = nn.Parameter(torch.empty(rows))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.d)
        for weight in self.parameters():  # in registration order, as nn.RNNBase draws them
            weight.uniform_(-bound, bound)

    def reference(self) -> nn.RNNBase:
        """``nn.GRU`` / ``nn.LSTM`` / ``nn.RNN`` (batch first) computing with these very parameters."""
        module = RNN_TYPES[self.rnn_type](self.d, self.d, num_layers=1, batch_first=True).to(self.weight_ih_l0)
        for name, weight in self.named_parameters():
            setattr(module, name, weight)
        return module

    def extra_repr(self) -> str:
        return f"{self.rnn_type}, {self.d}"


class LocalRNN(nn.Module):
    r"""A GRU, LSTM or tanh RNN run over the ``window`` positions ending at every position, all at once.

    ``forward(x (B, L, d)) -> (B, L, d)``: output ``t`` is the last hidden state of the RNN started
    from zero and fed ``x[t-M+1], ..., x[t]`` (``M = window``; positions before 0 read zeros). This
    is causal: output ``t`` depends on inputs ``<= t`` only.

    The parameters are those of a one-layer ``nn.GRU``/``nn.LSTM``/``nn.RNN`` (``self.rnn``, a
    :class:`RecurrentWeights`) with the same equations, but the computation never copies the sequence once per
    window. The input projection ``W_ih x + b_ih`` is shared by every window that contains ``x``, so it is
    computed once for the ``L`` positions; step ``j`` of all ``L`` windows then reads that projection shifted by
    ``M-1-j`` positions — a view of a time-major tensor, with the batch and the positions folded into one batch
    of ``L·B`` rows. Only the ``M`` hidden-to-hidden products run step by step, and each step holds ``O(B·L·d)``
    memory rather than a ``(B, L, M, d)`` copy of the sequence.

    Back-propagation through the ``M`` steps keeps each step's gate activations, so training memory grows
    with the window (evaluation memory does not). With ``recompute=True`` only the input is kept and the
    steps run again in the backward pass (activation checkpointing): the step activations of one layer
    at a time exist, instead of those of every layer from the forward pass to the backward pass.
    """

    def __init__(self, d_model: int, window: int, rnn_type: str = "gru", recompute: bool = False) -> None:
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.d_model = d_model
        self.window = window
        self.rnn_type = rnn_type
        self.recompute = recompute
        self.rnn = RecurrentWeights(rnn_type, d_model)

    def forward(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        if cache is not None:
            return self._cached_windows(x, cache)
        if self.recompute and torch.is_grad_enabled():
            # No randomness inside, so the recomputed steps are exactly the first ones.
            return checkpoint(self._windows, x, use_reentrant=False)
        return self._windows(x)

    def _cached_windows(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The outputs at positions that follow those of earlier calls: ``cache["x"]`` keeps the last ``window - 1``
        inputs (zeros before the start, as in one call over the whole sequence), so each new window is complete."""
        if self.window == 1:
            return self._windows(x)
        past = cache.get("x")
        if past is None:
            past = x.new_zeros(x.shape[0], self.window - 1, x.shape[2])
        joined = torch.cat([past, x], dim=1)
        cache["x"] = joined[:, joined.shape[1] - (self.window - 1) :]
        return self._windows(joined)[:, self.window - 1 :]

    def _windows(self, x: Tensor) -> Tensor:
        """The last hidden state of every window of ``x (B, L, d)``: the ``M`` steps of the RNN run over the ``L·B``
        windows at once, as rows of one batch."""
        batch, length, d_model = x.shape
        rnn = self.rnn
        # Input projection of every position, once, time-major: (L, B, G).
        gates_in = F.linear(x, rnn.weight_ih_l0, rnn.bias_ih_l0).transpose(0, 1)
        # Positions before the start read x = 0, whose projection is the bias alone.
        pad = rnn.bias_ih_l0.to(gates_in.dtype).expand(self.window - 1, batch, gates_in.shape[-1])
        gates_in = torch.cat([pad, gates_in], dim=0)
        h = x.new_zeros(length * batch, d_model)
        c = x.new_zeros(length * batch, d_model)
        for j in range(self.window):
            # Step j of the window ending at t reads position t - (M-1) + j: padded index t + j.
            gi = gates_in[j : j + length].reshape(length * batch, -1)
            gh = F.linear(h, rnn.weight_hh_l0, rnn.bias_hh_l0)
            h, c = _CELLS[self.rnn_type](gi, gh, h, c)
        return h.view(length, batch, d_model).transpose(0, 1).contiguous()

    def extra_repr(self) -> str:
        return f"rnn_type={self.rnn_type}, window={self.window}" + (", recompute=True" if self.recompute else "")


def _gru_cell(gi: Tensor, gh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``nn.GRU``'s step from the input and hidden projections ``gi = W_ih x + b_ih``, ``gh = W_hh h + b_hh`` (gates
    r, z, n)."""
    in_r, in_z, in_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    reset = torch.sigmoid(in_r + h_r)
    update = torch.sigmoid(in_z + h_z)
    new = torch.tanh(in_n + reset * h_n)
    return (1 - update) * new + update * h, c


def _lstm_cell(gi: Tensor, gh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``nn.LSTM``'s step (gates i, f, g, o): ``c' = f ⊙ c + i ⊙ g``, ``h' = o ⊙ tanh(c')``."""
    in_gate, forget, cell, out = (gi + gh).chunk(4, dim=-1)
    c = torch.sigmoid(forget) * c + torch.sigmoid(in_gate) * torch.tanh(cell)
    return torch.sigmoid(out) * torch.tanh(c), c


def _rnn_cell(gi: Tensor, gh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``nn.RNN``'s (tanh) step: ``h' = tanh(W_ih x + b_ih + W_hh h + b_hh)``."""
    return torch.tanh(gi + gh), c


_CELLS = {"gru": _gru_cell, "lstm": _lstm_cell, "rnn": _rnn_cell}


class RTransformerLayer(nn.Module):
    """LocalRNN sublayer (never gated), then the gated attention and FFN sublayers."""

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float,
                 norm: str, ffn: str, attn_gates: SublayerGates, ffn_gates: SublayerGates,
                 rnn_type: str, rnn_window: int, rnn_recompute: bool = False) -> None:
        super().__init__()
        self.local_rnn = Sublayer(LocalRNN(d_model, rnn_window, rnn_type, rnn_recompute), d_model, SublayerGates(),
                                  dropout, norm)
        self.attn = Sublayer(CausalSelfAttention(d_model, n_heads, attn_dropout), d_model, attn_gates,
                             dropout, norm)
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, dropout), d_model, ffn_gates, dropout, norm)
        self.recurrent_ffn = ffn == "sru"

    def forward(self, x: Tensor, cache: dict[str, dict] | None = None) -> Tensor:
        """The layer on ``x``; with ``cache`` on positions that follow the cached ones (the LocalRNN's last inputs,
        the attention's keys and values, an SRU feed-forward's cell)."""
        if cache is None:
            return self.ffn(self.attn(self.local_rnn(x)))
        x = self.attn(self.local_rnn(x, cache["rnn"]), cache["attn"])
        return self.ffn(x, cache["ffn"]) if self.recurrent_ffn else self.ffn(x)


class RTransformerLM(nn.Module):
    """Token embedding, ``n_layers`` R-Transformer layers, softmax output; no positional encoding.

    ``forward(tokens (B, L), state=None)`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of
    ``logits (B, L, V)``: every window is read on its own, so there is no state to carry.
    """

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 3, n_heads: int = 4,
                 d_ffn: int = 512, dropout: float = 0.1, emb_dropout: float | None = None,
                 attn_dropout: float = 0.0, norm: str = "post", ffn: str = "relu",
                 tie_embeddings: bool = False, gates: str = "", rnn_type: str = "gru",
                 rnn_window: int = 7, rnn_recompute: bool = False) -> None:
        super().__init__()
        check_lm_sizes(vocab_size, d_model, n_layers, n_heads, d_ffn)
        placement = resolve_placement(gates, n_layers)
        self.d_model = d_model
        self.embedding = TokenEmbedding(vocab_size, d_model)
        self.emb_dropout = Dropout(dropout if emb_dropout is None else emb_dropout)
        self.layers = nn.ModuleList(
            RTransformerLayer(d_model, n_heads, d_ffn, dropout, attn_dropout, norm, ffn,
                              placement.at(i, "attn"), placement.at(i, "ffn"), rnn_type, rnn_window, rnn_recompute)
            for i in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(d_model) if norm == "pre" else None
        self.output = OutputLayer(d_model, vocab_size)
        if tie_embeddings:
            self.output.weight = self.embedding.weight

    def forward(self, tokens: Tensor, state: object = None, *, targets: Tensor | None = None,
                reduction: str = "mean") -> ModelOutput:
        """``logits (B, L, V)``, or with ``targets`` their cross-entropy as ``loss`` in place of the logits (see
        :class:`~gatedformer.models.transformer.TransformerLM`); no ``state``."""
        x = self.embedding(tokens, math.sqrt(self.d_model), dropout=self.emb_dropout)
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if targets is None:
            return ModelOutput(logits=self.output(x))
        return ModelOutput(loss=self.output.loss(x, targets, reduction=reduction))

    def new_cache(self, state: object = None) -> dict:
        """An empty incremental-decoding cache for :meth:`step`."""
        return {"layers": [{"rnn": {}, "attn": {}, "ffn": {}} for _ in self.layers]}

    def step(self, tokens: Tensor, cache: dict) -> Tensor:
        """Logits ``(B, L, V)`` of ``tokens (B, L)`` that follow the tokens already fed through ``cache``, as
        ``forward`` gives them for the whole sequence: each LocalRNN reads its last ``window - 1`` cached inputs,
        each attention its cached keys and values."""
        x = self.embedding(tokens, math.sqrt(self.d_model), dropout=self.emb_dropout)
        for layer, layer_state in zip(self.layers, cache["layers"], strict=True):
            x = layer(x, layer_state)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.output(x)

    def cache_state(self, cache: dict) -> None:
        """What ``forward`` would carry after the tokens fed through ``cache``: nothing."""
        return None


@register_backbone(
    "rtransformer", task="lm",
    description="R-Transformer: a GRU/LSTM localRNN over the last model.rnn_window positions before each attention "
    "sublayer",
    fields=(*TRANSFORMER_FIELDS, "rnn_type", "rnn_window", "rnn_recompute"))
def _build(cfg: ModelConfig, vocab_size: int) -> RTransformerLM:
    return RTransformerLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates, rnn_type=cfg.rnn_type,
        rnn_window=cfg.rnn_window, rnn_recompute=cfg.rnn_recompute,
    )
