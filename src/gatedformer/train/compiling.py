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

import torch
from torch import nn

# Entries one compiled model may add to its forward code's cache: training and no-grad, each with a second shape.
ENTRIES_PER_MODEL = 4

# torch renamed the settings in 2.7; older releases have only the first names, newer ones both.
_PER_CODE = ("recompile_limit", "cache_size_limit")
_PER_PROCESS = ("accumulated_recompile_limit", "accumulated_cache_size_limit")
_FAIL = ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")


def _setting(names: tuple[str, ...]) -> str | None:
    from torch._dynamo import config

    known = getattr(config, "_config", None)
    for name in names:
        if (name in known) if known is not None else hasattr(config, name):
            return name
    return None


def _raise_limits(entries: int) -> None:
    from torch._dynamo import config

    for names in (_PER_CODE, _PER_PROCESS):
        name = _setting(names)
        if name is not None:
            setattr(config, name, getattr(config, name) + entries)


def compile_model(module: nn.Module) -> nn.Module:
    """``torch.compile(module)``, after making room in dynamo's caches for its entries (see the module).

    The limits only grow, by :data:`ENTRIES_PER_MODEL` a model, so code compiled elsewhere in the process keeps at
    least the room it had."""
    _raise_limits(ENTRIES_PER_MODEL)
    return torch.compile(module)


@contextlib.contextmanager
def compile_limits_fail() -> Iterator[None]:
    """Inside, code that reaches dynamo's recompile limit raises instead of running eagerly (where this torch has the
    setting)."""
    name = _setting(_FAIL)
    if name is None:
        yield
        return
    from torch._dynamo import config

    with config.patch(**{name: True}):
        yield
