"""Transformer-XL's post-LN attention sublayer as one autograd function: what its modules compute, where they would."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gatedformer.fused import fuse
from gatedformer.fused import transformer_xl as fused_transformer_xl
from gatedformer.kernels import blas as _blas
from gatedformer.kernels import epilogue as _epilogue_kernel
from gatedformer.kernels import relative_attention as _relative_attention_kernel
from gatedformer.models.transformer_xl import RelativeMultiHeadAttention, TransformerXLLM, relative_positions
from gatedformer.ops.relative_sublayer import RelativeAttentionAddNorm


@pytest.fixture(autouse=True)
def _layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the sublayer's own function: the model calls its layers one by one (the whole stack as
    one function is tested in test_layer_stack.py)."""
    monkeypatch.setattr(fused_transformer_xl, "layer_stack", lambda *args: None)


def _native_or_skip() -> None:
    for kernel in (_relative_attention_kernel.KERNEL, _epilogue_kernel.KERNEL):
        if kernel.pick_backend(torch.device("cpu")) != "native":
            pytest.skip(f"a compiled kernel is unavailable here: {kernel.error}")


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    fused = RelativeAttentionAddNorm.apply
    monkeypatch.setattr(RelativeAttentionAddNorm, "apply", lambda *args: calls.append(1) or fused(*args))
    return calls


def _count_streamed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    streamed = _epilogue_kernel.relative_sublayer_streamed
    monkeypatch.setattr(_epilogue_kernel, "relative_sublayer_streamed",
                        lambda *args: calls.append(1) or streamed(*args))
    return calls


def _train_two_windows(dropout: float, **model_args: object) -> list[Tensor]:
    """Losses over two windows (the second with the first's memory) and every parameter's gradient."""
    tokens = torch.randint(0, 50, (3, 2, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = fuse(TransformerXLLM(50, d_model=48, n_layers=2, n_heads=4, d_ffn=96, dropout=dropout, mem_len=16,
                                 **model_args)).train()
    state, losses = None, []
    for window in tokens.unbind(1):
        out = model(window[:, :-1], state, targets=window[:, 1:])
        state = out.state
        losses.append(out.loss)
    grads = torch.autograd.grad(sum(losses), list(model.parameters()))
    return [torch.stack(losses), *grads]


@pytest.mark.parametrize(("gates", "dropout"), [("", 0.0), ("", 0.1), ("+σ SDU", 0.1), ("+tanh SDU", 0.1),
                                                ("+highway gate", 0.1), ("+gated MHDPA", 0.1), ("+EAU", 0.1),
                                                ("+GRC", 0.1), ("+EAU+GRC", 0.1), ("+σ SDU+GRC", 0.0)])
def test_training_gives_the_losses_and_gradients_of_the_modules(gates: str, dropout: float,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gate the sublayer takes: the same dropout masks (one seed drawn where the modules draw it) and the same
    numbers to float rounding, every parameter's gradient (the gates' included)."""
    _native_or_skip()
    with pytest.MonkeyPatch.context() as patch:
        calls = _count_calls(patch)
        streamed = _count_streamed(patch)
        fused = _train_two_windows(dropout, gates=gates)
    assert len(calls) == 4  # two layers, two windows
    # Where PyTorch links MKL, each thread streams its sequences through the products, the kernel and the tail
    assert len(streamed) == (4 if _blas.packed_gemm() is not None else 0)
    monkeypatch.setattr(fused_transformer_xl, "relative_attention_add_norm", lambda *args, **kwargs: None)
    for a, b in zip(fused, _train_two_windows(dropout, gates=gates), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gates", ["", "+EAU+GRC", "+highway gate"])
def test_without_mkls_packed_products_it_gives_the_same(gates: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MKL's packed products (another BLAS, or GATEDFORMER_PACKED_GEMM=0) the function makes its products
    with PyTorch around the kernel: the same numbers."""
    _native_or_skip()
    streamed = _train_two_windows(0.1, gates=gates)
    monkeypatch.setenv("GATEDFORMER_PACKED_GEMM", "0")
    calls, streamed_calls = _count_calls(monkeypatch), _count_streamed(monkeypatch)
    for a, b in zip(streamed, _train_two_windows(0.1, gates=gates), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert len(calls) == 4 and not streamed_calls


def test_gradients_reach_the_memory_and_positions_when_they_ask_for_them() -> None:
    """The LM's memory and positions take no gradient; called with ones that do, the function gives theirs too."""
    _native_or_skip()
    torch.manual_seed(1)
    attention, norm = fuse(RelativeMultiHeadAttention(40, 4)).train(), nn.LayerNorm(40)
    nn.init.normal_(attention.u)
    nn.init.normal_(attention.v)
    x = torch.randn(2, 9, 40, requires_grad=True)
    memory = torch.randn(2, 5, 40, requires_grad=True)
    pos = torch.randn(20, 40, requires_grad=True)  # more rows than the 14 distances: the last 14 are used
    inputs = [x, memory, pos, *attention.parameters(), *norm.parameters()]
    grad = torch.randn(2, 9, 40)
    fused = attention.add_norm(x, 0.0, norm, memory=memory, pos=pos)
    assert fused is not None
    by_modules = norm(x + attention(x, memory, pos))
    torch.testing.assert_close(fused, by_modules, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(fused, inputs, grad), torch.autograd.grad(by_modules, inputs, grad),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_it_applies_only_where_the_modules_would_run_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation, a gate the fused tail does not take, attention dropout, hooks, autocast, the torch backend and
    pre-LN run the modules."""
    _native_or_skip()
    attention, norm = fuse(RelativeMultiHeadAttention(32, 2)).train(), nn.LayerNorm(32)
    x, pos = torch.randn(2, 5, 32), relative_positions(5, 32)
    assert attention.add_norm(x, 0.1, norm, pos=pos) is not None
    assert attention.add_norm(x, 0.1, norm, gate=nn.Identity(), pos=pos) is None
    assert attention.eval().add_norm(x, 0.1, norm, pos=pos) is None
    with_dropout = fuse(RelativeMultiHeadAttention(32, 2, dropout=0.1)).train()
    assert with_dropout.add_norm(x, 0.1, norm, pos=pos) is None
    attention.train().query.register_forward_hook(lambda *args: None)
    assert attention.add_norm(x, 0.1, norm, pos=pos) is None
    plain = fuse(RelativeMultiHeadAttention(32, 2)).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain.add_norm(x, 0.1, norm, pos=pos) is None
    monkeypatch.setenv("GATEDFORMER_ATTENTION_BACKEND", "torch")
    assert plain.add_norm(x, 0.1, norm, pos=pos) is None
    monkeypatch.delenv("GATEDFORMER_ATTENTION_BACKEND")
    calls = _count_calls(monkeypatch)
    _train_two_windows(0.1, gates="+σ SDU+EAU")  # an EAU beside an SDU: the sublayer applies them in pieces
    _train_two_windows(0.1, norm="pre")
    assert not calls
    _train_two_windows(0.1, gates="+σ SDU+EAU L2")  # layer 1's attention sublayer has no gate
    assert len(calls) == 2


@pytest.mark.parametrize(("batch", "length", "mem_len", "width", "gates"),
                         [(8, 64, 32, 64, ""), (8, 64, 32, 64, "+GRC"), (5, 16, 48, 48, ""), (5, 16, 48, 48, "+σ SDU")])
def test_two_threads_and_memories_longer_or_shorter_than_the_window_give_the_modules_numbers(
        batch: int, length: int, mem_len: int, width: int, gates: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences split between two threads in blocks, and memories shorter and longer than the window (the packed
    products are sized for the longer): the losses and gradients of the modules."""
    _native_or_skip()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def train() -> list[Tensor]:
            tokens = torch.randint(0, 50, (batch, 4, length + 1), generator=torch.Generator().manual_seed(1))
            torch.manual_seed(0)
            model = fuse(TransformerXLLM(50, d_model=width, n_layers=1, n_heads=4, d_ffn=2 * width, dropout=0.1,
                                         mem_len=mem_len, gates=gates)).train()
            state, losses = None, []
            for window in tokens.unbind(1):  # memories of 0, then up to mem_len positions
                out = model(window[:, :-1], state, targets=window[:, 1:])
                state = out.state
                losses.append(out.loss)
            return [torch.stack(losses), *torch.autograd.grad(sum(losses), list(model.parameters()))]

        with pytest.MonkeyPatch.context() as patch:
            streamed = _count_streamed(patch)
            fused = train()
        assert len(streamed) == (4 if _blas.packed_gemm() is not None else 0)
        monkeypatch.setattr(fused_transformer_xl, "relative_attention_add_norm", lambda *args, **kwargs: None)
        for a, b in zip(fused, train(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
