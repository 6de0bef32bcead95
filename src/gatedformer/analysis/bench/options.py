"""The benchmark's sizes, options and gate variants."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gatedformer.config import INIT_SCHEMES, ModelConfig, backbone_names
from gatedformer.errors import ConfigError
from gatedformer.gates.spec import parse_gate_spec

GATE_VARIANTS: dict[str, str] = {
    "baseline": "",
    "+σ SDU": "+σ SDU",
    "+tanh SDU": "+tanh SDU",
    "+highway gate": "+highway gate",
    "+gated MHDPA": "+gated MHDPA",
    "+EAU": "+EAU",
    "+GRC": "+GRC",
    "+EAU+GRC": "+EAU+GRC",
    "+SDPA gate": "+SDPA gate",
    "+SDPA gate headwise": "+SDPA gate headwise",
    "+SwiGLU": "+SwiGLU",
    "+GRU gate": "+GRU gate",
    "+ReZero": "+ReZero",
}
"""Variant name -> gate placement spec; any other spec string is accepted as a variant of its own (the other GLU
variants, ``+GLU``, ``+Bilinear``, ``+ReGLU``, ``+GEGLU``, cost what ``+SwiGLU`` costs with another activation)."""


SECTIONS = ("models", "transformer-peers", "rnn-peers", "memory", "bert", "translation", "sampling", "qa")
DEFAULT_SECTIONS = tuple(section for section in SECTIONS if section not in ("sampling", "qa"))
"""What ``bench`` runs unless ``--sections`` says otherwise: ``sampling`` (minutes of full recomputation) and ``qa``
(readers of the paper's size) are asked for by name."""
OPTIMIZERS = ("adamw-grouped", "adamw-fused", "adamw", "none")
MEMORY_METHODS = ("auto", "tensors", "rss", "cuda", "none")
RNN_TYPES = ("gru", "lstm", "rnn")

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

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first option out of range, before anything is built or timed."""
        for flag, value in (("--d-model", self.d_model), ("--layers", self.n_layers), ("--heads", self.n_heads),
                            ("--seq-len", self.seq_len), ("--batch", self.batch),
                            ("--rnn-window", self.rnn_window)):
            check_at_least(flag, value, 1)
        check_at_least("--d-ffn", self.d_ffn, 0, "0 means 4 × --d-model")
        check_at_least("--vocab", self.vocab, 2)
        check_at_least("--mem-len", self.mem_len, -1, "-1 means --seq-len")
        _require(self.kernel_size >= 1, f"kernel_size must be at least 1, got {self.kernel_size}")
        _require(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}; e.g. --dropout 0.1")
        _require(self.rnn_type in RNN_TYPES,
                 f"--rnn-type {self.rnn_type!r} is not one of {', '.join(RNN_TYPES)}; pick one of them")
        _require(self.d_model % self.n_heads == 0,
                 f"--d-model {self.d_model} is not divisible by --heads {self.n_heads}; "
                 "pick a head count that divides it")

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

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first size below 1."""
        for flag, value in (("--rnn-hidden", self.hidden), ("--rnn-len", self.length),
                            ("--rnn-batch", self.batch), ("--rnn-layers", self.layers)):
            check_at_least(flag, value, 1)


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

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first option out of range or not among its choices."""
        check_at_least("--repeats", self.repeats, 1)
        check_at_least("--warmup", self.warmup, 0)
        check_at_least("--threads", self.threads, 0, "0 keeps PyTorch's default")
        for flag, value, choices in (("--optimizer", self.optimizer, OPTIMIZERS), ("--init", self.init, INIT_SCHEMES),
                                     ("--memory", self.memory, MEMORY_METHODS)):
            _require(value in choices, f"{flag} {value!r} is not one of {', '.join(choices)}; pick one of them")


def check_selection(sections: Sequence[str], backbones: Sequence[str] | None, variants: Sequence[str] | None,
                    mem_lens: Sequence[int], windows: Sequence[int]) -> None:
    """Raise :class:`ConfigError` for an unknown section or backbone, a gate spec that does not parse, or a
    memory sweep value out of range: a typo must stop the run, not become a skipped row."""
    for flag, names, known in (("--sections", sections, SECTIONS), ("--backbones", backbones or (), backbone_names())):
        unknown = [name for name in names if name not in known]
        _require(not unknown, f"unknown {flag} value(s) {', '.join(map(repr, unknown))}; "
                              f"choose from {', '.join(known)}")
    for name in variants or ():
        try:
            parse_gate_spec(GATE_VARIANTS.get(name, name))
        except ConfigError as err:
            raise ConfigError(f"--variants {name!r}: {err}") from None
    for value in mem_lens:
        check_at_least("--mem-lens", value, 0)
    for value in windows:
        check_at_least("--windows", value, 1)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_at_least(flag: str, value: int, least: int, meaning: str = "") -> None:
    """Raise :class:`ConfigError` naming ``flag`` when ``value`` is below ``least`` (``meaning`` explains it)."""
    hint = f" ({meaning})" if meaning else ""
    _require(value >= least, f"{flag} must be at least {least}{hint}, got {value}")
