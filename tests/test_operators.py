"""The fused CPU paths as custom operators (``gatedformer.ops.operators``): each one's schema, fake function and
autograd registration as ``torch.library.opcheck`` checks them, on the arguments the models really pass; and a
compiled training step that keeps them and equals the eager one, dropout masks included."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gatedformer.analysis.bench import BenchOptions, BenchSize, format_report, run_bench
from gatedformer.config import ModelConfig
from gatedformer.fused import fuse
from gatedformer.gates import GatedResidual
from gatedformer.kernels.build import prepare_compile
from gatedformer.models import build_model
from gatedformer.ops import (
    attention,
    dropout,
    embedding,
    fused_gates,
    fused_linear,
    layer_stack,
    operators,
    output_loss,
    relative_attention,
    relative_sublayer,
    rnn,
    sru,
)
from gatedformer.ops.operators import REGISTERED, FunctionOperator

_CALLERS = (attention, dropout, embedding, fused_gates, fused_linear, layer_stack, output_loss, relative_attention,
            relative_sublayer, rnn, sru)

# Small models that between them call every operator in eager code: post-LN sublayers whole (with each gate slot),
# pre-LN ones in pieces, the relative sublayer, Transformer-XL's two whole stacks, the LocalRNN's recurrence and steps,
# the GLU, the SRU's recurrence.
_MODELS = [
    dict(backbone="transformer", gates="+σ SDU"),
    dict(backbone="transformer", gates="+EAU+GRC"),
    dict(backbone="transformer", gates="+highway gate", norm="pre"),
    dict(backbone="transformer", norm="pre"),
    dict(backbone="transformer-xl", gates="+σ SDU", hooked=True),  # the stack declines: its sublayers one by one
    dict(backbone="transformer-xl", norm="pre", dropout=0.0),  # attention dropout: the kernel takes none
    dict(backbone="transformer-xl", gates="+σ SDU", hooked=False),  # the streamed stack
    dict(backbone="transformer-xl", d_ffn=35, hooked=False),  # an odd FFN width it cannot split: the Python stack
    dict(backbone="rtransformer", rnn_type="gru"),
    dict(backbone="rtransformer", rnn_type="lstm"),
    dict(backbone="gcnn"),
    dict(backbone="sru"),
]


def _recorded_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[FunctionOperator, tuple[object, ...]]]:
    """The first call of each operator's function while the models above take a training step, with its arguments
    (detached copies, seeds as drawn)."""
    calls: dict[str, tuple[FunctionOperator, tuple[object, ...]]] = {}

    def record(operator: FunctionOperator, *args: object):  # noqa: ANN202
        if operator.name not in calls:
            calls[operator.name] = (operator, tuple(
                a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in args))
        return operator.function.apply(*args)

    for module in _CALLERS:
        monkeypatch.setattr(module, "call", record)
    for model_settings in _MODELS:
        extra = dict(model_settings)
        hooked = extra.pop("hooked", False)
        torch.manual_seed(0)
        cfg = ModelConfig(**{"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ffn": 64, "mem_len": 4, "dropout": 0.1,
                             "rnn_window": 3, **extra})
        model = fuse(build_model(cfg, 20)).train()
        tokens = torch.randint(0, 20, (2, 9))
        if hooked:  # a hooked layer: the stack declines, its sublayers run one by one
            model.layers[0].register_forward_hook(lambda *_: None)
        loss = model(tokens[:, :-1], None, targets=tokens[:, 1:]).loss
        loss.backward()
        if extra["backbone"] == "rtransformer":  # the steps one by one: what the recurrence does not take
            rnn.gru_step(torch.randn(3, 24, requires_grad=True), torch.randn(3, 24, requires_grad=True),
                         torch.randn(3, 8, requires_grad=True))
            rnn.lstm_step(torch.randn(3, 32, requires_grad=True), torch.randn(32), torch.randn(3, 8))
    # the pieces that the whole sublayers above leave out
    x, base = torch.randn(2, 5, 32, requires_grad=True), torch.randn(2, 5, 32, requires_grad=True)
    linear, norm = nn.Linear(32, 32), nn.LayerNorm(32)
    dropout.dropout_add(base, x, 0.3)
    dropout.relu_dropout(x, 0.3)
    fused_linear.linear_dropout(x, linear, 0.2)
    fused_linear.linear_dropout_add_norm(base, x, linear, 0.2, norm)
    fused_gates.apply_grc(GatedResidual(32), base, x)
    return calls


@pytest.fixture(scope="module")
def recorded() -> Iterator[dict[str, tuple[FunctionOperator, tuple[object, ...]]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone before the tests: they call the operators
        calls = _recorded_calls(monkeypatch)
    yield calls


def test_the_models_call_every_operator(recorded: dict) -> None:
    assert sorted(recorded) == sorted(op.name for op in REGISTERED)


@pytest.mark.parametrize("name", sorted(op.name for op in REGISTERED))
def test_each_operator_passes_opcheck(name: str, recorded: dict) -> None:
    operator, args = recorded[name]
    arguments = operator.operator_arguments(*args)
    needs = [t is not None and t.requires_grad for t in operators._leaves(operator._kinds, arguments)]
    torch.library.opcheck(operator.forward_op, (*arguments, needs))


def test_an_operator_computes_what_its_function_does(recorded: dict) -> None:
    operator, args = recorded["feed_forward_add_norm"]
    results = []
    for run in (operator.function.apply, operator):
        out = run(*args)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        results.append((out, *torch.autograd.grad(out.sin().sum(), leaves)))
    for expected, got in zip(*results, strict=True):
        assert torch.equal(expected, got)


def test_traced_seeds_are_drawn_in_the_eager_order() -> None:
    # Under compile the seed is drawn inside the graph; the generator ends where the eager draws leave it.
    x = torch.randn(4, 16, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return dropout.dropout_add(x, dropout.relu_dropout(dropout.dropout(x, 0.3), 0.2), 0.1).sum()

    results = []
    prepare_compile()
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        torch.manual_seed(3)
        loss = fn(x)
        results.append((loss, torch.autograd.grad(loss, x)[0], torch.randint(0, 2 ** 62, ())))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("backbone, extra", [
    ("transformer", {}), ("transformer-xl", {}), ("transformer-xl", {"d_ffn": 35}), ("gcnn", {}),
], ids=["transformer", "xl-streamed-stack", "xl-python-stack", "gcnn"])
@pytest.mark.slow
def test_a_compiled_step_with_dropout_equals_the_eager_one(backbone: str, extra: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Inductor compiles the glue; the fused paths stay operators (Transformer-XL's whole stack one of them, with its
    # memories carried into a second step), and their masks are the eager ones.
    stack = {"xl-streamed-stack": layer_stack.StreamedLayerStack, "xl-python-stack": layer_stack.LayerStack}.get(
        "xl-python-stack" if extra else "xl-streamed-stack" if backbone == "transformer-xl" else "")
    runs: list[int] = []
    if stack is not None:
        stack_forward = stack.forward
        monkeypatch.setattr(stack, "forward", staticmethod(lambda *args: runs.append(1) or stack_forward(*args)))
    torch._dynamo.reset()
    cfg = ModelConfig(**{"backbone": backbone, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ffn": 64, "dropout": 0.1,
                         "mem_len": 8, "gates": "" if backbone == "gcnn" else "+σ SDU", **extra})
    torch.manual_seed(0)
    model = fuse(build_model(cfg, 20)).train()
    tokens = torch.randint(0, 20, (2, 17))
    results = []
    prepare_compile()
    for forward in (model, torch.compile(model, fullgraph=True)):
        torch.manual_seed(1)
        state = None
        for window in (tokens[:, :9], tokens[:, 8:]):
            out = forward(window[:, :-1], state, targets=window[:, 1:])
            loss, state = out.loss, out.state
        results.append((loss, *torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)))
    torch._dynamo.reset()
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert len(runs) == (0 if stack is None else 4)  # two steps, eager then compiled


def test_bench_compile_times_the_eager_step_beside_the_compiled_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # dynamo's eager backend: the bench's rows and table are what is checked here, not Inductor's code
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    size = BenchSize(d_model=16, n_layers=1, n_heads=2, d_ffn=32, seq_len=8, batch=2, vocab=11)
    options = BenchOptions(repeats=2, warmup=1, memory="none", threads=1, compile=True)
    report = run_bench(size, options, sections=["models"], backbones=["transformer"], variants=["baseline"])
    torch._dynamo.reset()
    (row,) = report.section("models")
    assert row["train_eager_ms"] > 0 and row["train_ms"] > 0 and row["compiled_speedup"] > 0
    text = format_report(report)
    assert "torch.compile: the training step eager and compiled" in text
    assert f"{row['compiled_speedup']:.2f}x" in text


class _Scale(torch.autograd.Function):
    """``x * k``: a function to make operators of here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:  # type: ignore[override]
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.k, None


def _scale_operator(name: str) -> FunctionOperator:
    operator = FunctionOperator(name, _Scale, "Tensor x, float k", lambda x, k: [torch.empty_like(x)])
    REGISTERED.remove(operator)  # not one the models call
    return operator


def test_an_operator_runs_under_every_dispatch_a_compiled_graph_may_ask() -> None:
    # Gradients off (a compiled graph's forward pass), a dispatch mode, fake tensors, and autograd: all through
    # register_autograd's kernel, torch's public way.
    from torch.utils._python_dispatch import TorchDispatchMode

    operator = _scale_operator("test_scale_dispatch")
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(operator(x, 2.5), x * 2.5)

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Passing():
        assert torch.equal(operator(x, 2.5), x * 2.5)
    out = operator(x, 2.5)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(out, x * 2.5) and torch.equal(grad, torch.full_like(x, 2.5))
    with torch._subclasses.FakeTensorMode():
        assert operator(torch.empty(2, 2), 3.0).shape == (2, 2)
    torch.library.opcheck(operator.forward_op, (*operator.operator_arguments(x, -1.5), [True, False]))


def test_the_backward_context_travels_with_the_forward_operator_s_handle() -> None:
    # No table beside the operators: the handle's storage carries the context, a view of it (what autograd saves)
    # finds it, a copy does not, and the context goes when the handle does.
    import gc
    import weakref

    operator = _scale_operator("test_scale_handle")
    x = torch.randn(3, 4)
    *outputs, handle = operator.forward_op(*operator.operator_arguments(x, 1.5), [True, False])
    context = operators._kept_context(handle.view_as(handle))
    assert context.k == 1.5
    (grad,) = operator.backward_op(handle, [torch.ones(3, 4)], [x, None], outputs, [True, False])
    assert torch.equal(grad, torch.full_like(x, 1.5))
    with pytest.raises(RuntimeError, match="no forward pass"):
        operator.backward_op(handle.clone(), [torch.ones(3, 4)], [x, None], outputs, [True, False])
    kept = weakref.ref(context)
    del context, handle
    gc.collect()
    assert kept() is None
    assert not [name for name, value in vars(operators).items()
                if isinstance(value, dict) and any(isinstance(key, int) for key in value)]
