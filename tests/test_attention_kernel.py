"""The compiled causal attention kernel: the same values and gradients as scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gatedformer.kernels import attention as _attention_kernel
from gatedformer.kernels import build as _native
from gatedformer.kernels.attention import SUPPORTED_HEAD_SIZES, supported_head_sizes
from gatedformer.models.transformer import TransformerLM
from gatedformer.ops import attention as attention_ops
from gatedformer.ops.attention import causal_attention_packed, causal_attention_reference, kernel_applies


def _native_or_skip() -> None:
    if _attention_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled attention kernel is unavailable here: {_attention_kernel.KERNEL.error}")


def _values_and_grads(fn, qkv: Tensor, heads: int, grad: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    leaf = qkv.detach().requires_grad_()
    out = fn(leaf, heads)
    (g,) = torch.autograd.grad(out, leaf, grad)
    return out.detach(), g


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 70), heads=st.integers(1, 3),
       head=st.sampled_from(SUPPORTED_HEAD_SIZES), seed=st.integers(0, 2 ** 16))
def test_matches_scaled_dot_product_attention(batch: int, length: int, heads: int, head: int, seed: int) -> None:
    _native_or_skip()
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3 * heads * head, generator=generator) * 1.5
    grad = torch.randn(batch, length, heads * head, generator=generator)
    assert kernel_applies(qkv, heads, 0.0) == (head in supported_head_sizes())
    if head not in supported_head_sizes():
        torch.testing.assert_close(causal_attention_packed(qkv, heads), causal_attention_reference(qkv, heads))
        return
    out, g = _values_and_grads(attention_ops._PackedCausalAttention.apply, qkv, heads, grad)
    ref_out, ref_g = _values_and_grads(causal_attention_reference, qkv, heads, grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_matches_scaled_dot_product_attention(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The scalar, AVX2 and AVX-512 code paths (this CPU runs only one of them by default)."""
    _native_or_skip()
    lib = kernel_build(_attention_kernel.KERNEL, isa)
    assert 16 in supported_head_sizes(lib) and 32 in supported_head_sizes(lib)
    generator = torch.Generator().manual_seed(3)
    for length, heads, head in [(1, 1, 16), (37, 2, 32), (70, 1, 64), (130, 2, 16), (19, 1, 128), (45, 3, 8)]:
        if head not in supported_head_sizes(lib):
            continue
        qkv = torch.randn(2, length, 3 * heads * head, generator=generator) * 1.5
        grad = torch.randn(2, length, heads * head, generator=generator)
        out, g = _values_and_grads(attention_ops._PackedCausalAttention.apply, qkv, heads, grad)
        ref_out, ref_g = _values_and_grads(causal_attention_reference, qkv, heads, grad)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_a_bias_added_by_the_kernel_matches_one_added_before(isa: str, kernel_build) -> None:  # noqa: ANN001
    """``packed_forward(qkv, bias=b)`` is attention of ``qkv + b``, and the bias's gradient is the sum over rows."""
    _native_or_skip()
    lib = kernel_build(_attention_kernel.KERNEL, isa)
    generator = torch.Generator().manual_seed(5)
    for batch, length, heads, head in [(2, 37, 2, 32), (3, 130, 1, 16), (1, 19, 2, 64), (2, 5, 3, 8)]:
        if head not in supported_head_sizes(lib):
            continue
        qkv = torch.randn(batch, length, 3 * heads * head, generator=generator)
        # Strided: the kernel reads a contiguous copy, which must outlive the call.
        bias = torch.randn(3 * heads * head, 2, generator=generator)[:, 0]
        grad = torch.randn(batch, length, heads * head, generator=generator)
        out, lse = _attention_kernel.packed_forward(qkv, heads, bias=bias)
        ref_out, ref_lse = _attention_kernel.packed_forward(qkv + bias, heads)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        g, g_bias = _attention_kernel.packed_backward(qkv, out, grad, lse, heads, bias=bias, bias_grad=True)
        ref_g, none = _attention_kernel.packed_backward(qkv + bias, ref_out, grad, ref_lse, heads)
        assert none is None
        torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g_bias, ref_g.sum((0, 1)), rtol=1e-4, atol=1e-4)


def test_position_t_sees_only_positions_up_to_t() -> None:
    _native_or_skip()
    qkv = torch.randn(2, 20, 3 * 2 * 16, requires_grad=True)
    out = causal_attention_packed(qkv, 2)
    (g,) = torch.autograd.grad(out[:, 9].sum(), qkv)
    assert g[:, 10:].abs().max() == 0
    assert g[:, :10].abs().max() > 0


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_result(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    qkv = torch.randn(3, 33, 3 * 2 * 32)
    grad = torch.randn(3, 33, 2 * 32)
    one = _values_and_grads(attention_ops._PackedCausalAttention.apply, qkv, 2, grad)
    before = torch.get_num_threads()
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)
    torch.set_num_threads(threads)
    try:
        many = _values_and_grads(attention_ops._PackedCausalAttention.apply, qkv, 2, grad)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])  # each head runs whole on one thread


def test_evaluation_keeps_nothing_for_a_backward_pass() -> None:
    _native_or_skip()
    qkv = torch.randn(2, 16, 3 * 32)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.no_grad():
            causal_attention_packed(qkv, 1)
        causal_attention_packed(qkv.requires_grad_(), 1)
    assert len(saved) == 3  # qkv, the output and the log-sum-exp of every row; no L x L matrix


@pytest.mark.parametrize(("change", "reason"), [
    ({"dtype": torch.float64}, "float64"),
    ({"dropout": 0.1}, "attention dropout"),
    ({"head": 12}, "head size"),
])
def test_everything_else_takes_scaled_dot_product_attention(change: dict, reason: str) -> None:
    dtype, dropout, head = change.get("dtype", torch.float32), change.get("dropout", 0.0), change.get("head", 16)
    qkv = torch.randn(2, 9, 3 * 2 * head, dtype=dtype)
    assert not kernel_applies(qkv, 2, dropout), reason
    if dropout == 0.0:
        torch.testing.assert_close(causal_attention_packed(qkv, 2), causal_attention_reference(qkv, 2))


def test_the_environment_can_turn_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_ATTENTION_BACKEND", "torch")
    assert not kernel_applies(torch.randn(1, 4, 3 * 16), 1, 0.0)


def test_language_model_is_the_same_with_either_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=30, d_model=64, n_layers=2, n_heads=2, d_ffn=128, dropout=0.0).eval()
    tokens = torch.randint(0, 30, (3, 25))

    def logits_and_grads() -> tuple[Tensor, list[Tensor]]:
        model.zero_grad()
        logits = model(tokens).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    native_logits, native_grads = logits_and_grads()
    monkeypatch.setenv("GATEDFORMER_ATTENTION_BACKEND", "torch")
    torch_logits, torch_grads = logits_and_grads()
    torch.testing.assert_close(native_logits, torch_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(native_grads, torch_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_peaked_softmax_matches_and_denormals_stay_on_outside_the_kernel() -> None:
    _native_or_skip()
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 40, 3 * 2 * 16, generator=generator) * 12  # scores in the hundreds: P underflows
    grad = torch.randn(2, 40, 2 * 16, generator=generator)
    out, g = _values_and_grads(attention_ops._PackedCausalAttention.apply, qkv, 2, grad)
    ref_out, ref_g = _values_and_grads(causal_attention_reference, qkv, 2, grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g, ref_g, rtol=1e-3, atol=1e-3)
    tiny = torch.tensor(1e-39)  # a denormal float32: the kernel's flush-to-zero must not leak out of it
    assert (tiny * 1.5).item() > 0


def test_heads_narrower_than_the_vectors_run_on_the_narrower_build() -> None:
    """With AVX-512 (16 floats a vector), heads of 8 take the AVX2 build (8 floats) instead of PyTorch's attention,
    in the packed function and in the streamed sublayers that call the kernel by address."""
    _native_or_skip()
    if _attention_kernel.KERNEL.isa != "avx512":
        pytest.skip("the loaded build is not the AVX-512 one")
    assert 8 not in supported_head_sizes(_attention_kernel.KERNEL.library())
    assert 8 in supported_head_sizes()
    assert _attention_kernel.kernel_addresses(8) != _attention_kernel.kernel_addresses(16)
    generator = torch.Generator().manual_seed(8)
    qkv = torch.randn(3, 41, 3 * 4 * 8, generator=generator) * 1.5
    grad = torch.randn(3, 41, 4 * 8, generator=generator)
    assert kernel_applies(qkv, 4, 0.0)
    out, g = _values_and_grads(attention_ops._PackedCausalAttention.apply, qkv, 4, grad)
    ref_out, ref_g = _values_and_grads(causal_attention_reference, qkv, 4, grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=5e-5)
