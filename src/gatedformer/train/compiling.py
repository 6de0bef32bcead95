"""``torch.compile`` for a process that compiles many models: ``compare`` trains a recipe's variants one after
another, and the bench steps its models side by side.

Models of one class share their ``forward``'s code, and dynamo keeps that code's compiled entries (one for each
model structure, grad mode and shape it has seen) up to its recompile limit, 8 by default. Past the limit it runs the
code eagerly and only warns: the ninth variant of a ``compare --compile`` would train uncompiled, and the bench would
time eager steps as compiled ones. :func:`compile_model` raises the limits by what each model it compiles may take;
:func:`compile_limits_fail` turns a limit still reached into an error, for runs whose figures must be compiled ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gatedformer.kernels.build import prepare_compile

# Entries one compiled model may add to its forward code's cache: training and no-grad, each with a second shape.
ENTRIES_PER_MODEL = 4



def _config() -> Any:
    """``torch.compiler.config``, the public face of dynamo's limits (its names: ``recompile_limit``,
    ``accumulated_recompile_limit``, ``fail_on_recompile_limit_hit``)."""
    return torch.compiler.config


def _raise_limits(entries: int) -> None:
    config = _config()
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        setattr(config, name, getattr(config, name) + entries)


def compile_model(module: nn.Module) -> nn.Module:
    """``torch.compile(module)``, after making room in dynamo's caches for its entries (see the module).

    The limits only grow, by :data:`ENTRIES_PER_MODEL` a model, so code compiled elsewhere in the process keeps at
    least the room it had."""
    _raise_limits(ENTRIES_PER_MODEL)
    prepare_compile()
    return torch.compile(module)


@contextlib.contextmanager
def compile_limits_fail() -> Iterator[None]:
    """Inside, code that reaches dynamo's recompile limit raises instead of running eagerly."""
    config = _config()
    saved = config.fail_on_recompile_limit_hit
    config.fail_on_recompile_limit_hit = True
    try:
        yield
    finally:
        config.fail_on_recompile_limit_hit = saved
