"""The LocalRNN's whole recurrence as one compiled call each way: nn.GRU/LSTM/RNN over every window."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from gatedformer.fused import fuse
from gatedformer.kernels import build as _native
from gatedformer.kernels import local_rnn as _local_rnn_kernel
from gatedformer.models.rtransformer import LocalRNN
from gatedformer.ops import rnn as rnn_ops


def _kernel_or_skip() -> None:
    probe = torch.zeros(1)
    if _local_rnn_kernel.streams(probe, probe, probe) is None:
        reason = _local_rnn_kernel.KERNEL.error or "PyTorch links no MKL"
        pytest.skip(f"the compiled LocalRNN recurrence is unavailable here: {reason}")


def _module(d: int, window: int, cell: str, seed: int) -> LocalRNN:
    torch.manual_seed(seed)
    module = fuse(LocalRNN(d, window, cell))
    with torch.no_grad():  # random biases too, so that a misplaced bias term shows
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    return module


def _unfolded(module: LocalRNN, x: Tensor) -> Tensor:
    """The direct reading in float64: copy every window, run the module's own nn.GRU/LSTM/RNN over each."""
    batch, length, d = x.shape
    m = module.window
    windows = F.pad(x, (0, 0, m - 1, 0)).unfold(1, m, 1).permute(0, 1, 3, 2).reshape(batch * length, m, d)
    return module.rnn.double().reference()(windows)[0][:, -1].reshape(batch, length, d)


def _recorder(saved: list[Tensor]):  # noqa: ANN202
    """A pack hook that records each tensor autograd saves."""
    return lambda t: saved.append(t) or t


def _values_and_grads(module: LocalRNN, x: Tensor, grad: Tensor) -> list[Tensor]:
    x = x.detach().requires_grad_()
    out = module(x)
    params = [x, *module.parameters()]
    grads = torch.autograd.grad(out, params, grad, allow_unused=True)
    return [out.detach(), *(torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True))]


@pytest.mark.parametrize("cell", ["gru", "lstm", "rnn"])
@pytest.mark.parametrize(("d", "window", "batch", "length"), [
    (16, 9, 16, 20),   # sequences shorter than a block of the kernel (64 windows): blocks span several
    (24, 4, 2, 70),    # a width that is not a whole number of vectors; sequences span blocks, a short last one
    (5, 2, 3, 7),      # narrower than one vector, one block
    (8, 1, 4, 5),      # a window of one: no hidden-to-hidden product at all
    (8, 9, 2, 3),      # a window longer than the sequence: every window starts in the pad
    (16, 70, 3, 80),   # a window longer than a block: a step's rows reach back past the block before
])
def test_matches_nn_rnn_window_by_window(cell: str, d: int, window: int, batch: int, length: int) -> None:
    """Float32 kernel values and gradients (input, both weights, both biases) against the float64 reading."""
    _kernel_or_skip()
    module = _module(d, window, cell, seed=d + window)
    x, grad = torch.randn(batch, length, d), torch.randn(batch, length, d)
    ours = _values_and_grads(module, x, grad)
    theirs = _values_and_grads(module.double(), x.double(), grad.double())
    module.float()
    reference = _unfolded(module, x.double())
    torch.testing.assert_close(theirs[0], reference, rtol=1e-12, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=2e-5)


def test_the_module_runs_through_the_kernel_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 on the CPU takes the kernel; float64, the torch backend and no MKL take the steps one by one."""
    _kernel_or_skip()
    module = _module(8, 3, "gru", seed=0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    seen: list[str] = []
    original = rnn_ops._LocalRecurrence.apply

    def spy(*args: object) -> Tensor:
        seen.append("kernel")
        return original(*args)

    monkeypatch.setattr(rnn_ops._LocalRecurrence, "apply", spy)
    expected = module(x)
    assert seen == ["kernel"]
    module.double()(x.double())
    module.float()
    monkeypatch.setenv("GATEDFORMER_GRU_BACKEND", "torch")
    steps = module(x)
    monkeypatch.setenv("GATEDFORMER_GRU_BACKEND", "auto")
    monkeypatch.setenv("GATEDFORMER_PACKED_GEMM", "0")
    also_steps = module(x)
    assert seen == ["kernel"]
    torch.testing.assert_close(steps, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(also_steps, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
@pytest.mark.parametrize(("window", "batch", "length"), [(7, 8, 40), (70, 3, 100)])
def test_threads_share_the_rows_and_spill_their_overlap(cell: str, window: int, batch: int, length: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three threads (windows that read the previous thread's rows, up to more than a block back) give what one
    does, to rounding; a thread count gives the same bits every time, and b_hh's gradient the same bits whatever
    the thread count."""
    _kernel_or_skip()
    module = _module(16, window, cell, seed=5)
    x, grad = torch.randn(batch, length, 16), torch.randn(batch, length, 16)
    one = _values_and_grads(module, x, grad)
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        many, again = _values_and_grads(module, x, grad), _values_and_grads(module, x, grad)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(many, again, strict=True))
    for a, b in zip(one, many, strict=True):  # W_hh's gradient is a product PyTorch runs on its own threads
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(one[-1], many[-1])  # b_hh: summed per block of rows, then the blocks in order


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_matches(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The vector code with whole and masked vectors, on each instruction set's build."""
    _kernel_or_skip()
    kernel_build(_local_rnn_kernel.KERNEL, isa)
    for cell in ("gru", "lstm", "rnn"):
        for d in (16, 20):
            module = _module(d, 4, cell, seed=d)
            x, grad = torch.randn(3, 30, d) * 2, torch.randn(3, 30, d)  # saturated gates too
            ours = _values_and_grads(module, x, grad)
            theirs = _values_and_grads(module.double(), x.double(), grad.double())
            module.float()
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=2e-5)


def test_keeps_each_steps_hidden_product_and_state_and_nothing_for_evaluation() -> None:
    """Training keeps the padded projection and, per window and step, the hidden product and the state (the
    LSTM's cell too): what back-propagation through the steps needs, never a copy of the input per window.
    Without gradients the forward pass keeps nothing."""
    _kernel_or_skip()
    batch, length, d, window = 2, 8, 4, 7
    for cell, gates, states in (("gru", 3, 1), ("lstm", 4, 2)):
        module = fuse(LocalRNN(d, window, cell))
        saved: list[Tensor] = []
        x = torch.randn(batch, length, d, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(_recorder(saved), lambda t: t):
            out = module(x)
        rows = batch * length
        kept = sum(t.numel() for t in saved if t.dim() == 2 and t.shape[0] == rows * (window - 1))
        assert kept == rows * (window - 1) * (gates + states) * d
        assert not any(t.shape[0] == rows * window for t in saved if t.dim() >= 1)
        out.sum().backward()


def test_evaluation_memory_does_not_grow_with_the_window() -> None:
    """Without gradients nothing is kept per step: the peak is the projection and the output, whatever M."""
    _kernel_or_skip()
    from gatedformer.analysis.bench import measure_memory

    x = torch.randn(4, 64, 32)
    peaks = []
    for window in (2, 16):
        module = fuse(LocalRNN(32, window, "lstm"))
        with torch.no_grad():
            module(x)
            peaks.append(measure_memory(lambda m=module: m(x), "cpu", "tensors"))
    gates_and_output = 4 * 64 * (4 * 32 + 32) * 4 / 2 ** 20
    assert peaks[0] == peaks[1] <= gates_and_output * 1.01


def test_window_one_gives_zero_hidden_weight_gradient() -> None:
    _kernel_or_skip()
    module = _module(8, 1, "lstm", seed=3)
    x = torch.randn(2, 5, 8, requires_grad=True)
    module(x).sum().backward()
    assert torch.equal(module.rnn.weight_hh_l0.grad, torch.zeros_like(module.rnn.weight_hh_l0))
    assert module.rnn.bias_hh_l0.grad.abs().sum() > 0


def test_unknown_cell_and_mismatched_shapes_are_refused() -> None:
    _kernel_or_skip()
    probe = torch.zeros(1)
    blas = _local_rnn_kernel.streams(probe, probe, probe)
    gates, pad, w_hh, b_hh = torch.zeros(1, 4, 8), torch.zeros(8), torch.zeros(8, 2), torch.zeros(8)
    with pytest.raises(ValueError, match="unknown cell"):
        rnn_ops.local_recurrence(gates, pad, w_hh, b_hh, "elman", 3, blas)
    with pytest.raises(ValueError, match="takes"):
        rnn_ops.local_recurrence(gates, pad, w_hh, b_hh, "gru", 3, blas)
    with pytest.raises(ValueError, match="window"):
        rnn_ops.local_recurrence(torch.zeros(1, 4, 6), torch.zeros(6), torch.zeros(6, 2), torch.zeros(6), "gru", 0,
                                 blas)


def test_second_derivatives_are_refused_not_silently_wrong() -> None:
    _kernel_or_skip()
    module = _module(8, 3, "gru", seed=4)
    x = torch.randn(2, 5, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()
