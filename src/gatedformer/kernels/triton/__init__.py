"""Loading the package's Triton kernels (GPU): on first use only, and under Triton's CPU interpreter for tests.

Each ``_*_triton_kernels`` module holds ``@triton.jit`` functions and imports Triton at its top, so it is
imported only when a kernel is first needed, never when gatedformer is. Triton reads ``TRITON_INTERPRET``
when a kernel is defined; :func:`load_kernels` with ``interpreted=True`` therefore executes a private copy of
the module with it set, whose kernels run on CPU tensors (how the tests check them without a GPU).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

__all__ = ["available", "load_kernels"]


def available() -> bool:
    """Whether Triton is installed (it comes with PyTorch's CUDA builds on Linux)."""
    return importlib.util.find_spec("triton") is not None


def load_kernels(module_name: str, interpreted: bool = False) -> ModuleType:
    """The kernel module ``module_name``; with ``interpreted``, a private copy whose kernels Triton interprets."""
    if not interpreted:
        return importlib.import_module(module_name)
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        copy_spec = importlib.util.spec_from_file_location(f"{module_name}_interpreted", spec.origin)
        assert copy_spec is not None and copy_spec.loader is not None
        module = importlib.util.module_from_spec(copy_spec)
        copy_spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module
