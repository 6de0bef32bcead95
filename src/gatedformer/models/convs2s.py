r"""ConvS2S: the convolutional encoder-decoder of Gehring, Auli, Grangier, Yarats and Dauphin, "Convolutional Sequence
to Sequence Learning", ICML 2017.

Both stacks are 1-D convolutions over learned token and position embeddings, each a gated linear unit in a residual
connection scaled by :math:`\sqrt{0.5}`; the decoder's convolutions are causal and every decoder layer attends over
the source (multi-step attention). With ``e`` the embedding of a token plus that of its position (both after
dropout), ``p`` the keep probability ``1 - dropout``:

* **encoder**: ``x = fc1(e)``; every layer ``x ← (GLU(conv(dropout(x))) + r(x)) · √0.5`` with a centred convolution
  of width ``w`` (padded positions zeroed before each convolution, so a batch's padding changes nothing), ``r`` the
  identity or a linear projection where the channels change; then ``z = fc2(x)``, the keys, and ``z + e`` scaled by
  :math:`\sqrt{0.5}`, the values. Gradients reaching the encoder through ``z`` are divided by the number of
  attention layers (the decoder's layers); the source embeddings in the values are left unscaled (§3.4).
* **decoder**: ``h = fc1(g)`` for the target embeddings ``g``; every layer ``c ← GLU(conv(dropout(h)))`` with a
  causal convolution (position ``t`` reads ``t - w + 1 … t``), then attention:
  ``d = (W_d c + b_d + g) · √0.5``, ``a = softmax(d · zᵀ)`` over the source's real tokens,
  ``ĉ = m · √(1/m) · Σ_j a_j (z_j + e_j)`` with ``m`` the source length, and ``c ← (W_o ĉ + b_o + c) · √0.5``; the
  layer's residual follows, ``h ← (c + r(h)) · √0.5``. Then ``fc2`` to ``model.out_dim``, dropout, and the output
  layer ``fc3`` (``tie_embeddings`` shares the target embedding with it, as fairseq's ``share_input_output_embed``).

Initialisation (appendix A of the paper, exactly): a layer whose output feeds a GLU draws its weights from
:math:`\mathcal N(0, \sqrt{4p/n})`, every other layer from :math:`\mathcal N(0, \sqrt{p/n})`, where ``n`` is the
number of inputs per output (``width × channels`` for a convolution) and ``p`` the keep probability of the dropout
applied to the layer's input (1 where none is: the attention projections, ``fc2`` and the residual projections);
biases start at zero and the embeddings at :math:`\mathcal N(0, 0.1)`. Each GLU block then keeps
:math:`\mathrm{Var}[\mathrm{out}] \approx \mathrm{Var}[\mathrm{in}]` forward and backward (for equal widths) under
dropout, to first order in its input's variance: ``gatedformer init-check`` measures it. Every convolution and
linear layer (not the embeddings, nor a tied output layer) is weight-normalised when ``weight_norm`` (§3.5), applied
after the initialisation, so the effective weights start identical.

The reference implementation is fairseq's ``fconv``; this one follows it where the paper is silent (dropout before
every convolution and on ``fc3``'s input, projections of the residual where the channels change, zeroed padding),
with one difference: fairseq scales the encoder's gradients by ``1 / (2 · layers)``, the paper by ``1 / layers``,
which we follow.

Decoding: :meth:`ConvS2S.encode` returns the keys and values stacked as one ``(B, S, 2, k)`` tensor (its rows are
sentences, as every translation model's memory), :meth:`ConvS2S.decode_step` feeds one target position, each causal
convolution keeping its last ``w - 1`` inputs in the cache, so one decoder serves every translation model.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.errors import ConfigError
from gatedformer.gates import GLU
from gatedformer.gates._checks import check_size
from gatedformer.models.gcnn import EMBEDDING_STD, causal_conv1d, glu_init_std
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput

__all__ = ["ConvGLU", "ConvS2S", "MultiStepAttention", "parse_conv_layers"]

Cache = list[dict[str, Tensor]]
_HALF = math.sqrt(0.5)
_LAYER = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:\*\s*(\d+))?\s*$")


def parse_conv_layers(spec: str, n_layers: int, channels: int, width: int) -> list[tuple[int, int]]:
    """``(channels, width)`` of every convolution in ``spec`` (``"512x3*9, 1024x3*4, 2048x1*2"``: ``CHANNELSxWIDTH``
    items, each repeated ``*COUNT`` times); an empty spec is ``n_layers`` layers of ``channels × width``. A
    ValueError names what is wrong."""
    if not spec.strip():
        return [(channels, width)] * n_layers
    layers: list[tuple[int, int]] = []
    for item in spec.split(","):
        match = _LAYER.match(item)
        if match is None:
            raise ValueError(f"{item.strip()!r} is not CHANNELSxWIDTH or CHANNELSxWIDTH*COUNT (e.g. 512x3*9)")
        size, kernel, count = int(match[1]), int(match[2]), int(match[3] or 1)
        if min(size, kernel, count) < 1:
            raise ValueError(f"{item.strip()!r} has a zero channels, width or count")
        layers += [(size, kernel)] * count
    return layers


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient multiplied by ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def _linear(in_features: int, out_features: int, keep: float = 1.0, weight_norm: bool = False,
            kind: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """A linear layer (of class ``kind``) with weights :math:`\\mathcal N(0, \\sqrt{p/n})` for an input kept with
    probability ``keep``."""
    layer = kind(in_features, out_features)
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(keep / in_features))
        layer.bias.zero_()
    if weight_norm:
        nn.utils.parametrizations.weight_norm(layer, name="weight", dim=0)
    return layer


class ConvGLU(nn.Module):
    r"""``GLU(conv(dropout(x)))`` on channels-last ``(B, L, C_in) -> (B, L, C_out)``: one ConvS2S block's branch.

    The convolution has ``2 · C_out`` output channels (values, then gates) and width ``w``; it is ``causal`` (output
    ``t`` reads inputs ``t - w + 1 … t``) or centred (``t - ⌊(w-1)/2⌋ … t + ⌊w/2⌋``). Weights
    :math:`\mathcal N(0, \sqrt{4p/n})`, ``n = w · C_in``, zero biases. ``pad_mask (B, L)``, True at real tokens,
    zeroes the padded positions of the input first.
    """

    def __init__(self, in_channels: int, out_channels: int, width: int, dropout: float = 0.0, causal: bool = False,
                 weight_norm: bool = False) -> None:
        super().__init__()
        self.width = check_size("width", width)
        self.causal = causal
        self.keep = 1.0 - dropout
        self.dropout = Dropout(dropout)
        self.conv = nn.Conv1d(in_channels, 2 * out_channels, width)
        self.fan_in = in_channels * width
        self.fan_out = out_channels * width
        with torch.no_grad():
            self.conv.weight.normal_(0.0, glu_init_std(self.fan_in, dropout, gated=True))
            self.conv.bias.zero_()
        if weight_norm:
            nn.utils.parametrizations.weight_norm(self.conv, name="weight", dim=0)
        self.glu = GLU(dim=-1)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        if pad_mask is not None:
            x = x.masked_fill(~pad_mask[..., None], 0.0)
        x = self.dropout(x)
        if self.causal:
            return self.glu(self.convolve(x))
        # A centred convolution is a causal one over the input padded by ⌊w/2⌋ zeros on the right, read ⌊w/2⌋ later.
        right = self.width // 2
        return self.glu(self.convolve(F.pad(x, (0, 0, 0, right)))[:, right:])

    def convolve(self, x: Tensor) -> Tensor:
        """The causal convolution of channels-last ``x`` ``(B, L, C_in)``: output ``t`` reads inputs ``t - w + 1 … t``
        (zeros before the first), ``(B, L, 2 · C_out)``."""
        return causal_conv1d(x, self.conv.weight, self.conv.bias)

    def step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The causal block at one new position ``x (B, 1, C_in)``; ``cache["window"]`` keeps the last ``w - 1``
        inputs (zeros before the first, as the full convolution's padding)."""
        window = cache.get("window")
        if window is None:
            window = x.new_zeros((x.shape[0], self.width - 1, x.shape[2]))
        full = torch.cat([window, self.dropout(x)], dim=1)
        cache["window"] = full[:, 1:]
        return self.glu(self.convolve(full)[:, -1:])


class MultiStepAttention(nn.Module):
    r"""One decoder layer's attention (§3.3): ``d = (W_d c + b_d + g) · √0.5``, weights ``softmax(d · zᵀ)`` over the
    real source tokens, context ``√m · Σ_j a_j v_j`` (``v = (z + e) · √0.5``, ``m`` real source tokens), output
    ``(W_o ĉ + b_o + c) · √0.5``. Both projections start at :math:`\mathcal N(0, \sqrt{1/n})` (no dropout precedes
    them)."""

    def __init__(self, channels: int, embed_dim: int, weight_norm: bool = False) -> None:
        super().__init__()
        self.in_projection = _linear(channels, embed_dim, weight_norm=weight_norm)
        self.out_projection = _linear(embed_dim, channels, weight_norm=weight_norm)

    def forward(self, c: Tensor, g: Tensor, keys: Tensor, values: Tensor, src_mask: Tensor,
                context_scale: Tensor) -> tuple[Tensor, Tensor]:
        """``(output (B, T, C), weights (B, T, S))`` for the GLU output ``c``, target embeddings ``g``, the encoder's
        ``keys`` and ``values`` ``(B, S, k)``, ``src_mask (B, S)`` and ``context_scale (B, 1, 1)`` = ``√m``."""
        d = (self.in_projection(c) + g) * _HALF
        scores = torch.bmm(d, keys.transpose(1, 2)).masked_fill(~src_mask[:, None, :], -math.inf)
        weights = scores.float().softmax(dim=-1).to(d.dtype)
        context = torch.bmm(weights, values) * context_scale
        return (self.out_projection(context) + c) * _HALF, weights


class _Stack(nn.Module):
    """Embeddings, ``fc1`` and the convolution blocks (with residual projections) shared by both sides."""

    def __init__(self, vocab: int, embed_dim: int, max_len: int, layers: list[tuple[int, int]], dropout: float,
                 causal: bool, weight_norm: bool) -> None:
        super().__init__()
        keep = 1.0 - dropout
        self.embed_tokens = nn.Embedding(vocab, embed_dim)
        self.embed_positions = nn.Embedding(max_len, embed_dim)
        with torch.no_grad():
            self.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)
            self.embed_positions.weight.normal_(0.0, EMBEDDING_STD)
        self.dropout = Dropout(dropout)
        channels = layers[0][0]
        self.fc1 = _linear(embed_dim, channels, keep, weight_norm)
        self.convolutions = nn.ModuleList()
        self.projections = nn.ModuleList()
        for out_channels, width in layers:
            self.projections.append(_linear(channels, out_channels, weight_norm=weight_norm)
                                    if out_channels != channels else nn.Identity())
            self.convolutions.append(ConvGLU(channels, out_channels, width, dropout, causal, weight_norm))
            channels = out_channels
        self.channels = channels

    def embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        length = tokens.shape[1]
        if offset + length > self.embed_positions.num_embeddings:
            raise ValueError(f"sequence of {offset + length} tokens is longer than max_len n="
                             f"{self.embed_positions.num_embeddings}")
        positions = self.embed_positions.weight[offset: offset + length]
        return self.dropout(self.embed_tokens(tokens) + positions)


class ConvS2S(nn.Module):
    """The ConvS2S encoder-decoder (see the module docstring for the equations and the initialisation).

    ``forward(src (B, S), tgt_in (B, T))`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of ``logits
    (B, T, V_tgt)``, or with ``targets`` their cross-entropy as ``loss``; for
    inference :meth:`encode`, then :meth:`decode_step` with a cache from :meth:`new_cache`, as
    :class:`~gatedformer.models.seq2seq.Seq2SeqTransformer`. ``encoder_layers`` and ``decoder_layers`` are
    ``(channels, width)`` per convolution; ``out_dim`` is the width before the output layer (``embed_dim`` when 0).
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, embed_dim: int = 256,
                 encoder_layers: list[tuple[int, int]] | None = None,
                 decoder_layers: list[tuple[int, int]] | None = None, out_dim: int = 0, max_len: int = 128,
                 dropout: float = 0.1, pad_id: int = 1, weight_norm: bool = True, tie_embeddings: bool = False,
                 share_embeddings: bool = False) -> None:
        super().__init__()
        for name, value in (("src_vocab", src_vocab), ("tgt_vocab", tgt_vocab), ("embed_dim", embed_dim),
                            ("max_len", max_len)):
            check_size(name, value)
        if isinstance(dropout, bool) or not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        encoder_layers = encoder_layers or [(embed_dim, 3)] * 4
        decoder_layers = decoder_layers or encoder_layers
        out_dim = out_dim or embed_dim
        keep = 1.0 - dropout
        self.d_model = embed_dim
        self.max_len = max_len
        self.pad_id = pad_id
        self.dropout_p = float(dropout)
        self.encoder = _Stack(src_vocab, embed_dim, max_len, encoder_layers, dropout, False, weight_norm)
        self.encoder.fc2 = _linear(self.encoder.channels, embed_dim, weight_norm=weight_norm)
        self.decoder = _Stack(tgt_vocab, embed_dim, max_len, decoder_layers, dropout, True, weight_norm)
        self.attention = nn.ModuleList(MultiStepAttention(out_channels, embed_dim, weight_norm)
                                       for out_channels, _ in decoder_layers)
        self.decoder.fc2 = _linear(self.decoder.channels, out_dim, weight_norm=weight_norm)
        self.output_dropout = Dropout(dropout)
        if tie_embeddings:
            if out_dim != embed_dim:
                raise ValueError(f"tie_embeddings needs out_dim = embed_dim, got {out_dim} and {embed_dim}")
            self.output = OutputLayer(out_dim, tgt_vocab)
            self.output.weight = self.decoder.embed_tokens.weight
            with torch.no_grad():
                self.output.bias.zero_()
        else:
            self.output = _linear(out_dim, tgt_vocab, keep, weight_norm, OutputLayer)
        if share_embeddings:
            if src_vocab != tgt_vocab:
                raise ValueError(f"share_embeddings needs one vocabulary for both sides, got {src_vocab} source and "
                                 f"{tgt_vocab} target tokens")
            self.encoder.embed_tokens.weight = self.decoder.embed_tokens.weight
        self.gradient_scale = 1.0 / len(decoder_layers)
        """The encoder's gradients through the keys and values are scaled by this (one over the attention layers)."""

    # -- encoder ----------------------------------------------------------------------------------

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``(memory (B, S, 2, k), src_mask (B, S))``: the keys ``z`` and values ``(z + e) · √0.5`` stacked, and the
        mask, True at real (non-pad) tokens."""
        keys, values, src_mask = self._encode(src)
        return torch.stack([keys, values], dim=2), src_mask

    def _encode(self, src: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        src_mask = src != self.pad_id
        stack = self.encoder
        e = stack.embed(src)
        x = stack.fc1(e)
        for projection, block in zip(stack.projections, stack.convolutions, strict=True):
            x = (block(x, src_mask) + projection(x)) * _HALF
        z = stack.fc2(x).masked_fill(~src_mask[..., None], 0.0)
        z = _ScaleGradient.apply(z, self.gradient_scale)
        return z, (z + e) * _HALF, src_mask

    # -- decoder ----------------------------------------------------------------------------------

    def _layers(self, h: Tensor, g: Tensor, keys: Tensor, values: Tensor, src_mask: Tensor,
                cache: Cache | None = None) -> tuple[Tensor, list[Tensor]]:
        stack = self.decoder
        scale = src_mask.sum(dim=1, keepdim=True).clamp(min=1).to(h.dtype).sqrt()[..., None]
        maps = []
        for i, (projection, block, attention) in enumerate(zip(stack.projections, stack.convolutions, self.attention,
                                                               strict=True)):
            c = block(h) if cache is None else block.step(h, cache[i])
            c, weights = attention(c, g, keys, values, src_mask, scale)
            maps.append(weights)
            h = (c + projection(h)) * _HALF
        return self.output_dropout(self.decoder.fc2(h)), maps

    def _decoder_states(self, tgt_in: Tensor, keys: Tensor, values: Tensor, src_mask: Tensor) -> tuple[Tensor,
                                                                                                         list[Tensor]]:
        g = self.decoder.embed(tgt_in)
        return self._layers(self.decoder.fc1(g), g, keys, values, src_mask)

    def forward(self, src: Tensor, tgt_in: Tensor, *, targets: Tensor | None = None, ignore_index: int = -100,
                reduction: str = "mean", label_smoothing: float = 0.0) -> ModelOutput:
        """The ``logits`` ``(B, T, V)`` of every target position or, given ``targets (B, T)``, their cross-entropy as
        ``loss`` (as :meth:`Seq2SeqTransformer.forward <gatedformer.models.seq2seq.Seq2SeqTransformer.forward>`)."""
        keys, values, src_mask = self._encode(src)
        hidden, _ = self._decoder_states(tgt_in, keys, values, src_mask)
        if targets is None:
            return ModelOutput(logits=self.output(hidden))
        return ModelOutput(loss=self.output.loss(hidden, targets, ignore_index, reduction, label_smoothing))

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> list[Tensor]:
        """Every decoder layer's attention weights ``(B, T, S)`` as the decoder reads ``tgt_in`` with teacher forcing
        (the paper's Figure 3)."""
        keys, values, src_mask = self._encode(src)
        return self._decoder_states(tgt_in, keys, values, src_mask)[1]

    # -- incremental decoding -------------------------------------------------------------------

    def new_cache(self) -> Cache:
        """An empty cache for :meth:`decode_step`: each causal convolution's last inputs."""
        return [{} for _ in self.decoder.convolutions]

    def decode_step(self, tokens: Tensor, position: int, memory: Tensor, src_mask: Tensor, cache: Cache) -> Tensor:
        """Logits ``(B, V)`` of the next token after feeding ``tokens (B,)`` at ``position`` (0 = ``<bos>``)."""
        g = self.decoder.embed(tokens[:, None], offset=position)
        hidden, _ = self._layers(self.decoder.fc1(g), g, memory[:, :, 0], memory[:, :, 1], src_mask, cache)
        return self.output(hidden)[:, 0]

    @staticmethod
    def reorder_cache(cache: Cache, order: Tensor) -> None:
        """Keep rows ``order`` of every convolution's window (beam search)."""
        for layer_cache in cache:
            if "window" in layer_cache:
                layer_cache["window"] = layer_cache["window"].index_select(0, order)

    # -- init-check -----------------------------------------------------------------------------

    def init_check_layers(self) -> list[dict[str, Any]]:
        """The GLU blocks, ``dropout → conv → GLU``, of both stacks, with what appendix A predicts for them: with
        dropout ``Var[out]/Var[in] = 1`` and ``Var[∂in]/Var[∂out] = C_out/C_in``; without it (evaluation mode, the
        same weights) both times ``p``, the keep probability the weights were drawn for."""
        sites = []
        for side, stack in (("encoder", self.encoder), ("decoder", self.decoder)):
            for i, block in enumerate(stack.convolutions):
                ratio = block.fan_out / block.fan_in
                sites.append({
                    "name": f"{side}.convolutions.{i}", "module": block,
                    "kind": f"ConvS2S {side} GLU block ({block.fan_in // block.width}→{block.fan_out // block.width}, "
                            f"w={block.width})",
                    "forward": 1.0, "backward": ratio,
                    "forward_no_dropout": block.keep, "backward_no_dropout": block.keep * ratio,
                    "note": "N(0,√(4p/n)): 1st order in Var[in]",
                })
        return sites


def conv_layer_lists(cfg: ModelConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The encoder's and decoder's ``(channels, width)`` from ``model.conv_layers`` / ``decoder_conv_layers`` (the
    decoder's default to the encoder's, the encoder's to ``n_layers`` of ``d_model × kernel_size``); a
    :class:`ConfigError` names a malformed one."""
    try:
        encoder = parse_conv_layers(cfg.conv_layers, cfg.n_layers, cfg.d_model, cfg.kernel_size)
    except ValueError as err:
        raise ConfigError(f"model.conv_layers: {err}") from None
    try:
        decoder = parse_conv_layers(cfg.decoder_conv_layers, 0, cfg.d_model, cfg.kernel_size) or encoder
    except ValueError as err:
        raise ConfigError(f"model.decoder_conv_layers: {err}") from None
    return encoder, decoder


def _check(cfg: ModelConfig) -> None:
    conv_layer_lists(cfg)
    if cfg.tie_embeddings and cfg.out_dim not in (0, cfg.d_model):
        raise ConfigError(f"model.tie_embeddings shares the target embedding ({cfg.d_model} wide) with the output "
                          f"layer, which reads model.out_dim={cfg.out_dim}; set model.out_dim=0 or untie them")


@register_backbone(
    "convs2s", task="translation", gated=False, check=_check,
    description="ConvS2S (Gehring et al. 2017): convolutional encoder and causal decoder of GLU blocks with √0.5 "
    "residuals, learned positions, multi-step attention in every decoder layer, the appendix's initialisation; "
    "model.d_model is the embedding width, model.conv_layers the convolutions",
    # n_layers and kernel_size give the convolutions where conv_layers is empty
    fields=("d_model", "conv_layers", "decoder_conv_layers", "n_layers", "kernel_size", "out_dim", "dropout",
            "weight_norm", "tie_embeddings", "share_embeddings"))
def _build(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, max_len: int, pad_id: int) -> ConvS2S:
    encoder, decoder = conv_layer_lists(cfg)
    return ConvS2S(src_vocab, tgt_vocab, embed_dim=cfg.d_model, encoder_layers=encoder, decoder_layers=decoder,
                   out_dim=cfg.out_dim, max_len=max_len, dropout=cfg.dropout, pad_id=pad_id,
                   weight_norm=cfg.weight_norm, tie_embeddings=cfg.tie_embeddings,
                   share_embeddings=cfg.share_embeddings)
