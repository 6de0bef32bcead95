r"""The gated convolutional language model (GCNN).

From Dauphin, Fan, Auli and Grangier, "Language Modeling with Gated Convolutional Networks",
ICML 2017. Each layer is a causal 1-D convolution whose output is split in two halves and gated by
the Gated Linear Unit,

.. math::

    h(X) = (X * W + b) \odot \sigma(X * V + c),

where :math:`*` is a convolution over time whose input is padded on the left by ``kernel_size - 1``
positions, so the output at step :math:`t` reads the inputs :math:`t - k + 1 \ldots t` and never a later
one. Layers are wrapped in residual blocks, :math:`H = X + F(X)`, where the branch :math:`F` is

* a plain block: one gated convolution of width :math:`k`, :math:`d \to d`;
* a bottleneck block (``bottleneck = b > 0``, the paper's bottleneck structure): a gated 1×1
  convolution :math:`d \to b`, a gated :math:`k`-wide convolution :math:`b \to b` and a gated 1×1
  convolution :math:`b \to d`.

Every convolution reads its input through dropout (keep probability :math:`p = 1 - \text{dropout}`),
and so does the output projection; the residual stream itself is never dropped.

Initialisation (Gehring, Auli, Grangier, Yarats and Dauphin, "Convolutional Sequence to Sequence
Learning", ICML 2017, section 3.5 and appendix A). A layer with fan-in :math:`n` (input channels times
kernel width) has :math:`\mathrm{Var}[y] = n\,\mathrm{Var}[w]\,\mathrm{E}[x^2]`, and inverted dropout
multiplies :math:`\mathrm{E}[x^2]` by :math:`1/p`. To first order in its gate input the GLU has
:math:`\mathrm{Var}[a \odot \sigma(b)] \approx \mathrm{Var}[a]/4`, so weights are drawn from

.. math::

    w \sim \mathcal{N}\!\left(0, \sqrt{4p/n}\right) \text{ for a layer followed by a GLU,}\qquad
    w \sim \mathcal{N}\!\left(0, \sqrt{p/n}\right) \text{ otherwise (the output projection)},

which keeps :math:`\mathrm{Var}[F(X)] \approx \mathrm{Var}[X]` forward and, for square layers, the
gradient variance backward. Biases start at zero and embeddings at :math:`\mathcal{N}(0, 0.1)`; the small
embeddings keep the gate inputs near zero where the first-order approximation holds. With
``tie_embeddings`` the output projection shares the embedding matrix (and its initialisation).

With ``weight_norm`` every convolution is reparametrised as :math:`w = g\,v/\lVert v\rVert` (Salimans
and Kingma 2016, as in both papers) through :func:`torch.nn.utils.parametrizations.weight_norm`,
applied after the initialisation above, so the effective weights start identical
(:math:`v = w`, :math:`g = \lVert w\rVert`).

The model keeps its activations channels-last, ``(B, L, d)``; the weights stay in an ``nn.Conv1d`` (same
parameters, state dicts and initialisation). Fused (:mod:`gatedformer.fused.gcnn`), each convolution is one matrix
product over the ``k`` shifted windows of its input and a plain block's GLU and residual add, ``X + a ⊙ σ(b)``,
one compiled pass each way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.gates import GLU
from gatedformer.gates._checks import check_size
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput

__all__ = ["GatedConvBlock", "GatedConvLM", "GatedConvLayer", "causal_conv1d", "glu_init_std"]

EMBEDDING_STD = 0.1
"""Standard deviation of the embedding initialisation (Gehring et al. 2017)."""


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""Causal 1-D convolution on channels-last input: ``x (B, L, C_in)``, ``weight (C_out, C_in, k)`` as in
    ``nn.Conv1d`` -> ``(B, L, C_out)``, the input padded by ``k - 1`` zeros on the left so that output ``t`` reads
    inputs ``t - k + 1 .. t``:

    .. math::

        y_{b,t} = \text{bias} + \sum_{i=0}^{k-1} W_{:,:,i}\, x_{b,\,t-k+1+i} \qquad (x_{b,j} = 0 \text{ for } j < 0).
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"causal_conv1d takes x (B, L, C_in) and weight (C_out, C_in, k); got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    padded = F.pad(x.transpose(1, 2), (weight.shape[-1] - 1, 0))
    return F.conv1d(padded, weight, bias).transpose(1, 2)


def glu_init_std(fan_in: int, dropout: float = 0.0, gated: bool = True) -> float:
    r"""Standard deviation :math:`\sqrt{4p/n}` (``gated``) or :math:`\sqrt{p/n}` for fan-in ``n``,
    keep probability ``p = 1 - dropout``."""
    keep = 1.0 - dropout
    return math.sqrt((4.0 if gated else 1.0) * keep / fan_in)


class GatedConvLayer(nn.Module):
    r"""``GLU(conv(dropout(x)))``: one causal gated convolution, channels-last ``(B, L, C_in) -> (B, L, C_out)``.

    The convolution has ``2 * out_channels`` output channels (values, then gates), weights
    :math:`\mathcal{N}(0, \sqrt{4p/n})` with :math:`n` = ``in_channels * kernel_size`` and zero biases.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dropout: float = 0.0,
                 weight_norm: bool = False) -> None:
        super().__init__()
        self.kernel_size = check_size("kernel_size", kernel_size, 1)
        self.dropout = Dropout(dropout)
        self.conv = nn.Conv1d(in_channels, 2 * out_channels, kernel_size)
        self.fan_in = in_channels * kernel_size
        self.init_std = glu_init_std(self.fan_in, dropout, gated=True)
        with torch.no_grad():
            self.conv.weight.normal_(0.0, self.init_std)
            self.conv.bias.zero_()
        if weight_norm:
            nn.utils.parametrizations.weight_norm(self.conv, name="weight", dim=0)
        self.glu = GLU(dim=-1)

    def forward(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        return self.glu(self.convolve(x, cache))

    def convolve(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        """``conv(dropout(x))``: the GLU's input, values then gates along the last dimension. With ``cache`` (a dict)
        ``x`` follows the inputs of earlier calls, whose last ``kernel_size - 1`` (zeros before the start) the cache
        keeps: the receptive field, all an incremental step needs."""
        x = self.dropout(x)
        if cache is None or self.kernel_size == 1:
            return self.causal_conv(x)
        past = cache.get("x")
        if past is None:
            past = x.new_zeros(x.shape[0], self.kernel_size - 1, x.shape[2])
        joined = torch.cat([past, x], dim=1)
        cache["x"] = joined[:, joined.shape[1] - (self.kernel_size - 1) :]
        return self.causal_conv(joined)[:, self.kernel_size - 1 :]

    def causal_conv(self, x: Tensor) -> Tensor:
        """The causal convolution of channels-last ``x`` ``(B, L, C_in)``: output ``t`` reads inputs
        ``t - k + 1 … t`` (zeros before the first), ``(B, L, 2 · C_out)``."""
        return causal_conv1d(x, self.conv.weight, self.conv.bias)


class GatedConvBlock(nn.Module):
    r"""A residual block ``H = X + F(X)`` on ``(B, L, d_model)``; ``F`` (``self.branch``) is one gated
    ``k``-wide convolution, or with ``bottleneck = b > 0`` gated 1×1 ``d -> b``, ``k``-wide ``b -> b`` and
    1×1 ``b -> d`` convolutions."""

    def __init__(self, d_model: int, kernel_size: int, dropout: float = 0.0, bottleneck: int = 0,
                 weight_norm: bool = False) -> None:
        super().__init__()
        if bottleneck > 0:
            self.branch = nn.Sequential(
                GatedConvLayer(d_model, bottleneck, 1, dropout, weight_norm),
                GatedConvLayer(bottleneck, bottleneck, kernel_size, dropout, weight_norm),
                GatedConvLayer(bottleneck, d_model, 1, dropout, weight_norm),
            )
        else:
            self.branch = nn.Sequential(GatedConvLayer(d_model, d_model, kernel_size, dropout, weight_norm))

    def forward(self, x: Tensor, cache: list[dict[str, Tensor]] | None = None) -> Tensor:
        """``X + F(X)``; with ``cache`` (one dict per convolution) on positions that follow the cached ones."""
        if cache is None:
            return x + self.branch(x)
        h = x
        for layer, layer_cache in zip(self.branch, cache, strict=True):
            h = layer(h, layer_cache)
        return x + h


class GatedConvLM(nn.Module):
    r"""Embedding, ``n_layers`` residual gated convolution blocks, dropout and a softmax output layer.

    ``forward(tokens (B, L), state=None)`` gives a :class:`~gatedformer.nn.outputs.ModelOutput` of
    ``logits (B, L, V)`` and no ``state``. The model is causal (logits at
    ``t`` depend on tokens ``<= t`` only) and carries no state between windows: its context is the
    receptive field, ``n_layers * (kernel_size - 1) + 1`` tokens. See the module docstring for the
    equations and the initialisation.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, kernel_size: int = 4, dropout: float = 0.0,
                 bottleneck: int = 0, weight_norm: bool = False, tie_embeddings: bool = False) -> None:
        super().__init__()
        self.vocab_size = check_size("vocab_size", vocab_size, 1)
        self.d_model = check_size("d_model", d_model, 1)
        self.n_layers = check_size("n_layers", n_layers, 1)
        self.kernel_size = check_size("kernel_size", kernel_size, 1)
        self.bottleneck = check_size("bottleneck", bottleneck, 0)
        if isinstance(dropout, bool) or not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout_p = float(dropout)
        self.weight_norm = bool(weight_norm)
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            GatedConvBlock(d_model, kernel_size, self.dropout_p, bottleneck, self.weight_norm)
            for _ in range(n_layers)
        )
        self.dropout = Dropout(self.dropout_p)
        self.output = OutputLayer(d_model, vocab_size)
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, EMBEDDING_STD)
            self.output.weight.normal_(0.0, glu_init_std(d_model, self.dropout_p, gated=False))
            self.output.bias.zero_()
        if tie_embeddings:
            self.output.weight = self.embedding.weight

    @property
    def receptive_field(self) -> int:
        return self.n_layers * (self.kernel_size - 1) + 1

    def forward(self, tokens: Tensor, state: object = None, *, targets: Tensor | None = None,
                reduction: str = "mean") -> ModelOutput:
        """``logits (B, L, V)``, or with ``targets`` their cross-entropy as ``loss`` in place of the logits (see
        :class:`~gatedformer.models.transformer.TransformerLM`); no ``state``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, L), got {tuple(tokens.shape)}")
        x = self.embedding(tokens)
        for block in self.layers:
            x = block(x)
        x = self.dropout(x)
        if targets is None:
            return ModelOutput(logits=self.output(x))
        return ModelOutput(loss=self.output.loss(x, targets, reduction=reduction))

    def new_cache(self, state: object = None) -> list[list[dict[str, Tensor]]]:
        """An empty incremental-decoding cache for :meth:`step`: one dict per convolution of every block."""
        return [[{} for _ in block.branch] for block in self.layers]

    def step(self, tokens: Tensor, cache: list[list[dict[str, Tensor]]]) -> Tensor:
        """Logits ``(B, L, V)`` of ``tokens (B, L)`` that follow the tokens already fed through ``cache``, as
        ``forward`` gives them for the whole sequence: every convolution reads its last ``kernel_size - 1`` cached
        inputs, so a step costs the same however long the sequence."""
        x = self.embedding(tokens)
        for block, block_cache in zip(self.layers, cache, strict=True):
            x = block(x, block_cache)
        return self.output(self.dropout(x))

    def cache_state(self, cache: object) -> None:
        """What ``forward`` would carry after the tokens fed through ``cache``: nothing."""
        return None

    def init_check_layers(self) -> list[dict]:
        """The sites :func:`gatedformer.analysis.init_check.init_check` measures: each block's gated
        branch ``F`` (not ``X + F(X)``), whose forward ``Var[F(X)]/Var[X]`` and backward
        ``Var[dL/dX through F]/Var[dL/dF]`` the GLU initialisation sets to 1 to first order (a bottleneck's
        ``d -> b`` and ``b -> d`` layers scale the gradient by ``b/d`` and ``d/b``, which cancel)."""
        kind = "GCNN bottleneck branch" if self.bottleneck else "GCNN GLU branch"
        # Without dropout each gated convolution scales both by p, the keep probability its weights were drawn for.
        no_dropout = (1.0 - self.dropout_p) ** (3 if self.bottleneck else 1)
        return [
            {"name": f"layers.{i}.branch", "module": block.branch, "kind": kind, "forward": 1.0, "backward": 1.0,
             "forward_no_dropout": no_dropout, "backward_no_dropout": no_dropout,
             "note": "GLU init, 1st order; +~E[x²]/p per gated conv"}
            for i, block in enumerate(self.layers)
        ]

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, bottleneck={self.bottleneck}, dropout={self.dropout_p}, "
                f"weight_norm={self.weight_norm}")


@register_backbone(
    "gcnn", task="lm", gated=False,
    description="gated convolutional LM: causal convolutions with GLU, residual (optionally bottleneck) blocks, GLU "
    "init",
    fields=("d_model", "n_layers", "kernel_size", "dropout", "bottleneck", "weight_norm", "tie_embeddings"))
def _build(cfg: ModelConfig, vocab_size: int) -> GatedConvLM:
    return GatedConvLM(
        vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, kernel_size=cfg.kernel_size, dropout=cfg.dropout,
        bottleneck=cfg.bottleneck, weight_norm=cfg.weight_norm, tie_embeddings=cfg.tie_embeddings,
    )
