r"""The Simple Recurrent Unit: one layer and a stack of them.

From Lei, Zhang, Wang, Dai and Artzi, "Simple Recurrent Units for Highly Parallelizable Recurrence",
EMNLP 2018 (arXiv:1709.02755). All matrix products of a layer are one fused product over every time
step; only the element-wise recurrence runs step by step (:func:`gatedformer.ops.sru.sru_recurrence`, which
dispatches to the compiled CPU kernel, the Triton kernels on a GPU, or PyTorch operations).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.gates._checks import check_size
from gatedformer.nn.dropout import Dropout
from gatedformer.ops.dropout import dropout
from gatedformer.ops.sru import kernel_backend, sru_recurrence, sru_recurrence_reference

__all__ = [
    "MAX_HIGHWAY_BIAS",
    "SRU",
    "SRUFeedForward",
    "SRULayer",
    "highway_scale",
    "kernel_backend",
    "sru_recurrence",
    "sru_recurrence_reference",
]

_V_INIT_RANGE = 0.5
"""``v_f`` and ``v_r`` start uniform in ``[-0.5, 0.5]``: zero mean, variance 1/12."""


def _dropout_arg(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {value!r}")
    return float(value)


# The largest b whose alpha = sqrt(1 + 2e^b) is finite in float32: 2 ln(3.4e38) - ln 2 is about 176.
MAX_HIGHWAY_BIAS = 170.0


def highway_scale(highway_bias: float, rescale: bool = True) -> float:
    r"""The constant :math:`\alpha = \sqrt{1 + 2 e^{b}}` that scales the skip input (1 without ``rescale``).

    With weights of variance ``1/d`` and the reset gate starting around :math:`\sigma(b)`, this keeps
    the variance of ``h`` near that of ``x`` through deep stacks (SRU paper, appendix).
    """
    if not math.isfinite(highway_bias):
        raise ValueError(f"highway_bias must be a finite number, got {highway_bias}")
    if not rescale:
        return 1.0
    # sqrt(1 + 2e^b) overflows float32 long before math.exp overflows float64.
    if highway_bias > MAX_HIGHWAY_BIAS:
        raise ValueError(f"highway_bias={highway_bias} makes alpha = sqrt(1 + 2e^b) overflow float32; keep it at "
                         f"most {MAX_HIGHWAY_BIAS} (the paper uses 0 or below)")
    return math.sqrt(1.0 + 2.0 * math.exp(highway_bias))


class SRULayer(nn.Module):
    r"""One SRU layer (one or two directions); see :class:`SRU` for the equations.

    Parameters, for ``D`` directions of ``H = hidden_size`` units and ``K`` streams (3, or 4 with a
    projected skip):

    - ``weight``: ``(D * K * H, input_size)``, or ``(D * K * H, projection_size)`` with a projection;
      rows ordered (direction, stream, unit), streams ``[W; W_f; W_r; W_s]``;
    - ``weight_proj``: ``(projection_size, input_size)`` or ``None``;
    - ``v_f``, ``v_r``, ``b_f``, ``b_r``: ``(D, H)``;
    - ``norm``: a LayerNorm over the input when ``layer_norm`` (else ``None``).

    ``skip=False`` drops the highway term, ``h_t = r_t ⊙ c_t`` (the ``sru`` package's ``has_skip_term=False``), for
    an SRU inside a residual sublayer, whose residual connection carries ``x_t`` already; the input and hidden sizes
    may then differ without a fourth stream.

    ``forward(x (L, B, input_size), c0 (B, D * H) or None) -> (h (L, B, D * H), c_last (B, D * H))``.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        highway_bias: float = 0.0,
        rescale: bool = True,
        projection_size: int = 0,
        layer_norm: bool = False,
        bidirectional: bool = False,
        skip: bool = True,
    ) -> None:
        super().__init__()
        self.input_size = check_size("input_size", input_size, 1)
        self.hidden_size = check_size("hidden_size", hidden_size, 1)
        if isinstance(projection_size, bool) or not isinstance(projection_size, int) or projection_size < 0:
            raise ValueError(f"projection_size must be 0 (no projection) or a positive integer, "
                             f"got {projection_size!r}")
        self.highway_bias = float(highway_bias)
        self.rescale = bool(rescale)
        self.bidirectional = bool(bidirectional)
        self.num_directions = 2 if bidirectional else 1
        self.output_size = hidden_size * self.num_directions
        # The skip input must have the size of h: x itself when the sizes match (split between the two
        # directions when bidirectional), else a fourth stream W_s x of the fused product. Without the skip term
        # (h = r ⊙ c, where a residual connection around the layer carries x instead) three streams always do.
        self.skip = bool(skip)
        self.num_streams = 3 if input_size == self.output_size or not self.skip else 4
        self.alpha = highway_scale(self.highway_bias, self.rescale) if self.skip else 0.0
        fused = self.num_directions * self.num_streams * hidden_size
        self.projection_size = self._check_projection(projection_size, fused)

        inner = self.projection_size or input_size
        self.weight = nn.Parameter(torch.empty(fused, inner))
        self.weight_proj = (
            nn.Parameter(torch.empty(self.projection_size, input_size)) if self.projection_size else None
        )
        shape = (self.num_directions, hidden_size)
        self.v_f = nn.Parameter(torch.empty(shape))
        self.v_r = nn.Parameter(torch.empty(shape))
        self.b_f = nn.Parameter(torch.empty(shape))
        self.b_r = nn.Parameter(torch.empty(shape))
        self.norm = nn.LayerNorm(input_size) if layer_norm else None
        self.reset_parameters()

    def _check_projection(self, projection_size: int, fused: int) -> int:
        if projection_size <= 0:
            return 0
        limit = min(self.input_size, 3 * self.hidden_size)
        if projection_size >= limit:
            raise ValueError(
                f"projection_size={projection_size} cannot reduce anything: it must be below "
                f"min(input_size={self.input_size}, 3 * hidden_size={3 * self.hidden_size}) = {limit} "
                "(use 0 for no projection)"
            )
        full = self.input_size * fused
        factored = projection_size * (self.input_size + fused)
        if factored >= full:
            raise ValueError(
                f"projection_size={projection_size} does not save parameters: the factorised "
                f"{self.input_size} -> {projection_size} -> {fused} product has {factored} weights, the full "
                f"matrix {full}; use a projection_size below "
                f"{-(-full // (self.input_size + fused))} or 0"
            )
        return projection_size

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weights uniform with variance ``1/fan_in`` (paper appendix), ``v_f, v_r`` uniform in
        ``[-0.5, 0.5]``, ``b_f = 0`` and ``b_r = highway_bias``; the LayerNorm (if any) to identity."""
        for w in (self.weight, self.weight_proj):
            if w is not None:
                bound = math.sqrt(3.0 / w.shape[1])
                w.uniform_(-bound, bound)
        self.v_f.uniform_(-_V_INIT_RANGE, _V_INIT_RANGE)
        self.v_r.uniform_(-_V_INIT_RANGE, _V_INIT_RANGE)
        self.b_f.zero_()
        self.b_r.fill_(self.highway_bias)
        if self.norm is not None:
            self.norm.reset_parameters()

    def fused_projection(self, x: Tensor) -> Tensor:
        """``U`` of shape ``(L, B, D, K, H)``: every input projection of every step in one product."""
        x_in = x if self.norm is None else self.norm(x)
        if self.weight_proj is not None:
            x_in = F.linear(x_in, self.weight_proj)
        U = F.linear(x_in, self.weight)
        return U.view(x.shape[0], x.shape[1], self.num_directions, self.num_streams, self.hidden_size)

    def _recurrence_inputs(self, x: Tensor, c0: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(U, skip, c0)`` as the recurrence takes them, the arguments checked."""
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"x must have shape (L, B, {self.input_size}), got {tuple(x.shape)}")
        L, B, _ = x.shape
        if L == 0:
            raise ValueError("x is an empty sequence (L = 0)")
        D, H = self.num_directions, self.hidden_size
        if c0 is not None:
            if tuple(c0.shape) != (B, D * H):
                raise ValueError(f"c0 must have shape ({B}, {D * H}), got {tuple(c0.shape)}")
            c0 = c0.reshape(B, D, H)
        U = self.fused_projection(x)
        skip = x.reshape(L, B, D, H) if self.num_streams == 3 and self.skip else None
        if not self.skip:  # alpha = 0 leaves h = r ⊙ c: the recurrence reads a zero skip input, gives it no gradient
            skip = U.new_zeros((L, B, D, H))
        return U, skip, c0

    def forward(self, x: Tensor, c0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        U, skip, c0 = self._recurrence_inputs(x, c0)
        L, B, _ = x.shape
        h, c_last = sru_recurrence(U, skip, self.v_f, self.v_r, self.b_f, self.b_r, c0, self.alpha)
        return h.reshape(L, B, -1), c_last.reshape(B, -1)

    def cell_states(self, x: Tensor, c0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(h, c)``: the output and the cell state of every step, ``(L, B, directions · hidden)`` each, by the
        reference recurrence (slow; for measuring, e.g. the SRU appendix's ``Var[c]/Var[x]``)."""
        U, skip, c0 = self._recurrence_inputs(x, c0)
        L, B, _ = x.shape
        cells: list[Tensor] = []
        h, _ = sru_recurrence_reference(U, skip, self.v_f, self.v_r, self.b_f, self.b_r, c0, self.alpha, cells=cells)
        return h.reshape(L, B, -1), cells[0].reshape(L, B, -1)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.projection_size:
            s += f", projection_size={self.projection_size}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if self.highway_bias:
            s += f", highway_bias={self.highway_bias}"
        if not self.skip:
            s += ", no skip term"
        else:
            s += f", rescale={self.rescale} (alpha={self.alpha:.4g})"
        if self.num_streams == 4:
            s += ", projected skip"
        return s


class SRU(nn.Module):
    r"""A stack of Simple Recurrent Unit layers, time-major like :class:`torch.nn.LSTM`.

    Each layer computes, for input :math:`x_t` and cell :math:`c_{t-1}`,

    .. math::

        f_t &= \sigma(W_f x_t + v_f \odot c_{t-1} + b_f) \\
        c_t &= f_t \odot c_{t-1} + (1 - f_t) \odot (W x_t) \\
        r_t &= \sigma(W_r x_t + v_r \odot c_{t-1} + b_r) \\
        h_t &= r_t \odot c_t + (1 - r_t) \odot x_t \cdot \alpha

    with :math:`\alpha = \sqrt{1 + 2 e^{b}}` for the highway bias :math:`b` (the initial :math:`b_r`)
    when ``rescale`` (:math:`\sqrt 3` at :math:`b = 0`), else :math:`\alpha = 1`. When the input and
    output sizes differ, :math:`x_t` in :math:`h_t` is replaced by a linear skip :math:`W_s x_t`.
    :math:`[W; W_f; W_r (; W_s)]` is one matrix applied to every time step in a single product; with
    ``projection_size`` :math:`d'` it is factorised as :math:`Q P` with :math:`P: d \to d'`. Only the
    element-wise recurrence runs step by step, in a compiled kernel with a hand-written backward.

    Lei, Zhang, Wang, Dai and Artzi, "Simple Recurrent Units for Highly Parallelizable Recurrence",
    EMNLP 2018 (arXiv:1709.02755).

    Args:
        input_size: features of ``x``.
        hidden_size: units per direction.
        num_layers: stacked layers; layer ``i > 0`` reads the ``hidden_size * directions`` outputs.
        dropout: dropout on the outputs of every layer but the last (``variational_dropout`` shares
            one mask across the time steps of a sequence, as in the paper).
        highway_bias: initial reset-gate bias :math:`b_r` (also sets :math:`\alpha`); the SRU paper uses
            negative values such as -2 or -3 for deep stacks.
        rescale: scale the skip input by :math:`\alpha`.
        projection_size: factorise each layer's fused matrix through this many dimensions; 0 for none.
            A size that cannot reduce the parameter count is a ``ValueError``.
        layer_norm: LayerNorm on each layer's input before the fused product (the skip term keeps the
            un-normalised input), as in the ``sru`` package.
        bidirectional: add a backwards direction; outputs are ``[forward, backward]``, ``2 * hidden_size``.

    ``forward(x (L, B, input_size), c0 (num_layers, B, hidden_size * directions) or None)`` returns
    ``h (L, B, hidden_size * directions)`` (the last layer) and ``c_last`` shaped like ``c0``: each
    layer's cell after its last step (for the backward direction, after ``t = 0``).
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 2,
        dropout: float = 0.0,
        highway_bias: float = 0.0,
        rescale: bool = True,
        projection_size: int = 0,
        layer_norm: bool = False,
        bidirectional: bool = False,
        *,
        variational_dropout: bool = False,
    ) -> None:
        super().__init__()
        self.input_size = check_size("input_size", input_size, 1)
        self.hidden_size = check_size("hidden_size", hidden_size, 1)
        self.num_layers = check_size("num_layers", num_layers, 1)
        self.dropout = _dropout_arg(dropout)
        self.variational_dropout = bool(variational_dropout)
        self.bidirectional = bool(bidirectional)
        self.output_size = hidden_size * (2 if bidirectional else 1)
        layers = []
        for i in range(num_layers):
            try:
                layers.append(
                    SRULayer(
                        input_size if i == 0 else self.output_size,
                        hidden_size,
                        highway_bias=highway_bias,
                        rescale=rescale,
                        projection_size=projection_size,
                        layer_norm=layer_norm,
                        bidirectional=bidirectional,
                    )
                )
            except ValueError as err:
                raise ValueError(f"SRU layer {i}: {err}") from None
        self.layers = nn.ModuleList(layers)

    def reset_parameters(self) -> None:
        for layer in self.layers:
            layer.reset_parameters()

    def _drop(self, x: Tensor) -> Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        if not self.variational_dropout:
            return dropout(x, self.dropout)
        keep = 1.0 - self.dropout
        mask = x.new_empty((1, *x.shape[1:])).bernoulli_(keep).div_(keep)
        return x * mask

    def forward(self, x: Tensor, c0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"x must have shape (L, B, {self.input_size}), got {tuple(x.shape)}")
        expected = (self.num_layers, x.shape[1], self.output_size)
        if c0 is not None and tuple(c0.shape) != expected:
            raise ValueError(f"c0 must have shape {expected}, got {tuple(c0.shape)}")
        cells = []
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = self._drop(x)
            x, c = layer(x, None if c0 is None else c0[i])
            cells.append(c)
        return x, torch.stack(cells)

    def extra_repr(self) -> str:
        s = f"num_layers={self.num_layers}"
        if self.dropout:
            s += f", dropout={self.dropout}" + (" (variational)" if self.variational_dropout else "")
        return s


class SRUFeedForward(nn.Module):
    r"""The Transformer's feed-forward sublayer with an SRU for its hidden layer: ``W2 · Dropout(SRU(x)) + b2``.

    The SRU paper (Lei et al. 2018, §4.4 and appendix B.3, "Transformer w/ SRU") replaces the hidden layer
    :math:`\mathrm{ReLU}(W_1 x + b_1)` of every feed-forward sublayer, in the encoder and the decoder, by an SRU layer
    of ``d_ffn`` units, followed by the same output projection :math:`W_2`; as in the authors' own implementation
    (flambe's ``TransformerSRU``, ``SRUCell(d_model, d_ffn, has_skip_term=False)``), the SRU has no highway term,
    :math:`h_t = r_t \odot c_t`, since the sublayer's residual connection carries :math:`x_t`. Its parameters are
    :math:`3 \cdot d \cdot f` weights and :math:`4f` vectors in place of :math:`W_1, b_1`'s :math:`d f + f`.

    The recurrence runs left to right over ``(B, L, d)`` batch-first input, so it is causal: a decoder stays
    autoregressive, and right-padding never reaches a real position. ``cache`` (a dict) carries the last cell ``c``
    from one call to the next, so a decoder can be fed one position at a time. Like
    :class:`~gatedformer.nn.sublayer.FeedForward` it offers ``features`` and ``output_projection``, so the sublayer
    fuses :math:`W_2` with its dropout, residual add and LayerNorm.
    """

    activation = "sru"
    """Not ``relu``: the fused paths that compute a ReLU feed-forward themselves decline it."""

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.sru = SRULayer(d_model, d_ffn, skip=False)
        self.outer = nn.Linear(d_ffn, d_model)
        self.dropout = Dropout(_dropout_arg(dropout))

    @property
    def output_projection(self) -> nn.Linear:
        return self.outer

    def features(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        """``Dropout(SRU(x))``, ``(B, L, d_ffn)``, from ``x (B, L, d_model)``; ``cache`` carries the last cell."""
        c0 = None if cache is None else cache.get("c")
        h, c_last = self.sru(x.transpose(0, 1), c0)
        if cache is not None:
            cache["c"] = c_last
        return self.dropout(h.transpose(0, 1))

    def forward(self, x: Tensor, cache: dict[str, Tensor] | None = None) -> Tensor:
        return self.outer(self.features(x, cache))
