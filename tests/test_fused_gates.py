"""Gate units with their element-wise tail in one kernel: the same values and gradients as the modules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gatedformer.gates import EAU, SDU, GatedMHDPA, GatedResidual, HighwayGate
from gatedformer.kernels import build as _native
from gatedformer.kernels import gate as _gate_kernel
from gatedformer.ops import fused_gates
from gatedformer.train.gate_stats import GateStatistics


def _kernel_or_skip() -> None:
    if _gate_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled gate kernel is unavailable here: {_gate_kernel.KERNEL.error}")


def _randomise(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.5)  # biases too: the zero-initialised ones would hide mistakes
    return module


def _cases(d: int) -> list[tuple[str, nn.Module, callable, callable]]:
    sdu_s, sdu_t, highway, mix, grc, eau = (_randomise(m) for m in (SDU(d), SDU(d, "tanh"), HighwayGate(d),
                                                                      GatedMHDPA(d), GatedResidual(d), EAU(d)))
    return [
        ("sdu-sigmoid", sdu_s, lambda x, s: fused_gates.apply_sdu(sdu_s, x, s), lambda x, s: sdu_s(x, add_to=s)),
        ("sdu-tanh", sdu_t, lambda x, s: fused_gates.apply_sdu(sdu_t, x, s), lambda x, s: sdu_t(x, add_to=s)),
        ("highway", highway, lambda x, s: fused_gates.apply_highway(highway, x), lambda x, s: highway(x)),
        ("gated mhdpa", mix, lambda x, s: fused_gates.gated_mhdpa_blend(mix, s, x), lambda x, s: mix(x, s)),
        ("grc", grc, lambda x, s: fused_gates.apply_grc(grc, x, s), lambda x, s: grc(x, s)),
        ("eau", eau, lambda x, s: fused_gates.apply_eau(eau, s), lambda x, s: eau(s)),
    ]


def _compare(fused, plain, params: list[Tensor], x: Tensor, s: Tensor) -> None:  # noqa: ANN001
    grad = torch.randn_like(s)
    a, b = fused(x, s), plain(x, s)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    inputs = [x, s, *params]
    got = torch.autograd.grad(a, inputs, grad, allow_unused=True)
    want = torch.autograd.grad(b, inputs, grad, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            # A weight's gradient sums a product over every row, in the kernel's order or PyTorch's: an element that
            # nearly cancels keeps the rounding of the largest ones (seen: 1.3e-5 off where the largest was 64.5).
            torch.testing.assert_close(g, w, rtol=1e-4, atol=max(1e-5, 2e-6 * w.abs().max().item()))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 30), d=st.integers(2, 70), seed=st.integers(0, 2 ** 16))
def test_every_gate_tail_matches_the_gate_module(rows: int, d: int, seed: int) -> None:
    _kernel_or_skip()
    torch.manual_seed(seed)
    for name, module, fused, plain in _cases(d):
        x = torch.randn(rows, 3, d, requires_grad=True)
        s = torch.randn(rows, 3, d, requires_grad=True)
        assert fused_gates.tail_applies(module, x, s), name
        _compare(fused, plain, list(module.parameters()), x, s)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_computes_the_tails(isa: str, kernel_build) -> None:  # noqa: ANN001
    _kernel_or_skip()
    kernel_build(_gate_kernel.KERNEL, isa)
    torch.manual_seed(1)
    for _, module, fused, plain in _cases(37):
        x, s = torch.randn(5, 37, requires_grad=True), torch.randn(5, 37, requires_grad=True)
        _compare(fused, plain, list(module.parameters()), x, s)


def test_hooked_gates_run_their_own_forward_so_statistics_still_see_them() -> None:
    sdu = SDU(8)
    stats = GateStatistics(nn.ModuleDict({"sdu": sdu}))
    x, s = torch.randn(4, 8), torch.randn(4, 8)
    with stats.recording():
        assert not fused_gates.tail_applies(sdu, x, s)
        out = fused_gates.apply_sdu(sdu, x, s)
    torch.testing.assert_close(out, sdu(x, add_to=s))
    assert stats.summary()["sdu"]["mean"] > 0


@pytest.mark.parametrize("case", ["float64", "switched off"])
def test_elsewhere_the_gate_module_runs(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    grc = GatedResidual(6)
    r, s = torch.randn(3, 6), torch.randn(3, 6)
    if case == "float64":
        grc, r, s = grc.double(), r.double(), s.double()
    else:
        monkeypatch.setenv("GATEDFORMER_GATE_BACKEND", "torch")
    assert not fused_gates.tail_applies(grc, r, s)
    assert torch.equal(fused_gates.apply_grc(grc, r, s), grc(r, s))


def test_saturated_gates_stay_finite() -> None:
    """Pre-activations far beyond the sigmoid's range give 0 or 1, never NaN (fast maths divides approximately)."""
    _kernel_or_skip()
    a = torch.tensor([[-1e4, -200.0, -90.0, 0.0, 90.0, 200.0, 1e4, 3.0] * 4])
    b, c = torch.ones_like(a), torch.zeros_like(a)
    out = _gate_kernel.tail_forward("sdu-sigmoid", c, a, a.shape[1], b, b.shape[1])
    torch.testing.assert_close(out, torch.sigmoid(a))
    eau = _gate_kernel.tail_forward("eau", c, a, a.shape[1], a, a.shape[1])
    assert torch.isfinite(eau).all()
    torch.testing.assert_close(eau, torch.sigmoid(a) * torch.tanh(a))
