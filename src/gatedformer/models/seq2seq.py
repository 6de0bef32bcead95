"""Encoder-decoder Transformer for translation, with EAU and GRC (and the SDU family) placed by spec.

The parameter layout is that of :class:`torch.nn.Transformer` (post-LN layers; a final LayerNorm after
the encoder stack and after the decoder stack; attention projections of ``4k² + 4k`` parameters),
plus source and target token embeddings scaled by ``sqrt(k)``, fixed sinusoidal positions (no learned
positions) and an output projection with bias over the target vocabulary.

Hyperparameters, named as the EAU/GRC paper names them:

=====  ==========================  ============================
name   meaning                     argument
=====  ==========================  ============================
l      layers (encoder = decoder)  ``layers`` (``model.n_layers``)
n      longest sequence, tokens    ``max_len`` (``translation.max_len``)
k      model width                 ``d_model`` (``model.d_model``)
f      feed-forward width          ``ffn`` (``model.d_ffn``)
heads  attention heads             ``heads`` (``model.n_heads``)
=====  ==========================  ============================

Gates: ``eau=True`` puts an EAU after **every** multi-head attention (encoder self-attention, decoder
self-attention, decoder cross-attention: ``3l`` units); ``grc=True`` puts a GRC in place of **every**
residual connection (two per encoder layer, three per decoder layer: ``5l`` units). Any other gate
spec of :mod:`gatedformer.gates.spec` works too (``gates="+σ SDU"``, ``"eau /cross"``...);
layer ``Li`` of a spec is encoder layer i and decoder layer i.

The feed-forward body is ``ffn_kind``: ``relu`` (the paper's), ``glu``, or ``sru``: the SRU paper's "Transformer w/
SRU" (Lei et al. 2018, appendix B.3), whose feed-forward hidden layer is an SRU of ``f`` units without highway term
(:class:`~gatedformer.nn.sru.SRUFeedForward`) in every encoder and decoder layer, registered as the ``sru-transformer``
backbone. The SRU runs left to right, so the decoder stays causal; incremental decoding carries its last cell.

Sequences: the source is ``tokens <eos>``, the decoder input ``<bos> tokens`` and its target
``tokens <eos>``, right-padded with ``pad_id``. Padded source positions are masked out of every
attention; the decoder's self-attention is causal, which also keeps real positions away from the
target's right padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.gates.spec import SublayerGates, resolve_placement
from gatedformer.models.transformer import SRU_FFN_FIELDS, TRANSFORMER_FIELDS, check_sru_ffn
from gatedformer.nn.attention import sinusoidal_positions
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sru import SRUFeedForward
from gatedformer.nn.sublayer import Sublayer, make_ffn

Cache = list[dict[str, Any]]


def _heads(x: Tensor, n_heads: int) -> Tensor:
    """``(B, L, k)`` -> ``(B, heads, L, k / heads)``."""
    batch, length, d_model = x.shape
    return x.view(batch, length, n_heads, d_model // n_heads).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    batch, n_heads, length, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, length, n_heads * d_head)


class SelfAttention(nn.Module):
    """Multi-head self-attention, optionally causal, with a key padding mask and an incremental cache.

    ``forward(x, key_mask=None, causal=False, cache=None)``: ``key_mask (B, L)`` is True at real
    tokens. With ``cache`` (a dict) the keys and values of earlier calls are kept in it, so a decoder
    can be fed one position at a time.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor, key_mask: Tensor | None = None, causal: bool = False,
                cache: dict[str, Tensor] | None = None) -> Tensor:
        return self.out(self.features(x, key_mask, causal, cache))

    def features(self, x: Tensor, key_mask: Tensor | None = None, causal: bool = False,
                 cache: dict[str, Tensor] | None = None) -> Tensor:
        """The heads' outputs side by side, before the output projection ``out`` (where an attention output gate
        goes)."""
        q, k, v = (_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
        if cache is not None:
            if "k" in cache:
                if causal and x.shape[1] != 1:
                    raise ValueError("a cached causal self-attention takes one new position per call")
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
                causal = False  # the single new position may see every cached one
            cache["k"], cache["v"] = k, v
        mask = None if key_mask is None else key_mask[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  dropout_p=self.dropout if self.training else 0.0)
        return _merge(attended)


class CrossAttention(nn.Module):
    """Multi-head attention from the decoder (queries) to the encoder output (keys and values).

    ``forward(x, memory, memory_mask, cache=None)``; with ``cache`` the projected keys and values of
    ``memory`` are computed once and reused.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={n_heads}")
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None,
                cache: dict[str, Tensor] | None = None) -> Tensor:
        return self.out(self.features(x, memory, memory_mask, cache))

    def features(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None,
                 cache: dict[str, Tensor] | None = None) -> Tensor:
        """The heads' outputs side by side, before the output projection ``out``."""
        q = _heads(self.q(x), self.n_heads)
        if cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = (_heads(t, self.n_heads) for t in self.kv(memory).chunk(2, dim=-1))
            if cache is not None:
                cache["k"], cache["v"] = k, v
        mask = None if memory_mask is None else memory_mask[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=self.dropout if self.training else 0.0)
        return _merge(attended)

    def probabilities(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None) -> Tensor:
        """The attention weights ``(B, heads, T, S)`` of every query over the memory (what ``forward`` averages the
        values with, before dropout)."""
        q = _heads(self.q(x), self.n_heads)
        k, _ = (_heads(t, self.n_heads) for t in self.kv(memory).chunk(2, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if memory_mask is not None:
            scores = scores.masked_fill(~memory_mask[:, None, None, :], -math.inf)
        return scores.float().softmax(dim=-1)


class EncoderLayer(nn.Module):
    """``U = LN(X + Att(X))``, ``O = LN(U + FFN(U))`` with the gates of its two sublayers."""

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float, norm: str,
                 ffn: str, attn_gates: SublayerGates, ffn_gates: SublayerGates) -> None:
        super().__init__()
        self.attn = Sublayer(SelfAttention(d_model, n_heads, attn_dropout), d_model, attn_gates, dropout, norm)
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, dropout), d_model, ffn_gates, dropout, norm)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        return self.ffn(self.attn(x, src_mask, False))


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, then feed-forward; each a sublayer."""

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float, norm: str,
                 ffn: str, attn_gates: SublayerGates, cross_gates: SublayerGates,
                 ffn_gates: SublayerGates) -> None:
        super().__init__()
        self.attn = Sublayer(SelfAttention(d_model, n_heads, attn_dropout), d_model, attn_gates, dropout, norm)
        self.cross_attn = Sublayer(CrossAttention(d_model, n_heads, attn_dropout), d_model, cross_gates, dropout,
                                   norm)
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, dropout), d_model, ffn_gates, dropout, norm)
        self.recurrent_ffn = isinstance(self.ffn.body, SRUFeedForward)
        """Whether the feed-forward carries a state from position to position (the SRU's cell)."""

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, cache: dict[str, Any] | None = None) -> Tensor:
        x = self.attn(x, None, True, None if cache is None else cache["self"])
        x = self.cross_attn(x, memory, src_mask, None if cache is None else cache["cross"])
        if cache is not None and self.recurrent_ffn:
            return self.ffn(x, cache["ffn"])
        return self.ffn(x)

    def cross_attention(self, x: Tensor, memory: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's output and its cross-attention weights ``(B, T, S)``, averaged over the heads."""
        x = self.attn(x, None, True, None)
        sub = self.cross_attn
        weights = sub.body.probabilities(sub.norm(x) if sub.pre_norm else x, memory, src_mask).mean(dim=1)
        return self.ffn(sub(x, memory, src_mask)), weights


def gate_spec(gates: str = "", eau: bool = False, grc: bool = False) -> str:
    """The placement spec of ``gates`` with ``+EAU`` and/or ``+GRC`` appended."""
    parts = [gates] if gates.strip() and gates.strip().lower() not in ("baseline", "none") else []
    parts += ["EAU"] * eau + ["GRC"] * grc
    return "+".join(parts)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer (see the module docstring for the layout and the names l, n, k, f).

    ``forward(src (B, S), tgt_in (B, T))`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of ``logits
    (B, T, V_tgt)`` (or, given ``targets``, their ``loss``). For inference: :meth:`encode`,
    then :meth:`decode` (a whole prefix) or :meth:`decode_step` (one position, with a cache from
    :meth:`new_cache`). ``tie_embeddings`` shares the target embedding with the output projection,
    ``share_embeddings`` the source embedding with the target one (one vocabulary for both sides).
    ``attn_dropout`` / ``emb_dropout`` default to ``dropout`` (as in ``torch.nn.Transformer``); ``norm``
    is ``post`` (the paper's) or ``pre``; ``ffn_kind`` is ``relu`` or ``glu``.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, layers: int = 3, d_model: int = 256, ffn: int = 1024,
                 heads: int = 8, max_len: int = 128, dropout: float = 0.1, eau: bool = False, grc: bool = False,
                 gates: str = "", tie_embeddings: bool = False, pad_id: int = 1, attn_dropout: float | None = None,
                 norm: str = "post", ffn_kind: str = "relu", emb_dropout: float | None = None,
                 share_embeddings: bool = False) -> None:
        super().__init__()
        for name, value in (("src_vocab", src_vocab), ("tgt_vocab", tgt_vocab), ("layers", layers),
                            ("d_model", d_model), ("ffn", ffn), ("heads", heads), ("max_len", max_len)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.d_model = d_model
        self.max_len = max_len
        self.pad_id = pad_id
        self.spec = gate_spec(gates, eau, grc)
        placement = resolve_placement(self.spec, layers, cross_attention=True)
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        self.embed_src = TokenEmbedding(src_vocab, d_model)
        self.embed_tgt = TokenEmbedding(tgt_vocab, d_model)
        self.emb_dropout = Dropout(dropout if emb_dropout is None else emb_dropout)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(d_model, heads, ffn, dropout, attn_dropout, norm, ffn_kind,
                         placement.at(i, "attn"), placement.at(i, "ffn"))
            for i in range(layers)
        )
        self.encoder_norm = nn.LayerNorm(d_model)
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(d_model, heads, ffn, dropout, attn_dropout, norm, ffn_kind,
                         placement.at(i, "attn"), placement.at(i, "cross"), placement.at(i, "ffn"))
            for i in range(layers)
        )
        self.decoder_norm = nn.LayerNorm(d_model)
        self.output = OutputLayer(d_model, tgt_vocab)
        if share_embeddings:
            if src_vocab != tgt_vocab:
                raise ValueError(f"share_embeddings needs one vocabulary for both sides, got {src_vocab} source and "
                                 f"{tgt_vocab} target tokens")
            self.embed_tgt.weight = self.embed_src.weight
        if tie_embeddings:
            self.output.weight = self.embed_tgt.weight
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)

    # -- embeddings -----------------------------------------------------------------------------

    def _embed(self, table: TokenEmbedding, tokens: Tensor, offset: int = 0) -> Tensor:
        length = tokens.shape[1]
        if offset + length > self.max_len:
            raise ValueError(f"sequence of {offset + length} tokens is longer than max_len n={self.max_len}")
        return table(tokens, math.sqrt(self.d_model), self.positions[offset: offset + length], self.emb_dropout)

    # -- the three entry points -----------------------------------------------------------------

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``(memory (B, S, k), src_mask (B, S))``; ``src_mask`` is True at real (non-pad) tokens."""
        src_mask = src != self.pad_id
        x = self._embed(self.embed_src, src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Logits ``(B, T, V)`` for every position of the decoder input ``tgt_in`` (teacher forcing)."""
        return self.output(self._decoder_states(tgt_in, memory, src_mask))

    def _decoder_states(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        x = self._embed(self.embed_tgt, tgt_in)
        for layer in self.decoder_layers:
            x = layer(x, memory, src_mask)
        return self.decoder_norm(x)

    def forward(self, src: Tensor, tgt_in: Tensor, *, targets: Tensor | None = None, ignore_index: int = -100,
                reduction: str = "mean", label_smoothing: float = 0.0) -> ModelOutput:
        """The ``logits`` ``(B, T, V)`` of every target position or, given ``targets (B, T)``, their cross-entropy
        as ``loss`` (``F.cross_entropy``'s ``ignore_index``, ``reduction`` and ``label_smoothing``; the output
        layer's :meth:`~gatedformer.nn.output.OutputLayer.loss`)."""
        memory, src_mask = self.encode(src)
        if targets is None:
            return ModelOutput(logits=self.decode(tgt_in, memory, src_mask))
        hidden = self._decoder_states(tgt_in, memory, src_mask)
        return ModelOutput(loss=self.output.loss(hidden, targets, ignore_index, reduction, label_smoothing))

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> list[Tensor]:
        """Every decoder layer's cross-attention weights ``(B, T, S)`` (averaged over the heads) as the decoder reads
        ``tgt_in`` with teacher forcing: target position ``t`` over the source tokens."""
        memory, src_mask = self.encode(src)
        x = self._embed(self.embed_tgt, tgt_in)
        maps = []
        for layer in self.decoder_layers:
            x, weights = layer.cross_attention(x, memory, src_mask)
            maps.append(weights)
        return maps

    # -- incremental decoding -------------------------------------------------------------------

    def new_cache(self) -> Cache:
        """An empty cache for :meth:`decode_step`: self-attention keys/values, cross-attention ones and the SRU
        feed-forward's cell (``sru-transformer``)."""
        return [{"self": {}, "cross": {}, "ffn": {}} for _ in self.decoder_layers]

    def decode_step(self, tokens: Tensor, position: int, memory: Tensor, src_mask: Tensor, cache: Cache) -> Tensor:
        """Logits ``(B, V)`` of the next token after feeding ``tokens (B,)`` at ``position`` (0 = ``<bos>``)."""
        x = self._embed(self.embed_tgt, tokens[:, None], offset=position)
        for layer, layer_cache in zip(self.decoder_layers, cache, strict=True):
            x = layer(x, memory, src_mask, layer_cache)
        return self.output(self.decoder_norm(x))[:, 0]

    @staticmethod
    def reorder_cache(cache: Cache, order: Tensor) -> None:
        """Keep rows ``order`` of the self-attention cache (beam search); cross-attention keys stay.

        Rows are only ever reordered among the beams of one sentence, whose cross-attention keys and
        values are identical, so those need no reordering.
        """
        for layer_cache in cache:
            own = layer_cache["self"]
            for key in ("k", "v"):
                if key in own:
                    own[key] = own[key].index_select(0, order)
            recurrent = layer_cache["ffn"]
            if "c" in recurrent:
                recurrent["c"] = recurrent["c"].index_select(0, order)


def seq2seq_parameter_count(src_vocab: int, tgt_vocab: int, layers: int, d_model: int, ffn: int,
                            eau: bool = False, grc: bool = False, tie_embeddings: bool = False,
                            ffn_kind: str = "relu") -> int:
    """The closed-form parameter count of :class:`Seq2SeqTransformer` (ReLU or SRU FFN).

    With ``V_s, V_t`` the vocabularies, ``k = d_model``, ``f = ffn``, ``l = layers``::

        embeddings   V_s k + V_t k
        encoder      l (4k² + 4k  +  2kf + f + k  +  2·2k)       attention, FFN, 2 LayerNorms
        decoder      l (2(4k² + 4k)  +  2kf + f + k  +  3·2k)    2 attentions, FFN, 3 LayerNorms
        final norms  2·2k
        output       k V_t + V_t        (V_t only when tied)
        EAU          3l (k h + h + h k + k + k² + k), h = k // 2
        GRC          5l (k² + k)

    With ``ffn_kind="sru"`` each feed-forward is ``3kf + 4f`` (the SRU: three streams, ``v_f, v_r, b_f, b_r``) plus
    ``fk + k`` (the output projection) in place of ``2kf + f + k``.
    """
    if ffn_kind not in ("relu", "sru"):
        raise ValueError(f"ffn_kind must be relu or sru, got {ffn_kind!r}")
    k, f, h = d_model, ffn, d_model // 2
    attention = 4 * k * k + 4 * k
    feed_forward = 2 * k * f + f + k if ffn_kind == "relu" else 3 * k * f + 4 * f + f * k + k
    total = src_vocab * k + tgt_vocab * k
    total += layers * (attention + feed_forward + 2 * 2 * k)
    total += layers * (2 * attention + feed_forward + 3 * 2 * k)
    total += 2 * 2 * k
    total += tgt_vocab + (0 if tie_embeddings else k * tgt_vocab)
    if eau:
        total += 3 * layers * (k * h + h + h * k + k + k * k + k)
    if grc:
        total += 5 * layers * (k * k + k)
    return total


@register_backbone(
    "transformer", task="translation", cross_attention=True,
    description="an encoder-decoder with the layout of torch.nn.Transformer; '+EAU+GRC' puts an EAU after every "
    "attention (encoder self, decoder self and cross) and a GRC on every residual connection",
    fields=(*TRANSFORMER_FIELDS, "share_embeddings"))
def _build(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, max_len: int, pad_id: int,
           ffn_kind: str | None = None) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(
        src_vocab, tgt_vocab, layers=cfg.n_layers, d_model=cfg.d_model, ffn=cfg.d_ffn, heads=cfg.n_heads,
        max_len=max_len, dropout=cfg.dropout, gates=cfg.gates, tie_embeddings=cfg.tie_embeddings, pad_id=pad_id,
        attn_dropout=cfg.attn_dropout, norm=cfg.norm, ffn_kind=ffn_kind or cfg.ffn, emb_dropout=cfg.emb_dropout,
        share_embeddings=cfg.share_embeddings,
    )


@register_backbone(
    "sru-transformer", task="translation", cross_attention=True, check=check_sru_ffn,
    description="the SRU paper's Transformer w/ SRU: the encoder-decoder above with an SRU of model.d_ffn units (no "
    "highway term) as every feed-forward's hidden layer; gates by the same spec",
    fields=(*SRU_FFN_FIELDS, "share_embeddings"))
def _build_sru(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, max_len: int, pad_id: int) -> Seq2SeqTransformer:
    return _build(cfg, src_vocab, tgt_vocab, max_len, pad_id, "sru")
