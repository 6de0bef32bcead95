"""Transformer-XL's layers as one autograd function (the Python :class:`LayerStack`): the numbers of the layers one by
one, where they apply."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gatedformer.fused import fuse
from gatedformer.fused import sublayer as fused_sublayer
from gatedformer.fused import transformer_xl as fused_transformer_xl
from gatedformer.kernels import epilogue as _epilogue_kernel
from gatedformer.kernels import relative_attention as _relative_attention_kernel
from gatedformer.models import transformer_xl
from gatedformer.models.transformer_xl import TransformerXLLM
from gatedformer.ops import layer_stack
from gatedformer.ops.layer_stack import LayerStack
from gatedformer.ops.relative_sublayer import RelativeAttentionAddNorm


@pytest.fixture(autouse=True)
def _python_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of :class:`LayerStack` itself: the compiled whole stack (tests/test_streamed_layer_stack.py)
    steps aside."""
    monkeypatch.setattr(layer_stack, "_streams_whole_stack", lambda *args: False)


def _native_or_skip() -> None:
    for kernel in (_relative_attention_kernel.KERNEL, _epilogue_kernel.KERNEL):
        if kernel.pick_backend(torch.device("cpu")) != "native":
            pytest.skip(f"a compiled kernel is unavailable here: {kernel.error}")


def _count(monkeypatch: pytest.MonkeyPatch, function: type[torch.autograd.Function]) -> list[int]:
    calls: list[int] = []
    apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls


def _layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_transformer_xl, "layer_stack", lambda *args: None)


def _model(n_layers: int = 3, dropout: float = 0.1, **model_args: object) -> TransformerXLLM:
    torch.manual_seed(0)
    return fuse(TransformerXLLM(50, d_model=48, n_layers=n_layers, n_heads=4, d_ffn=96, dropout=dropout,
                                mem_len=16, **model_args)).train()


def _train_two_windows(model: TransformerXLLM, batch: int = 3, length: int = 12) -> list[Tensor]:
    """Losses over two windows (the second with the first's memory), every parameter's gradient, the memories."""
    tokens = torch.randint(0, 50, (batch, 2, length + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    state, losses = None, []
    for window in tokens.unbind(1):
        out = model(window[:, :-1], state, targets=window[:, 1:])
        state = out.state
        losses.append(out.loss)
    grads = torch.autograd.grad(sum(losses), list(model.parameters()))
    return [torch.stack(losses), *grads, *(state or [])]


@pytest.mark.parametrize(("threads", "dropout", "gates"), [
    (1, 0.0, ""), (1, 0.1, ""), (2, 0.0, ""), (2, 0.1, ""), (2, 0.1, "+σ SDU"), (1, 0.1, "+tanh SDU L2"),
    (2, 0.1, "+highway gate"), (2, 0.1, "+gated MHDPA"), (1, 0.1, "+EAU"), (2, 0.1, "+GRC"), (2, 0.1, "+EAU+GRC"),
    (2, 0.1, "+σ SDU+GRC")])
def test_the_stack_gives_the_numbers_of_the_layers_one_by_one(threads: int, dropout: float, gates: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sublayer functions (with every gate they take), the same masks drawn in the same order: the same
    losses, gradients and memories bit for bit, and within float rounding of the modules themselves."""
    _native_or_skip()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.MonkeyPatch.context() as patch:
            stacks, sublayers = _count(patch, LayerStack), _count(patch, RelativeAttentionAddNorm)
            stacked = _train_two_windows(_model(dropout=dropout, gates=gates))
        assert len(stacks) == 2 and not sublayers  # one call per window, no layer called on its own
        _layer_by_layer(monkeypatch)
        sublayers = _count(monkeypatch, RelativeAttentionAddNorm)
        one_by_one = _train_two_windows(_model(dropout=dropout, gates=gates))
        assert len(sublayers) == 6
        for a, b in zip(stacked, one_by_one, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # The sublayers in pieces: neither whole-sublayer function applies.
        monkeypatch.setattr(fused_transformer_xl, "relative_attention_add_norm", lambda *args, **kwargs: None)
        monkeypatch.setattr(fused_sublayer, "feed_forward_add_norm", lambda *args, **kwargs: None)
        for a, b in zip(stacked, _train_two_windows(_model(dropout=dropout, gates=gates)), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(saved_threads)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 9), n_layers=st.integers(1, 3), mem_len=st.integers(0, 12))
def test_any_batch_window_depth_and_memory_give_the_layers_numbers(batch: int, length: int, n_layers: int,
                                                                   mem_len: int) -> None:
    _native_or_skip()

    def run(stacked: bool) -> list[Tensor]:
        torch.manual_seed(0)
        model = fuse(TransformerXLLM(50, d_model=32, n_layers=n_layers, n_heads=4, d_ffn=64, dropout=0.1,
                                     mem_len=mem_len)).train()
        with pytest.MonkeyPatch.context() as patch:
            if not stacked:
                _layer_by_layer(patch)
            calls = _count(patch, LayerStack)
            result = _train_two_windows(model, batch, length)
        assert len(calls) == (2 if stacked else 0)
        return result

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_it_steps_aside_where_a_layer_would_not_run_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-LN, a sublayer whose function does not take its gates, hooks on a layer or a sublayer (which must run),
    global module hooks, evaluation and memories that ask for a gradient leave the layers to themselves."""
    _native_or_skip()
    calls = _count(monkeypatch, LayerStack)
    tokens = torch.randint(0, 50, (2, 8))
    for model_args in ({"norm": "pre"}, {"gates": "+σ SDU+EAU L2"}):
        _model(**model_args)(tokens, targets=tokens).loss.backward()
    model = _model()
    seen: list[int] = []
    handle = model.layers[1].ffn.register_forward_hook(lambda *args: seen.append(1))
    model(tokens, targets=tokens).loss.backward()
    handle.remove()
    assert seen == [1]
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: seen.append(2))
    try:
        model(tokens, targets=tokens)
    finally:
        handle.remove()
    assert 2 in seen
    memories = [torch.zeros(2, 4, 48, requires_grad=True) for _ in model.layers]
    model(tokens, memories, targets=tokens).loss.backward()
    assert all(m.grad is not None for m in memories)
    with torch.no_grad():
        model.eval()(tokens)
    assert not calls
    model.train()(tokens, targets=tokens).loss.backward()
    assert len(calls) == 1


def _no_hook(module: torch.nn.Module) -> None:
    module.register_forward_hook(lambda *args: None)


@pytest.mark.parametrize("change", [
    lambda layer: setattr(layer.attn.body.dropout, "p", 0.1),  # attention dropout: no whole function
    lambda layer: setattr(layer.attn.dropout, "p", 1.0),  # a rate the fused masks do not take
    lambda layer: setattr(layer.ffn.body.dropout, "p", 1.0),
    lambda layer: _no_hook(layer.attn.body.key_value),
    lambda layer: _no_hook(layer.ffn.body.outer),
    lambda layer: _no_hook(layer.ffn.norm),
    lambda layer: layer.attn.body.eval(),
    lambda layer: setattr(layer.ffn.body, "inner", torch.nn.Linear(48, 96, bias=False)),
    lambda layer: setattr(layer.attn, "norm", torch.nn.RMSNorm(48)),
    lambda layer: layer.ffn.body.outer.double(),
])
def test_the_stack_checks_every_layers_own_modules(change: object) -> None:
    """The stack asks what the sublayers need of their input once, and of each layer's modules in every layer: a
    change to the last layer alone leaves the layers to themselves."""
    _native_or_skip()
    model = _model()
    x = torch.randn(2, 8, 48, requires_grad=True)
    pos = transformer_xl.relative_positions(8, 48)
    assert layer_stack.layer_stack(model.layers, x, None, pos) is not None
    change(model.layers[-1])  # type: ignore[operator]
    assert layer_stack.layer_stack(model.layers, x, None, pos) is None


def test_the_stack_checks_its_inputs_once_for_every_layer() -> None:
    """What the sublayers ask of their inputs: float32 CPU tensors outside autocast, enough position rows, and
    memories like the input."""
    _native_or_skip()
    model = _model()
    x = torch.randn(2, 8, 48, requires_grad=True)
    pos = transformer_xl.relative_positions(12, 48)
    memories = [torch.zeros(2, 4, 48) for _ in model.layers]
    assert layer_stack.layer_stack(model.layers, x, memories, pos) is not None
    assert layer_stack.layer_stack(model.layers, x, memories, pos[:11]) is None  # 12 keys, 11 positions
    assert layer_stack.layer_stack(model.layers, x, [*memories[:-1], memories[-1].double()], pos) is None
    assert layer_stack.layer_stack(model.layers, x.double(), memories, pos.double()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer_stack.layer_stack(model.layers, x, memories, pos) is None


def test_a_retained_graph_gives_its_gradients_again_and_a_freed_one_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The activations are saved as any function's: kept with ``retain_graph``, freed after the backward pass."""
    _native_or_skip()
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))

    def twice(model: TransformerXLLM) -> list[Tensor]:
        torch.manual_seed(3)
        loss = model(tokens, targets=tokens).loss
        loss.backward(retain_graph=True)
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        return [p.grad for p in model.parameters()]

    calls = _count(monkeypatch, LayerStack)
    stacked = twice(_model())
    assert len(calls) == 1
    _layer_by_layer(monkeypatch)
    for a, b in zip(stacked, twice(_model()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_frozen_parameters_get_no_gradient_and_the_others_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which of its inputs ask for a gradient reaches each sublayer function in the stack as it would alone."""
    _native_or_skip()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))

    def grads(model: TransformerXLLM) -> list[Tensor | None]:
        for frozen in (model.layers[0].attn.body.key_value.weight, model.layers[1].ffn.body.inner.bias,
                       model.layers[1].attn.norm.weight, model.layers[2].attn.sdu.proj.weight):
            frozen.requires_grad_(False)
        torch.manual_seed(4)
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        return [p.grad for p in model.parameters()]

    calls = _count(monkeypatch, LayerStack)
    stacked = grads(_model(gates="+σ SDU L3"))
    assert len(calls) == 1
    _layer_by_layer(monkeypatch)
    one_by_one = grads(_model(gates="+σ SDU L3"))
    assert sum(g is None for g in stacked) == 4
    for a, b in zip(stacked, one_by_one, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
