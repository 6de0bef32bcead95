"""The compiled GRU step of the LocalRNN: nn.GRU's equations, in one pass each way."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gatedformer.kernels import build as _native
from gatedformer.kernels import gru as _gru_kernel
from gatedformer.ops.rnn import gru_step, gru_step_reference


def _native_or_skip() -> None:
    if _gru_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled GRU step is unavailable here: {_gru_kernel.KERNEL.error}")


def _inputs(rows: int, d: int, dtype: torch.dtype, bias_only: bool, zero_state: bool) -> tuple:
    gi = torch.randn(rows, 3 * d, dtype=dtype, requires_grad=True)
    gh = torch.randn(3 * d if bias_only else (rows, 3 * d), dtype=dtype, requires_grad=True)
    h = None if zero_state else torch.randn(rows, d, dtype=dtype, requires_grad=True)
    return gi, gh, h


@pytest.mark.parametrize("bias_only", [False, True])
@pytest.mark.parametrize("zero_state", [False, True])
def test_matches_the_reference_and_passes_gradcheck(bias_only: bool, zero_state: bool) -> None:
    _native_or_skip()
    torch.manual_seed(0)
    gi, gh, h = _inputs(7, 5, torch.float64, bias_only, zero_state)
    out = gru_step(gi, gh, h)
    assert type(out.grad_fn).__name__ == "_GRUStepBackward"
    torch.testing.assert_close(out, gru_step_reference(gi, gh, h), rtol=1e-12, atol=1e-12)
    inputs = tuple(t for t in (gi, gh, h) if t is not None)
    assert torch.autograd.gradcheck(lambda *t: gru_step(t[0], t[1], t[2] if len(t) == 3 else None), inputs)


def test_float32_gradients_match_the_reference() -> None:
    _native_or_skip()
    torch.manual_seed(1)
    gi, gh, h = _inputs(300, 16, torch.float32, False, False)
    grad = torch.randn(300, 16)
    ours = torch.autograd.grad(gru_step(gi, gh, h), (gi, gh, h), grad)
    theirs = torch.autograd.grad(gru_step_reference(gi, gh, h), (gi, gh, h), grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_matches_the_reference(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The vector code (rows of whole vectors) and the scalar loops, on each instruction set's build."""
    _native_or_skip()
    kernel_build(_gru_kernel.KERNEL, isa)
    torch.manual_seed(3)
    for d in (16, 128, 5, 24):
        for zero_state in (False, True):
            gi, gh, h = _inputs(37, d, torch.float32, False, zero_state)
            gi = gi.detach().mul(4).requires_grad_()  # saturated gates too
            inputs = [t for t in (gi, gh, h) if t is not None]
            grad = torch.randn(37, d)
            ours = gru_step(gi, gh, h)
            theirs = gru_step_reference(gi, gh, h)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-6)
            for a, b in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(theirs, inputs, grad),
                            strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_keeps_only_its_inputs_and_splits_rows_between_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    gi, gh, h = _inputs(40, 8, torch.float32, False, False)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        one = gru_step(gi, gh, h)
    assert len(saved) == 3  # gi, gh and h; the gates are recomputed in the backward pass
    grad = torch.randn_like(one)
    one_grads = torch.autograd.grad(one, (gi, gh, h), grad)
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        many = gru_step(gi, gh, h)
        many_grads = torch.autograd.grad(many, (gi, gh, h), grad)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    assert all(torch.equal(a, b) for a, b in zip(one_grads, many_grads, strict=True))


def test_the_environment_can_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_GRU_BACKEND", "torch")
    gi, gh, h = _inputs(4, 3, torch.float32, False, False)
    assert type(gru_step(gi, gh, h).grad_fn).__name__ != "_GRUStepBackward"
