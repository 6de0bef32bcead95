"""The fused input layer: ``dropout(embedding(tokens) * scale + positions)`` in one pass, as the operations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gatedformer.config import ModelConfig
from gatedformer.fused import fuse
from gatedformer.kernels import dropout as _dropout_kernel
from gatedformer.models import build_model
from gatedformer.nn.dropout import Dropout
from gatedformer.ops import embedding as token_embedding_module
from gatedformer.ops.embedding import embed_tokens


@pytest.fixture(autouse=True)
def _native_kernel() -> None:
    if _dropout_kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the compiled dropout kernel is unavailable here: {_dropout_kernel.KERNEL.error}")


def _one_by_one(tokens, embedding, scale, positions, dropout):
    x = embedding(tokens) * scale
    if positions is not None:
        x = x + positions
    return x if dropout is None else dropout(x)


def _fused_and_reference(tokens, embedding, scale, positions, dropout, seed=7):
    """Both paths from the same generator state: outputs, then the table's gradients for one output gradient."""
    results = []
    for fn in (embed_tokens, _one_by_one):
        embedding.weight.grad = None
        torch.manual_seed(seed)
        out = fn(tokens, embedding, scale, positions, dropout)
        torch.manual_seed(seed + 1)
        out.backward(torch.randn_like(out))
        results.append((out.detach(), embedding.weight.grad.clone(), out.grad_fn))
    return results


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), length=st.integers(1, 40), width=st.integers(1, 200), vocab=st.integers(1, 60),
       p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), with_positions=st.booleans(), threads=st.sampled_from([1, 2]),
       int32=st.booleans())
def test_fused_input_layer_is_the_operations_one_by_one(batch: int, length: int, width: int, vocab: int, p: float,
                                                        with_positions: bool, threads: int, int32: bool) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(batch * 1000 + length * 10 + width)
        embedding = nn.Embedding(vocab, width)
        tokens = torch.randint(0, vocab, (batch, length), generator=generator)
        tokens = tokens.int() if int32 else tokens
        positions = torch.randn(length, width, generator=generator) if with_positions else None
        (fused, fused_grad, node), (reference, reference_grad, _) = _fused_and_reference(
            tokens, embedding, math.sqrt(width), positions, Dropout(p))
    finally:
        torch.set_num_threads(previous)
    assert type(node).__name__ == "_EmbedDropoutBackward"
    assert torch.equal(fused, reference)  # the same mask, and the same roundings (no fused multiply-add)
    torch.testing.assert_close(fused_grad, reference_grad, rtol=1e-5, atol=1e-5)


def test_the_mask_is_the_dropout_modules_and_eval_mode_has_none() -> None:
    embedding, dropout = nn.Embedding(50, 128), Dropout(0.25)
    tokens = torch.randint(0, 50, (8, 128))
    positions = torch.randn(128, 128)
    (fused, _, _), (reference, _, _) = _fused_and_reference(tokens, embedding, 3.0, positions, dropout)
    kept = (fused != 0).float().mean().item()
    assert kept == pytest.approx(0.75, abs=0.01)
    assert torch.equal(fused, reference)
    dropout.eval()
    plain = embed_tokens(tokens, embedding, 3.0, positions, dropout)
    assert type(plain.grad_fn).__name__ == "_EmbedDropoutBackward"
    assert torch.equal(plain, embedding(tokens) * 3.0 + positions)


@pytest.mark.parametrize("case", ["padding_idx", "torch_dropout", "learned_positions", "hooked", "p_one"])
def test_what_the_kernel_does_not_take_runs_the_operations(case: str) -> None:
    embedding = nn.Embedding(20, 16, padding_idx=0 if case == "padding_idx" else None)
    dropout = nn.Dropout(0.2) if case == "torch_dropout" else Dropout(1.0 if case == "p_one" else 0.2)
    positions = torch.randn(6, 16, requires_grad=case == "learned_positions")
    if case == "hooked":
        embedding.register_forward_hook(lambda module, args, out: out * 2)
    tokens = torch.randint(0, 20, (3, 6))
    torch.manual_seed(0)
    out = embed_tokens(tokens, embedding, 2.0, positions, dropout)
    torch.manual_seed(0)
    assert torch.equal(out, _one_by_one(tokens, embedding, 2.0, positions, dropout))
    assert type(out.grad_fn).__name__ != "_EmbedDropoutBackward"
    out.sum().backward()
    if case == "learned_positions":
        assert positions.grad is not None
    if case == "padding_idx" and (tokens == 0).any():
        assert torch.equal(embedding.weight.grad[0], torch.zeros(16))


@pytest.mark.parametrize("token", [-1, 20])
def test_a_token_outside_the_vocabulary_is_an_index_error(token: int) -> None:
    tokens = torch.randint(0, 20, (2, 5))
    tokens[1, 3] = token
    with pytest.raises(IndexError, match=r"1 token ids outside \[0, 20\)"):
        embed_tokens(tokens, nn.Embedding(20, 8), 1.0, None, Dropout(0.1))


@pytest.mark.parametrize("backbone", ["transformer", "rtransformer", "transformer-xl", "sru", "sru-transformer"])
def test_language_models_train_alike_with_and_without_the_fused_input(backbone: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(backbone=backbone, d_model=32, n_layers=2, n_heads=2, d_ffn=64, dropout=0.2)
    tokens = torch.randint(0, 30, (2, 12))
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(token_embedding_module, "_fuses", lambda *args: False)
        torch.manual_seed(0)
        model = fuse(build_model(cfg, 30))  # the fused model, its input layer fused or (monkeypatched) not
        torch.manual_seed(1)
        logits = model(tokens).logits
        logits.square().mean().backward()
        runs.append((logits.detach(), model.embedding.weight.grad.clone()))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-6)
    assert runs[0][1].abs().sum() > 0
