r"""The Transformer-XL language model, with gates placed by spec on its attention and FFN sublayers.

From Dai, Yang, Yang, Carbonell, Le and Salakhutdinov, "Transformer-XL: Attentive Language Models
Beyond a Fixed-Length Context", ACL 2019 (arXiv:1901.02860).

**Relative positional attention.** For a query at position ``i`` and a key at position ``j`` the
score of one head is

.. math::

    A_{ij} = \underbrace{q_i^\top k_j}_{a} + \underbrace{q_i^\top W_{k,R} R_{i-j}}_{b}
           + \underbrace{u^\top k_j}_{c} + \underbrace{v^\top W_{k,R} R_{i-j}}_{d}

with ``R`` the sinusoidal encoding of the relative distance and ``u``, ``v`` learned per head;
``(a + c)`` is computed as ``(q + u)^T k`` and ``(b + d)`` as ``(q + v)^T W_{k,R} R`` for every
distance, then moved into place by the relative-shift trick (:func:`rel_shift`): ``O(L·(M+L))`` work
and memory, with no per-pair gather of position encodings.

**Segment-level recurrence.** Each layer attends over ``[SG(memory) ∘ current segment]``, where the
memory holds the last ``mem_len`` inputs of that layer from the previous windows, with the gradient
stopped. The memories are the model's state: ``forward(tokens, state)`` returns them as its output's ``state``.

This module is the reference; fused (:mod:`gatedformer.fused.transformer_xl`), the attention runs on a compiled CPU
kernel and a post-LN sublayer, or all the layers, as one autograd function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.gates.spec import SublayerGates, resolve_placement
from gatedformer.models.transformer import TRANSFORMER_FIELDS
from gatedformer.nn.attention import sinusoidal_positions
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sublayer import Sublayer, check_lm_sizes, make_ffn

_DISTANCES_CACHED = 1024
"""Distances whose encodings are built with the model (a longer span extends the table)."""

__all__ = ["RelativeMultiHeadAttention", "TransformerXLLM", "TransformerXLLayer", "rel_shift",
           "relative_positions"]


def relative_positions(length: int, d_model: int, device: torch.device | None = None,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """Sinusoidal encodings of the distances ``length-1, ..., 1, 0`` (in that order): ``(length, d_model)``.

    Row ``r`` encodes distance ``length - 1 - r``, so the last ``k`` rows are the encodings for a
    span of ``k`` keys.
    """
    return sinusoidal_positions(length, d_model, device, dtype).flip(0)


def rel_shift(scores: Tensor, padded: bool = False) -> Tensor:
    """Move per-distance scores into per-key place: ``out[..., i, j] = scores[..., i, j + Lq - 1 - i]``.

    ``scores (..., Lq, Lk)`` holds, for query ``i``, one score per distance in the order of
    :func:`relative_positions` (column ``c`` is distance ``Lk - 1 - c``). The query ``i`` of a segment
    that follows ``Lk - Lq`` memory positions is at distance ``Lk - Lq + i - j`` from key ``j``, which is
    column ``j + Lq - 1 - i``. Entries with ``j > Lk - Lq + i`` (future keys) hold leftovers and
    must be masked. One pad, one view and one slice: no gather, no index tensor.

    With ``padded=True`` the caller has already put a spare column in front, ``scores (..., Lq, Lk + 1)``
    (e.g. by multiplying with position keys that start with a zero row), and no copy is made here.
    """
    if not padded:
        scores = torch.cat([scores.new_zeros(*scores.shape[:-1], 1), scores], dim=-1)
    return _PaddedRelShift.apply(scores)


class _PaddedRelShift(torch.autograd.Function):
    """The view behind :func:`rel_shift`. Its gradient is written into one new tensor whose only other
    entries, the spare column's, are zeroed: autograd's own backward of the slice would zero the whole
    ``(..., Lq, Lk + 1)`` tensor first and then copy into it."""

    @staticmethod
    def forward(ctx, scores: Tensor) -> Tensor:  # type: ignore[override]
        *lead, q_len, k_len_1 = scores.shape
        ctx.shape = scores.shape
        return scores.view(*lead, k_len_1, q_len)[..., 1:, :].reshape(*lead, q_len, k_len_1 - 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        *lead, q_len, k_len_1 = ctx.shape
        grad_scores = grad.new_empty(ctx.shape)
        folded = grad_scores.view(*lead, k_len_1, q_len)
        folded[..., 0, :].zero_()
        folded[..., 1:, :].copy_(grad.reshape(*lead, k_len_1 - 1, q_len))
        return grad_scores


class RelativeMultiHeadAttention(nn.Module):
    """Multi-head attention with Transformer-XL's relative positions over ``[memory ∘ h]``, causal.

    ``forward(h (B, L, d), memory (B, M, d) | None, pos (>= M + L, d)) -> (B, L, d)``, where ``pos`` is
    :func:`relative_positions` of at least ``M + L`` distances (its last ``M + L`` rows are used).
    Query ``i`` (at position ``M + i``) sees keys ``0 .. M + i``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.d_head)
        self.query = nn.Linear(d_model, d_model, bias=False)
        self.key_value = nn.Linear(d_model, 2 * d_model, bias=False)
        self.position = nn.Linear(d_model, d_model, bias=False)
        """``W_{k,R}``: projects the relative encodings into keys."""
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.u = nn.Parameter(torch.empty(n_heads, self.d_head))
        """Content bias of each head (term c)."""
        self.v = nn.Parameter(torch.empty(n_heads, self.d_head))
        """Position bias of each head (term d)."""
        nn.init.normal_(self.u, std=0.02)
        nn.init.normal_(self.v, std=0.02)
        self.dropout = Dropout(dropout)

    def _projections_apart(self, h: Tensor, memory: Tensor | None,
                           pos: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Queries ``(B, L, H·dh)``, the window's keys then values ``(B, L, 2·H·dh)``, the memory's ``(B, M, 2·H·dh)``
        (``None`` without a memory) and the position keys ``(M+L, H·dh)``."""
        memory = memory if memory is not None and memory.shape[1] > 0 else None
        k_len = h.shape[1] + (0 if memory is None else memory.shape[1])
        if pos.shape[0] < k_len:
            raise ValueError(f"pos has {pos.shape[0]} rows but the attention spans {k_len} keys")
        # The memory's keys and values by a product of their own: the memory takes no gradient, so the backward
        # pass computes only the weight's share from it, not an input gradient to throw away.
        memory_kv = None if memory is None else self.key_value(memory.to(h.dtype))
        return self.query(h), self.key_value(h), memory_kv, self.position(pos[pos.shape[0] - k_len :])

    def projections(self, h: Tensor, memory: Tensor | None, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``(B, L, H·dh)``, keys then values ``(B, M+L, 2·H·dh)``, position keys ``(M+L, H·dh)``: the
        projections' outputs, heads side by side."""
        q, kv, memory_kv, r = self._projections_apart(h, memory, pos)
        return q, (kv if memory_kv is None else torch.cat([memory_kv, kv], dim=1)), r

    def project(self, h: Tensor, memory: Tensor | None, pos: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Queries ``(B, H, L, dh)``, keys and values ``(B, H, M+L, dh)``, position keys ``(H, M+L, dh)``."""
        return self._heads(*self.projections(h, memory, pos))

    def _heads(self, q: Tensor, kv: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        batch, q_len, _ = q.shape
        k_len = kv.shape[1]
        q = q.view(batch, q_len, self.n_heads, self.d_head).transpose(1, 2)
        k, v = kv.view(batch, k_len, 2, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        r = r.view(k_len, self.n_heads, self.d_head).transpose(0, 1)
        return q, k, v, r

    def attention_scores(self, q: Tensor, k: Tensor, r: Tensor) -> Tensor:
        """The masked pre-softmax scores ``(a + b + c + d) / sqrt(dh)``: ``(B, H, L, M+L)``."""
        q_len, k_len = q.shape[2], k.shape[2]
        # b + d for every distance, against position keys with a zero row in front so the product comes
        # out already padded for the shift; the scale is folded into the small query side.
        r_padded = F.pad(r, (0, 0, 1, 0))
        position = rel_shift(torch.matmul((q + self.v.unsqueeze(1).to(q.dtype)) * self.scale,
                                          r_padded.transpose(-1, -2)), padded=True)
        # a + c = (q + u)^T k.
        scores = torch.matmul((q + self.u.unsqueeze(1).to(q.dtype)) * self.scale, k.transpose(-1, -2))
        # The causal mask as an additive -inf: its backward pass is nothing (the softmax already gives those
        # entries a zero gradient), where masked_fill_'s is another pass over the scores.
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).triu(k_len - q_len + 1)
        mask = torch.zeros(q_len, k_len, dtype=scores.dtype, device=q.device).masked_fill_(future, float("-inf"))
        return scores.add_(position).add_(mask)

    def forward(self, h: Tensor, memory: Tensor | None, pos: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        if cache is not None:
            return self._cached(h, memory, pos, cache)
        return self.out(self.features(h, memory, pos))

    def features(self, h: Tensor, memory: Tensor | None, pos: Tensor,
                 cache: dict[str, Tensor] | None = None) -> Tensor:
        """The heads' outputs side by side, before the output projection ``out``: ``(B, L, d)`` (where an attention
        output gate goes)."""
        if cache is not None:
            return self._cached_features(h, memory, pos, cache)
        return self.attend(*self.project(h, memory, pos))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, r: Tensor) -> Tensor:
        """``dropout(softmax(scores)) V`` of queries, keys, values ``(B, H, ·, dh)`` and position keys ``(H, ·, dh)``,
        the heads side by side: ``(B, L, d)``."""
        batch, _, q_len, _ = q.shape
        # Written out rather than through scaled_dot_product_attention: with the positional terms as an
        # additive mask it would fall back to this same computation on CPU, with two more copies.
        weights = self.dropout(self.attention_scores(q, k, r).softmax(dim=-1))
        return torch.matmul(weights, v).transpose(1, 2).reshape(batch, q_len, self.d_model)

    def _cached(self, h: Tensor, memory: Tensor | None, pos: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """``forward`` for positions that follow those of earlier calls in the same segment (see
        :meth:`_cached_features`)."""
        return self.out(self._cached_features(h, memory, pos, cache))

    def _cached_features(self, h: Tensor, memory: Tensor | None, pos: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """``features`` for positions that follow those of earlier calls in the same segment (see
        :meth:`_cached_projections`)."""
        q, _, _, r = self._cached_projections(h, memory, pos, cache)
        return self.attend(*self._heads(q, cache["kv"], r))

    def _cached_projections(self, h: Tensor, memory: Tensor | None, pos: Tensor, cache: dict[str, Tensor]
                            ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Queries, the new keys and values, the earlier ones (``None`` at a segment's start without memory) and the
        position keys, each in the projections' layout; ``cache["kv"]`` then keeps the keys and values of the memory
        and of the segment so far, ``cache["r"]`` the position keys of every distance ``pos`` holds (``pos`` may span
        more than the keys: its last rows are used)."""
        q_len = h.shape[1]
        past = cache.get("kv")
        if past is None and memory is not None and memory.shape[1] > 0:
            past = self.key_value(memory.to(h.dtype))
        q, kv = self.query(h), self.key_value(h)
        k_len = q_len + (0 if past is None else past.shape[1])
        if "r" not in cache or cache["r"].shape[0] != pos.shape[0]:
            cache["r"] = self.position(pos)
        if cache["r"].shape[0] < k_len:
            raise ValueError(f"pos has {pos.shape[0]} rows but the attention spans {k_len} keys")
        cache["kv"] = kv if past is None else torch.cat([past, kv], dim=1)
        return q, kv, past, cache["r"][cache["r"].shape[0] - k_len :]

    def scores(self, h: Tensor, memory: Tensor | None, pos: Tensor) -> Tensor:
        """:meth:`attention_scores` for inputs ``h``, ``memory``, ``pos`` (for inspection and tests)."""
        q, k, _, r = self.project(h, memory, pos)
        return self.attention_scores(q, k, r)


class TransformerXLLayer(nn.Module):
    """Relative attention over ``[memory ∘ X]`` then feed-forward, each a gated :class:`Sublayer`."""

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float,
                 norm: str, ffn: str, attn_gates: SublayerGates, ffn_gates: SublayerGates) -> None:
        super().__init__()
        self.attn = Sublayer(RelativeMultiHeadAttention(d_model, n_heads, attn_dropout), d_model, attn_gates,
                             dropout, norm)
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, dropout), d_model, ffn_gates, dropout, norm)
        self.recurrent_ffn = ffn == "sru"

    def forward(self, x: Tensor, memory: Tensor | None, pos: Tensor, cache: dict | None = None) -> Tensor:
        """The layer on ``x`` after ``memory``; with ``cache`` on positions that follow the cached ones of the
        same segment (the attention's keys and values, an SRU feed-forward's cell)."""
        # With pre-LN the attention reads LN(X); LayerNorm is per position, so the memory (raw layer
        # inputs) gets the same LN and the keys read LN([memory ∘ X]) throughout.
        if memory is not None and self.attn.pre_norm and (cache is None or "kv" not in cache["attn"]):
            memory = self.attn.norm(memory)
        if cache is None:
            return self.ffn(self.attn(x, memory, pos))
        x = self.attn(x, memory, pos, cache["attn"])
        return self.ffn(x, cache["ffn"]) if self.recurrent_ffn else self.ffn(x)


class TransformerXLLM(nn.Module):
    """Token embedding, ``n_layers`` Transformer-XL layers with segment-level recurrence, softmax output.

    ``forward(tokens (B, L), state)`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of ``logits (B, L, V)``
    and the memories as its ``state``. ``state`` is ``None`` or the memories a previous call returned: a list of one
    ``(B, M, d)`` tensor per layer, the inputs of that layer over the last ``M <= mem_len`` positions, detached.
    With ``mem_len=0`` the model keeps no memory and its ``state`` is ``None``.
    """

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 3, n_heads: int = 4,
                 d_ffn: int = 512, dropout: float = 0.1, emb_dropout: float | None = None,
                 attn_dropout: float = 0.0, norm: str = "post", ffn: str = "relu",
                 tie_embeddings: bool = False, gates: str = "", mem_len: int = 0) -> None:
        super().__init__()
        check_lm_sizes(vocab_size, d_model, n_layers, n_heads, d_ffn)
        if isinstance(mem_len, bool) or not isinstance(mem_len, int) or mem_len < 0:
            raise ValueError(f"mem_len must be an integer >= 0, got {mem_len!r}")
        placement = resolve_placement(gates, n_layers)
        self.d_model = d_model
        self.n_layers = n_layers
        self.mem_len = mem_len
        self.embedding = TokenEmbedding(vocab_size, d_model)
        self.emb_dropout = Dropout(dropout if emb_dropout is None else emb_dropout)
        self.layers = nn.ModuleList(
            TransformerXLLayer(d_model, n_heads, d_ffn, dropout, attn_dropout, norm, ffn,
                               placement.at(i, "attn"), placement.at(i, "ffn"))
            for i in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(d_model) if norm == "pre" else None
        self.output = OutputLayer(d_model, vocab_size)
        if tie_embeddings:
            self.output.weight = self.embedding.weight
        # The distances' encodings, computed once (not saved in checkpoints) and grown on demand: the last k rows of
        # a longer table are those of k distances.
        self.register_buffer("distances", relative_positions(_DISTANCES_CACHED, d_model), persistent=False)

    def _relative_positions(self, length: int, dtype: torch.dtype) -> Tensor:
        if length > self.distances.shape[0]:
            self.distances = relative_positions(max(length, 2 * self.distances.shape[0]), self.d_model,
                                                self.distances.device)
        return self.distances[self.distances.shape[0] - length :].to(dtype)

    def _check_state(self, state: object, batch: int) -> list[Tensor] | None:
        if state is None:
            return None
        if not isinstance(state, list | tuple) or len(state) != self.n_layers:
            raise ValueError(
                f"Transformer-XL state must be a list of {self.n_layers} memories (one per layer), "
                f"got {type(state).__name__}{f' of {len(state)}' if isinstance(state, list | tuple) else ''}"
            )
        well_formed = all(isinstance(m, Tensor) and m.dim() == 3 and m.shape[0] == batch for m in state)
        if not well_formed or len({m.shape[1] for m in state}) != 1:
            shapes = ", ".join(str(tuple(m.shape)) if isinstance(m, Tensor) else type(m).__name__ for m in state)
            raise ValueError(
                f"Transformer-XL memories must all be (batch={batch}, M, {self.d_model}) with one M; got {shapes}. "
                "Pass the state returned for the previous window of the same batch, or None"
            )
        return list(state)

    def forward(self, tokens: Tensor, state: list[Tensor] | None = None, *, targets: Tensor | None = None,
                reduction: str = "mean") -> ModelOutput:
        """``logits (B, L, V)`` and the new memories as ``state``, or with ``targets`` their cross-entropy as ``loss``
        in place of the logits (see :class:`~gatedformer.models.transformer.TransformerLM`)."""
        batch, length = tokens.shape
        memories = self._check_state(state, batch)
        mem_len_in = memories[0].shape[1] if memories else 0
        x = self.embedding(tokens, math.sqrt(self.d_model), dropout=self.emb_dropout)
        pos = self.emb_dropout(self._relative_positions(mem_len_in + length, x.dtype))
        x, inputs = self.run_layers(x, memories, pos)
        if self.final_norm is not None:
            x = self.final_norm(x)
        state = self._update_memories(memories, inputs)
        if targets is None:
            return ModelOutput(logits=self.output(x), state=state)
        return ModelOutput(loss=self.output.loss(x, targets, reduction=reduction), state=state)

    def run_layers(self, x: Tensor, memories: list[Tensor] | None, pos: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The layers in turn on ``x``, layer ``i`` after its memory ``memories[i]``: the last layer's output and
        every layer's input (the next window's memories are taken from these)."""
        inputs = []
        for i, layer in enumerate(self.layers):
            inputs.append(x)
            x = layer(x, memories[i] if memories else None, pos)
        return x, inputs

    def new_cache(self, state: list[Tensor] | None = None) -> dict:
        """An incremental-decoding cache for :meth:`step`: a new segment after the memories ``state`` (what
        ``forward`` returned for the previous window, or ``None``)."""
        return {"memory": state, "length": 0, "span": 0,
                "layers": [{"attn": {}, "ffn": {}, "inputs": []} for _ in self.layers]}

    def step(self, tokens: Tensor, cache: dict) -> Tensor:
        """Logits ``(B, L, V)`` of ``tokens (B, L)`` that follow the tokens of this segment already fed through
        ``cache``: what ``forward(segment, memory)`` gives at those positions, from each layer's cached keys and
        values of the memory and of the segment so far, and its position keys."""
        batch, length = tokens.shape
        memories = self._check_state(cache["memory"], batch)
        needed = (memories[0].shape[1] if memories else 0) + cache["length"] + length
        if needed > cache["span"]:  # the position keys are projected once per doubling of the span, not per step
            cache["span"] = max(needed, 2 * cache["span"])
        x = self.embedding(tokens, math.sqrt(self.d_model), dropout=self.emb_dropout)
        pos = self.emb_dropout(self._relative_positions(cache["span"], x.dtype))
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache["layers"], strict=True)):
            layer_cache["inputs"].append(x)
            x = layer(x, memories[i] if memories else None, pos, layer_cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        cache["length"] += length
        return self.output(x)

    def cache_state(self, cache: dict) -> list[Tensor] | None:
        """The memories ``forward`` would return for the segment fed through ``cache``, after its memory."""
        if cache["length"] == 0:
            return cache["memory"]
        memories = self._check_state(cache["memory"], cache["layers"][0]["inputs"][0].shape[0])
        return self._update_memories(memories, [torch.cat(c["inputs"], dim=1) for c in cache["layers"]])

    @torch.no_grad()
    def _update_memories(self, memories: list[Tensor] | None, inputs: list[Tensor]) -> list[Tensor] | None:
        """The last ``mem_len`` layer inputs over ``[memory ∘ current]``, with the gradient stopped."""
        if self.mem_len == 0:
            return None
        updated = []
        for i, current in enumerate(inputs):
            current = current.detach()
            kept = self.mem_len - current.shape[1]  # positions the old memory still gives
            if memories is None or kept <= 0:
                # A copy, not a view: the memory must not change with the layer input it was taken from.
                updated.append(current[:, -self.mem_len :].clone(memory_format=torch.contiguous_format))
            else:  # only the rows that stay, joined once
                updated.append(torch.cat([memories[i][:, -kept:].to(current.dtype), current], dim=1))
        return updated


@register_backbone(
    "transformer-xl", task="lm", fields=(*TRANSFORMER_FIELDS, "mem_len"),
    description="relative positional attention and segment memory of model.mem_len states, carried across windows")
def _build(cfg: ModelConfig, vocab_size: int) -> TransformerXLLM:
    return TransformerXLLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ffn=cfg.d_ffn,
        dropout=cfg.dropout, emb_dropout=cfg.emb_dropout, attn_dropout=cfg.attn_dropout, norm=cfg.norm,
        ffn=cfg.ffn, tie_embeddings=cfg.tie_embeddings, gates=cfg.gates, mem_len=cfg.mem_len,
    )
