"""GATEDFORMER_EXPLAIN_FUSION=1: a fused path that declines says why, once per path and reason."""

from __future__ import annotations

import logging

import pytest
import torch

from gatedformer import TransformerLM
from gatedformer.fused import fuse
from gatedformer.ops import explain


@pytest.fixture
def explaining(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    monkeypatch.setenv(explain.ENV_VAR, "1")
    monkeypatch.setattr(explain, "_SAID", set())
    caplog.set_level(logging.INFO, logger="gatedformer.ops")
    return caplog


def _step(model: TransformerLM) -> None:
    tokens = torch.randint(0, 11, (2, 9))
    loss = model(tokens, targets=tokens).loss
    loss.backward()


def test_a_declined_path_says_why_once(explaining: pytest.LogCaptureFixture) -> None:
    model = fuse(TransformerLM(11, d_model=16, n_layers=2, n_heads=2, d_ffn=32, gates="+σ SDU")).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _step(model)
        _step(model)
    lines = [r.getMessage() for r in explaining.records]
    assert "ops.fused_linear.feed_forward_add_norm declined: autocast is on" in lines
    assert len(lines) == len(set(lines))  # each path and reason once


def test_a_hooked_gate_and_a_kernel_turned_off_are_named(explaining: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = fuse(TransformerLM(11, d_model=16, n_layers=1, n_heads=2, d_ffn=32, gates="+EAU")).train()
    model.layers[0].attn.eau.register_forward_hook(lambda *args: None)
    _step(model)
    monkeypatch.setenv("GATEDFORMER_CROSS_ENTROPY_BACKEND", "torch")
    _step(model)
    text = "\n".join(r.getMessage() for r in explaining.records)
    assert "EAU has hooks" in text
    assert "ops.output_loss.linear_cross_entropy declined:" in text
    assert "GATEDFORMER_CROSS_ENTROPY_BACKEND=torch" in text


def test_nothing_is_said_without_the_variable(caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(explain.ENV_VAR, raising=False)
    caplog.set_level(logging.INFO, logger="gatedformer.ops")
    model = TransformerLM(11, d_model=16, n_layers=1, n_heads=2, d_ffn=32).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _step(model)
    assert not caplog.records
