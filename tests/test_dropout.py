"""The fast CPU dropout: Bernoulli masks seeded by torch's generator, scaled so the expectation holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from gatedformer.kernels import build as _native
from gatedformer.kernels import dropout as _dropout_kernel
from gatedformer.nn.dropout import Dropout
from gatedformer.ops import dropout as dropout_module
from gatedformer.ops.dropout import dropout, dropout_add, keep_mask, relu_dropout


def test_masks_follow_torch_seed_and_keep_probability() -> None:
    torch.manual_seed(3)
    a = keep_mask((400, 500), 0.25)
    torch.manual_seed(3)
    b = keep_mask((400, 500), 0.25)
    assert torch.equal(a, b)
    assert not torch.equal(a, keep_mask((400, 500), 0.25))  # the generator moved on
    kept = (a > 0).float().mean().item()
    assert kept == pytest.approx(0.75, abs=0.005)  # 200,000 draws: ~6 standard deviations
    assert a.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert a.mean().item() == pytest.approx(1.0, abs=0.01)


def test_dropout_module_is_a_torch_dropout() -> None:
    layer = Dropout(0.3)
    assert isinstance(layer, nn.Dropout) and layer.p == 0.3
    x = torch.randn(64, 32, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    mask = y.detach() / x.detach()
    kept = y != 0
    assert torch.allclose(mask[kept], torch.full_like(mask[kept], 1 / 0.7))
    assert torch.equal(x.grad, torch.where(kept, torch.tensor(1 / 0.7), torch.tensor(0.0)))
    layer.eval()
    assert layer(x) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_dtype_is_kept() -> None:
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    assert Dropout(0.5)(x).dtype == torch.bfloat16
    assert keep_mask((3, 4), 0.5, torch.float64).dtype == torch.float64


def test_relu_dropout_is_dropout_of_relu() -> None:
    x = torch.randn(256, 64, requires_grad=True)
    torch.manual_seed(0)
    fused = relu_dropout(x, 0.2)
    fused.sum().backward()
    kept = fused.detach() != 0
    assert torch.equal(kept & (x.detach() <= 0), torch.zeros_like(kept))  # never keeps a non-positive input
    assert torch.allclose(fused[kept], x.detach()[kept] / 0.8)
    assert torch.equal(x.grad != 0, kept)
    assert (kept.sum() / (x > 0).sum()).item() == pytest.approx(0.8, abs=0.03)
    assert torch.equal(relu_dropout(x, 0.2, training=False), x.relu())


# ------------------------------------------------------------------------------------------------
# The Philox masks: the generator itself, the compiled kernel against the NumPy reference, the autograd.


_KEEP_90 = round(0.9 * 2 ** 32)


def _native_or_skip() -> None:
    if _dropout_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled dropout kernel is unavailable here: {_dropout_kernel.KERNEL.error}")


@pytest.mark.parametrize(("counter", "key", "expected"), [
    # Known-answer vectors of the Random123 distribution (Salmon et al. 2011) for Philox4x32-10.
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_reference_matches_known_answers(counter: tuple[int, ...], key: tuple[int, int],
                                                expected: tuple[int, ...]) -> None:
    words = _dropout_kernel.philox4x32_10(tuple(np.array([c], dtype=np.uint32) for c in counter), key)
    assert [int(w[0]) for w in words] == list(expected)


def test_reference_words_are_uniform_and_windowed() -> None:
    words = _dropout_kernel.philox_words(1 << 16, seed=7)
    assert words.dtype == np.uint32
    assert abs(float(words.mean()) / 2 ** 32 - 0.5) < 0.01
    assert len(np.unique(words)) > 0.99 * words.size
    # Any window of the stream is the same slice of the whole stream (what a thread's chunk draws).
    assert np.array_equal(_dropout_kernel.philox_words(100, seed=7, start=1000), words[1000:1100])


@pytest.mark.parametrize("tile", [0, 1, 5, (1 << 29) + 3, (1 << 61) - 1])
def test_native_words_match_reference(tile: int) -> None:
    _native_or_skip()
    seed = 0x0123456789ABCDEF
    words = np.zeros(32, dtype=np.uint32)
    _dropout_kernel.KERNEL.library().dropout_tile_words(tile, seed, words.ctypes.data)
    assert np.array_equal(words, _dropout_kernel.philox_words(32, seed, start=tile * 32))


@pytest.mark.parametrize("isa", _native.ISAS)
def test_every_instruction_set_build_draws_the_reference_masks(isa: str, kernel_build) -> None:  # noqa: ANN001
    """The scalar, AVX2 (8 blocks) and AVX-512 (16 blocks) generators are one stream, whatever the build."""
    _native_or_skip()
    lib = kernel_build(_dropout_kernel.KERNEL, isa)
    seed, scale = (1 << 40) + 7, 2 ** 32 / _KEEP_90
    x = torch.randn(64 * 5 + 33)  # odd tails of both the 32- and the 64-element draws
    base = torch.randn_like(x)
    out = torch.empty_like(x)
    for threads in (1, 3):
        lib.dropout_add_f32(base.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel(), seed, _KEEP_90, scale, threads)
        keep = torch.from_numpy(_dropout_kernel.philox_words(x.numel(), seed) < np.uint32(_KEEP_90))
        assert torch.equal(out, base + x * keep.float() * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_kernels_match_reference_bit_for_bit(dtype: torch.dtype, threads: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    torch.manual_seed(0)
    x = torch.randn(1000 * 3 + 17, dtype=dtype)  # not a whole number of 32-element tiles
    base = torch.randn_like(x)
    x[5], x[6], x[7] = float("nan"), float("inf"), -float("inf")
    seed, scale = 987654321, 2 ** 32 / _KEEP_90

    def run() -> list[Tensor]:
        return [_dropout_kernel.apply_dropout(x, seed, _KEEP_90, scale),
                _dropout_kernel.apply_relu_dropout(x, seed, _KEEP_90, scale),
                _dropout_kernel.apply_dropout_add(base, x, seed, _KEEP_90, scale),
                _dropout_kernel.scale_where_positive(x, base, scale)]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    monkeypatch.setattr(_native, "_ELEMENTS_PER_THREAD", 1)  # split even this small tensor
    try:
        native = run()
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("GATEDFORMER_DROPOUT_BACKEND", "torch")
    reference = run()
    for ours, theirs in zip(native, reference, strict=True):
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    assert native[0][5].isnan() and native[0][6].isinf() | native[0][6].isnan()  # as a mask product would


def test_the_backward_pass_redraws_the_mask_and_saves_nothing() -> None:
    _native_or_skip()  # PyTorch's dropout, the fallback, saves its mask
    x = torch.randn(64, 33, requires_grad=True)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = dropout(x, 0.25)
    assert saved == []
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.where(y != 0, torch.tensor(1 / 0.75), torch.tensor(0.0)))


def test_dropout_add_is_residual_plus_dropout() -> None:
    base, x = torch.randn(50, 40, requires_grad=True), torch.randn(50, 40, requires_grad=True)
    torch.manual_seed(5)
    fused = dropout_add(base, x, 0.3)
    torch.manual_seed(5)
    separate = base + dropout(x, 0.3)
    assert torch.equal(fused, separate)
    grad = torch.randn_like(fused)
    fused_grads = torch.autograd.grad(fused, (base, x), grad)
    separate_grads = torch.autograd.grad(separate, (base, x), grad)
    for a, b in zip(fused_grads, separate_grads, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(dropout_add(base, x, 0.3, training=False), base + x)


def test_gradients_pass_gradcheck() -> None:
    x = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    base = torch.randn_like(x, requires_grad=True)
    seed = 42
    assert torch.autograd.gradcheck(lambda t: dropout_module._MaskedDropout.apply(t, seed, _KEEP_90), (x,))
    assert torch.autograd.gradcheck(lambda b, t: dropout_module._MaskedDropoutAdd.apply(b, t, seed, _KEEP_90),
                                    (base, x))
    shifted = (x.detach() + 0.05 * x.detach().sign()).requires_grad_()  # no input at the ReLU's kink
    assert torch.autograd.gradcheck(lambda t: dropout_module._MaskedReluDropout.apply(t, seed, _KEEP_90),
                                    (shifted,))


def test_without_the_kernel_dropout_is_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(300, 7, requires_grad=True)
    monkeypatch.setenv("GATEDFORMER_DROPOUT_BACKEND", "torch")
    for ours, theirs in [(lambda: dropout(x, 0.4), lambda: torch.nn.functional.dropout(x, 0.4)),
                         (lambda: relu_dropout(x, 0.4), lambda: torch.nn.functional.dropout(x.relu(), 0.4)),
                         (lambda: dropout_add(x, x, 0.4), lambda: x + torch.nn.functional.dropout(x, 0.4))]:
        torch.manual_seed(11)
        a = ours()
        torch.manual_seed(11)
        assert torch.equal(a, theirs())
    monkeypatch.setenv("GATEDFORMER_DROPOUT_BACKEND", "fast")
    with pytest.raises(ValueError, match="GATEDFORMER_DROPOUT_BACKEND"):
        dropout(x, 0.4)


def test_kernel_threads_follow_torch_and_the_work_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert _native.kernel_threads(1000) == 1
    assert _native.kernel_threads(10 ** 8) == 4
    assert _native.kernel_threads(10 ** 8, elements_per_thread=10 ** 8) == 1
    # a 1024 x 48 dropout-residual-LayerNorm: one thread as a plain pass, split when each element is heavy
    assert _native.kernel_threads(1024 * 48) == 1
    assert _native.kernel_threads(1024 * 48, cost=_native.HEAVY_ELEMENT) == 4
    assert _native.kernel_threads(1000, cost=_native.HEAVY_ELEMENT) == 1


def test_heavy_kernels_split_small_tensors_between_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout draws a Philox word per element: tensors of 4k-32k elements go to several threads, with the mask
    (a function of each element's index) the same as on one."""
    _native_or_skip()
    x = torch.randn(128, 64)  # 8192 elements: one thread for a plain pass
    assert _native.kernel_threads(x.numel()) == 1
    one = _dropout_kernel.apply_dropout(x, seed=11, keep_below=3 << 30, scale=4 / 3)
    calls = []
    original = _native.kernel_threads

    def counting(numel: int, elements_per_thread: int | None = None, *, cost: int = 1) -> int:
        calls.append(original(numel, elements_per_thread, cost=cost))
        return calls[-1]

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(_dropout_kernel, "kernel_threads", counting)
    two = _dropout_kernel.apply_dropout(x, seed=11, keep_below=3 << 30, scale=4 / 3)
    assert calls == [2]
    torch.testing.assert_close(two, one, rtol=0, atol=0)


def test_kernel_isa_cap_picks_the_build_and_rejects_unknown_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip()
    loaded = _dropout_kernel.KERNEL.isa
    assert loaded in _native.ISAS

    def fresh() -> _native.NativeKernel:
        return _native.NativeKernel("dropout", abi_version=2, env_var="GATEDFORMER_DROPOUT_BACKEND",
                                    description="the dropout kernel", fallback="torch",
                                    extra_cflags=("-ffp-contract=off",), avx512=True)

    monkeypatch.setenv("GATEDFORMER_KERNEL_ISA", "baseline")
    capped = fresh()
    assert capped.library() is not None and capped.isa == "baseline"
    monkeypatch.setenv("GATEDFORMER_KERNEL_ISA", "sse9")
    broken = fresh()
    with pytest.raises(ValueError, match="GATEDFORMER_KERNEL_ISA must be one of"):
        broken.library()


@pytest.mark.parametrize("count", [0, 1, 3, 37])
def test_seeds_drawn_in_one_call_are_those_drawn_one_by_one(count: int) -> None:
    torch.manual_seed(5)
    one_by_one, next_draw = [dropout_module._draw_seed() for _ in range(count)], torch.rand(())
    torch.manual_seed(5)
    at_once = dropout_module._draw_seeds(count)
    assert at_once == one_by_one
    assert torch.equal(torch.rand(()), next_draw)  # and the generator is left where the calls one by one leave it
