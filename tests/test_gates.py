"""Tests for the gating units: equations, gradients, parameter counts, bounds and introspection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gatedformer.gates import (
    EAU,
    GATE_UNITS,
    GLU,
    SDU,
    GatedMHDPA,
    GatedResidual,
    GateUnit,
    GLUFeedForward,
    HighwayGate,
)

FAST = settings(max_examples=25, deadline=None)

leading_shapes = st.lists(st.integers(min_value=1, max_value=5), min_size=0, max_size=3).map(tuple)
small_d = st.integers(min_value=2, max_value=7)


def _randomize_biases(module: nn.Module, seed: int = 0) -> None:
    """Zero biases would hide a swapped or missing bias term, so the equation tests use random ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _all_gated(d: int) -> list[nn.Module]:
    return [SDU(d), SDU(d, gate="tanh"), HighwayGate(d), GatedMHDPA(d), EAU(d), GatedResidual(d)]


def _call(module: nn.Module, x: Tensor, other: Tensor) -> Tensor:
    """Two-input units take (sublayer input, sublayer output); the rest take one tensor."""
    if isinstance(module, (GatedMHDPA, GatedResidual)):
        return module(x, other)
    return module(x)


# --- equations, recomputed from each unit's own parameters ---------------------------------


@pytest.mark.parametrize("gate", ["sigmoid", "tanh"])
def test_sdu_matches_equation(gate: str) -> None:
    torch.manual_seed(0)
    d = 6
    sdu = SDU(d, gate=gate)
    _randomize_biases(sdu)
    w1, w2 = sdu.proj.weight[:d], sdu.proj.weight[d:]
    b1, b2 = sdu.proj.bias[:d], sdu.proj.bias[d:]
    x = torch.randn(3, 5, d)
    psi = torch.sigmoid if gate == "sigmoid" else torch.tanh
    expected = psi(x @ w1.T + b1) * (x @ w2.T + b2)
    torch.testing.assert_close(sdu(x), expected)
    torch.testing.assert_close(sdu.gate_activation(x), psi(x @ w1.T + b1))
    torch.testing.assert_close(sdu.gate_bias, b1.detach())


def test_sdu_sigmoid_and_tanh_differ() -> None:
    torch.manual_seed(0)
    a, b = SDU(4, "sigmoid"), SDU(4, "tanh")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 4)
    assert not torch.allclose(a(x), b(x))


def test_highway_matches_equation() -> None:
    torch.manual_seed(1)
    d = 5
    hw = HighwayGate(d)
    _randomize_biases(hw)
    w1, w2 = hw.proj.weight[:d], hw.proj.weight[d:]
    b1, b2 = hw.proj.bias[:d], hw.proj.bias[d:]
    x = torch.randn(4, d)
    t = torch.sigmoid(x @ w1.T + b1)
    expected = (1 - t) * x + t * (x @ w2.T + b2)
    torch.testing.assert_close(hw(x), expected)
    torch.testing.assert_close(hw.gate_activation(x), t)
    torch.testing.assert_close(hw.gate_bias, b1.detach())


def test_gated_mhdpa_matches_equation() -> None:
    torch.manual_seed(2)
    d = 5
    g = GatedMHDPA(d)
    _randomize_biases(g)
    w1, w2 = g.proj.weight[:d], g.proj.weight[d:]
    b1, b2 = g.proj.bias[:d], g.proj.bias[d:]
    x, att = torch.randn(2, 3, d), torch.randn(2, 3, d)
    t = torch.sigmoid(x @ w1.T + b1)
    expected = (1 - t) * att + t * (x @ w2.T + b2)
    torch.testing.assert_close(g(x, att), expected)
    torch.testing.assert_close(g.gate_activation(x), t)
    torch.testing.assert_close(g.gate_bias, b1.detach())
    # The gate reads x, not att: changing att alone must leave T unchanged but change the output.
    assert not torch.allclose(g(x, att), g(x, att + 1.0))


@pytest.mark.parametrize("d", [2, 7, 8])
def test_eau_matches_equation(d: int) -> None:
    torch.manual_seed(3)
    eau = EAU(d)
    _randomize_biases(eau)
    assert eau.d_hidden == d // 2
    w1, b1 = eau.evaluator_in.weight, eau.evaluator_in.bias
    w2, b2 = eau.evaluator_out.weight, eau.evaluator_out.bias
    w3, b3 = eau.adjuster.weight, eau.adjuster.bias
    assert w1.shape == (d // 2, d) and w2.shape == (d, d // 2) and w3.shape == (d, d)
    x = torch.randn(3, d)
    h = torch.relu(x @ w1.T + b1)
    e = torch.sigmoid(h @ w2.T + b2)
    a = torch.tanh(x @ w3.T + b3)
    torch.testing.assert_close(eau(x), x + a * e)
    torch.testing.assert_close(eau.gate_activation(x), e)
    torch.testing.assert_close(eau.gate_bias, b2.detach())


def test_grc_matches_equation() -> None:
    torch.manual_seed(4)
    d = 6
    grc = GatedResidual(d)
    _randomize_biases(grc)
    wg, bg = grc.gate_proj.weight, grc.gate_proj.bias
    r, s = torch.randn(2, 4, d), torch.randn(2, 4, d)
    g = torch.sigmoid(r @ wg.T + bg)
    torch.testing.assert_close(grc(r, s), r + g * s)
    torch.testing.assert_close(grc.gate_activation(r), g)
    torch.testing.assert_close(grc.gate_bias, bg.detach())
    # The gate is computed from the residual stream, not from the sublayer output.
    torch.testing.assert_close(grc(r, torch.zeros_like(s)), r)


def test_glu_halves() -> None:
    x = torch.randn(3, 8)
    a, b = x[:, :4], x[:, 4:]
    torch.testing.assert_close(GLU()(x), a * torch.sigmoid(b))
    y = torch.randn(6, 5)
    torch.testing.assert_close(GLU(dim=0)(y), y[:3] * torch.sigmoid(y[3:]))
    assert GLU(dim=1)(torch.randn(2, 10, 3)).shape == (2, 5, 3)


def test_glu_ffn_matches_equation() -> None:
    torch.manual_seed(5)
    d, f = 4, 3
    ffn = GLUFeedForward(d, f)
    _randomize_biases(ffn)
    w_in, b_in, w_o = ffn.w_in.weight, ffn.w_in.bias, ffn.w_out.weight
    assert w_in.shape == (2 * f, d) and w_o.shape == (d, f)
    x = torch.randn(2, 5, d)
    u = x @ w_in.T + b_in
    expected = (u[..., :f] * torch.sigmoid(u[..., f:])) @ w_o.T
    torch.testing.assert_close(ffn(x), expected)


def test_glu_ffn_dropout_only_in_training() -> None:
    torch.manual_seed(6)
    ffn = GLUFeedForward(4, 8, dropout=0.5)
    x = torch.randn(16, 4)
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn(x))
    ffn.train()
    assert not torch.allclose(ffn(x), ffn(x))


# --- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        lambda: SDU(4),
        lambda: SDU(4, gate="tanh"),
        lambda: HighwayGate(4),
        lambda: GatedMHDPA(4),
        lambda: EAU(6),
        lambda: GatedResidual(4),
        lambda: GLU(),
        lambda: GLUFeedForward(4, 3),
    ],
    ids=["sdu-sigmoid", "sdu-tanh", "highway", "gated_mhdpa", "eau", "grc", "glu", "glu_ffn"],
)
def test_gradcheck(factory) -> None:
    torch.manual_seed(7)
    module = factory().double()
    _randomize_biases(module)
    x = torch.randn(2, 4 if not isinstance(module, EAU) else 6, dtype=torch.float64, requires_grad=True)
    if isinstance(module, (GatedMHDPA, GatedResidual)):
        other = torch.randn_like(x, requires_grad=True)
        assert torch.autograd.gradcheck(module, (x, other))
    else:
        assert torch.autograd.gradcheck(module, (x,))
    # Gradients reach every parameter, including the ones behind the gate.
    out = _call(module, x, torch.randn_like(x))
    out.square().sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# --- parameter counts ------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 8])
def test_param_counts_square_units(d: int) -> None:
    assert _n_params(SDU(d)) == 2 * d * (d + 1)
    assert _n_params(SDU(d, gate="tanh")) == 2 * d * (d + 1)
    assert _n_params(HighwayGate(d)) == 2 * d * (d + 1)
    assert _n_params(GatedMHDPA(d)) == 2 * d * (d + 1)
    assert _n_params(GatedResidual(d)) == d * (d + 1)


@pytest.mark.parametrize("d", [2, 5, 8])
def test_param_count_eau(d: int) -> None:
    k = d // 2
    assert _n_params(EAU(d)) == d * k + k + k * d + d + d * d + d


@pytest.mark.parametrize(("d", "f"), [(1, 1), (4, 3), (6, 16)])
def test_param_count_glu_ffn(d: int, f: int) -> None:
    assert _n_params(GLUFeedForward(d, f)) == d * 2 * f + 2 * f + f * d
    assert _n_params(GLU()) == 0


def test_sdu_uses_one_fused_projection() -> None:
    linears = [m for m in SDU(5).modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 1 and linears[0].weight.shape == (10, 5)


# --- gate bounds -----------------------------------------------------------------------------


@FAST
@given(
    lead=leading_shapes,
    d=small_d,
    scale=st.floats(min_value=1e-3, max_value=5.0),
    gate=st.sampled_from(["sigmoid", "tanh"]),
    seed=st.integers(0, 2**16),
)
def test_sdu_gate_bounds(lead: tuple[int, ...], d: int, scale: float, gate: str, seed: int) -> None:
    # float64: in float32, tanh rounds to exactly ±1 from |z| ≈ 9, which is a rounding artefact.
    torch.manual_seed(seed)
    sdu = SDU(d, gate=gate).double()
    _randomize_biases(sdu, seed)
    x = (torch.rand(*lead, d, dtype=torch.float64) * 2 - 1) * scale
    psi = sdu.gate_activation(x)
    assert psi.shape == x.shape
    if gate == "sigmoid":
        assert bool(((psi > 0) & (psi < 1)).all())
    else:
        assert bool(((psi > -1) & (psi < 1)).all())
    # The output is never larger in magnitude than the ungated value it scales.
    value = x @ sdu.proj.weight[d:].T + sdu.proj.bias[d:]
    assert bool((sdu(x).abs() <= value.abs()).all())


@FAST
@given(lead=leading_shapes, d=small_d, scale=st.floats(min_value=1e-3, max_value=5.0))
def test_sigmoid_gates_in_unit_interval(lead: tuple[int, ...], d: int, scale: float) -> None:
    torch.manual_seed(d)
    x = torch.randn(*lead, d, dtype=torch.float64) * scale
    for module in (HighwayGate(d), GatedMHDPA(d), EAU(d), GatedResidual(d)):
        g = module.double().gate_activation(x)
        assert g.shape == x.shape
        assert bool(((g > 0) & (g < 1)).all()), type(module).__name__


# --- init, shapes, introspection -------------------------------------------------------------


def test_biases_zero_at_init() -> None:
    modules = [*_all_gated(6), GLUFeedForward(6, 4)]
    for module in modules:
        biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
        assert biases, type(module).__name__
        for b in biases:
            assert torch.count_nonzero(b) == 0, type(module).__name__
        if isinstance(module, GateUnit):
            assert torch.count_nonzero(module.gate_bias) == 0
    # Weights keep nn.Linear's random init; zeroed weights would make every gate a constant.
    assert torch.count_nonzero(SDU(6).proj.weight) > 0


@FAST
@given(lead=leading_shapes, d=small_d)
def test_shape_preserved(lead: tuple[int, ...], d: int) -> None:
    x = torch.randn(*lead, d)
    other = torch.randn(*lead, d)
    for module in _all_gated(d):
        assert _call(module, x, other).shape == x.shape, type(module).__name__
        assert module.gate_activation(x).shape == x.shape
    assert GLUFeedForward(d, 3)(x).shape == x.shape
    assert GLU()(torch.randn(*lead, 2 * d)).shape == (*lead, d)


def test_gate_bias_is_a_detached_view_of_the_parameter() -> None:
    for module in _all_gated(4):
        bias = module.gate_bias
        assert not bias.requires_grad
        assert bias.shape == (4,)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5)
        # Writes to the parameter show through: the property did not hand back a copy.
        assert torch.all(bias == 0.5), type(module).__name__


def test_kinds_and_protocol() -> None:
    kinds = {type(m).kind for m in _all_gated(4)}
    assert kinds == {"sdu", "highway", "gated_mhdpa", "eau", "grc"}
    assert set(GATE_UNITS) == kinds
    for kind, cls in GATE_UNITS.items():
        assert cls.kind == kind
    assert all(isinstance(m, GateUnit) for m in _all_gated(4))
    assert not isinstance(GLU(), GateUnit)
    assert not isinstance(GLUFeedForward(4, 2), GateUnit)


def test_extra_repr() -> None:
    assert "d_model=4" in repr(HighwayGate(4))
    assert "d_model=4" in repr(GatedMHDPA(4))
    assert "d_model=4" in repr(GatedResidual(4))
    assert "d_model=6" in repr(EAU(6))
    assert "d_model=3" in repr(SDU(3)) and "gate=sigmoid" in repr(SDU(3))
    assert "gate=tanh" in repr(SDU(3, gate="tanh"))
    assert "d_ffn=5" in repr(GLUFeedForward(2, 5))


# --- bad arguments ---------------------------------------------------------------------------


def test_sdu_unknown_gate_names_allowed_values() -> None:
    with pytest.raises(ValueError, match="sigmoid") as err:
        SDU(4, gate="relu")
    assert "tanh" in str(err.value) and "relu" in str(err.value)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4"])
@pytest.mark.parametrize("cls", [SDU, HighwayGate, GatedMHDPA, EAU, GatedResidual])
def test_bad_d_model(cls: type, bad: object) -> None:
    with pytest.raises(ValueError, match="d_model"):
        cls(bad)


def test_eau_rejects_d_model_one() -> None:
    with pytest.raises(ValueError, match="d_model"):
        EAU(1)


def test_glu_odd_size_rejected() -> None:
    with pytest.raises(ValueError, match="odd"):
        GLU()(torch.randn(2, 5))
    with pytest.raises(ValueError, match="odd"):
        GLU(dim=0)(torch.randn(3, 4))
    with pytest.raises(ValueError):
        GLU(dim=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"d_model": 0, "d_ffn": 4},
        {"d_model": 4, "d_ffn": 0},
        {"d_model": 4, "d_ffn": 4, "dropout": 1.0},
        {"d_model": 4, "d_ffn": 4, "dropout": -0.1},
    ],
)
def test_glu_ffn_bad_args(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GLUFeedForward(**kwargs)


class _CountKernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that compute something (views and detaches left out)."""

    _FREE = {"view", "t", "transpose", "detach", "split", "split_with_sizes", "slice", "alias", "unsqueeze", "expand"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func.overloadpacket.__name__ not in self._FREE
        return func(*args, **(kwargs or {}))


def _kernels_of_step(product) -> int:  # noqa: ANN001
    base, a, b = (torch.randn(4, 6, requires_grad=True) for _ in range(3))
    with _CountKernels() as counter:
        product(base, a, b).sum().backward()
    return counter.count


def test_gates_multiply_add_takes_fewer_kernels_with_gradients_than_addcmul() -> None:
    from gatedformer.gates._product import add_product

    assert _kernels_of_step(add_product) < _kernels_of_step(torch.addcmul)
    base, a, b = (torch.randn(4, 6) for _ in range(3))
    with torch.no_grad(), _CountKernels() as counter:
        out = add_product(base, a, b)
    assert counter.count == 1  # addcmul itself
    torch.testing.assert_close(out, torch.addcmul(base, a, b), rtol=0, atol=0)


@pytest.mark.parametrize("unit", ["sdu", "eau", "grc"])
def test_gates_ending_in_a_multiply_add_keep_their_values_and_gradients(unit: str) -> None:
    torch.manual_seed(0)
    d = 6
    x, s = torch.randn(3, d, requires_grad=True), torch.randn(3, d, requires_grad=True)
    if unit == "sdu":
        gate = SDU(d)
        out = gate(x, add_to=s)
        pre, value = gate.proj(x).chunk(2, dim=-1)
        expected = torch.addcmul(s, torch.sigmoid(pre), value)
    elif unit == "eau":
        gate = EAU(d)
        out = gate(x)
        expected = torch.addcmul(x, torch.tanh(gate.adjuster(x)), gate.gate_activation(x))
    else:
        gate = GatedResidual(d)
        out = gate(x, s)
        expected = torch.addcmul(x, gate.gate_activation(x), s)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, s, *gate.parameters()], grad, allow_unused=True)
    want = torch.autograd.grad(expected, [x, s, *gate.parameters()], grad, allow_unused=True)
    torch.testing.assert_close(out, expected)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w)
