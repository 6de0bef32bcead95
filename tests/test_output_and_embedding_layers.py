"""Each fused implementation of this part (the output loss, the token embedding, ConvS2S's convolution) against its
plain-PyTorch reference: the same values and gradients up to float rounding."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gatedformer.fused import fuse, is_fused
from gatedformer.kernels import cross_entropy as _cross_entropy_kernel
from gatedformer.kernels import dropout as _dropout_kernel
from gatedformer.models.bert import BertForMaskedLM
from gatedformer.models.convs2s import ConvGLU, ConvS2S
from gatedformer.models.seq2seq import Seq2SeqTransformer
from gatedformer.models.sru import SRULanguageModel
from gatedformer.models.transformer import TransformerLM
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.embedding import TokenEmbedding
from gatedformer.nn.output import OutputLayer


def _native_or_skip(kernel) -> None:  # noqa: ANN001
    if kernel.KERNEL.pick_backend(torch.device("cpu")) != "native":
        pytest.skip(f"the kernel is unavailable here: {kernel.KERNEL.error}")


def test_an_output_layer_keeps_nn_linear_state_dict_keys_and_its_logits() -> None:
    layer, linear = OutputLayer(8, 11), nn.Linear(8, 11)
    assert layer.state_dict().keys() == linear.state_dict().keys()
    linear.load_state_dict(layer.state_dict())
    hidden = torch.randn(3, 5, 8)
    torch.testing.assert_close(layer(hidden), linear(hidden), rtol=0, atol=0)


@pytest.mark.parametrize(("reduction", "smoothing", "bias"), [("mean", 0.0, True), ("sum", 0.1, True),
                                                              ("mean", 0.0, False)])
def test_fused_output_loss_is_the_reference_in_value_and_gradients(reduction: str, smoothing: float,
                                                                  bias: bool) -> None:
    _native_or_skip(_cross_entropy_kernel)
    torch.manual_seed(0)
    layer = OutputLayer(16, 37, bias=bias)
    fused = fuse(copy.deepcopy(layer))
    assert is_fused(fused) and not is_fused(layer)
    hidden = torch.randn(4, 9, 16, requires_grad=True)
    targets = torch.randint(0, 37, (4, 9))
    targets[0, :3] = -100
    results = []
    for module in (layer, fused):
        hidden.grad = None
        loss = module.loss(hidden, targets, reduction=reduction, label_smoothing=smoothing)
        loss.backward()
        grads = [hidden.grad] + [p.grad for p in module.parameters()]
        results.append((loss.detach(), grads))
    (ref_loss, ref_grads), (fused_loss, fused_grads) = results
    # the fused path really is another computation: no logits tensor, the kernel's autograd node
    torch.testing.assert_close(fused_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_output_loss_runs_the_kernel_and_hooks_see_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_or_skip(_cross_entropy_kernel)
    library = _cross_entropy_kernel.KERNEL.library()
    native, calls = library.softmax_cross_entropy_f32, []
    monkeypatch.setattr(library, "softmax_cross_entropy_f32", lambda *args: calls.append(args) or native(*args))
    layer = fuse(OutputLayer(8, 13))
    hidden, targets = torch.randn(2, 5, 8), torch.randint(0, 13, (2, 5))
    layer.loss(hidden, targets)
    assert calls, "the fused loss did not call the cross-entropy kernel"
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    calls.clear()
    torch.testing.assert_close(layer.loss(hidden, targets), OutputLayer.loss(layer, hidden, targets))
    assert seen == [(2, 5, 13), (2, 5, 13)] and not calls


def test_a_token_embedding_keeps_nn_embedding_state_dict_keys_and_padding() -> None:
    table, plain = TokenEmbedding(20, 6, padding_idx=0), nn.Embedding(20, 6, padding_idx=0)
    assert table.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(table.state_dict())
    tokens = torch.randint(0, 20, (3, 7))
    torch.testing.assert_close(table(tokens), plain(tokens), rtol=0, atol=0)
    torch.testing.assert_close(fuse(table)(tokens), plain(tokens), rtol=0, atol=0)  # padding_idx: the reference


@pytest.mark.parametrize(("p", "with_positions", "training"), [(0.0, False, True), (0.3, True, True),
                                                               (0.3, True, False)])
def test_fused_token_embedding_is_the_reference_in_value_and_gradients(p: float, with_positions: bool,
                                                                      training: bool) -> None:
    _native_or_skip(_dropout_kernel)
    torch.manual_seed(0)
    table = TokenEmbedding(30, 24)
    fused = fuse(copy.deepcopy(table))
    dropout = Dropout(p).train(training)
    tokens = torch.randint(0, 30, (3, 11))
    positions = torch.randn(11, 24) if with_positions else None
    grad_out = torch.randn(3, 11, 24)
    results = []
    for module in (table, fused):
        torch.manual_seed(5)  # the same dropout mask: the fused pass draws its seed as the module does
        out = module(tokens, 2.5, positions, dropout)
        out.backward(grad_out)
        results.append((out.detach(), module.weight.grad, out.grad_fn))
    (ref_out, ref_grad, ref_node), (fused_out, fused_grad, fused_node) = results
    assert type(fused_node) is not type(ref_node)  # the one-pass kernel, not the operations
    torch.testing.assert_close(fused_out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_convs2s_convolution_is_the_reference_in_value_and_gradients(causal: bool) -> None:
    torch.manual_seed(0)
    block = ConvGLU(12, 10, 3, dropout=0.0, causal=causal, weight_norm=True)
    fused = fuse(copy.deepcopy(block))
    x = torch.randn(2, 7, 12)
    pad_mask = torch.ones(2, 7, dtype=torch.bool)
    pad_mask[1, 5:] = False
    results = []
    for module in (block, fused):
        leaf = x.clone().requires_grad_(True)
        out = module(leaf, pad_mask)
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad, [p.grad for p in module.parameters()]))
    (ref_out, ref_grad, ref_params), (fused_out, fused_grad, fused_params) = results
    assert is_fused(fused) and not is_fused(block)
    torch.testing.assert_close(fused_out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, ref_grad, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_params, ref_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cache: dict[str, torch.Tensor] = {}
    if causal:  # one position at a time, through the cache, as the whole
        with torch.no_grad():
            steps = torch.cat([fused.step(x[:, t: t + 1], cache) for t in range(7)], dim=1)
            torch.testing.assert_close(steps, fused(x), rtol=1e-5, atol=1e-6)


def _whole_models() -> dict[str, Callable[[], nn.Module]]:
    return {
        "transformer": lambda: TransformerLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.0,
                                             tie_embeddings=True),
        "sru": lambda: SRULanguageModel(23, 16, 2),
        "seq2seq": lambda: Seq2SeqTransformer(23, 23, layers=2, d_model=16, ffn=32, heads=2, max_len=16, dropout=0.0,
                                              tie_embeddings=True, share_embeddings=True),
        "convs2s": lambda: ConvS2S(23, 23, embed_dim=16, encoder_layers=[(16, 3)] * 2, max_len=16, dropout=0.0),
        "bert": lambda: BertForMaskedLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.0,
                                        attn_dropout=0.0, max_positions=16),
    }


@pytest.mark.parametrize("name", list(_whole_models()))
def test_a_fused_model_keeps_its_weights_and_computes_its_references_loss(name: str) -> None:
    """Fusing changes no parameter, tie or state-dict key, and the loss and every gradient are the reference's up to
    float rounding."""
    torch.manual_seed(0)
    reference = _whole_models()[name]()
    fused = fuse(copy.deepcopy(reference))
    assert list(fused.state_dict()) == list(reference.state_dict())
    output = fused.head.decoder if name == "bert" else fused.output
    assert is_fused(output) and not any(is_fused(m) for m in reference.modules())
    if name in ("transformer", "seq2seq"):
        table = fused.embedding if name == "transformer" else fused.embed_tgt
        assert fused.output.weight is table.weight
    tokens, targets = torch.randint(4, 23, (3, 9)), torch.randint(4, 23, (3, 9))
    targets[0, -2:] = 1
    results = []
    for model in (reference, fused):
        model.train()
        if name in ("transformer", "sru"):
            out = model(tokens, targets=targets)
        elif name == "bert":
            out = model(tokens, positions=torch.tensor([[1, 4]] * 3), targets=targets[:, :2], ignore_index=1)
        else:
            out = model(tokens, tokens, targets=targets, ignore_index=1)
        assert out.logits is None
        params = [p for p in model.parameters() if p.requires_grad]
        results.append((out.loss, *torch.autograd.grad(out.loss, params)))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
