"""The compiled LSTM step of the LocalRNN: nn.LSTM's equations, in one pass each way."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gatedformer.fused import fuse
from gatedformer.kernels import build as _native
from gatedformer.kernels import lstm as _lstm_kernel
from gatedformer.models.rtransformer import LocalRNN
from gatedformer.ops.rnn import lstm_step, lstm_step_reference


def _native_or_skip() -> None:
    if _lstm_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled LSTM step is unavailable here: {_lstm_kernel.KERNEL.error}")


def _inputs(rows: int, d: int, dtype: torch.dtype, bias_only: bool, zero_state: bool) -> tuple:
    gi = torch.randn(rows, 4 * d, dtype=dtype, requires_grad=True)
    gh = torch.randn(4 * d if bias_only else (rows, 4 * d), dtype=dtype, requires_grad=True)
    c = None if zero_state else torch.randn(rows, d, dtype=dtype, requires_grad=True)
    return gi, gh, c


@pytest.mark.parametrize("bias_only", [False, True])
@pytest.mark.parametrize("zero_state", [False, True])
@pytest.mark.parametrize("outputs", ["h", "c", "both"])
def test_matches_the_reference_and_passes_gradcheck(bias_only: bool, zero_state: bool, outputs: str) -> None:
    """Both outputs, and either alone (the last step's cell and a step's hidden state are not always used)."""
    _native_or_skip()
    torch.manual_seed(0)
    gi, gh, c = _inputs(7, 5, torch.float64, bias_only, zero_state)
    h_new, c_new = lstm_step(gi, gh, c)
    assert type(h_new.grad_fn).__name__ == "_LSTMStepBackward"
    ref_h, ref_c = lstm_step_reference(gi, gh, c)
    torch.testing.assert_close(h_new, ref_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_new, ref_c, rtol=1e-12, atol=1e-12)
    pick = {"h": lambda h, c: h, "c": lambda h, c: c, "both": lambda h, c: (h, c)}[outputs]
    inputs = tuple(t for t in (gi, gh, c) if t is not None)
    assert torch.autograd.gradcheck(lambda *t: pick(*lstm_step(t[0], t[1], t[2] if len(t) == 3 else None)), inputs)


def test_float32_gradients_match_the_reference() -> None:
    _native_or_skip()
    torch.manual_seed(1)
    gi, gh, c = _inputs(300, 16, torch.float32, False, False)
    grads = torch.randn(300, 16), torch.randn(300, 16)
    ours = torch.autograd.grad(lstm_step(gi, gh, c), (gi, gh, c), grads)
    theirs = torch.autograd.grad(lstm_step_reference(gi, gh, c), (gi, gh, c), grads)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_matches_the_reference(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The vector code (rows of whole vectors) and the scalar loops, on each instruction set's build."""
    _native_or_skip()
    kernel_build(_lstm_kernel.KERNEL, isa)
    torch.manual_seed(3)
    for d in (16, 64, 5, 24):
        for zero_state in (False, True):
            gi, gh, c = _inputs(37, d, torch.float32, False, zero_state)
            gi = gi.detach().mul(4).requires_grad_()  # saturated gates too
            inputs = [t for t in (gi, gh, c) if t is not None]
            grads = torch.randn(37, d), torch.randn(37, d)
            ours = lstm_step(gi, gh, c)
            theirs = lstm_step_reference(gi, gh, c)
            for a, b in zip([*ours, *torch.autograd.grad(ours, inputs, grads)],
                            [*theirs, *torch.autograd.grad(theirs, inputs, grads)], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_keeps_only_its_inputs_and_splits_rows_between_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    gi, gh, c = _inputs(40, 8, torch.float32, False, False)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        one = lstm_step(gi, gh, c)
    assert len(saved) == 3  # gi, gh and c; the gates are recomputed in the backward pass
    grads = torch.randn_like(one[0]), torch.randn_like(one[1])
    one_grads = torch.autograd.grad(one, (gi, gh, c), grads)
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        many = lstm_step(gi, gh, c)
        many_grads = torch.autograd.grad(many, (gi, gh, c), grads)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(one_grads, many_grads, strict=True))


def test_local_rnn_matches_nn_lstm_window_by_window() -> None:
    """Each output of the LocalRNN is nn.LSTM's last hidden state over the window ending there, gradients too."""
    _native_or_skip()
    torch.manual_seed(2)
    local = fuse(LocalRNN(6, window=4, rnn_type="lstm"))
    x = torch.randn(2, 9, 6, requires_grad=True)
    out = local(x)
    assert out.grad_fn is not None
    padded = torch.cat([x.new_zeros(2, 3, 6), x], dim=1)
    windows = torch.stack([padded[:, t : t + 4] for t in range(9)], dim=1).reshape(18, 4, 6)
    ref = local.rnn.reference()(windows)[0][:, -1].view(2, 9, 6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, [x, *local.parameters()], grad)
    theirs = torch.autograd.grad(ref, [x, *local.parameters()], grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_environment_can_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_GRU_BACKEND", "torch")
    gi, gh, c = _inputs(4, 3, torch.float32, False, False)
    assert type(lstm_step(gi, gh, c)[0].grad_fn).__name__ != "_LSTMStepBackward"
