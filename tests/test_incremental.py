"""Incremental decoding: every language-model backbone's cached steps (``new_cache`` / ``step`` / ``cache_state``)
against the full recomputation of ``forward``, and sampling with and without the cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gatedformer.analysis.bench import BenchOptions, BenchReport, BenchSize, RNNSize
from gatedformer.analysis.bench.report import format_report, report_meta
from gatedformer.analysis.bench.sampling import bench_sampling
from gatedformer.config import ModelConfig, backbone_names
from gatedformer.models import build_model
from gatedformer.tasks.lm import DecodingWindow, sample_ids

VOCAB = 23
BASE = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.1, kernel_size=3, rnn_window=4)

CASES = {
    "transformer": {},
    "transformer +σ SDU": {"gates": "+σ SDU"},
    "transformer pre-LN +highway gate": {"norm": "pre", "gates": "+highway gate"},
    "transformer +EAU+GRC glu": {"gates": "+EAU+GRC", "ffn": "glu"},
    "transformer +gated MHDPA": {"gates": "+gated MHDPA"},
    "sru-transformer": {"gates": "+tanh L1"},
    "rtransformer": {"gates": "+σ SDU"},
    "rtransformer lstm pre-LN": {"rnn_type": "lstm", "norm": "pre"},
    "transformer-xl": {"mem_len": 8, "gates": "+σ SDU"},
    "transformer-xl pre-LN": {"mem_len": 8, "norm": "pre", "gates": "+EAU+GRC"},
    "transformer-xl no memory": {"mem_len": 0},
    "gcnn": {},
    "gcnn bottleneck": {"bottleneck": 8},
    "sru": {},
}


def _model(case: str) -> torch.nn.Module:
    backbone = case.split()[0]
    cfg = dataclasses.replace(BASE, backbone=backbone, **CASES[case])
    torch.manual_seed(0)
    return build_model(cfg, VOCAB).eval()


def test_every_backbone_has_a_case() -> None:
    assert {case.split()[0] for case in CASES} == set(backbone_names())


def _max_difference(a: object, b: object) -> float:
    if a is None or b is None:
        assert a is None and b is None
        return 0.0
    if isinstance(a, list | tuple):
        return max(_max_difference(x, y) for x, y in zip(a, b, strict=True))
    return float((a - b).abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_cached_steps_equal_full_recomputation(case: str) -> None:
    model = _model(case)
    generator = torch.Generator().manual_seed(1)
    earlier = torch.randint(0, VOCAB, (2, 6), generator=generator)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=generator)
    with torch.no_grad():
        state = model(earlier).state  # a window before, whose state (Transformer-XL memory, SRU cells) carries over
        out = model(tokens, state)
        full, full_state = out.logits, out.state
        cache = model.new_cache(state)
        # a prefill of several tokens, then one token a step
        steps = [model.step(tokens[:, :5], cache)] + [model.step(tokens[:, t : t + 1], cache) for t in range(5, 24)]
        cached = torch.cat(steps, dim=1)
        assert _max_difference(full, cached) < 1e-4
        assert _max_difference(full_state, model.cache_state(cache)) < 1e-4


@pytest.mark.parametrize("case", ["transformer", "sru-transformer", "rtransformer", "transformer-xl",
                                  "transformer-xl no memory", "gcnn", "sru"])
def test_sampling_with_and_without_the_cache_is_identical(case: str) -> None:
    model = _model(case)
    # A window of 8 tokens moves several times in 30: stateful models carry their state into the next window, the
    # others read the last half again.
    cached = list(sample_ids(model, [3, 1, 4], 30, temperature=1.0, seed=5, context=8, cache=True))
    full = list(sample_ids(model, [3, 1, 4], 30, temperature=1.0, seed=5, context=8, cache=False))
    assert cached == full and len(cached) == 30
    assert cached != list(sample_ids(model, [3, 1, 4], 30, seed=6, context=8))  # the seed matters


def test_window_moves_as_documented() -> None:
    stateless = DecodingWindow(_model("transformer"), context=6, cached=False)
    stateless.start([1, 2, 3, 4, 5, 6])
    stateless.feed(7)
    assert stateless.window == [4, 5, 6, 7]  # the last half again, then the new token
    stateful = DecodingWindow(_model("sru"), context=6, cached=True)
    stateful.start([1, 2, 3, 4, 5, 6])
    stateful.feed(7)
    assert stateful.window == [7] and stateful.state is not None  # a new window after the full one's state


def test_bench_sampling_section() -> None:
    size = BenchSize(d_model=16, n_layers=2, n_heads=2, d_ffn=32, seq_len=8, batch=2, vocab=11, mem_len=8,
                     rnn_window=3)
    options = BenchOptions(repeats=2, warmup=1, threads=1)
    report = BenchReport(report_meta(size, RNNSize(), options, torch.device("cpu")))
    bench_sampling(report, size, options, torch.device("cpu"),
                   ["transformer", "sru"], lambda message: None, tokens=24, context=16)
    rows = report.section("sampling")
    assert [r["backbone"] for r in rows] == ["transformer", "sru"]
    for row in rows:
        assert row["same_tokens"] is True and row["cached_tokens_per_s"] > 0 and row["full_tokens_per_s"] > 0
        assert row["cache_speedup"] > 0
    assert "== sampling 24 tokens (window 16)" in format_report(report)
