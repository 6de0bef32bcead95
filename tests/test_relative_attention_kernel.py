"""The compiled relative-position attention kernel: the same values and gradients as Transformer-XL's equation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gatedformer.fused import fuse
from gatedformer.kernels import build as _native
from gatedformer.kernels import relative_attention as _relative_attention_kernel
from gatedformer.kernels.relative_attention import backward_kernel, forward_kernel, kernel_takes
from gatedformer.models.transformer_xl import RelativeMultiHeadAttention, TransformerXLLM, relative_positions
from gatedformer.ops import relative_attention as relative_attention_ops
from gatedformer.ops.relative_attention import relative_attention


def _native_or_skip() -> None:
    if _relative_attention_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled kernel is unavailable here: {_relative_attention_kernel.KERNEL.error}")


def _by_the_equation(q: Tensor, kv: Tensor, r: Tensor, u: Tensor, v: Tensor, heads: int) -> Tensor:
    """The attention written pair by pair from the paper's terms: the distance ``M + i - j`` of every (query, key)
    pair looked up in ``r`` by index, no shift trick, float64."""
    batch, length, width = q.shape
    keys = kv.shape[1]
    head = width // heads
    q, kv, r, u, v = (t.double() for t in (q, kv, r, u, v))
    qh = q.view(batch, length, heads, head).transpose(1, 2)
    k, val = (t.transpose(1, 2) for t in kv.view(batch, keys, 2, heads, head).unbind(2))
    rh = r.view(keys, heads, head).transpose(0, 1)  # row c: distance keys - 1 - c
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(keys).unsqueeze(0)
    memory = keys - length
    distance = memory + i - j
    row = (keys - 1 - distance).clamp(0, keys - 1)
    content = (qh + u.unsqueeze(1)) @ k.transpose(-1, -2)
    position = torch.einsum("bhid,hijd->bhij", qh + v.unsqueeze(1), rh[:, row])
    scores = (content + position) / math.sqrt(head)
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return (scores.softmax(-1) @ val).transpose(1, 2).reshape(batch, length, width)


def _inputs(batch: int, length: int, memory: int, heads: int, head: int, seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = heads * head
    return [torch.randn(*shape, generator=generator) for shape in
            [(batch, length, width), (batch, memory + length, 2 * width), (memory + length, width), (heads, head),
             (heads, head)]]


def _values_and_grads(fn, inputs: list[Tensor], heads: int, grad: Tensor) -> list[Tensor]:  # noqa: ANN001
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, heads)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    return [out.detach().float(), *(g.float() for g in grads)]


def _memory_apart(q: Tensor, kv: Tensor, r: Tensor, u: Tensor, v: Tensor, heads: int) -> Tensor:
    """The kernel given the memory's keys and values and the window's as two tensors (their own copies, with their
    own sequence strides), as the Transformer-XL layer gives them."""
    memory = kv.shape[1] - q.shape[1]
    return relative_attention(q, kv[:, memory:].contiguous(), r, u, v, heads, memory_kv=kv[:, :memory].contiguous())


def _assert_matches_equation(inputs: list[Tensor], heads: int, seed: int, apart: bool = False) -> None:
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    got = _values_and_grads(_memory_apart if apart else relative_attention, inputs, heads, grad)
    want = _values_and_grads(_by_the_equation, inputs, heads, grad)
    for name, a, b in zip(["out", "q", "kv", "r", "u", "v"], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 45), memory=st.integers(0, 40), heads=st.integers(1, 3),
       head=st.sampled_from([1, 5, 8, 12, 16, 24, 32, 40, 48, 64, 80, 128]), apart=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_matches_the_equation(batch: int, length: int, memory: int, heads: int, head: int, apart: bool,
                              seed: int) -> None:
    """Every head size up to 128 (padded inside), with and without memory, windows across the block sizes, the
    memory's keys and values in the same tensor as the window's or in one of their own."""
    _native_or_skip()
    _assert_matches_equation(_inputs(batch, length, memory, heads, head, seed), heads, seed, apart)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_matches_the_equation(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The scalar, AVX2 and AVX-512 code paths (this CPU runs only one of them by default)."""
    _native_or_skip()
    kernel_build(_relative_attention_kernel.KERNEL, isa)
    for batch, length, memory, heads, head in [(2, 1, 0, 1, 16), (2, 37, 20, 2, 12), (1, 64, 64, 2, 32),
                                               (2, 9, 70, 1, 48), (1, 19, 3, 1, 128), (2, 17, 17, 3, 7)]:
        for apart in (False, True):
            _assert_matches_equation(_inputs(batch, length, memory, heads, head, length), heads, length, apart)


def test_the_pytorch_path_matches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's two paths (kernel; matmul + rel_shift + softmax) agree, gradients of every parameter included."""
    _native_or_skip()

    def run() -> list[Tensor]:
        torch.manual_seed(0)
        layer = fuse(RelativeMultiHeadAttention(64, 4))
        torch.nn.init.normal_(layer.u)
        torch.nn.init.normal_(layer.v)
        h = torch.randn(3, 21, 64, requires_grad=True)
        memory = torch.randn(3, 30, 64, requires_grad=True)
        pos = relative_positions(60, 64)
        out = layer(h, memory, pos)
        grads = torch.autograd.grad(out, [h, memory, *layer.parameters()], torch.randn_like(out))
        return [out, *grads]

    native = run()
    monkeypatch.setenv("GATEDFORMER_ATTENTION_BACKEND", "torch")
    for a, b in zip(native, run(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_query_i_sees_only_memory_and_positions_up_to_i() -> None:
    _native_or_skip()
    batch, length, memory, heads, head = 2, 20, 7, 2, 16
    q, kv, r, u, v = (t.requires_grad_() for t in _inputs(batch, length, memory, heads, head, 0))
    out = relative_attention(q, kv, r, u, v, heads)
    g_q, g_kv, g_r = torch.autograd.grad(out[:, 9].sum(), [q, kv, r])
    assert g_kv[:, memory + 10 :].abs().max() == 0 and g_kv[:, : memory + 10].abs().min() >= 0
    assert g_kv[:, memory + 9].abs().max() > 0 and g_kv[:, 0].abs().max() > 0
    assert g_q[:, 10:].abs().max() == 0 and g_q[:, :9].abs().max() == 0
    # Query 9 is at distances 0 .. memory + 9 from its keys: rows keys - 1 - (memory + 9) .. keys - 1 of r.
    assert g_r[: length - 10].abs().max() == 0 and g_r[length - 10 :].abs().max() > 0


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_result(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    inputs = _inputs(3, 33, 12, 2, 32, 4)
    grad = torch.randn(inputs[0].shape)
    one = _values_and_grads(relative_attention, inputs, 2, grad)
    before = torch.get_num_threads()
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)
    torch.set_num_threads(threads)
    try:
        many = _values_and_grads(relative_attention, inputs, 2, grad)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, many, strict=True):  # each (sequence, head) runs whole on one thread
        assert torch.equal(a, b)


def test_evaluation_keeps_nothing_for_a_backward_pass() -> None:
    _native_or_skip()
    inputs = _inputs(2, 16, 16, 2, 16, 1)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.no_grad():  # parameters that require a gradient, as in a model's evaluation
            relative_attention(*(t.requires_grad_() for t in inputs), 2)
        assert not saved
        relative_attention(*inputs, 2)
    assert len(saved) == 7  # the five inputs, the output and the log-sum-exp of every row; no L x K matrix


@pytest.mark.parametrize(("dtype", "dropout", "width", "heads", "takes"), [
    (torch.float32, 0.0, 64, 4, True),
    (torch.float64, 0.0, 64, 4, False),
    (torch.float32, 0.1, 64, 4, False),
    (torch.float32, 0.0, 2 * 130, 2, False),
])
def test_what_the_kernel_takes(dtype: torch.dtype, dropout: float, width: int, heads: int, takes: bool) -> None:
    _native_or_skip()
    inputs = [t.to(dtype) for t in _inputs(1, 3, 2, heads, width // heads, 0)]
    assert kernel_takes(inputs, heads, dropout) == takes


def test_attention_dropout_in_training_takes_the_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention dropout (not in the kernel) runs the PyTorch operations while training, the kernel in evaluation."""
    _native_or_skip()
    calls: list[int] = []
    kernel = relative_attention_ops._RelativeAttention.apply
    monkeypatch.setattr(relative_attention_ops._RelativeAttention, "apply",
                        lambda *args: calls.append(1) or kernel(*args))
    layer = fuse(RelativeMultiHeadAttention(32, 2, dropout=0.5))
    h, pos = torch.randn(2, 5, 32), relative_positions(5, 32)
    layer.train()(h, None, pos)
    assert not calls
    layer.eval()(h, None, pos)
    assert calls


def test_inputs_it_does_not_take_are_refused_with_their_shapes() -> None:
    _native_or_skip()
    q, kv, r, u, v = _inputs(2, 5, 3, 2, 8, 0)
    with pytest.raises(ValueError, match=r"float32 CPU tensors.*\(2, 5, 16\) torch.bfloat16"):
        relative_attention(q.bfloat16(), kv, r, u, v, 2)
    with pytest.raises(ValueError, match=r"r \(M\+L, H·D\)"):
        relative_attention(q, kv, r[1:], u, v, 2)
    with pytest.raises(ValueError, match=r"memory_kv \(B, M, 2·H·D\).*\(2, 8, 32\).*\(2, 3, 16\)"):
        relative_attention(q, kv, r, u, v, 2, memory_kv=kv[:, :3, :16])  # kv then spans only the window


def test_the_layer_gives_the_kernel_the_memory_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a memory, the layer's kernel path joins no keys: the window's and the memory's projections go in as
    they are."""
    _native_or_skip()
    calls: list[tuple] = []
    kernel = relative_attention_ops._RelativeAttention.apply
    monkeypatch.setattr(relative_attention_ops._RelativeAttention, "apply",
                        lambda *args: calls.append(args) or kernel(*args))
    monkeypatch.setattr(torch, "cat", lambda *args, **kwargs: pytest.fail("keys joined with torch.cat"))
    layer = fuse(RelativeMultiHeadAttention(32, 2))
    layer(torch.randn(2, 5, 32), torch.randn(2, 4, 32), relative_positions(9, 32)).sum().backward()
    (q, kv, r, u, v, memory_kv, heads, recorded), = calls
    assert kv.shape == (2, 5, 64) and memory_kv.shape == (2, 4, 64) and recorded


def test_bf16_autocast_takes_the_pytorch_path() -> None:
    """Under autocast the projections come out in bfloat16, which the kernel does not take."""
    layer = fuse(RelativeMultiHeadAttention(32, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 5, 32), torch.randn(2, 4, 32), relative_positions(9, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_the_environment_can_turn_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_ATTENTION_BACKEND", "torch")
    assert not kernel_takes(_inputs(1, 3, 2, 4, 16, 0), 4, 0.0)


def test_language_model_is_the_same_with_either_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two windows through Transformer-XL (the second with the first's memory): the same losses and gradients."""
    _native_or_skip()
    tokens = torch.randint(0, 50, (3, 2, 16), generator=torch.Generator().manual_seed(0))

    def run() -> list[Tensor]:
        torch.manual_seed(0)
        model = fuse(TransformerXLLM(50, d_model=48, n_layers=2, n_heads=4, d_ffn=96, dropout=0.0, mem_len=16,
                                     gates="+tanh L1-2"))
        state, losses = None, []
        for window in tokens.unbind(1):
            out = model(window[:, :-1], state, targets=window[:, 1:])
            state = out.state
            losses.append(out.loss)
        grads = torch.autograd.grad(sum(losses), list(model.parameters()))
        return [torch.stack(losses), *grads]

    native = run()
    monkeypatch.setenv("GATEDFORMER_ATTENTION_BACKEND", "torch")
    for a, b in zip(native, run(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_queries_keys_and_values_read_as_views_of_one_product() -> None:
    """forward_kernel / backward_kernel on q and kv that are column slices of one (B, L, 3·H·D) buffer (rows 3·H·D
    apart), the gradients written into slices of one buffer: the equation's values and gradients."""
    _native_or_skip()
    batch, length, memory, heads, head = 2, 19, 7, 3, 12
    q, kv, r, u, v = _inputs(batch, length, memory, heads, head, 11)
    width = heads * head
    qkv = torch.cat([q, kv[:, memory:]], dim=-1)
    memory_kv = kv[:, :memory].contiguous()
    grad = torch.randn(batch, length, width, generator=torch.Generator().manual_seed(12))
    out, lse = forward_kernel(qkv[..., :width], qkv[..., width:], r, u, v, memory_kv, heads)
    grad_qkv = torch.empty_like(qkv)
    grads = backward_kernel(grad, qkv[..., :width], qkv[..., width:], r, u, v, memory_kv, out, lse, heads,
                            grad_qkv[..., :width], grad_qkv[..., width:])
    want = _values_and_grads(_by_the_equation, [q, kv, r, u, v], heads, grad)
    got_kv = torch.cat([grads[5], grad_qkv[..., width:]], dim=1)  # the memory's rows, then the window's
    for name, a, b in zip(["out", "q", "kv", "r", "u", "v"], [out, grad_qkv[..., :width], got_kv, *grads[2:5]], want,
                          strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ValueError, match="must have their strides"):
        backward_kernel(grad, qkv[..., :width], qkv[..., width:], r, u, v, memory_kv, out, lse, heads)
