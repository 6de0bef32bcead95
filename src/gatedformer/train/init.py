"""Weight initialisation schemes. Biases of standard layers always start at zero."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from gatedformer.config import InitConfig

_STANDARD_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d)


@torch.no_grad()
def initialise(model: nn.Module, cfg: InitConfig) -> None:
    """Re-initialise the weights of ``model``'s standard layers by ``cfg.scheme``; zero their biases.

    ``default`` keeps each layer's own weight initialisation. Only Linear, Embedding and Conv1d
    layers are touched: LayerNorm gains stay at one, and units with their own paper-specific
    scheme (SRU's recurrent vectors and highway bias) keep it.
    """
    for module in model.modules():
        if not isinstance(module, _STANDARD_LAYERS):
            continue
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
        # A parametrised weight (e.g. weight norm) is computed on access: fill a copy, then assign it
        # through the parametrisation (weight norm's right inverse sets g = ||v||, v = the new weight).
        parametrised = parametrize.is_parametrized(module, "weight")
        weight = module.weight.detach().clone() if parametrised else module.weight
        if cfg.scheme == "uniform":
            weight.uniform_(-cfg.scale, cfg.scale)
        elif cfg.scheme == "normal":
            weight.normal_(0.0, cfg.scale)
        elif cfg.scheme == "xavier":
            nn.init.xavier_uniform_(weight)
        if parametrised and cfg.scheme != "default":
            module.weight = weight
