"""torch.compile in a process that compiles many models (``gatedformer.train.compiling``), and compiled code that
dynamo traces without complaint."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import for_backbone, tiny_overrides
from torch import nn

from gatedformer.config import ModelConfig, RunConfig, apply_overrides, validate
from gatedformer.fused import fuse
from gatedformer.kernels.build import prepare_compile
from gatedformer.models import build_model
from gatedformer.ops import sru as sru_ops
from gatedformer.ops.sru import sru_recurrence
from gatedformer.train.compiling import compile_limits_fail, compile_model
from gatedformer.train.loop import train
from gatedformer.train.runlog import read_log, series


class _Stack(nn.Module):
    """Models of one class whose structure differs, as a recipe's variants do."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    prepare_compile()  # what compile_model does first: the tests also call torch.compile itself
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _graphs_compiled(compile_fn, depths: range) -> int:
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for depth in depths:
        model = compile_fn(_Stack(depth))
        model(torch.randn(2, 4)).sum().backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


@pytest.fixture
def dynamo_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo keeps its cache entries whatever compiles the graphs; its eager backend spares a test Inductor's time."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


def test_every_model_is_compiled_past_dynamo_s_limit(fresh_dynamo: None, dynamo_only: None) -> None:
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        # the limit as dynamo keeps it: the third model of the class runs eagerly
        assert _graphs_compiled(torch.compile, range(1, 5)) == 2
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        assert _graphs_compiled(compile_model, range(1, 5)) == 4


def test_a_reached_limit_fails_where_asked(fresh_dynamo: None, dynamo_only: None) -> None:
    with torch._dynamo.config.patch(recompile_limit=1), compile_limits_fail():
        _graphs_compiled(torch.compile, range(1, 2))
        with pytest.raises(Exception, match="(?i)limit"):
            _graphs_compiled(torch.compile, range(2, 3))


@pytest.fixture
def dynamo_warnings() -> Iterator[list[str]]:
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@pytest.mark.slow
@pytest.mark.parametrize("backbone", ["transformer", "transformer-xl"])
def test_compiled_variants_in_one_process_train_without_dynamo_warnings(
        backbone: str, text_corpus: str, tmp_path: Path, fresh_dynamo: None, dynamo_warnings: list[str],
        dynamo_only: None) -> None:
    # As `compare --compile` does: several variants, one after another, under a limit smaller than their count.
    variants = ["", "+σ SDU"]
    with torch._dynamo.config.patch(recompile_limit=1):
        for i, gates in enumerate(variants):
            overrides = ["model.mem_len=8", f"model.gates={gates}", "model.dropout=0.0", "train.compile=true"]
            config = validate(apply_overrides(RunConfig(), for_backbone(backbone, tiny_overrides(text_corpus, 2)
                                                                        + overrides)))
            train(config, tmp_path / str(i), progress=False)
            assert series(read_log(tmp_path / str(i)), "train", "train_loss")[1]
    assert dynamo_warnings == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= len(variants)


@pytest.mark.parametrize("backbone, extra", [
    ("transformer", {"gates": "+σ SDU"}), ("transformer-xl", {"gates": "+EAU+GRC"}), ("gcnn", {}),
    ("rtransformer", {"gates": "+highway gate"}), ("rtransformer", {"rnn_type": "lstm", "rnn_recompute": True}),
    ("sru", {}), ("sru-transformer", {"gates": "+σ SDU"}),
])
def test_every_backbone_compiles_into_one_graph(backbone: str, extra: dict, fresh_dynamo: None) -> None:
    # A graph break splits the step into several compiled graphs with eager code between them (or, inside a loop,
    # gives the whole frame up to eager): the SRU's kernels and the LocalRNN's weights used to cause them.
    cfg = ModelConfig(backbone=backbone, d_model=16, n_layers=2, n_heads=2, d_ffn=32, mem_len=4, **extra)
    model = fuse(build_model(cfg, 20)).train()  # as a run trains it: the fused paths are what must compile
    tokens = torch.randint(0, 20, (2, 8))
    explained = torch._dynamo.explain(model)(tokens, None, targets=tokens)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow
@pytest.mark.parametrize("streams, directions", [(3, 1), (4, 2)])
def test_the_sru_recurrence_is_one_operator_under_compile(streams: int, directions: int, fresh_dynamo: None) -> None:
    length, batch, hidden = 5, 3, 8
    torch.manual_seed(0)
    # batch-major inputs seen time-major, as the SRU layers inside a Transformer pass them
    U = torch.randn(batch, length, directions, streams, hidden).transpose(0, 1).requires_grad_()
    skip = (torch.randn(batch, length, directions, hidden).transpose(0, 1).requires_grad_() if streams == 3
            else None)
    vectors = [torch.randn(directions, hidden, requires_grad=True) for _ in range(4)]
    c0 = torch.randn(batch, directions, hidden, requires_grad=True)
    # its fake (shape) function, autograd registration and schema, as torch checks a custom operator
    arguments = sru_ops.RECURRENCE.operator_arguments(U, skip, *vectors, c0, 1.7, "")
    needs = [t is not None and t.requires_grad for t in (U, skip, *vectors, c0)] + [False]  # the seeds last
    torch.library.opcheck(sru_ops.RECURRENCE.forward_op, (*arguments, needs))

    def run(*inputs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return sru_recurrence(*inputs, alpha=1.7)

    leaves = [t for t in (U, skip, *vectors, c0) if t is not None]
    results = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        h, c_last = fn(U, skip, *vectors, c0)
        results.append((h, c_last, *torch.autograd.grad(h.sin().sum() + c_last.cos().sum(), leaves)))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backbone", ["rtransformer", "sru-transformer"])
def test_a_compiled_step_equals_the_eager_one(backbone: str, fresh_dynamo: None) -> None:
    # the backbones whose recurrences compile as operators or as PyTorch steps rather than their eager kernels
    cfg = ModelConfig(backbone=backbone, d_model=16, n_layers=1, n_heads=2, d_ffn=32, dropout=0.0, gates="+σ SDU",
                      rnn_window=3)
    torch.manual_seed(0)
    model = fuse(build_model(cfg, 20)).train()
    tokens = torch.randint(0, 20, (3, 12))
    results = []
    for forward in (model, torch.compile(model)):
        loss = forward(tokens[:, :-1], None, targets=tokens[:, 1:]).loss
        results.append((loss, *torch.autograd.grad(loss, list(model.parameters()))))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_eager_use_never_loads_dynamo_and_compiled_code_still_sees_the_constant_checks() -> None:
    # torch._dynamo costs every command about as long as torch to import; the kernels' checks are marked constant
    # when compiling starts, and a model built and run before then still compiles into one graph.
    import subprocess
    import sys

    script = """
import sys, torch
from gatedformer.config import ModelConfig
from gatedformer.fused import fuse
from gatedformer.models import build_model
import gatedformer, gatedformer.cli
model = fuse(build_model(ModelConfig(backbone="transformer-xl", d_model=16, n_layers=2, n_heads=2, d_ffn=32,
                                     mem_len=4, gates="+σ SDU"), 20)).train()
tokens = torch.randint(0, 20, (2, 8))
model(tokens, None, targets=tokens).loss.backward()
assert "torch._dynamo" not in sys.modules, "eager use imported torch._dynamo"
from gatedformer.kernels.build import prepare_compile
prepare_compile()
import torch._dynamo
explained = torch._dynamo.explain(model)(tokens, None, targets=tokens)
assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
