"""torch.compile in a process that compiles many models (``gatedformer.train.compiling``), and compiled code that
dynamo traces without complaint."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from torch import nn

from gatedformer.analysis.runlog import read_log, series
from gatedformer.config import RunConfig, apply_overrides, validate
from gatedformer.train.compiling import compile_limits_fail, compile_model
from gatedformer.train.loop import train


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


def test_every_model_is_compiled_past_dynamo_s_limit(fresh_dynamo: None) -> None:
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        # the limit as dynamo keeps it: the third model of the class runs eagerly
        assert _graphs_compiled(torch.compile, range(1, 5)) == 2
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        assert _graphs_compiled(compile_model, range(1, 5)) == 4


def test_a_reached_limit_fails_where_asked(fresh_dynamo: None) -> None:
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


@pytest.mark.parametrize("backbone", ["transformer", "transformer-xl"])
def test_compiled_variants_in_one_process_train_without_dynamo_warnings(
        backbone: str, text_corpus: str, tmp_path: Path, fresh_dynamo: None, dynamo_warnings: list[str]) -> None:
    # As `compare --compile` does: several variants, one after another, under a limit smaller than their count.
    variants = ["", "+σ SDU"]
    with torch._dynamo.config.patch(recompile_limit=1):
        for i, gates in enumerate(variants):
            overrides = [f"model.backbone={backbone}", "model.mem_len=8", f"model.gates={gates}",
                         "model.dropout=0.0", "train.compile=true"]
            config = validate(apply_overrides(RunConfig(), tiny_overrides(text_corpus, 2) + overrides))
            train(config, tmp_path / str(i), progress=False)
            assert series(read_log(tmp_path / str(i)), "train", "train_loss")[1]
    assert dynamo_warnings == []
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= len(variants)
