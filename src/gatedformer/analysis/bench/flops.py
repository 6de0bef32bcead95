"""Model FLOPs, counted analytically per layer (or by torch's counter where no formula exists)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gatedformer.config import ModelConfig
from gatedformer.gates.kinds import GATE_KINDS
from gatedformer.gates.spec import SublayerGates, resolve_placement

_RNN_GATES = {"gru": 3, "lstm": 4, "rnn": 1}


@dataclass
class FlopCount:
    """FLOPs of one forward pass over a batch, by component."""

    forward: dict[str, int]
    method: str = "analytic"

    @property
    def forward_total(self) -> int:
        return sum(self.forward.values())

    @property
    def train_total(self) -> int:
        """Forward + backward: every product of the forward pass is followed by two of the same size."""
        return 3 * self.forward_total


def _mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def _gate_flops(site: SublayerGates, tokens: int, d: int, f: int, heads: int) -> int:
    """The gates' products beside a sublayer's body (a GLU-variant feed-forward is the body: :func:`_body_kind`)."""
    return sum(tokens * GATE_KINDS[name].matmul_flops(d, f, heads) for name in site.kinds
               if GATE_KINDS[name].role != "body")


def _body_kind(site: SublayerGates) -> str | None:
    """The kind that is a sublayer's body (a GLU-variant feed-forward), if any."""
    return next((name for name in site.kinds if GATE_KINDS[name].role == "body"), None)


def count_flops(cfg: ModelConfig, vocab: int, batch: int, seq_len: int, memory_len: int | None = None) -> FlopCount:
    """Forward FLOPs of the language model ``cfg`` on one ``(batch, seq_len)`` window, counted per layer.

    See the module docstring for what is counted. ``memory_len`` is the Transformer-XL memory in use
    (default ``cfg.mem_len``, the steady state). Backbones without a formula here raise ``ValueError``.
    """
    b, t, d = batch, seq_len, cfg.d_model
    n = b * t
    parts: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        parts[key] = parts.get(key, 0) + value

    if cfg.backbone in ("transformer", "rtransformer", "transformer-xl", "sru-transformer"):
        placement = resolve_placement(cfg.gates, cfg.n_layers)
        f = cfg.d_ffn
        for i in range(cfg.n_layers):
            if cfg.backbone == "rtransformer":
                width = _RNN_GATES[cfg.rnn_type] * d
                # Input projection once per position, then window - 1 hidden-to-hidden products.
                add("local_rnn", cfg.rnn_window * _mm(n, d, width))
            if cfg.backbone == "transformer-xl":
                mem = cfg.mem_len if memory_len is None else memory_len
                keys = mem + t
                pairs = t * mem + t * (t + 1) // 2
                add("attn.proj", _mm(n, d, d) + _mm(b * keys, d, 2 * d) + _mm(keys, d, d) + _mm(n, d, d))
                add("attn.scores", 2 * (2 * b * pairs * d))  # content (a + c) and position (b + d) terms
                add("attn.values", 2 * b * pairs * d)
            else:
                pairs = t * (t + 1) // 2
                add("attn.proj", _mm(n, d, 3 * d) + _mm(n, d, d))
                add("attn.scores", 2 * b * pairs * d)
                add("attn.values", 2 * b * pairs * d)
            if cfg.backbone == "sru-transformer":
                # the SRU in place of the hidden layer: [W x, W_f x, W_r x] in one product, then W2
                add("sru.proj", _mm(n, d, 3 * f))
                add("ffn", _mm(n, f, d))
            elif _body_kind(placement.at(i, "ffn")) is not None:  # SwiGLU & co. in place of the feed-forward
                add("ffn", n * GATE_KINDS[_body_kind(placement.at(i, "ffn"))].matmul_flops(d, f, cfg.n_heads))
            else:
                add("ffn", _mm(n, d, 2 * f) + _mm(n, f, d) if cfg.ffn == "glu" else _mm(n, d, f) + _mm(n, f, d))
            gates = (_gate_flops(placement.at(i, "attn"), n, d, f, cfg.n_heads)
                     + _gate_flops(placement.at(i, "ffn"), n, d, f, cfg.n_heads))
            if gates:
                add("gates", gates)
    elif cfg.backbone == "gcnn":
        k, bott = cfg.kernel_size, cfg.bottleneck
        for _ in range(cfg.n_layers):
            if bott > 0:
                add("conv", _mm(n, d, 2 * bott) + _mm(n, bott * k, 2 * bott) + _mm(n, bott, 2 * d))
            else:
                add("conv", _mm(n, d * k, 2 * d))
    elif cfg.backbone == "sru":
        p = cfg.projection_size
        for _ in range(cfg.n_layers):
            add("sru.proj", _mm(n, d, p) + _mm(n, p, 3 * d) if p else _mm(n, d, 3 * d))
    else:
        raise ValueError(f"no FLOP formula for backbone {cfg.backbone!r}")
    add("output", _mm(n, d, vocab))
    return FlopCount(parts)


def measured_flops(model: nn.Module, tokens: Tensor) -> FlopCount:
    """Fallback for backbones without a formula: torch's operator-level counter on one forward pass."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens)
    return FlopCount({"all": int(counter.get_total_flops())}, method="torch.utils.flop_counter")
