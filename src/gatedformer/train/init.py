"""Weight initialisation schemes. Biases of the layers a scheme covers always start at zero.

The schemes cover what the papers' statements ("weights are initialised with U(-0.1, 0.1) and biases as 0s", HT
A.1/A.2) cover: every weight and bias of the linear, embedding and convolution layers and of the recurrent cells
(the R-Transformer's LocalRNN: ``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``, as
``torch.nn.RNNBase`` names them). LayerNorm gains stay at one, and units with a scheme of their own from their paper
keep it (the SRU's recurrent vectors and highway bias, Transformer-XL's position biases).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from gatedformer.config import InitConfig

_STANDARD_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d)
_RECURRENT_WEIGHTS = ("weight_ih_l0", "weight_hh_l0")


def _recurrent(module: nn.Module) -> bool:
    """A one-layer recurrent cell's parameters under torch's names (nn.GRU/LSTM/RNN or a module that holds them)."""
    return isinstance(module, nn.RNNBase) or all(hasattr(module, name) for name in _RECURRENT_WEIGHTS)


def _fill(weight: torch.Tensor, cfg: InitConfig) -> None:
    if cfg.scheme == "uniform":
        weight.uniform_(-cfg.scale, cfg.scale)
    elif cfg.scheme == "normal":
        weight.normal_(0.0, cfg.scale)
    elif cfg.scheme == "xavier":
        nn.init.xavier_uniform_(weight)


@torch.no_grad()
def initialise(model: nn.Module, cfg: InitConfig) -> None:
    """Re-initialise the weights of ``model``'s layers by ``cfg.scheme`` and zero their biases (see the module).

    ``default`` keeps each layer's own weights (and the recurrent cells' biases) and zeroes the other biases.
    """
    for module in model.modules():
        if cfg.scheme != "default" and _recurrent(module):
            for name, parameter in module.named_parameters(recurse=False):
                if name.startswith("weight"):
                    _fill(parameter, cfg)
                elif name.startswith("bias"):
                    parameter.zero_()
            continue
        if not isinstance(module, _STANDARD_LAYERS):
            continue
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
        # A parametrised weight (e.g. weight norm) is computed on access: fill a copy, then assign it
        # through the parametrisation (weight norm's right inverse sets g = ||v||, v = the new weight).
        parametrised = parametrize.is_parametrized(module, "weight")
        weight = module.weight.detach().clone() if parametrised else module.weight
        _fill(weight, cfg)
        if parametrised and cfg.scheme != "default":
            module.weight = weight
