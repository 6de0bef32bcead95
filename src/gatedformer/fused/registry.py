"""The one place where fused execution plugs into a model.

Every module of :mod:`gatedformer.nn` and :mod:`gatedformer.models` computes its equations in plain PyTorch: that is
the reference, and what a model built by its class runs. A faster implementation of one of a module's methods (its
``forward``, or a part such as a feed-forward's ``features``) is registered here, beside the class it serves, with
:func:`implements`; :func:`fuse` binds every registered implementation onto the modules of a model, in place, as
Hugging Face picks an attention function from outside the model or ``sru`` dispatches its recurrence to ``csrc``.
``gatedformer train`` and everything that runs a model for a user fuse it; ``GATEDFORMER_FUSED=0`` keeps the
reference.

An implementation takes the module and the method's arguments and returns what the method returns; each checks its
case (dtype, device, autocast, hooks, the gate kinds it lists) when called and, where it does not apply, computes the
same thing another way, saying why with ``GATEDFORMER_EXPLAIN_FUSION=1`` (:mod:`gatedformer.ops.explain`).
Implementations change no number beyond float rounding (the tests hold each to its reference); with the same seed
and the same fused paths a run's losses are the same bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MethodType
from typing import Any, TypeVar

from torch import nn

__all__ = ["ENV_VAR", "Implementation", "fuse", "implementations", "implements", "is_fused", "reference", "unfuse"]

ENV_VAR = "GATEDFORMER_FUSED"
"""Set to ``0`` to keep every model on its reference path (:func:`fuse` then leaves it as built)."""

M = TypeVar("M", bound=nn.Module)
Fn = TypeVar("Fn", bound=Callable[..., Any])


@dataclass(frozen=True)
class Implementation:
    """A faster ``method`` of ``cls``'s modules: ``function(module, *args, **kwargs)``; ``prepare(module)`` runs once
    when a module is fused (to work out, from its structure, what the function needs at every call)."""

    cls: type[nn.Module]
    method: str
    function: Callable[..., Any]
    prepare: Callable[[nn.Module], None] | None = None

    @property
    def name(self) -> str:
        return f"{self.function.__module__}.{self.function.__name__}"


_REGISTRY: dict[tuple[type[nn.Module], str], Implementation] = {}
_FUSED = "_gatedformer_fused"
"""The attribute a fused module keeps: the names of the methods bound onto it."""


def implements(cls: type[nn.Module], method: str = "forward",
               prepare: Callable[[nn.Module], None] | None = None) -> Callable[[Fn], Fn]:
    """Register the decorated function as the fused ``method`` of ``cls`` (and of its subclasses that register none
    of their own). ``cls`` need not define ``method``: a fused implementation may add a method its other
    implementations call (a whole-sublayer function of a body, say)."""

    def register(function: Fn) -> Fn:
        key = (cls, method)
        if key in _REGISTRY:
            raise ValueError(f"{cls.__name__}.{method} already has a fused implementation, "
                             f"{_REGISTRY[key].name}")
        _REGISTRY[key] = Implementation(cls, method, function, prepare)
        return function

    return register


def implementations() -> list[Implementation]:
    """Every registered implementation, in registration order."""
    return list(_REGISTRY.values())


def _for(module: nn.Module) -> Iterator[Implementation]:
    """The implementations that apply to ``module``: for each method, the one registered nearest its class."""
    seen: set[str] = set()
    for cls in type(module).__mro__:
        for (registered, method), implementation in _REGISTRY.items():
            if registered is cls and method not in seen:
                seen.add(method)
                yield implementation


def fuse(model: M) -> M:
    """Bind every registered implementation onto ``model``'s modules (in place) and return ``model``; with
    ``GATEDFORMER_FUSED=0``, return it unchanged. Fusing twice is fusing once."""
    if os.environ.get(ENV_VAR, "").strip() == "0":
        return model
    prepared = []
    for module in model.modules():
        found = list(_for(module))
        for implementation in found:
            # An instance attribute, so the class keeps the reference and nn.Module.__call__ finds the fused one.
            object.__setattr__(module, implementation.method, MethodType(implementation.function, module))
            prepared += [(implementation.prepare, module)] if implementation.prepare is not None else []
        if found:
            object.__setattr__(module, _FUSED, tuple(i.method for i in found))
    # After every module is bound: a module's preparation may ask what its children offer (a body's add_norm).
    for prepare, module in prepared:
        prepare(module)
    return model


def unfuse(model: M) -> M:
    """Put every module of ``model`` back on its reference methods (in place) and return ``model``."""
    for module in model.modules():
        for method in module.__dict__.pop(_FUSED, ()):
            module.__dict__.pop(method, None)
    return model


def is_fused(module: nn.Module) -> bool:
    """Whether :func:`fuse` bound an implementation onto ``module``."""
    return _FUSED in module.__dict__


def reference(module: nn.Module, method: str = "forward") -> Callable[..., Any]:
    """``module``'s reference ``method`` (its class's), whatever is bound onto it."""
    return getattr(type(module), method).__get__(module)
