"""Gated Linear Unit and a GLU feed-forward block."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

from ._checks import check_size


class GLU(nn.Module):
    r"""Gated Linear Unit.

    .. math::

        \mathrm{GLU}(a, b) = a \odot \sigma(b)

    where ``a`` and ``b`` are the first and second halves of the input along ``dim``. From
    Dauphin et al., "Language Modeling with Gated Convolutional Networks", ICML 2017.
    Has no parameters; the size along ``dim`` must be even, and the output has half of it.
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim must be an integer, got {dim!r}")
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 0:
            raise ValueError("GLU needs a tensor with at least one dimension")
        size = x.shape[self.dim]
        if size % 2:
            raise ValueError(f"GLU splits dim {self.dim} in two halves, but its size {size} is odd")
        return F.glu(x, dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class GLUFeedForward(nn.Module):
    r"""Position-wise feed-forward block with a GLU non-linearity.

    .. math::

        \mathrm{FFN}(x) = W_o\, \mathrm{Dropout}(\mathrm{GLU}(x W_{in} + b_{in}))

    with :math:`W_{in}: d \to 2 d_{ffn}` (value half, then gate half) and
    :math:`W_o: d_{ffn} \to d` without a bias of its own (the residual stream it is added to
    carries one). The GLU is from Dauphin et al., "Language Modeling with Gated
    Convolutional Networks", ICML 2017.

    Has ``d * 2 f + 2 f + f * d`` parameters for ``f = d_ffn``. ``b_in`` starts at zero.
    Works on tensors of shape ``(..., d_model)``.
    """

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.d_ffn = check_size("d_ffn", d_ffn)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.w_in = nn.Linear(d_model, 2 * d_ffn)
        self.glu = GLU(dim=-1)
        self.dropout = nn.Dropout(float(dropout))
        self.w_out = nn.Linear(d_ffn, d_model, bias=False)
        nn.init.zeros_(self.w_in.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_out(self.dropout(self.glu(self.w_in(x))))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ffn={self.d_ffn}"
