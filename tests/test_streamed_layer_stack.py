"""Transformer-XL's plain and SDU-gated layers in one compiled call each way (:class:`StreamedLayerStack`): the
numbers of the Python stack, where it applies, and the Python stack where it does not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gatedformer.fused import fuse
from gatedformer.fused import sublayer as fused_sublayer
from gatedformer.fused import transformer_xl as fused_transformer_xl
from gatedformer.kernels import blas as _blas
from gatedformer.kernels import epilogue as _epilogue_kernel
from gatedformer.kernels import relative_attention as _relative_attention_kernel
from gatedformer.models.transformer_xl import TransformerXLLM
from gatedformer.ops import layer_stack
from gatedformer.ops.layer_stack import LayerStack, StreamedLayerStack


def _streams_or_skip() -> None:
    for kernel in (_relative_attention_kernel.KERNEL, _epilogue_kernel.KERNEL):
        if kernel.pick_backend(torch.device("cpu")) != "native":
            pytest.skip(f"a compiled kernel is unavailable here: {kernel.error}")
    if _blas.packed_gemm() is None:
        pytest.skip("PyTorch links no MKL here: the whole stack is not streamed")


def _count(monkeypatch: pytest.MonkeyPatch, function: type[torch.autograd.Function]) -> list[int]:
    calls: list[int] = []
    apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls


def _model(n_layers: int = 3, dropout: float = 0.1, width: int = 48, ffn: int = 96, mem_len: int = 16,
           **model_args: object) -> TransformerXLLM:
    torch.manual_seed(0)
    return fuse(TransformerXLLM(50, d_model=width, n_layers=n_layers, n_heads=4, d_ffn=ffn, dropout=dropout,
                                mem_len=mem_len, **model_args)).train()


def _train_two_windows(model: TransformerXLLM, batch: int = 3, length: int = 12) -> list[Tensor]:
    """Losses over two windows (the second with the first's memory), the memories, every parameter's gradient."""
    tokens = torch.randint(0, 50, (batch, 2, length + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    state, losses = None, []
    for window in tokens.unbind(1):
        out = model(window[:, :-1], state, targets=window[:, 1:])
        state = out.state
        losses.append(out.loss)
    grads = torch.autograd.grad(sum(losses), list(model.parameters()))
    return [torch.stack(losses), *(state or []), *grads]


def _run(make: Callable[[], TransformerXLLM], streamed: bool, **window_args: int) -> tuple[list[Tensor], int, int]:
    """The two windows with the whole stack streamed or not, and how often each stack ran."""
    with pytest.MonkeyPatch.context() as patch:
        if not streamed:
            patch.setattr(layer_stack, "_streams_whole_stack", lambda *args: False)
        streams, stacks = _count(patch, StreamedLayerStack), _count(patch, LayerStack)
        result = _train_two_windows(make(), **window_args)
    return result, len(streams), len(stacks)


def _assert_same(streamed: list[Tensor], python: list[Tensor], outputs: int) -> None:
    """The losses and memories (the first ``outputs``) bit for bit: the same products, kernels and masks in the same
    order. The gradients to float rounding: the threads' shares of the weights' gradients are added in another
    order, and on one thread the weights' products are made inside the stream."""
    for a, b in zip(streamed[:outputs], python[:outputs], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(streamed[outputs:], python[outputs:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("threads", "dropout", "mem_len"), [
    (1, 0.0, 16), (1, 0.1, 16), (2, 0.0, 16), (2, 0.1, 16), (2, 0.1, 0), (2, 0.1, 5)])
def test_the_streamed_stack_gives_the_python_stacks_numbers(threads: int, dropout: float, mem_len: int) -> None:
    _streams_or_skip()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        streamed, streams, stacks = _run(lambda: _model(dropout=dropout, mem_len=mem_len), True)
        assert (streams, stacks) == (2, 0)
        python, streams, stacks = _run(lambda: _model(dropout=dropout, mem_len=mem_len), False)
        assert (streams, stacks) == (0, 2)
        _assert_same(streamed, python, 1 + (3 if mem_len else 0))
        # and the modules themselves, to float rounding
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_transformer_xl, "layer_stack", lambda *args: None)
            patch.setattr(fused_transformer_xl, "relative_attention_add_norm", lambda *args, **kwargs: None)
            patch.setattr(fused_sublayer, "feed_forward_add_norm", lambda *args, **kwargs: None)
            modules = _train_two_windows(_model(dropout=dropout, mem_len=mem_len))
        for a, b in zip(streamed, modules, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(saved_threads)


@pytest.mark.parametrize("gates", ["", "+tanh SDU", "+highway gate", "+gated MHDPA", "+GRC", "+EAU+GRC"])
def test_two_threads_each_take_half_the_batch_and_give_the_python_stacks_numbers(gates: str) -> None:
    """A batch big enough for the kernel to split it between two threads: their shares of the weights' gradients and
    of the column sums are added up, and the column sums' rows are zeroed by the thread that fills them."""
    _streams_or_skip()
    batch, length, width, ffn = 16, 32, 48, 96
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _epilogue_kernel.stack_blocks(batch, length, width, ffn)[:2] == (8, 2)  # 8 sequences a thread
        def make() -> TransformerXLLM:
            return _model(n_layers=2, width=width, ffn=ffn, mem_len=length, gates=gates)

        streamed, streams, _ = _run(make, True, batch=batch, length=length)
        python, *_ = _run(make, False, batch=batch, length=length)
    finally:
        torch.set_num_threads(saved_threads)
    assert streams == 2
    if gates:
        for a, b in zip(streamed, python, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    else:
        _assert_same(streamed, python, 1 + 2)


@settings(max_examples=16, deadline=None)
@given(batch=st.integers(1, 5), length=st.integers(1, 9), n_layers=st.integers(1, 3), mem_len=st.integers(0, 12),
       ffn=st.sampled_from([32, 64, 40, 33]), threads=st.sampled_from([1, 2]),
       gates=st.sampled_from(["", "", "+σ SDU L1", "+highway gate", "+gated MHDPA L1", "+GRC", "+EAU+GRC"]))
def test_any_batch_window_depth_memory_ffn_and_gate_give_the_python_stacks_numbers(
        batch: int, length: int, n_layers: int, mem_len: int, ffn: int, threads: int, gates: str) -> None:
    """FFN widths whose rows would not start the hidden layer's mask draws where the kernel needs them (33, odd) leave
    the layers to the Python stack. Plain layers give its numbers bit for bit, gated ones to float rounding."""
    _streams_or_skip()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def make() -> TransformerXLLM:
            return _model(n_layers=n_layers, width=32, ffn=ffn, mem_len=mem_len, gates=gates)

        streamed, streams, stacks = _run(make, True, batch=batch, length=length)
        python, *_ = _run(make, False, batch=batch, length=length)
    finally:
        torch.set_num_threads(saved_threads)
    odd = _epilogue_kernel.stack_blocks(batch, length, 32, ffn) is None
    assert (streams, stacks) == ((0, 2) if odd else (2, 0))
    if gates:
        for a, b in zip(streamed, python, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    else:
        _assert_same(streamed, python, 1 + (n_layers if mem_len else 0))


@pytest.mark.parametrize(("gates", "threads", "dropout", "mem_len"), [
    ("+σ SDU", 1, 0.1, 16), ("+tanh SDU", 2, 0.1, 16), ("+σ SDU L2", 2, 0.0, 16), ("+tanh L1-2\\FFN", 2, 0.1, 0),
    ("+σ SDU L1,3", 1, 0.1, 5), ("+highway gate", 1, 0.1, 16), ("+highway gate", 2, 0.1, 16),
    ("+highway gate L2", 2, 0.0, 5), ("+gated MHDPA", 1, 0.1, 16), ("+gated MHDPA", 2, 0.1, 0),
    ("+gated MHDPA L1", 2, 0.0, 16), ("+GRC", 1, 0.1, 16), ("+GRC", 2, 0.1, 5), ("+GRC L2-3", 2, 0.0, 16),
    ("+EAU", 1, 0.1, 16), ("+EAU", 2, 0.1, 5), ("+EAU+GRC", 2, 0.1, 16), ("+EAU L2", 1, 0.0, 16)])
def test_every_gate_streams_and_gives_the_python_stacks_numbers(gates: str, threads: int, dropout: float,
                                                                mem_len: int) -> None:
    """SDU branches, highway gates, gated MHDPAs, gated residual connections and EAUs on any layers and sublayers run
    inside the streamed stack: the Python stack's losses, memories and gradients to float rounding (a gate's product
    gets its bias after the product, not before)."""
    _streams_or_skip()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def make() -> TransformerXLLM:
            return _model(dropout=dropout, mem_len=mem_len, gates=gates)

        streamed, streams, stacks = _run(make, True)
        assert (streams, stacks) == (2, 0)
        python, streams, stacks = _run(make, False)
        assert (streams, stacks) == (0, 2)
    finally:
        torch.set_num_threads(saved_threads)
    names = [name for name, _ in make().named_parameters()]
    unit = {"h": ".highway.", "g": ".gated_mhdpa.", "G": ".grc.", "E": ".eau."}.get(gates[1], ".sdu.")
    assert any(unit in name for name in names)
    for a, b in zip(streamed, python, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # every unit's parameter got a gradient of its own, not zeros
    grads = dict(zip(names, streamed[len(streamed) - len(names) :], strict=True))
    assert all(grads[name].abs().sum() > 0 for name in names if unit in name)


def test_other_gates_or_no_mkl_leave_the_layers_to_the_python_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    _streams_or_skip()
    tokens = torch.randint(0, 50, (2, 8))
    streams, stacks = _count(monkeypatch, StreamedLayerStack), _count(monkeypatch, LayerStack)
    for gates in ("+σ SDU+GRC",):
        _model(gates=gates)(tokens, targets=tokens).loss.backward()
    assert (len(streams), len(stacks)) == (0, 1)
    monkeypatch.setenv("GATEDFORMER_PACKED_GEMM", "0")
    _model()(tokens, targets=tokens).loss.backward()
    assert (len(streams), len(stacks)) == (0, 2)
    monkeypatch.delenv("GATEDFORMER_PACKED_GEMM")
    _model()(tokens, targets=tokens).loss.backward()
    assert (len(streams), len(stacks)) == (1, 2)


def test_a_retained_graph_gives_its_gradients_again_and_a_freed_one_refuses() -> None:
    _streams_or_skip()
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    model = _model()
    loss = model(tokens, targets=tokens).loss
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    for a, p in zip(first, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_a_weight_changed_in_place_before_the_backward_pass_is_an_error() -> None:
    """The kernel reads the weights where they are: changing one between the passes must not go unnoticed."""
    _streams_or_skip()
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    model = _model()
    loss = model(tokens, targets=tokens).loss
    with torch.no_grad():
        model.layers[1].ffn.body.outer.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_frozen_parameters_get_no_gradient_and_the_others_the_python_stacks() -> None:
    _streams_or_skip()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))

    def make() -> TransformerXLLM:
        model = _model()
        for frozen in (model.layers[0].attn.body.key_value.weight, model.layers[1].ffn.body.inner.bias,
                       model.layers[1].attn.norm.weight, model.layers[2].attn.body.u,
                       model.layers[2].attn.body.position.weight):
            frozen.requires_grad_(False)
        return model

    def grads(streamed: bool) -> list[Tensor | None]:
        model = make()
        with pytest.MonkeyPatch.context() as patch:
            if not streamed:
                patch.setattr(layer_stack, "_streams_whole_stack", lambda *args: False)
            streams = _count(patch, StreamedLayerStack)
            torch.manual_seed(4)
            model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        assert len(streams) == int(streamed)
        return [p.grad for p in model.parameters()]

    streamed, python = grads(True), grads(False)
    assert sum(g is None for g in streamed) == 5
    for a, b in zip(streamed, python, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
