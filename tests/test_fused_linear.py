"""Linear layers fused with their bias, ReLU, dropout and residual add: the same numbers as the unfused ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gatedformer.config import ModelConfig
from gatedformer.fused import fuse
from gatedformer.gates import EAU, SDU, GatedMHDPA, GatedResidual, HighwayGate
from gatedformer.kernels import attention as _attention_kernel
from gatedformer.kernels import blas as _blas
from gatedformer.kernels import build as _native
from gatedformer.kernels import dropout as _dropout_kernel
from gatedformer.kernels import epilogue as _epilogue_kernel
from gatedformer.kernels import gate as _gate_kernel
from gatedformer.models import build_model
from gatedformer.models.transformer import TransformerLM
from gatedformer.nn.attention import CausalSelfAttention
from gatedformer.nn.sublayer import FeedForward
from gatedformer.ops import fused_gates, fused_linear
from gatedformer.ops.dropout import dropout, dropout_add, relu_dropout
from gatedformer.ops.fused_linear import (
    _wide_weight_grad,
    fusion_applies,
    linear_dropout_add,
    linear_relu_dropout,
    registered,
)


def _kernel_or_skip() -> None:
    for kernel in (_dropout_kernel.KERNEL, _epilogue_kernel.KERNEL):
        if kernel.pick_backend(torch.device("cpu")) != "native":
            pytest.skip(f"{kernel.description} is unavailable here: {kernel.error}")


def _grads(out: Tensor, grad: Tensor, *inputs: Tensor) -> list[Tensor]:
    return list(torch.autograd.grad(out, inputs, grad))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), d_in=st.integers(1, 24), d_out=st.integers(1, 150), p=st.sampled_from([0.1, 0.5]),
       seed=st.integers(0, 2 ** 16))
def test_fused_linear_relu_dropout_is_the_unfused_computation(rows: int, d_in: int, d_out: int, p: float,
                                                             seed: int) -> None:
    _kernel_or_skip()
    torch.manual_seed(seed)
    linear = nn.Linear(d_in, d_out)
    x = torch.randn(2, rows, d_in, requires_grad=True)
    grad = torch.randn(2, rows, d_out)
    assert fusion_applies(x, linear, p, True)
    torch.manual_seed(seed + 1)
    fused = linear_relu_dropout(x, linear, p)
    torch.manual_seed(seed + 1)
    plain = relu_dropout(linear(x), p)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    assert torch.equal(fused == 0, plain == 0)  # the same mask (and ReLU zeros)
    params = (x, linear.weight, linear.bias)
    for a, b in zip(_grads(fused, grad, *params), _grads(plain, grad, *params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), d_in=st.integers(1, 24), d_out=st.integers(1, 150), seed=st.integers(0, 2 ** 16))
def test_fused_linear_dropout_add_is_the_unfused_computation(rows: int, d_in: int, d_out: int, seed: int) -> None:
    _kernel_or_skip()
    torch.manual_seed(seed)
    linear = nn.Linear(d_in, d_out)
    x = torch.randn(rows, 3, d_in, requires_grad=True)
    base = torch.randn(rows, 3, d_out, requires_grad=True)
    grad = torch.randn(rows, 3, d_out)
    torch.manual_seed(seed + 1)
    fused = linear_dropout_add(base, x, linear, 0.3)
    torch.manual_seed(seed + 1)
    plain = dropout_add(base, linear(x), 0.3)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    params = (base, x, linear.weight, linear.bias)
    for a, b in zip(_grads(fused, grad, *params), _grads(plain, grad, *params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 70), d_in=st.integers(1, 24), d_out=st.integers(8, 150), seed=st.integers(0, 2 ** 16))
def test_fused_post_norm_tail_is_the_unfused_computation(rows: int, d_in: int, d_out: int, seed: int) -> None:
    """LayerNorm(base + dropout(linear(x))) in one kernel each way: values, every gradient, the same mask.
    (Rows of at least 8: over fewer the norm's gradient is too ill-conditioned to compare two float32 orders.)"""
    _kernel_or_skip()
    torch.manual_seed(seed)
    linear, norm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(rows, 2, d_in, requires_grad=True)
    base = torch.randn(rows, 2, d_out, requires_grad=True)
    grad = torch.randn(rows, 2, d_out)
    torch.manual_seed(seed + 1)
    fused = fused_linear.linear_dropout_add_norm(base, x, linear, 0.25, norm)
    torch.manual_seed(seed + 1)
    plain = norm(dropout_add(base, linear(x), 0.25))
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)
    params = (base, x, linear.weight, linear.bias, norm.weight, norm.bias)
    for a, b in zip(_grads(fused, grad, *params), _grads(plain, grad, *params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_hooked_or_unusual_norm_is_applied_unfused() -> None:
    linear, x, base = nn.Linear(4, 6), torch.randn(3, 4), torch.randn(3, 6)
    seen: list[Tensor] = []
    for norm in (nn.LayerNorm(6, elementwise_affine=False), nn.LayerNorm(6)):
        if norm.weight is not None:
            norm.register_forward_hook(lambda module, args, out: seen.append(out))
        torch.manual_seed(0)
        out = fused_linear.linear_dropout_add_norm(base, x, linear, 0.2, norm)
        torch.manual_seed(0)
        torch.testing.assert_close(out, norm(dropout_add(base, linear(x), 0.2)))
    assert len(seen) == 2


@pytest.mark.parametrize("isa", _native.ISAS)
def test_epilogue_kernels_match_the_reference_masks(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The in-place bias epilogues draw the masks of the NumPy Philox reference, row by row of any width."""
    _kernel_or_skip()
    kernel_build(_epilogue_kernel.KERNEL, isa)
    keep_below, seed = round(0.8 * 2 ** 32), 12345
    scale = 2 ** 32 / keep_below
    h, base, bias = torch.randn(7, 37), torch.randn(7, 37), torch.randn(37)
    keep = torch.from_numpy(_dropout_kernel.philox_words(h.numel(), seed) < np.uint32(keep_below)).view(7, 37)
    relu, positive = _epilogue_kernel.bias_relu_dropout_(h.clone(), bias, seed, keep_below, scale)
    pre = h + bias
    assert torch.equal(relu, pre * ((keep & (pre > 0)).float() * scale))
    assert torch.equal(positive, _epilogue_kernel._pack_bits(relu.reshape(-1) > 0))
    added = _epilogue_kernel.bias_dropout_add_(h.clone(), base, bias, seed, keep_below, scale)
    assert torch.equal(added, base + pre * (keep.float() * scale))
    # The post-LN tail: the same mask, torch's LayerNorm and its gradients.
    gamma, beta, grad = torch.rand(37) + 0.5, torch.randn(37), torch.randn(7, 37)
    normed, xhat, rstd, keep_bits = _epilogue_kernel.dropout_add_norm(h, base, bias, gamma, beta, 1e-5, seed,
                                                                     keep_below, scale)
    summed = (base + pre * (keep.float() * scale)).requires_grad_()
    reference = torch.nn.functional.layer_norm(summed, (37,), gamma, beta, 1e-5)
    torch.testing.assert_close(normed, reference, rtol=1e-5, atol=1e-5)
    grad_sum, grad_pre, grad_gamma, grad_beta, grad_bias = _epilogue_kernel.dropout_add_norm_backward(
        grad, xhat, rstd, gamma, keep_bits, scale)
    (expected,) = torch.autograd.grad(reference, summed, grad)
    torch.testing.assert_close(grad_sum, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_pre, expected * keep.float() * scale, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_bias, grad_pre.sum(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_beta, grad.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_gamma, (grad * xhat).sum(0), rtol=1e-5, atol=1e-5)
    # With a GRC's gate g = sigmoid(a): LayerNorm(base + g * dropout(h + bias)), and the gradient of a.
    a = torch.randn(7, 37)
    gate = torch.sigmoid(a)
    normed, xhat, rstd, keep_bits = _epilogue_kernel.dropout_add_norm(h, base, bias, gamma, beta, 1e-5, seed,
                                                                     keep_below, scale, gate=gate)
    a_ = a.clone().requires_grad_()
    dropped = (h + bias) * (keep.float() * scale)
    reference = torch.nn.functional.layer_norm(base + torch.sigmoid(a_) * dropped, (37,), gamma, beta, 1e-5)
    torch.testing.assert_close(normed, reference, rtol=1e-5, atol=1e-5)
    grad_sum, grad_pre, grad_a, _, _, grad_bias, grad_gate_bias = _epilogue_kernel.gated_dropout_add_norm_backward(
        grad, xhat, rstd, gamma, keep_bits, scale, gate, h, bias)
    (expected_a,) = torch.autograd.grad(reference, a_, grad)
    torch.testing.assert_close(grad_a, expected_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_pre, grad_sum * gate * keep.float() * scale, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_bias, grad_pre.sum(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_gate_bias, grad_a.sum(0), rtol=1e-4, atol=1e-5)
    sigmoid = _gate_kernel.bias_sigmoid_(a.clone(), bias[:37])
    torch.testing.assert_close(sigmoid, torch.sigmoid(a + bias), rtol=1e-6, atol=1e-6)


_BRANCHES = ["", "grc", "sdu-sigmoid", "sdu-tanh", "grc+sdu-tanh", "highway", "gated-mhdpa", "eau", "grc+eau"]
"""What a whole sublayer's function may carry besides its body: a GRC, an SDU (σ or tanh), both, a highway gate,
a gated MHDPA, an EAU, or an EAU and a GRC."""


def _random_branches(branches: str, width: int) -> tuple[GatedResidual | None, nn.Module | None, EAU | None]:
    gate = GatedResidual(width) if "grc" in branches else None
    unit = SDU(width, branches.split("sdu-")[1]) if "sdu" in branches else None
    if branches in ("highway", "gated-mhdpa"):
        unit = HighwayGate(width) if branches == "highway" else GatedMHDPA(width)
    eau = EAU(width) if "eau" in branches else None
    with torch.no_grad():  # their biases start at zero
        for module in (gate, unit, eau):
            if module is not None:
                for parameter in module.parameters():
                    if parameter.dim() == 1:
                        parameter.uniform_(-1.0, 1.0)
    return gate, unit, eau


def _sublayer_in_pieces(x: Tensor, body: Tensor, p: float, norm: nn.LayerNorm, gate: GatedResidual | None,
                        unit: nn.Module | None, eau: EAU | None) -> Tensor:
    if eau is not None:
        body = eau(body)
    if isinstance(unit, HighwayGate):  # the residual stream carries the gate's mix
        return norm(dropout_add(unit(x), body, p))
    if isinstance(unit, GatedMHDPA):  # the body's output is mixed with f(x)
        return norm(dropout_add(x, unit(x, body), p))
    if unit is not None:
        body = unit(x, add_to=body)
    return norm(gate(x, dropout(body, p)) if gate is not None else dropout_add(x, body, p))


def _parameters(*modules: nn.Module | None) -> list[Tensor]:
    return [parameter for module in modules if module is not None for parameter in module.parameters()]


def _affine_norm(width: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(width)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm


@pytest.mark.parametrize("branches", _BRANCHES)
@settings(max_examples=4, deadline=None)
@given(rows=st.integers(8, 60), d_model=st.integers(8, 40), d_ffn=st.integers(1, 90),
       p=st.sampled_from([(0.1, 0.1), (0.3, 0.2)]), seed=st.integers(0, 2 ** 16))
def test_feed_forward_sublayer_in_one_function_is_the_unfused_computation(rows: int, d_model: int, d_ffn: int,
                                                                          p: tuple[float, float], branches: str,
                                                                          seed: int) -> None:
    """norm(x + dropout(FFN(x))), with a GRC norm(x + σ(Wg x + bg) ⊙ dropout(FFN(x))), with an SDU
    norm(x + dropout(FFN(x) + SDU(x))), with a highway gate norm(highway(x) + dropout(FFN(x))), with a gated MHDPA
    norm(x + dropout(mix(x, FFN(x)))), as one autograd function: the values, every gradient and both masks
    (drawn in the unfused order) of the sublayer computed piece by piece. (Rows of at least 8, as for the tail
    above.)"""
    _kernel_or_skip()
    inner_p, outer_p = p
    torch.manual_seed(seed)
    ffn, norm = fuse(FeedForward(d_model, d_ffn, inner_p)), _affine_norm(d_model)
    gate, unit, eau = _random_branches(branches, d_model)
    x = torch.randn(rows, 2, d_model, requires_grad=True)
    grad = torch.randn(rows, 2, d_model)
    torch.manual_seed(seed + 1)
    fused = ffn.add_norm(x, outer_p, norm, gate, unit, eau)
    assert fused is not None
    torch.manual_seed(seed + 1)
    plain = _sublayer_in_pieces(x, ffn.outer(relu_dropout(ffn.inner(x), inner_p)), outer_p, norm, gate, unit, eau)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)
    params = (x, *ffn.parameters(), *norm.parameters(), *_parameters(gate, unit, eau))
    for a, b in zip(_grads(fused, grad, *params), _grads(plain, grad, *params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("branches", _BRANCHES)
@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(8, 40), heads=st.sampled_from([1, 2]),
       head=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2 ** 16))
def test_attention_sublayer_in_one_function_is_the_unfused_computation(batch: int, length: int, heads: int,
                                                                       head: int, branches: str, seed: int) -> None:
    """norm(x + dropout(Att(x))) (with a GRC, an SDU, both, a highway gate or a gated MHDPA) as one autograd function
    around the attention kernel: the values and every gradient of the sublayer computed piece by piece. Heads of 8
    run on the AVX2 build where the loaded one is AVX-512's."""
    _kernel_or_skip()
    if head not in _attention_kernel.supported_head_sizes():
        pytest.skip(f"the attention kernel here does not take heads of {head}")
    d_model = heads * head
    torch.manual_seed(seed)
    attention, norm = fuse(CausalSelfAttention(d_model, heads)), _affine_norm(d_model)
    gate, unit, eau = _random_branches(branches, d_model)
    x = torch.randn(batch, length, d_model, requires_grad=True)
    grad = torch.randn(batch, length, d_model)
    torch.manual_seed(seed + 1)
    fused = attention.add_norm(x, 0.2, norm, gate, unit, eau)
    assert fused is not None
    torch.manual_seed(seed + 1)
    plain = _sublayer_in_pieces(x, attention(x), 0.2, norm, gate, unit, eau)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)
    params = (x, *attention.parameters(), *norm.parameters(), *_parameters(gate, unit, eau))
    for a, b in zip(_grads(fused, grad, *params), _grads(plain, grad, *params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["eval", "hooked", "attention dropout", "frozen"])
def test_a_sublayer_in_one_function_only_where_it_applies(case: str) -> None:
    """Not training, a hooked layer or attention-weight dropout: ``add_norm`` declines (the sublayer then runs
    its pieces). With frozen weights it applies and gives only the gradients asked for."""
    _kernel_or_skip()
    attention = fuse(CausalSelfAttention(32, 2, dropout=0.1 if case == "attention dropout" else 0.0))
    ffn, norm = fuse(FeedForward(32, 48, 0.1)), nn.LayerNorm(32)
    x = torch.randn(2, 9, 32, requires_grad=True)
    if case == "eval":
        attention.eval(), ffn.eval()
    if case == "hooked":
        attention.out.register_forward_hook(lambda module, args, out: None)
        ffn.inner.register_forward_hook(lambda module, args, out: None)
    if case == "frozen":
        for parameter in (*attention.parameters(), *ffn.parameters()):
            parameter.requires_grad_(False)
        out = ffn.add_norm(attention.add_norm(x, 0.1, norm), 0.1, norm)
        out.sum().backward()
        assert x.grad is not None and all(p.grad is None for p in (*attention.parameters(), *ffn.parameters()))
        return
    assert ffn.add_norm(x, 0.1, norm) is None or case == "attention dropout"
    assert attention.add_norm(x, 0.1, norm) is None


def test_a_hooked_gated_residual_connection_is_called_as_written() -> None:
    """Gate statistics record a GRC through its forward hooks: a hooked GRC keeps the sublayer in pieces."""
    _kernel_or_skip()
    model = fuse(TransformerLM(vocab_size=11, d_model=32, n_layers=1, n_heads=2, d_ffn=48, gates="+GRC"))
    seen: list[Tensor] = []
    for module in model.modules():
        if isinstance(module, GatedResidual):
            module.register_forward_hook(lambda module, args, out: seen.append(out))
    model(torch.randint(0, 11, (2, 9)))
    assert len(seen) == 2


def test_only_post_norm_sublayers_without_an_eau_run_as_one_function() -> None:
    def whole(gates: str, layers: int) -> dict[str, bool]:
        model = fuse(TransformerLM(vocab_size=11, d_model=16, n_layers=layers, n_heads=2, d_ffn=32, gates=gates))
        return {name: sub.fuse_sublayer for name, sub in model.named_modules() if hasattr(sub, "fuse_sublayer")}

    assert whole("+highway L1 + σ L2/ffn + GRC L3", 3) == {
        "layers.0.attn": True, "layers.0.ffn": True, "layers.1.attn": True, "layers.1.ffn": True,
        "layers.2.attn": True, "layers.2.ffn": True}
    # a GRC with either mix: declined (placements refuse it)
    ffn, x = fuse(FeedForward(16, 32, 0.1)), torch.randn(2, 8, 16)
    assert ffn.add_norm(x, 0.1, nn.LayerNorm(16), GatedResidual(16), HighwayGate(16)) is None
    assert ffn.add_norm(x, 0.1, nn.LayerNorm(16), GatedResidual(16), GatedMHDPA(16)) is None
    assert whole("+gated MHDPA L1 + tanh L2", 2) == {
        "layers.0.attn": True, "layers.0.ffn": True, "layers.1.attn": True, "layers.1.ffn": True}
    assert whole("+EAU+GRC", 1) == {"layers.0.attn": True, "layers.0.ffn": True}
    assert whole("+EAU + σ L1/attn", 1) == {"layers.0.attn": False, "layers.0.ffn": True}  # an EAU with a unit: pieces
    pre_norm = fuse(TransformerLM(vocab_size=11, d_model=16, n_layers=1, n_heads=2, d_ffn=32, norm="pre"))
    assert not any(getattr(module, "fuse_sublayer", False) for module in pre_norm.modules())


@pytest.mark.parametrize("case", ["eval", "float64", "hooked", "no bias", "p=1"])
def test_everything_else_is_computed_unfused(case: str) -> None:
    linear = nn.Linear(4, 6, bias=case != "no bias")
    x = torch.randn(3, 4)
    p, training = (1.0 if case == "p=1" else 0.2), case != "eval"
    if case == "float64":
        linear, x = linear.double(), x.double()
    seen: list[Tensor] = []
    if case == "hooked":
        linear.register_forward_hook(lambda module, args, out: seen.append(out))
    assert not fusion_applies(x, linear, p, training)
    torch.manual_seed(0)
    out = linear_relu_dropout(x, linear, p, training)
    torch.manual_seed(0)
    assert torch.equal(out, relu_dropout(linear(x), p, training))
    if case == "hooked":
        assert len(seen) == 2  # the hook saw the layer's call inside linear_relu_dropout too


def test_without_dropout_a_linear_layer_still_fuses_and_draws_no_seed() -> None:
    _kernel_or_skip()
    linear, x = nn.Linear(4, 6), torch.randn(3, 4)
    assert fusion_applies(x, linear, 0.0, True)
    torch.manual_seed(0)
    out = linear_relu_dropout(x, linear, 0.0)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))  # no seed drawn, as dropout(p=0) draws none
    torch.testing.assert_close(out, linear(x).relu(), rtol=1e-6, atol=1e-6)
    assert type(out.grad_fn).__name__ != "ReluBackward0"


def test_sublayers_fuse_only_where_no_gate_stands_between() -> None:
    model = fuse(TransformerLM(vocab_size=11, d_model=16, n_layers=3, n_heads=2, d_ffn=32,
                          gates="+EAU L1 + highway L2 + σ L3/ffn"))
    fused = {name: module.fuse_linear for name, module in model.named_modules() if hasattr(module, "fuse_linear")}
    assert fused == {"layers.0.attn": False, "layers.0.ffn": True, "layers.1.attn": True, "layers.1.ffn": True,
                     "layers.2.attn": True, "layers.2.ffn": False}


@pytest.mark.parametrize(("backbone", "gates", "norm", "dropout"), [
    *[("transformer", gates, "post", 0.2) for gates in ["", "+σ SDU", "+highway gate", "+gated MHDPA", "+EAU",
                                                         "+GRC", "+EAU+GRC"]],
    *[("transformer", gates, "pre", 0.2) for gates in ["", "+highway gate", "+EAU+GRC"]],
    ("rtransformer", "+σ SDU", "post", 0.2), ("transformer-xl", "+EAU+GRC", "post", 0.2),
    ("sru-transformer", "", "post", 0.2),
    *[("transformer", gates, norm, 0.0) for gates in ["", "+GRC", "+σ SDU"] for norm in ["post", "pre"]],
])
def test_language_model_trains_the_same_fused_or_not(backbone: str, gates: str, norm: str, dropout: float,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sublayer form (post- and pre-LN, each gate, each backbone built on Sublayer; with dropout and
    without): the fused passes give the loss and every gradient of the model computed as written."""
    _kernel_or_skip()
    torch.manual_seed(0)
    cfg = ModelConfig(backbone=backbone, d_model=32, n_layers=2, n_heads=2, d_ffn=64, dropout=dropout, gates=gates,
                      norm=norm, rnn_window=3, mem_len=8)
    model = build_model(cfg, 30)
    tokens = torch.randint(0, 30, (3, 17))

    def loss_and_grads() -> tuple[Tensor, list[Tensor]]:
        model.zero_grad()
        torch.manual_seed(5)
        logits = model(tokens).logits
        loss = logits.square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    fused_loss, fused_grads = loss_and_grads()
    monkeypatch.setattr(fused_linear, "fusion_applies", lambda *args: False)
    monkeypatch.setattr(fused_linear, "_plain_layer_norm", lambda *args: False)
    monkeypatch.setattr(fused_gates, "tail_applies", lambda *args: False)
    plain_loss, plain_grads = loss_and_grads()
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 3])
def test_relu_gradient_from_bits_with_column_sums(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The epilogue's sign bits give the gradient of scale_where_positive, and the column sums do not depend
    on the threads; the NumPy fallback packs and reads the same bits."""
    _kernel_or_skip()
    keep_below, seed, scale = round(0.7 * 2 ** 32), 99, 2 ** 32 / round(0.7 * 2 ** 32)
    h, bias, grad = torch.randn(200, 37), torch.randn(37), torch.randn(200, 37)
    before = torch.get_num_threads()
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)
    torch.set_num_threads(threads)
    try:
        out, positive = _epilogue_kernel.bias_relu_dropout_(h.clone(), bias, seed, keep_below, scale)
        grad_pre, sums = _epilogue_kernel.scale_where_positive_with_sums(positive, grad, scale)
    finally:
        torch.set_num_threads(before)
    assert positive.dtype == torch.int32 and positive.numel() == -(-h.numel() // 32)
    assert torch.equal(grad_pre, _dropout_kernel.scale_where_positive(out, grad, scale))
    torch.testing.assert_close(sums, grad_pre.sum(0), rtol=1e-5, atol=1e-5)
    assert torch.equal(_epilogue_kernel.scale_where_positive_with_sums(positive, grad, scale)[1], sums)
    overwritten = grad.clone()
    in_place, in_place_sums = _epilogue_kernel.scale_where_positive_with_sums(positive, overwritten, scale,
                                                                              in_place=True)
    assert in_place.data_ptr() == overwritten.data_ptr()
    assert torch.equal(in_place, grad_pre) and torch.equal(in_place_sums, sums)
    assert torch.equal(_epilogue_kernel._pack_bits(out.reshape(-1) > 0), positive)
    monkeypatch.setenv("GATEDFORMER_DROPOUT_BACKEND", "torch")
    fallback_pre, fallback_sums = _epilogue_kernel.scale_where_positive_with_sums(positive, grad, scale)
    assert torch.equal(fallback_pre, grad_pre)
    torch.testing.assert_close(fallback_sums, sums, rtol=1e-5, atol=1e-5)


def _packed_gemm_or_skip() -> None:
    _kernel_or_skip()
    if _blas.packed_gemm() is None:
        pytest.skip("PyTorch does not expose MKL's packed products here")


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 5), length=st.integers(1, 70), d_model=st.sampled_from([8, 24, 128]),
       d_ffn=st.sampled_from([7, 64, 96, 512]), seed=st.integers(0, 2 ** 16))
@example(batch=5, length=70, d_model=24, d_ffn=512, seed=0)  # enough rows for two threads: the weights in the stream
def test_streamed_feed_forward_is_the_sublayer_operation_by_operation(batch: int, length: int, d_model: int,
                                                                      d_ffn: int, seed: int, threads: int) -> None:
    """A plain FFN sublayer streamed by row blocks through MKL's packed products (one parallel region) gives the
    values, every gradient and the masks of the same function computed one operation after another. Widths where
    a 64-row block is not a whole number of mask draws take 128-row blocks; the last block may be partial."""
    _packed_gemm_or_skip()
    torch.manual_seed(seed)
    ffn, norm = fuse(FeedForward(d_model, d_ffn, 0.2)), _affine_norm(d_model)
    x = torch.randn(batch, length, d_model, requires_grad=True)
    grad = torch.randn(batch, length, d_model)
    params = (x, *ffn.parameters(), *norm.parameters())
    results = {}
    for streamed in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "get_num_threads", lambda: threads)  # the kernels' share, not PyTorch's own pool
            patch.setenv("GATEDFORMER_PACKED_GEMM", streamed)
            torch.manual_seed(seed + 1)
            out = ffn.add_norm(x, 0.1, norm)
            results[streamed] = [out, *_grads(out, grad, *params)]
    for a, b in zip(results["1"], results["0"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 9), length=st.integers(1, 70),
       heads_and_width=st.sampled_from([(1, 16), (2, 64), (4, 128)]), seed=st.integers(0, 2 ** 16))
@example(batch=9, length=64, heads_and_width=(2, 64), seed=0)  # two threads' shares: the weights in the stream
def test_streamed_attention_sublayer_is_the_sublayer_operation_by_operation(batch: int, length: int,
                                                                            heads_and_width: tuple[int, int],
                                                                            seed: int, threads: int) -> None:
    """A plain attention sublayer streamed by blocks of whole sequences (the attention kernel called on each block
    by its thread) gives the values and every gradient of the same function computed operation by operation;
    lengths that are not a multiple of 64 rows take several sequences per block."""
    _packed_gemm_or_skip()
    heads, width = heads_and_width
    if not _attention_kernel.kernel_takes(3 * width, heads, 0.0, torch.device("cpu"), torch.float32):
        pytest.skip("the attention kernel is unavailable here")
    torch.manual_seed(seed)
    attention, norm = fuse(CausalSelfAttention(width, heads)), _affine_norm(width)
    with torch.no_grad():
        attention.qkv.bias.uniform_(-0.5, 0.5)
    x = torch.randn(batch, length, width, requires_grad=True)
    grad = torch.randn(batch, length, width)
    params = (x, *attention.parameters(), *norm.parameters())
    results = {}
    for streamed in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "get_num_threads", lambda: threads)
            patch.setenv("GATEDFORMER_PACKED_GEMM", streamed)
            torch.manual_seed(seed + 1)
            out = attention.add_norm(x, 0.1, norm)
            assert out is not None
            results[streamed] = [out, *_grads(out, grad, *params)]
    for a, b in zip(results["1"], results["0"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("branches", [b for b in _BRANCHES if b])
@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=3, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 70), width_ffn=st.sampled_from([(16, 64), (32, 96), (128, 512)]),
       seed=st.integers(0, 2 ** 16))
@example(batch=4, length=64, width_ffn=(128, 512), seed=0)  # two threads' shares: the weights in the stream
def test_streamed_bodies_of_gated_sublayers_are_the_operations_one_by_one(batch: int, length: int,
                                                                          width_ffn: tuple[int, int], seed: int,
                                                                          threads: int, branches: str) -> None:
    """With a GRC, an SDU, a highway gate, a gated MHDPA or an EAU the FFN's and the attention's bodies are streamed
    up to their last product and the gates follow: values and every gradient (x's with the gates' shares added to
    the body's in the stream) as computed operation by operation."""
    _packed_gemm_or_skip()
    width, hidden_width = width_ffn
    heads = width // 16
    if not _attention_kernel.kernel_takes(3 * width, heads, 0.0, torch.device("cpu"), torch.float32):
        pytest.skip("the attention kernel is unavailable here")
    torch.manual_seed(seed)
    ffn, attention = fuse(FeedForward(width, hidden_width, 0.2)), fuse(CausalSelfAttention(width, heads))
    norm = _affine_norm(width)
    gate, unit, eau = _random_branches(branches, width)
    x = torch.randn(batch, length, width, requires_grad=True)
    grad = torch.randn(batch, length, width)
    params = (x, *ffn.parameters(), *attention.parameters(), *norm.parameters(), *_parameters(gate, unit, eau))
    results = {}
    for streamed in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "get_num_threads", lambda: threads)
            patch.setenv("GATEDFORMER_PACKED_GEMM", streamed)
            torch.manual_seed(seed + 1)
            middle = attention.add_norm(x, 0.1, norm, gate, unit, eau)
            assert middle is not None
            out = ffn.add_norm(middle, 0.1, norm, gate, unit, eau)
            assert out is not None
            results[streamed] = [out, *_grads(out, grad, *params)]
    for a, b in zip(results["1"], results["0"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_language_model_streams_its_plain_sublayers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MKL's packed products are available, the Transformer's plain FFN and attention sublayers take the
    streamed kernels (once per layer and step each), and gated ones stream their bodies; with
    GATEDFORMER_PACKED_GEMM=0 neither."""
    _packed_gemm_or_skip()
    calls = []
    for name, kind in (("feed_forward_streamed", "whole"), ("attention_sublayer_streamed", "whole"),
                       ("feed_forward_body_streamed", "body"), ("attention_body_streamed", "body")):
        real = getattr(fused_linear, name)
        monkeypatch.setattr(fused_linear, name, lambda *a, real=real, kind=kind: calls.append(kind) or real(*a))

    def one_step(gates: str) -> tuple[int, int]:
        calls.clear()
        model = fuse(TransformerLM(vocab_size=11, d_model=32, n_layers=2, n_heads=2, d_ffn=32, gates=gates))
        logits = model(torch.randint(0, 11, (2, 9))).logits
        logits.sum().backward()
        return calls.count("whole"), calls.count("body")

    assert one_step("") == (4, 0)
    assert one_step("+σ SDU") == (0, 4)
    assert one_step("+GRC") == (0, 4)
    monkeypatch.setenv("GATEDFORMER_PACKED_GEMM", "0")
    assert one_step("") == (0, 0)
    assert one_step("+σ SDU") == (0, 0)


def test_a_streamed_kernel_without_scratch_memory_says_how_to_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed kernels allocate MKL's packed weights themselves; where that fails the sublayer raises one
    MemoryError that names the switch back to the unstreamed path, and that path still computes it."""
    _packed_gemm_or_skip()
    library = _epilogue_kernel.KERNEL.library()
    ffn, norm = fuse(FeedForward(16, 32, 0.1)), nn.LayerNorm(16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with monkeypatch.context() as patch:
        patch.setattr(library, "ffn_forward_f32", lambda *args: 1)
        with pytest.raises(MemoryError, match="GATEDFORMER_PACKED_GEMM=0"):
            ffn.add_norm(x, 0.1, norm)
    monkeypatch.setenv("GATEDFORMER_PACKED_GEMM", "0")
    monkeypatch.setattr(library, "ffn_forward_f32", lambda *args: 1)
    assert ffn.add_norm(x, 0.1, norm) is not None


@pytest.mark.parametrize("outputs", [512, 96, 50])
def test_wide_weight_gradient_is_grad_transposed_times_x_in_the_weights_layout(outputs: int) -> None:
    generator = torch.Generator().manual_seed(outputs)
    grad, x = torch.randn(300, outputs, generator=generator), torch.randn(300, 24, generator=generator)
    result = _wide_weight_grad(grad, x)
    assert result.shape == (outputs, 24) and result.is_contiguous()
    torch.testing.assert_close(result, grad.t().mm(x), rtol=1e-5, atol=1e-4)


def test_without_dropout_the_sublayers_stay_fused_and_draw_no_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """p = 0 is the kernels' keep-everything mask (keep_below 2**32, 0 in their 32-bit argument): the fused and
    streamed functions still run, the output is the one computed as written, and torch's generator moves on
    exactly as it does unfused (not at all)."""
    _kernel_or_skip()
    calls = []
    for name in ("_FeedForwardAddNorm", "_AttentionAddNorm"):
        real = getattr(fused_linear, name).apply
        monkeypatch.setattr(getattr(fused_linear, name), "apply",
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    torch.manual_seed(0)
    model = fuse(TransformerLM(vocab_size=11, d_model=32, n_layers=2, n_heads=2, d_ffn=64, dropout=0.0))
    tokens = torch.randint(0, 11, (2, 9))
    torch.manual_seed(3)
    fused = model(tokens).logits
    after_fused = torch.rand(4)
    assert calls.count("_FeedForwardAddNorm") == calls.count("_AttentionAddNorm") == 2
    fused.sum().backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(fused_linear, "fusion_applies", lambda *args: False)
    torch.manual_seed(3)
    plain = model(tokens).logits
    after_plain = torch.rand(4)
    plain.sum().backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    assert torch.equal(after_fused, after_plain)
    for a, b in zip(fused_grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_a_keep_below_of_two_to_the_32_keeps_every_element(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The epilogue kernels read keep_below 2**32 (0 in their 32-bit argument) as "keep everything", in every
    build."""
    _kernel_or_skip()
    kernel_build(_epilogue_kernel.KERNEL, isa)
    h, bias, base = torch.randn(64, 40), torch.randn(40), torch.randn(64, 40)
    gamma, beta = torch.randn(40), torch.randn(40)
    relu, _ = _epilogue_kernel.bias_relu_dropout_(h.clone(), bias, 7, 2 ** 32, 1.0)
    assert torch.equal(relu, (h + bias).relu())
    added = _epilogue_kernel.bias_dropout_add_(h.clone(), base, bias, 7, 2 ** 32, 1.0)
    assert torch.equal(added, base + (h + bias))
    y, _, _, bits = _epilogue_kernel.dropout_add_norm(h.clone(), base, bias, gamma, beta, 1e-5, 7, 2 ** 32, 1.0)
    reference = torch.nn.functional.layer_norm(base + (h + bias), (40,), gamma, beta, 1e-5)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(bits[:, 0], torch.full((64,), -1, dtype=torch.int32))  # columns 0-31 kept
    assert torch.equal(bits[:, 1], torch.full((64,), 0xFF, dtype=torch.int32))  # and 32-39


def test_registered_reads_what_getattr_reads_for_submodules_and_parameters() -> None:
    block = fuse(FeedForward(8, 16, 0.1))
    block.inner.bias = None
    assert registered(block, "inner") is block.inner
    assert registered(block.inner, "weight") is block.inner.weight
    assert registered(block.inner, "bias") is None  # registered as absent
    assert registered(block.outer, "bias") is block.outer.bias
    assert registered(block, "no_such_part") is None
    assert registered(block, "training") is None  # a plain attribute is not a registered part
