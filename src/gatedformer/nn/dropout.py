"""The dropout module every model uses: :class:`torch.nn.Dropout` with the cheap CPU masks of
:mod:`gatedformer.ops.dropout`."""

from __future__ import annotations

from torch import Tensor, nn

from gatedformer.ops.dropout import dropout, dropout_add, relu_dropout

__all__ = ["Dropout"]


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` (same arguments, same ``p``) drawing its CPU masks with
    :func:`~gatedformer.ops.dropout.keep_mask`."""

    counter_masks = True
    """The fused paths (:mod:`gatedformer.ops`) draw this module's masks themselves, as its ``forward`` would."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training, self.inplace)

    def add_to(self, base: Tensor, x: Tensor) -> Tensor:
        """``base + self(x)``, fused as in :func:`dropout_add`."""
        return dropout_add(base, x, self.p, self.training)

    def after_relu(self, x: Tensor) -> Tensor:
        """``self(relu(x))``, fused as in :func:`relu_dropout`."""
        return relu_dropout(x, self.p, self.training)
