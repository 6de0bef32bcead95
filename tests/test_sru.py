"""Tests for the SRU: equations, the compiled recurrence against its reference, initialisation,
projection, state carrying, bidirectionality, bf16, the language model, and the ``sru`` package."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor

from gatedformer.kernels import build as _native
from gatedformer.kernels import sru as _sru_kernel
from gatedformer.models.sru import SRULanguageModel
from gatedformer.nn.sru import (
    SRU,
    SRULayer,
    highway_scale,
    kernel_backend,
    sru_recurrence,
    sru_recurrence_reference,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # These tensors are tiny: Torch's intra-op threads only add scheduling noise on a busy machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _native_or_skip() -> None:
    if kernel_backend() != "native":
        pytest.skip(f"the compiled SRU kernel is unavailable here: {_sru_kernel.KERNEL.error}")


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Zero biases and identity LayerNorms would hide swapped or missing terms: randomise everything."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def _direct_layer(layer: SRULayer, x: Tensor, c0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The SRU equations, written out step by step from the layer's own parameters."""
    L, B, _ = x.shape
    D, H, K = layer.num_directions, layer.hidden_size, layer.num_streams
    W = layer.weight if layer.weight_proj is None else layer.weight @ layer.weight_proj
    W = W.view(D, K, H, layer.input_size)
    x_in = x if layer.norm is None else layer.norm(x)
    alpha = math.sqrt(1 + 2 * math.exp(layer.highway_bias)) if layer.rescale else 1.0
    h = x.new_zeros(L, B, D * H)
    c_last = []
    for d in range(D):
        c = x.new_zeros(B, H) if c0 is None else c0[:, d * H : (d + 1) * H]
        for t in range(L) if d == 0 else reversed(range(L)):
            xt = x_in[t]
            f = torch.sigmoid(xt @ W[d, 1].T + layer.v_f[d] * c + layer.b_f[d])
            r = torch.sigmoid(xt @ W[d, 2].T + layer.v_r[d] * c + layer.b_r[d])
            c = f * c + (1 - f) * (xt @ W[d, 0].T)
            skip = x[t, :, d * H : (d + 1) * H] if K == 3 else xt @ W[d, 3].T
            h[t, :, d * H : (d + 1) * H] = r * c + (1 - r) * skip * alpha
        c_last.append(c)
    return h, torch.cat(c_last, dim=1)


LAYER_CONFIGS = [
    dict(input_size=6, hidden_size=6),  # identity skip
    dict(input_size=5, hidden_size=7),  # projected skip
    dict(input_size=8, hidden_size=4, bidirectional=True),  # identity skip split between directions
    dict(input_size=5, hidden_size=3, bidirectional=True),  # projected skip, two directions
    dict(input_size=6, hidden_size=6, rescale=False, highway_bias=-1.0),
    dict(input_size=6, hidden_size=6, layer_norm=True, highway_bias=-2.0),
    dict(input_size=12, hidden_size=10, projection_size=3),
]


@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("with_c0", [False, True])
def test_layer_matches_the_equations_step_by_step(cfg: dict, with_c0: bool) -> None:
    torch.manual_seed(0)
    layer = SRULayer(**cfg).double()
    _randomize(layer)
    L, B = 5, 3
    x = torch.randn(L, B, cfg["input_size"], dtype=torch.float64)
    c0 = torch.randn(B, layer.output_size, dtype=torch.float64) if with_c0 else None
    h, c = layer(x, c0)
    h_ref, c_ref = _direct_layer(layer, x, c0)
    assert h.shape == (L, B, layer.output_size) and c.shape == (B, layer.output_size)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(c, c_ref, rtol=1e-10, atol=1e-10)


def _recurrence_inputs(
    K: int, D: int, dtype: torch.dtype = torch.float64, L: int = 6, B: int = 3, H: int = 5
):
    g = torch.Generator().manual_seed(K * 10 + D)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(shape, generator=g, dtype=dtype).requires_grad_()

    U = rnd(L, B, D, K, H)
    skip = rnd(L, B, D, H) if K == 3 else None
    return U, skip, rnd(D, H), rnd(D, H), rnd(D, H), rnd(D, H), rnd(B, D, H)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("K,D", [(3, 1), (4, 1), (3, 2), (4, 2)])
def test_fast_recurrence_matches_reference_values_and_gradients(backend: str, K: int, D: int) -> None:
    if backend == "native":
        _native_or_skip()
    inputs = _recurrence_inputs(K, D)
    leaves = [t for t in inputs if t is not None]
    results = []
    for fn in (sru_recurrence_reference, lambda *a, **k: sru_recurrence(*a, **k, backend=backend)):
        h, c = fn(*inputs, alpha=1.3)
        g = torch.Generator().manual_seed(1)
        loss = (h * torch.randn(h.shape, generator=g, dtype=h.dtype)).sum()
        loss = loss + (c * torch.randn(c.shape, generator=g, dtype=c.dtype)).sum()
        results.append((h, c, torch.autograd.grad(loss, leaves)))
    (h_ref, c_ref, g_ref), (h, c, grads) = results
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c, c_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, g_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("K,D", [(3, 2), (4, 1)])
def test_recurrence_gradcheck_float64(backend: str, K: int, D: int) -> None:
    if backend == "native":
        _native_or_skip()
    inputs = _recurrence_inputs(K, D, L=4, B=2, H=3)
    assert torch.autograd.gradcheck(lambda *a: sru_recurrence(*a, alpha=1.7, backend=backend), inputs)


def test_stack_gradcheck_float64() -> None:
    torch.manual_seed(0)
    model = SRU(3, 2, num_layers=2, bidirectional=True, layer_norm=True, highway_bias=-1.0).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, c0: model(x, c0), (x, c0))


def test_float32_fast_path_matches_reference() -> None:
    _native_or_skip()
    inputs = [None if t is None else t.detach().float() for t in _recurrence_inputs(4, 2, L=40, B=4, H=33)]
    h, c = sru_recurrence(*inputs, alpha=1.5)
    h_ref, c_ref = sru_recurrence_reference(*inputs, alpha=1.5)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, c_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", _native.ISAS)
@pytest.mark.parametrize("K,D,H", [(3, 1, 37), (4, 2, 16), (3, 2, 5)])
def test_every_instruction_set_build_matches_in_float32(isa: str, K: int, D: int, H: int, kernel_build) -> None:  # noqa: ANN001
    """The float32 rows run whole vectors (16 or 8 units, by the build) with the inline exp, then a scalar tail:
    values and every gradient against the float64 reference, with widths below, at and across a vector."""
    _native_or_skip()
    kernel_build(_sru_kernel.KERNEL, isa)
    inputs64 = [None if t is None else t.detach() for t in _recurrence_inputs(K, D, L=9, B=3, H=H)]
    results = []
    for dtype, fn in ((torch.float64, sru_recurrence_reference),
                      (torch.float32, lambda *a, **k: sru_recurrence(*a, **k, backend="native"))):
        inputs = [None if t is None else t.to(dtype).requires_grad_() for t in inputs64]
        h, c = fn(*inputs, alpha=1.3)
        g = torch.Generator().manual_seed(1)
        loss = (h * torch.randn(h.shape, generator=g, dtype=torch.float64).to(dtype)).sum()
        loss = loss + (c * torch.randn(c.shape, generator=g, dtype=torch.float64).to(dtype)).sum()
        leaves = [t for t in inputs if t is not None]
        results.append((h, c, torch.autograd.grad(loss, leaves)))
    (h_ref, c_ref, g_ref), (h, c, grads) = results
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, g_ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_multithreaded_kernel_matches_reference(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    assert _native.kernel_threads(1000) == 1  # small problems stay on one thread
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)  # split even this tiny one
    inputs = _recurrence_inputs(3, 2, L=6, B=5, H=7)  # 10 rows: uneven chunks for 3 and 4 threads
    leaves = [t for t in inputs if t is not None]
    torch.set_num_threads(threads)
    assert _native.kernel_threads(10**7) == threads
    h, c = sru_recurrence(*inputs, alpha=0.9, backend="native")
    grads = torch.autograd.grad(h.square().sum() + c.sum(), leaves)
    torch.set_num_threads(1)
    h_ref, c_ref = sru_recurrence_reference(*inputs, alpha=0.9)
    grads_ref = torch.autograd.grad(h_ref.square().sum() + c_ref.sum(), leaves)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c, c_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_alpha_is_sqrt3_at_zero_bias_and_scales_the_skip() -> None:
    assert SRULayer(4, 4).alpha == pytest.approx(math.sqrt(3))
    assert highway_scale(0.0) == pytest.approx(math.sqrt(3))
    assert highway_scale(-2.0) == pytest.approx(math.sqrt(1 + 2 * math.exp(-2.0)))
    assert SRULayer(4, 4, highway_bias=-2.0, rescale=False).alpha == 1.0
    # With the reset gate shut (r = 0), h is the scaled input.
    for rescale, alpha in ((True, math.sqrt(3)), (False, 1.0)):
        layer = SRULayer(4, 4, rescale=rescale).double()
        with torch.no_grad():
            layer.b_r.fill_(-1e4)
        x = torch.randn(3, 2, 4, dtype=torch.float64)
        torch.testing.assert_close(layer(x)[0], alpha * x)


def test_initialisation_follows_the_paper_appendix() -> None:
    torch.manual_seed(0)
    layer = SRULayer(512, 256, highway_bias=-3.0)
    assert layer.weight.shape == (4 * 256, 512)  # projected skip: 512 != 256
    assert layer.weight.mean().item() == pytest.approx(0.0, abs=2e-3)
    assert layer.weight.var().item() == pytest.approx(1 / 512, rel=0.03)
    assert torch.equal(layer.b_f, torch.zeros(1, 256))
    assert torch.equal(layer.b_r, torch.full((1, 256), -3.0))
    for v in (layer.v_f, layer.v_r):
        assert v.abs().max().item() <= 0.5 and abs(v.mean().item()) < 0.05
    projected = SRULayer(512, 256, projection_size=64)
    assert projected.weight_proj.var().item() == pytest.approx(1 / 512, rel=0.05)
    assert projected.weight.var().item() == pytest.approx(1 / 64, rel=0.05)
    # Unit-variance inputs give h of roughly unit variance through a deep stack at init.
    stack = SRU(256, 256, num_layers=8)
    with torch.no_grad():
        h, _ = stack(torch.randn(32, 16, 256))
    assert 0.3 < h.var().item() < 3.0


def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_projection_parameter_counts() -> None:
    d, H, p = 256, 256, 64
    full = SRULayer(d, H)
    assert _n_params(full) == 3 * H * d + 4 * H
    proj = SRULayer(d, H, projection_size=p)
    assert proj.weight_proj.shape == (p, d) and proj.weight.shape == (3 * H, p)
    assert _n_params(proj) == p * d + 3 * H * p + 4 * H
    skip = SRULayer(128, 256, projection_size=32)  # the skip stream is in the factorised product too
    assert _n_params(skip) == 32 * 128 + 4 * 256 * 32 + 4 * 256
    bi = SRULayer(d, H // 2, bidirectional=True, projection_size=p)
    assert _n_params(bi) == p * d + 2 * 3 * (H // 2) * p + 4 * H
    assert SRULayer(d, H, projection_size=0).weight_proj is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(input_size=64, hidden_size=64, projection_size=64), "cannot reduce"),
        (dict(input_size=64, hidden_size=64, projection_size=100), "cannot reduce"),
        (dict(input_size=300, hidden_size=4, projection_size=12), "cannot reduce"),  # >= 3 * hidden
        (dict(input_size=64, hidden_size=64, projection_size=60), "does not save parameters"),
        (dict(input_size=64, hidden_size=64, projection_size=-5), "0 \\(no projection\\) or a positive integer"),
    ],
)
def test_useless_projection_is_a_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SRULayer(**kwargs)
    with pytest.raises(ValueError, match="SRU layer 0"):
        SRU(kwargs["input_size"], kwargs["hidden_size"], projection_size=kwargs["projection_size"])


@pytest.mark.parametrize("bias, match", [(float("nan"), "finite"), (float("inf"), "finite"), (-math.inf, "finite"),
                                         (1000.0, "overflow float32"), (171.0, "overflow float32")])
def test_a_highway_bias_without_a_finite_alpha_is_a_value_error(bias: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SRULayer(8, 8, highway_bias=bias)
    layer = SRULayer(8, 8, highway_bias=170.0)  # the largest allowed: alpha is still a float32
    assert math.isfinite(layer.alpha) and torch.isfinite(torch.tensor(layer.alpha, dtype=torch.float32))


def test_carrying_c_across_two_halves_equals_one_pass() -> None:
    torch.manual_seed(0)
    model = SRU(5, 6, num_layers=3, highway_bias=-1.0, layer_norm=True)
    _randomize(model)
    x = torch.randn(10, 2, 5)
    c0 = torch.randn(3, 2, 6)
    h_full, c_full = model(x, c0)
    h1, c1 = model(x[:4], c0)
    h2, c2 = model(x[4:], c1)
    torch.testing.assert_close(torch.cat([h1, h2]), h_full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c2, c_full, rtol=1e-5, atol=1e-6)


def test_bidirectional_shapes() -> None:
    model = SRU(10, 8, num_layers=3, bidirectional=True)
    x = torch.randn(9, 4, 10)
    h, c = model(x)
    assert h.shape == (9, 4, 16) and c.shape == (3, 4, 16)
    assert model.layers[1].input_size == 16 and model.layers[1].num_streams == 3
    h2, c2 = model(x, torch.zeros(3, 4, 16))
    torch.testing.assert_close(h2, h)
    torch.testing.assert_close(c2, c)


def test_shape_errors() -> None:
    model = SRU(4, 4, num_layers=2)
    with pytest.raises(ValueError, match="x must have shape"):
        model(torch.randn(3, 4))
    with pytest.raises(ValueError, match="x must have shape"):
        model(torch.randn(3, 2, 5))
    with pytest.raises(ValueError, match="c0 must have shape"):
        model(torch.randn(3, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="empty sequence"):
        model(torch.randn(0, 2, 4))
    with pytest.raises(ValueError, match="dropout"):
        SRU(4, 4, dropout=1.0)


def test_bf16_forward_and_backward_on_cpu() -> None:
    torch.manual_seed(0)
    model = SRU(16, 16, num_layers=2, projection_size=4, highway_bias=-1.0)
    x = torch.randn(12, 3, 16)
    h32, _ = model(x)
    model_bf16 = model.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_()
    h, c = model_bf16(xb)
    assert h.dtype == torch.bfloat16 and c.dtype == torch.bfloat16
    (h.float().square().mean() + c.float().sum()).backward()
    assert xb.grad is not None and xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad).all()
    for p in model_bf16.parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
    torch.testing.assert_close(h.float(), h32, rtol=0.05, atol=0.05)


def test_dropout_between_layers_and_variational_mask() -> None:
    torch.manual_seed(0)
    model = SRU(6, 6, num_layers=2, dropout=0.5)
    x = torch.randn(5, 3, 6)
    model.eval()
    h_eval, _ = model(x)
    torch.testing.assert_close(model(x)[0], h_eval)
    model.train()
    assert not torch.allclose(model(x)[0], h_eval)
    variational = SRU(6, 6, num_layers=2, dropout=0.5, variational_dropout=True).train()
    dropped = variational._drop(torch.ones(5, 3, 6))
    assert torch.equal(dropped, dropped[:1].expand_as(dropped))  # one mask for every time step
    assert set(dropped.unique().tolist()) <= {0.0, 2.0}


def test_language_model_shapes_state_and_tying() -> None:
    torch.manual_seed(0)
    lm = SRULanguageModel(50, 16, 2, tie_embeddings=True)
    assert lm.output.weight is lm.embedding.weight
    tokens = torch.randint(0, 50, (3, 7))
    out = lm(tokens)
    logits, state = out.logits, out.state
    assert logits.shape == (3, 7, 50) and state.shape == (2, 3, 16)
    assert state.requires_grad  # returned un-detached
    # Carrying the state over two windows equals one window over the concatenation.
    first = lm(tokens[:, :3])
    l1, s1 = first.logits, first.state
    second = lm(tokens[:, 3:], s1)
    l2, s2 = second.logits, second.state
    torch.testing.assert_close(torch.cat([l1, l2], dim=1), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, state, rtol=1e-5, atol=1e-5)
    untied = SRULanguageModel(50, 16, 2, projection_size=4, layer_norm=True)
    assert untied.output.weight is not untied.embedding.weight
    with pytest.raises(ValueError, match="tokens must have shape"):
        lm(torch.zeros(5, dtype=torch.long))


def test_language_model_is_causal() -> None:
    torch.manual_seed(0)
    lm = SRULanguageModel(30, 12, 3, dropout=0.1, highway_bias=-1.0).eval()
    tokens = torch.randint(0, 30, (2, 10))
    base = lm(tokens).logits
    for t in (0, 4, 8):
        changed = tokens.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 30
        logits = lm(changed).logits
        torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], rtol=0, atol=0)
        assert not torch.allclose(logits[:, t + 1], base[:, t + 1])


def test_language_model_learns() -> None:
    torch.manual_seed(0)
    lm = SRULanguageModel(8, 16, 2)
    tokens = torch.arange(8).repeat(4, 3)  # 0 1 2 ... 7 0 1 ...: every next token is predictable
    opt = torch.optim.Adam(lm.parameters(), lr=0.02)
    losses = []
    for _ in range(20):
        logits = lm(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


def test_nothing_compiles_at_import(tmp_path: Path) -> None:
    env = {**os.environ, "GATEDFORMER_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": str(REPO / "src")}
    code = "import gatedformer.kernels.sru as k, gatedformer.nn.sru; assert k.KERNEL._lib is None"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert not (tmp_path / "kernels").exists()


def test_missing_compiler_falls_back_to_torch_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-gatedformer")
    monkeypatch.setattr(_sru_kernel.KERNEL, "_lib", None)
    monkeypatch.setattr(_sru_kernel.KERNEL, "error", None)
    monkeypatch.setattr(_sru_kernel.KERNEL, "_warned", False)
    monkeypatch.delenv("GATEDFORMER_SRU_BACKEND", raising=False)
    monkeypatch.delenv("GATEDFORMER_REQUIRE_NATIVE", raising=False)  # the fallback users without a compiler get
    layer = SRULayer(4, 4)
    x = torch.randn(3, 2, 4)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        h, _ = layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        layer(x)
    assert kernel_backend() == "torch"
    with pytest.raises(RuntimeError, match="unavailable"):
        sru_recurrence(*[t for t in _recurrence_inputs(4, 1)], backend="native")
    torch.testing.assert_close(h, _direct_layer(layer, x, None)[0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Against the reference implementation by the paper's authors (pip install sru==2.6.0).


def _import_sru_package() -> ModuleType:
    """``sru``, skipping when it is absent, and also when importing it would first compile its C++
    extension (minutes, at import; set ``GATEDFORMER_TEST_SRU=1`` to allow that, or import it once)."""
    if importlib.util.find_spec("sru") is None:
        pytest.skip("the sru package is not installed (pip install sru==2.6.0)")
    if "sru" not in sys.modules and not os.environ.get("GATEDFORMER_TEST_SRU"):
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        if not any(root.glob("sru_cpu/sru_cpu*.so")) and not any(root.glob("*/sru_cpu/sru_cpu*.so")):
            pytest.skip("importing sru would compile its C++ extension first; set GATEDFORMER_TEST_SRU=1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that it cannot build its CUDA kernels
        return pytest.importorskip("sru")


def _to_sru_package(ours: SRU, theirs: torch.nn.Module) -> None:
    """Copy our weights into an ``sru.SRU``: its fused weight is (input, D, H, K) and applies no alpha to
    a projected skip at run time (it scales those weights at init instead)."""
    with torch.no_grad():
        for mine, cell in zip(ours.layers, theirs.rnn_lst, strict=True):
            D, K, H = mine.num_directions, mine.num_streams, mine.hidden_size
            w = mine.weight.view(D, K, H, -1).clone()
            if K == 4:
                w[:, 3] *= mine.alpha
            cell.weight.copy_(w.permute(3, 0, 2, 1).reshape(w.shape[-1], D * H * K))
            if mine.weight_proj is not None:
                cell.weight_proj.copy_(mine.weight_proj.T)
            cell.weight_c.copy_(torch.stack([mine.v_f, mine.v_r]).reshape(-1))
            cell.bias.copy_(torch.stack([mine.b_f, mine.b_r]).reshape(-1))
            if mine.norm is not None:
                cell.layer_norm.load_state_dict(mine.norm.state_dict())
            cell.scale_x.fill_(mine.alpha)  # it holds a float32 value; make it exact in float64


@pytest.mark.parametrize(
    "cfg",
    [
        dict(input_size=8, hidden_size=8, num_layers=2, highway_bias=-1.0),
        dict(input_size=5, hidden_size=8, num_layers=2, rescale=False),
        dict(input_size=6, hidden_size=4, num_layers=2, bidirectional=True, layer_norm=True),
        dict(input_size=24, hidden_size=24, num_layers=2, projection_size=6, highway_bias=-2.0),
    ],
    ids=["skip", "proj-skip", "bidir-ln", "projection"],
)
def test_matches_the_sru_package(cfg: dict) -> None:
    sru = _import_sru_package()
    torch.manual_seed(0)
    ours = SRU(**cfg).double()
    _randomize(ours)
    kwargs = {k: v for k, v in cfg.items() if k != "input_size" and k != "hidden_size"}
    kwargs.setdefault("rescale", True)
    theirs = sru.SRU(cfg["input_size"], cfg["hidden_size"], **kwargs).double()
    _to_sru_package(ours, theirs)
    assert [cell.num_matrices for cell in theirs.rnn_lst] == [layer.num_streams for layer in ours.layers]
    x = torch.randn(7, 3, cfg["input_size"], dtype=torch.float64)
    c0 = torch.randn(2, 3, ours.output_size, dtype=torch.float64)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    h, c = ours(x_ours, c0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Running SRU on CPU with grad_enabled=True"
        h_ref, c_ref = theirs(x_theirs, c0)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(c, c_ref, rtol=1e-10, atol=1e-10)
    (h.sum() + c.square().sum()).backward()
    (h_ref.sum() + c_ref.square().sum()).backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-10, atol=1e-10)


def test_backend_choice_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "torch")
    assert kernel_backend() == "torch"
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "bogus")
    with pytest.raises(ValueError, match="GATEDFORMER_SRU_BACKEND"):
        kernel_backend()
    with pytest.raises(ValueError, match="backend must be"):
        sru_recurrence(*_recurrence_inputs(4, 1), backend="cuda")


# The GPU kernels (Triton), checked on any machine by Triton's interpreter.

def _interpreted_triton_kernels(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # the compiled kernels themselves are tested there, in test_cuda.py
        pytest.skip("a GPU is present: the Triton kernels are tested compiled, not interpreted")
    from gatedformer.kernels.triton import sru as _sru_triton

    kernels = _sru_triton.load_kernels(interpreted=True)
    monkeypatch.setattr(_sru_triton, "_kernels", lambda: kernels)
    return kernels


@pytest.mark.parametrize(("length", "directions", "streams", "with_grad_c"),
                         [(7, 2, 4, True), (7, 1, 3, False), (5, 2, 3, True), (1, 2, 4, False), (2, 1, 4, True)])
def test_triton_kernels_match_the_reference(monkeypatch: pytest.MonkeyPatch, length: int, directions: int,
                                            streams: int, with_grad_c: bool) -> None:
    from gatedformer.ops.sru import _SRURecurrence

    _interpreted_triton_kernels(monkeypatch)
    torch.manual_seed(length)
    B, H = 3, 5
    f64 = torch.float64
    inputs = [torch.randn(length, B, directions, streams, H, dtype=f64),
              torch.randn(length, B, directions, H, dtype=f64) if streams == 3 else None,
              torch.rand(directions, H, dtype=f64) - 0.5, torch.rand(directions, H, dtype=f64) - 0.5,
              torch.randn(directions, H, dtype=f64), torch.randn(directions, H, dtype=f64),
              torch.randn(B, directions, H, dtype=f64)]
    ours = [None if t is None else t.clone().requires_grad_() for t in inputs]
    theirs = [None if t is None else t.clone().requires_grad_() for t in inputs]
    h, c = _SRURecurrence.apply(*ours, 1.7, "triton")
    h_ref, c_ref = sru_recurrence_reference(*theirs, alpha=1.7)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c, c_ref, rtol=1e-12, atol=1e-12)
    weight_h, weight_c = torch.randn_like(h), torch.randn_like(c) if with_grad_c else torch.zeros_like(c)
    ((h * weight_h).sum() + ((c * weight_c).sum() if with_grad_c else 0)).backward()
    ((h_ref * weight_h).sum() + (c_ref * weight_c).sum()).backward()
    for mine, reference in zip(ours, theirs, strict=True):
        if mine is not None:
            torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-12, atol=1e-12)


def test_triton_is_chosen_for_cuda_tensors_and_torch_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.kernels.triton import sru as _sru_triton
    from gatedformer.ops import sru as _sru_ops

    monkeypatch.setattr(_sru_triton, "available", lambda: True)
    assert _sru_ops._pick_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "torch")
    assert _sru_ops._pick_backend(torch.device("cuda")) == "torch"
    monkeypatch.setattr(_sru_triton, "available", lambda: False)
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "native")
    with pytest.raises(RuntimeError, match="needs Triton"):
        _sru_ops._pick_backend(torch.device("cuda"))
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "auto")
    monkeypatch.setattr(_sru_ops, "_warned_no_triton", False)
    with pytest.warns(UserWarning, match="Triton is not installed"):
        assert _sru_ops._pick_backend(torch.device("cuda")) == "torch"
