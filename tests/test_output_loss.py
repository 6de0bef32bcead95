"""The output layer and its cross-entropy as one function: the loss and gradients of linear then cross_entropy."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import for_backbone
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer import Seq2SeqTransformer
from gatedformer.config import RunConfig, apply_overrides, validate
from gatedformer.fused import fuse
from gatedformer.kernels import build as _native
from gatedformer.kernels import cross_entropy as _cross_entropy_kernel
from gatedformer.models import backbone_names, build_model
from gatedformer.ops import output_loss
from gatedformer.ops.output_loss import fused_loss_applies, linear_cross_entropy


def _kernel_or_skip() -> None:
    if _cross_entropy_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the cross-entropy kernel is unavailable here: {_cross_entropy_kernel.KERNEL.error}")


def _unfused(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int = -100,
             reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Records the arguments of every call into the kernel (and makes it)."""
    library = _cross_entropy_kernel.KERNEL.library()
    native, calls = library.softmax_cross_entropy_f32, []
    monkeypatch.setattr(library, "softmax_cross_entropy_f32", lambda *args: calls.append(args) or native(*args))
    return calls


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 200), vocab=st.integers(1, 700), width=st.integers(1, 40), with_bias=st.booleans(),
       reduction=st.sampled_from(["mean", "sum"]), smoothing=st.sampled_from([0.0, 0.1, 1.0]),
       budget=st.sampled_from([1 << 22, 500]), seed=st.integers(0, 2 ** 16))
def test_fused_loss_and_gradients_are_those_of_linear_then_cross_entropy(
        threads: int, rows: int, vocab: int, width: int, with_bias: bool, reduction: str, smoothing: float,
        budget: int, seed: int) -> None:
    """Random shapes, a bias or none, ignored targets, both reductions, label smoothing or none, the rows in one
    block or in many (a small logits budget), one thread or two."""
    _kernel_or_skip()
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=generator) / math.sqrt(width)).requires_grad_()
    bias = (torch.randn(vocab, generator=generator) * 0.5).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[torch.rand(rows, generator=generator) < 0.2] = -100
    targets[0] = 0  # at least one counted target, so that the mean is a number
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(output_loss, "LOGITS_BUDGET", budget)
            calls = _calls(patch)
            fused = linear_cross_entropy(hidden, weight, bias, targets, reduction=reduction,
                                         label_smoothing=smoothing)
            fused_grads = torch.autograd.grad(fused * 1.5, inputs)
    finally:
        torch.set_num_threads(previous)
    most = max(1, min(rows, budget // vocab))
    assert len(calls) == -(-rows // most)
    sizes = [call[3] for call in calls]  # the rows of each block: at most the budget's, shared out evenly
    assert sum(sizes) == rows and max(sizes) <= most and max(sizes) - min(sizes) < len(sizes)
    expected = _unfused(hidden, weight, bias, targets, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(fused, expected, rtol=2e-5, atol=2e-5)
    for got, want in zip(fused_grads, torch.autograd.grad(expected * 1.5, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_gives_the_loss_of_linear_then_cross_entropy(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The vector passes (whole vectors of a row) and the scalar loops (the rest, or all of a row without AVX2), on
    each instruction set's build, with ignored targets, label smoothing and extreme logits."""
    _kernel_or_skip()
    kernel_build(_cross_entropy_kernel.KERNEL, isa)
    generator = torch.Generator().manual_seed(5)
    for rows, vocab, smoothing in [(9, 37, 0.0), (33, 100, 0.1), (4, 5, 0.0), (40, 64, 1.0)]:
        hidden = (torch.randn(rows, 8, generator=generator) * 6).requires_grad_()  # logits far from 0 too
        weight = torch.randn(vocab, 8, generator=generator).requires_grad_()
        bias = torch.randn(vocab, generator=generator).requires_grad_()
        targets = torch.randint(0, vocab, (rows,), generator=generator)
        targets[1::3] = -100
        fused = linear_cross_entropy(hidden, weight, bias, targets, label_smoothing=smoothing)
        expected = _unfused(hidden, weight, bias, targets, label_smoothing=smoothing)
        torch.testing.assert_close(fused, expected, rtol=2e-5, atol=2e-5)
        for got, want in zip(torch.autograd.grad(fused, [hidden, weight, bias]),
                             torch.autograd.grad(expected, [hidden, weight, bias]), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_bias_gradient_does_not_depend_on_the_thread_count() -> None:
    _kernel_or_skip()
    torch.manual_seed(0)
    hidden, weight = torch.randn(300, 16), torch.randn(400, 16) * 0.25
    bias = torch.zeros(400, requires_grad=True)
    targets = torch.randint(0, 400, (300,))
    grads = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            grads.append(torch.autograd.grad(linear_cross_entropy(hidden, weight, bias, targets), bias)[0])
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(grads[0], grads[1])


def test_without_autograd_the_kernel_computes_no_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_or_skip()
    calls = _calls(monkeypatch)
    hidden, weight = torch.randn(8, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    targets = torch.randint(0, 5, (8,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, None, targets, reduction="sum")
    torch.testing.assert_close(loss, _unfused(hidden, weight, None, targets, reduction="sum").detach())
    assert calls[0][8] == 0  # want_grad


def test_edge_cases_are_those_of_cross_entropy() -> None:
    _kernel_or_skip()
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    ignored = torch.full((6,), -100)
    # every target ignored: a mean over nothing is NaN (and so are its gradients), a sum is 0
    assert math.isnan(float(linear_cross_entropy(hidden, weight, None, ignored).detach()))
    assert math.isnan(float(_unfused(hidden, weight, None, ignored).detach()))
    assert float(linear_cross_entropy(hidden, weight, None, ignored, reduction="sum").detach()) == 0.0
    # no positions at all: as cross_entropy, a NaN mean and a zero sum
    empty = torch.zeros(0, dtype=torch.long)
    assert math.isnan(float(linear_cross_entropy(hidden[:0], weight, None, empty).detach()))
    assert float(linear_cross_entropy(hidden[:0], weight, None, empty, reduction="sum").detach()) == 0.0
    assert not torch.autograd.grad(linear_cross_entropy(hidden[:0], weight, None, empty, reduction="sum"),
                                   weight)[0].any()
    # a NaN or an infinite logit gives a non-finite loss, which the trainer's skip test sees
    for poison in (float("nan"), float("inf")):
        poisoned = hidden.detach().clone()
        poisoned[2, 1] = poison
        loss = linear_cross_entropy(poisoned, weight.detach(), None, torch.zeros(6, dtype=torch.long))
        assert not math.isfinite(float(loss))
    # a target out of the vocabulary: one IndexError naming it
    with pytest.raises(IndexError, match="target 7 is out of bounds for a vocabulary of 5"):
        linear_cross_entropy(hidden, weight, None, torch.tensor([0, 1, 7, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        linear_cross_entropy(hidden, weight, None, ignored, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction must be one of mean, sum"):
        linear_cross_entropy(hidden, weight, None, ignored, reduction="none")
    with pytest.raises(ValueError, match="one target per position"):
        linear_cross_entropy(hidden, weight, None, torch.zeros(5, dtype=torch.long))


def test_other_dtypes_autocast_and_the_torch_backend_take_linear_then_cross_entropy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_or_skip()
    calls = _calls(monkeypatch)
    hidden, weight, bias = torch.randn(10, 6), torch.randn(7, 6), torch.randn(7)
    targets = torch.randint(0, 7, (10,))
    assert not fused_loss_applies(hidden.double(), weight.double(), bias.double())
    torch.testing.assert_close(linear_cross_entropy(hidden.double(), weight.double(), bias.double(), targets),
                               _unfused(hidden.double(), weight.double(), bias.double(), targets))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_loss_applies(hidden, weight, bias)
        linear_cross_entropy(hidden, weight, bias, targets)
    monkeypatch.setenv("GATEDFORMER_CROSS_ENTROPY_BACKEND", "torch")
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, bias, targets),
                               _unfused(hidden, weight, bias, targets))
    assert calls == []


def _small_model(backbone: str, tie: bool = False) -> nn.Module:
    config = apply_overrides(RunConfig(), for_backbone(backbone, [
        "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.n_layers=2", "model.dropout=0.1",
        "model.rnn_window=3", "model.mem_len=4", f"model.tie_embeddings={str(tie).lower()}"]))
    torch.manual_seed(0)
    return fuse(build_model(validate(config).model, 23))


@pytest.mark.parametrize("backbone", sorted(b for b in backbone_names() if b != "seq2seq"))
def test_each_language_model_returns_the_loss_of_its_logits_given_targets(backbone: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """forward(tokens, targets=...) is the cross-entropy of forward(tokens)'s logits, with the same gradients
    for every parameter (tied embeddings included) and the same recurrent state, in training (same dropout
    masks from the same seed) and in evaluation; the kernel is what computes it."""
    _kernel_or_skip()
    calls = _calls(monkeypatch)
    for tie in (False, True):
        model = _small_model(backbone, tie)
        tokens, targets = torch.randint(0, 23, (3, 9)), torch.randint(0, 23, (3, 9))
        for training in (True, False):
            model.train(training)
            torch.manual_seed(1)
            out = model(tokens)
            logits, state = out.logits, out.state
            expected = F.cross_entropy(logits.reshape(-1, 23), targets.reshape(-1))
            torch.manual_seed(1)
            out = model(tokens, targets=targets)
            loss, fused_state = out.loss, out.state
            assert out.logits is None
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
            if state is not None:
                for got, want in zip(fused_state if isinstance(state, list) else [fused_state],
                                     state if isinstance(state, list) else [state], strict=True):
                    torch.testing.assert_close(got, want)
            if training:
                params = [p for p in model.parameters() if p.requires_grad]
                for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(expected, params),
                                     strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            summed = model(tokens, targets=targets, reduction="sum").loss
            if not training:
                torch.testing.assert_close(summed, expected * targets.numel(), rtol=1e-5, atol=1e-5)
    assert calls


def test_hooks_on_the_output_layer_still_see_its_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_or_skip()
    calls = _calls(monkeypatch)
    model = _small_model("transformer").eval()
    seen = []
    model.output.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    tokens, targets = torch.randint(0, 23, (2, 5)), torch.randint(0, 23, (2, 5))
    loss = model(tokens, targets=targets).loss
    assert seen == [(2, 5, 23)] and calls == []
    torch.testing.assert_close(loss, F.cross_entropy(model(tokens).logits.reshape(-1, 23), targets.reshape(-1)))


def test_the_translation_model_returns_its_smoothed_loss_given_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's output layer and the label-smoothed, padding-ignoring loss the translation trainer asks for."""
    _kernel_or_skip()
    calls = _calls(monkeypatch)
    torch.manual_seed(0)
    model = fuse(Seq2SeqTransformer(23, 29, layers=2, d_model=16, ffn=32, heads=2, max_len=24, dropout=0.1))
    src, tgt_in, tgt_out = torch.randint(4, 23, (3, 7)), torch.randint(4, 29, (3, 6)), torch.randint(4, 29, (3, 6))
    tgt_out[:, -2:] = 1  # padding
    torch.manual_seed(1)
    logits = model(src, tgt_in).logits
    expected = F.cross_entropy(logits.reshape(-1, 29), tgt_out.reshape(-1), ignore_index=1, label_smoothing=0.1)
    torch.manual_seed(1)
    loss = model(src, tgt_in, targets=tgt_out, ignore_index=1, label_smoothing=0.1).loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    params = list(model.parameters())
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(expected, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert calls


def test_a_strided_bias_is_read_from_a_copy_that_outlives_the_call() -> None:
    _kernel_or_skip()
    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 8), torch.randn(300, 8) * 0.3
    wide = torch.randn(300, 2, requires_grad=True)
    bias, targets = wide[:, 0], torch.randint(0, 300, (40,))
    assert not bias.is_contiguous()
    loss = linear_cross_entropy(hidden, weight, bias, targets)
    torch.testing.assert_close(loss, _unfused(hidden, weight, bias, targets))
    torch.testing.assert_close(torch.autograd.grad(loss, wide)[0],
                               torch.autograd.grad(_unfused(hidden, weight, bias, targets), wide)[0])
