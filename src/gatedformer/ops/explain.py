"""Why a fused path declined a case: ``GATEDFORMER_EXPLAIN_FUSION=1`` says so, once per path and reason.

A fused path that does not apply (a dtype it does not take, autocast, a hooked module, a kernel turned off or not
built, a gate kind it does not list) falls back to PyTorch operations or to the modules
one by one: the same numbers, more time. With the variable set, the first time a path declines for a reason, one
line goes to the ``gatedformer.ops`` logger (to standard error unless the application configured logging), e.g.::

    gatedformer: ops.fused_linear.feed_forward_add_norm declined: autocast is on

The reason is worked out only when a path declines and the variable is set, so the fast path pays nothing. Under
``torch.compile`` the fused paths run as custom operators (:mod:`gatedformer.ops.operators`) and decline for the
same reasons as in eager code, except the Transformer-XL layer stack (:mod:`gatedformer.ops.layer_stack`), which
says so. (With the variable set, a line written while dynamo traces breaks the graph there: set it to diagnose,
not to time.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["ENV_VAR", "declined", "explaining", "first_reason"]

ENV_VAR = "GATEDFORMER_EXPLAIN_FUSION"
_LOGGER = logging.getLogger("gatedformer.ops")
_SAID: set[tuple[str, str]] = set()


def explaining() -> bool:
    """Whether declines are to be explained (``GATEDFORMER_EXPLAIN_FUSION`` set to anything but ``0`` or empty)."""
    return os.environ.get(ENV_VAR, "").strip() not in ("", "0")


def declined(path: str, reason: str) -> None:
    """Report that ``path`` declined for ``reason`` (once per pair), where :func:`explaining`."""
    if not explaining() or (path, reason) in _SAID:
        return
    _SAID.add((path, reason))
    if not _LOGGER.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("gatedformer: %(message)s"))
        _LOGGER.addHandler(handler)
        _LOGGER.setLevel(logging.INFO)
    _LOGGER.info("%s declined: %s", path, reason)


def first_reason(tensors: Iterable[Tensor | None] = (), modules: Iterable[nn.Module | None] = (),
                 kernels: Iterable[object] = (), training: bool | None = None) -> str | None:
    """The first of the common reasons a fused CPU path declines that holds here, or ``None``: a tensor not float32
    on the CPU, autocast, not training (where ``training`` is given), a module with hooks,
    a kernel that is off or unavailable."""
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.device.type != "cpu":
            return f"a tensor is on {tensor.device} (the fused paths are for the CPU)"
        if tensor.dtype != torch.float32:
            return f"a tensor is {tensor.dtype}, not float32"
    if torch.is_autocast_enabled("cpu"):
        return "autocast is on"
    if training is False:
        return "the module is not training"
    for module in modules:
        if module is not None and (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks):
            return f"{type(module).__name__} has hooks (e.g. gate statistics being recorded)"
    for kernel in kernels:
        backend = kernel.pick_backend(torch.device("cpu"))
        if backend != "native":
            detail = kernel.error or f"{kernel.env_var}={kernel.requested_backend()}"
            return f"{kernel.description} is not in use ({detail})"
    return None
