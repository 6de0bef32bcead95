"""The benchmark's sizes, options and gate variants."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gatedformer.config import ModelConfig
from gatedformer.errors import ConfigError

GATE_VARIANTS: dict[str, str] = {
    "baseline": "",
    "+σ SDU": "+σ SDU",
    "+tanh SDU": "+tanh SDU",
    "+highway gate": "+highway gate",
    "+gated MHDPA": "+gated MHDPA",
    "+EAU": "+EAU",
    "+GRC": "+GRC",
    "+EAU+GRC": "+EAU+GRC",
}
"""Variant name -> gate placement spec; any other spec string is accepted as a variant of its own."""


SECTIONS = ("models", "transformer-peers", "rnn-peers", "memory")
OPTIMIZERS = ("adamw-grouped", "adamw-fused", "adamw", "none")
MEMORY_METHODS = ("auto", "tensors", "rss", "cuda", "none")

GATE_TARGET_SLACK_PCT = 10.0
"""A gate meets the target when its extra step time is at most its extra FLOPs plus this many points."""
NOISY_SPREAD_PCT = 25.0
"""An IQR wider than this share of the median marks a comparison as noisy (the machine was busy)."""


@dataclass
class BenchSize:
    """The language models' size; the defaults are those of the ``-tiny`` recipes (``ptb-char-tiny``)."""

    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    d_ffn: int = 0
    """0: ``4 * d_model``."""
    seq_len: int = 128
    batch: int = 16
    vocab: int = 50
    dropout: float = 0.1
    mem_len: int = -1
    """Transformer-XL memory length; -1: ``seq_len``."""
    rnn_window: int = 7
    rnn_type: str = "gru"
    """R-Transformer LocalRNN cell: ``gru``, ``lstm`` or ``rnn``."""
    kernel_size: int = 4

    @property
    def ffn(self) -> int:
        return self.d_ffn or 4 * self.d_model

    @property
    def memory(self) -> int:
        return self.seq_len if self.mem_len < 0 else self.mem_len

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def model_config(self, backbone: str, gates: str = "", **changes: Any) -> ModelConfig:
        cfg = ModelConfig(backbone=backbone, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                          d_ffn=self.ffn, dropout=self.dropout, gates=gates, mem_len=self.memory,
                          rnn_window=self.rnn_window, rnn_type=self.rnn_type, kernel_size=self.kernel_size)
        return dataclasses.replace(cfg, **changes)


@dataclass
class RNNSize:
    """The recurrent peers' size (time-major input ``(length, batch, hidden)``)."""

    hidden: int = 256
    length: int = 128
    batch: int = 16
    layers: int = 2


@dataclass
class BenchOptions:
    repeats: int = 10
    warmup: int = 3
    device: str = "auto"
    compile: bool = False
    bf16: bool = False
    optimizer: str = "adamw-grouped"
    memory: str = "auto"
    threads: int = 0
    seed: int = 0
    init: str = "xavier"
    """Weight initialisation of every language model, ours and the peers alike (see :func:`initialise_weights`)."""
    flush_denormal: bool = False
    """Flush denormal floats to zero on the CPU for the run (``torch.set_flush_denormal``)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} but no CUDA device is available; use --device cpu or auto")
    return torch.device(name)
