"""R-Transformer and Transformer-XL: shapes, causality, the localRNN and relative-attention equations,
segment-level memory carried across windows and checkpoints, gate placement, and short training runs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from conftest import for_backbone
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import ModelConfig, RunConfig, apply_overrides, validate
from gatedformer.data import LMStream
from gatedformer.fused import fuse, is_fused
from gatedformer.fused import rtransformer as fused_rtransformer
from gatedformer.fused import transformer_xl as fused_transformer_xl
from gatedformer.gates import SDU
from gatedformer.models import RTransformerLM, TransformerXLLM, backbone_names, build_model
from gatedformer.models.rtransformer import RNN_TYPES, LocalRNN, RecurrentWeights
from gatedformer.models.transformer_xl import RelativeMultiHeadAttention, rel_shift, relative_positions
from gatedformer.train.checkpoint import load_checkpoint, save_checkpoint
from gatedformer.train.loop import train

VOCAB, D, LAYERS = 11, 16, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def rt(**kw: object) -> RTransformerLM:
    args = {"d_model": D, "n_layers": LAYERS, "n_heads": 2, "d_ffn": 24, "dropout": 0.0, "rnn_window": 3}
    return RTransformerLM(VOCAB, **{**args, **kw})


def xl(**kw: object) -> TransformerXLLM:
    args = {"d_model": D, "n_layers": LAYERS, "n_heads": 2, "d_ffn": 24, "dropout": 0.0, "mem_len": 6}
    return TransformerXLLM(VOCAB, **{**args, **kw})


def tokens(batch: int, length: int, seed: int = 0) -> Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


MODELS = {
    "rt-gru": lambda **kw: rt(**kw),
    "rt-lstm": lambda **kw: rt(rnn_type="lstm", **kw),
    "xl": lambda **kw: xl(**kw),
}


# ------------------------------------------------------------------------------------------------
# Shapes, registration


def test_shapes_and_state() -> None:
    torch.manual_seed(0)
    out = rt()(tokens(2, 7))
    assert out.logits.shape == (2, 7, VOCAB) and out.state is None and out.loss is None
    model = xl()
    out = model(tokens(2, 4))
    assert out.logits.shape == (2, 4, VOCAB)
    state = out.state
    assert isinstance(state, list) and [m.shape for m in state] == [(2, 4, D)] * LAYERS
    out = model(tokens(2, 5), state)
    assert out.logits.shape == (2, 5, VOCAB) and [m.shape for m in out.state] == [(2, 6, D)] * LAYERS  # trimmed
    assert xl(mem_len=0)(tokens(2, 4)).state is None
    with_targets = model(tokens(2, 5), state, targets=tokens(2, 5, seed=1))
    assert with_targets.logits is None and with_targets.loss.shape == ()
    assert all(torch.equal(a, b) for a, b in zip(with_targets.state, out.state, strict=True))
    with pytest.raises(ValueError, match="batch=3"):
        model(tokens(3, 5), state)


@pytest.mark.parametrize("mem_len", [3, 4, 6, 11])
def test_memories_are_the_last_layer_inputs_of_the_windows_so_far(mem_len: int) -> None:
    """Over windows of 4 and 5 positions, each layer's memory holds its inputs at the last ``mem_len`` positions
    seen (fewer at first), copied: changing the activations afterwards does not change it."""
    torch.manual_seed(0)
    model = xl(mem_len=mem_len).eval()
    seen: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]
    hooks = [layer.register_forward_pre_hook(lambda _, args, i=i: seen[i].append(args[0].detach().clone()))
             for i, layer in enumerate(model.layers)]
    state = None
    with torch.no_grad():
        for length in (4, 5, 4):
            inputs: list[torch.Tensor] = []
            captured = model.layers[0].register_forward_pre_hook(lambda _, args, into=inputs: into.append(args[0]))
            state = model(tokens(2, length), state).state
            captured.remove()
            for i, memory in enumerate(state):
                expected = torch.cat(seen[i], dim=1)[:, -mem_len:]
                assert torch.equal(memory, expected)
            inputs[0].add_(1.0)  # the activations change; the memory taken from them must not
            assert torch.equal(state[0], torch.cat(seen[0], dim=1)[:, -mem_len:])
    for hook in hooks:
        hook.remove()


def test_builders_pass_the_backbone_fields() -> None:
    assert {"rtransformer", "transformer-xl"} <= set(backbone_names())
    cfg = ModelConfig(backbone="rtransformer", d_model=D, n_heads=2, d_ffn=24, n_layers=2, rnn_type="lstm",
                      rnn_window=5, gates="+σ SDU")
    model = build_model(cfg, VOCAB)
    assert isinstance(model, RTransformerLM)
    local = model.layers[0].local_rnn.body
    assert isinstance(local.rnn.reference(), nn.LSTM) and local.window == 5
    model = build_model(ModelConfig(backbone="transformer-xl", d_model=D, n_heads=2, d_ffn=24, mem_len=9), VOCAB)
    assert isinstance(model, TransformerXLLM) and model.mem_len == 9


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_autocast(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name](norm="pre")
    state = None
    for seed in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tokens(2, 5, seed=seed), state)
        logits, state = out.logits, out.state
        F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens(2, 5, seed=9).reshape(-1)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# Causality


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_causal(name: str, norm: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name](norm=norm, gates="+tanh SDU").eval()
    state = model(tokens(2, 5, seed=3)).state  # a memory for the XL model, None otherwise
    x = tokens(2, 9)
    for t in (0, 4, 7):
        changed = x.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
        a = model(x, state).logits
        b = model(changed, state).logits
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=0)
        assert not torch.allclose(a[:, t + 1], b[:, t + 1])


# ------------------------------------------------------------------------------------------------
# LocalRNN against the naive formulation


@pytest.mark.parametrize("rnn_type", list(RNN_TYPES))
def test_recurrent_weights_are_those_of_the_torch_module(rnn_type: str) -> None:
    # same names, shapes and random draws: seeded models and checkpoints are as when the LocalRNN held the module
    torch.manual_seed(5)
    module = RNN_TYPES[rnn_type](D, D, num_layers=1, batch_first=True)
    torch.manual_seed(5)
    weights = RecurrentWeights(rnn_type, D)
    expected, got = module.state_dict(), weights.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    reference = weights.reference()
    assert type(reference) is type(module) and reference.weight_hh_l0 is weights.weight_hh_l0
    x = torch.randn(2, 4, D)
    assert torch.equal(reference(x)[0], module(x)[0])
    reference(x)[0].sum().backward()
    assert weights.bias_ih_l0.grad is not None
    with pytest.raises(ValueError, match="unknown rnn_type"):
        RecurrentWeights("elman", D)


def local_rnn_unfold(module: LocalRNN, x: Tensor) -> Tensor:
    """The direct reading: copy every window (B, L, M, d), run the module's nn.GRU/LSTM/RNN over each."""
    batch, length, d = x.shape
    m = module.window
    windows = F.pad(x, (0, 0, m - 1, 0)).unfold(1, m, 1)  # (B, L, d, M)
    windows = windows.permute(0, 1, 3, 2).reshape(batch * length, m, d)
    out, _ = module.rnn.reference()(windows)
    return out[:, -1].reshape(batch, length, d)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("rnn_type", ["gru", "lstm", "rnn"])
@pytest.mark.parametrize("window", [1, 3, 9])
def test_local_rnn_equals_unfold(rnn_type: str, window: int, fused: bool) -> None:
    torch.manual_seed(window)
    module = LocalRNN(5, window, rnn_type).double()
    with torch.no_grad():  # random biases too, so a misplaced bias term would show
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    if fused:
        module = fuse(module)
    x = torch.randn(2, 6, 5, dtype=torch.double, requires_grad=True)
    weights = torch.randn(2, 6, 5, dtype=torch.double)
    fast, slow = module(x), local_rnn_unfold(module, x)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    params = [x, *module.parameters()]
    grads_fast = torch.autograd.grad((fast * weights).sum(), params, allow_unused=True)
    grads_slow = torch.autograd.grad((slow * weights).sum(), params)
    for p, a, b in zip(params, grads_fast, grads_slow, strict=True):
        # With a window of 1 the hidden-to-hidden weights only ever meet the zero state: no gradient.
        torch.testing.assert_close(torch.zeros_like(p) if a is None else a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_local_rnn_never_holds_a_copy_per_window(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """The steps one by one (the compiled recurrence's own test is in test_local_rnn_kernel.py)."""
    monkeypatch.setenv("GATEDFORMER_PACKED_GEMM", "0")
    batch, length, d, window = 2, 8, 4, 7
    module = LocalRNN(d, window, "gru")
    module = fuse(module) if fused else module
    largest = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal largest
        largest = max(largest, t.numel())
        return t

    x = torch.randn(batch, length, d, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    # Step tensors are (L·B, 3d) at most (plus the padded input projection): never (B, L, M, ·).
    assert largest <= (length + window - 1) * batch * 3 * d < batch * length * window * 3 * d


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("rnn_type", ["gru", "lstm", "rnn"])
def test_local_rnn_recompute_gives_the_same_values_and_gradients_and_keeps_only_the_input(rnn_type: str,
                                                                                           fused: bool) -> None:
    torch.manual_seed(1)
    kept, recomputed = LocalRNN(6, 4, rnn_type), LocalRNN(6, 4, rnn_type, recompute=True)
    recomputed.load_state_dict(kept.state_dict())
    if fused:
        kept, recomputed = fuse(kept), fuse(recomputed)
    x = torch.randn(2, 9, 6, requires_grad=True)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = recomputed(x)
    # The forward pass keeps the input alone (some torch versions also save an empty placeholder).
    kept_tensors = [t for t in saved if t.numel()]
    assert len(kept_tensors) == 1 and kept_tensors[0] is x
    assert torch.equal(out, kept(x))
    params = [x, *kept.parameters()]
    expected = torch.autograd.grad(kept(x).square().sum(), params)
    got = torch.autograd.grad(out.square().sum(), [x, *recomputed.parameters()])
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Relative attention equations


def sinusoid(distance: int, d: int) -> Tensor:
    out = torch.zeros(d, dtype=torch.double)
    for k in range(0, d, 2):
        angle = distance * 10000.0 ** (-k / d)
        out[k] = math.sin(angle)
        out[k + 1] = math.cos(angle)
    return out


def test_rel_shift_places_each_distance() -> None:
    q_len, k_len = 3, 7
    # Column c holds distance k_len - 1 - c; after the shift query i / key j must hold i + (k_len - q_len) - j.
    by_distance = (k_len - 1 - torch.arange(k_len)).expand(q_len, k_len).clone()
    shifted = rel_shift(by_distance[None, None])[0, 0]
    for i in range(q_len):
        for j in range(k_len - q_len + i + 1):
            assert shifted[i, j] == k_len - q_len + i - j
    # Already padded (the spare column's content only ever lands on masked future keys).
    padded = torch.cat([torch.full((q_len, 1), -1), by_distance], dim=1)
    valid = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    assert torch.equal(rel_shift(padded[None], padded=True)[0][valid], shifted[valid])


def test_relative_attention_equals_direct_a_b_c_d() -> None:
    torch.manual_seed(0)
    d, heads, batch, q_len, m_len = 8, 2, 2, 4, 3
    dh = d // heads
    attn = RelativeMultiHeadAttention(d, heads).double().eval()
    with torch.no_grad():
        attn.u.normal_()
        attn.v.normal_()
    h = torch.randn(batch, q_len, d, dtype=torch.double)
    memory = torch.randn(batch, m_len, d, dtype=torch.double)
    pos = relative_positions(m_len + q_len + 2, d, dtype=torch.double)  # extra rows: only the tail is used
    context = torch.cat([memory, h], dim=1)
    w_q = attn.query.weight
    w_k, w_v = attn.key_value.weight.chunk(2, dim=0)
    direct = torch.full((batch, heads, q_len, m_len + q_len), float("-inf"), dtype=torch.double)
    for b in range(batch):
        for n in range(heads):
            rows = slice(n * dh, (n + 1) * dh)
            for i in range(q_len):
                q = w_q[rows] @ h[b, i]
                for j in range(m_len + i + 1):  # keys up to the query's own position m_len + i
                    k = w_k[rows] @ context[b, j]
                    r = attn.position.weight[rows] @ sinusoid(m_len + i - j, d)
                    a, b_term, c, d_term = q @ k, q @ r, attn.u[n] @ k, attn.v[n] @ r
                    direct[b, n, i, j] = (a + b_term + c + d_term) / math.sqrt(dh)
    with torch.no_grad():
        torch.testing.assert_close(attn.scores(h, memory, pos), direct)
        values = (context @ w_v.T).view(batch, m_len + q_len, heads, dh).transpose(1, 2)
        expected = attn.out((direct.softmax(-1) @ values).transpose(1, 2).reshape(batch, q_len, d))
        torch.testing.assert_close(attn(h, memory, pos), expected)


def test_fused_relative_attention_matches_the_reference_with_and_without_a_cache() -> None:
    """The kernel's attention (float32, no attention dropout) against the reference's, on the whole window and
    position by position through the cache."""
    torch.manual_seed(0)
    attention = RelativeMultiHeadAttention(16, 2).eval()
    fused = fuse(copy.deepcopy(attention))
    h, memory = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 3, 16)
    pos = relative_positions(12, 16)
    expected, got = attention(h, memory, pos), fused(h, memory, pos)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(got, [h, *fused.parameters()], grad),
                    torch.autograd.grad(expected, [h, *attention.parameters()], grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        cache: dict[str, Tensor] = {}
        steps = torch.cat([fused(h[:, t : t + 1], memory, pos, cache) for t in range(5)], dim=1)
    torch.testing.assert_close(steps, expected.detach(), rtol=1e-5, atol=1e-5)
    assert not hasattr(attention, "add_norm") and hasattr(fused, "add_norm")  # the whole sublayer is fused only


# ------------------------------------------------------------------------------------------------
# The fused models against the reference

FUSED_CASES = {
    "xl": lambda: xl(),
    "xl +σ SDU": lambda: xl(gates="+σ SDU"),
    "xl +highway gate": lambda: xl(gates="+highway gate"),
    "xl +gated MHDPA": lambda: xl(gates="+gated MHDPA"),
    "xl +EAU+GRC": lambda: xl(gates="+EAU+GRC"),
    "xl +tanh L2": lambda: xl(gates="+tanh L2"),
    "xl pre-LN +σ SDU": lambda: xl(norm="pre", gates="+σ SDU"),
    "xl no memory": lambda: xl(mem_len=0),
    "rt-gru +σ SDU": lambda: rt(gates="+σ SDU"),
    "rt-lstm pre-LN": lambda: rt(rnn_type="lstm", norm="pre"),
    "rt-rnn": lambda: rt(rnn_type="rnn"),
    "rt-gru window 1": lambda: rt(rnn_window=1),
}


def _train_windows(model: nn.Module) -> list[Tensor]:
    """Two training windows (the second after the first's state), their losses and then every parameter's
    gradient."""
    state, losses = None, []
    for seed in range(2):
        out = model(tokens(3, 7, seed=seed), state, targets=tokens(3, 7, seed=10 + seed))
        out.loss.backward()
        state, losses = out.state, [*losses, out.loss.detach()]
    return [*losses, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_the_fused_model_computes_what_the_reference_computes(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training mode without dropout (so no mask is drawn): the same losses and gradients to float rounding, with the
    fused paths taken where they apply."""
    torch.manual_seed(0)
    reference = FUSED_CASES[case]()
    fused = fuse(copy.deepcopy(reference))
    assert not any(is_fused(m) for m in reference.modules()) and is_fused(fused.layers[0].attn.body)
    calls: list[str] = []
    for module, name in ((fused_transformer_xl, "layer_stack"), (fused_transformer_xl, "relative_attention_add_norm"),
                         (fused_transformer_xl, "relative_attention"), (fused_rtransformer, "local_recurrence"),
                         (fused_rtransformer, "gru_step"), (fused_rtransformer, "lstm_step")):
        function = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=function, _n=name: calls.append(_n) or _f(*a))
    for a, b in zip(_train_windows(fused), _train_windows(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    expected_paths = ({"local_recurrence", "gru_step", "lstm_step"} if case.startswith("rt") and "rnn" not in case
                      else {"layer_stack", "relative_attention_add_norm", "relative_attention"} if case.startswith("xl")
                      else set())
    assert not expected_paths or set(calls) & expected_paths, calls
    with torch.no_grad():
        fused.eval()
        reference.eval()
        state = reference(tokens(3, 7, seed=4)).state
        torch.testing.assert_close(fused(tokens(3, 7, seed=5), state).logits,
                                   reference(tokens(3, 7, seed=5), state).logits, rtol=1e-4, atol=1e-5)
        # Incremental decoding on the fused model gives the reference's full recomputation.
        cache = fused.new_cache(state)
        x = tokens(3, 7, seed=5)
        steps = torch.cat([fused.step(x[:, :3], cache)] + [fused.step(x[:, t : t + 1], cache) for t in range(3, 7)],
                          dim=1)
        torch.testing.assert_close(steps, reference(x, state).logits, rtol=1e-4, atol=1e-5)


def test_fusing_keeps_the_state_dict() -> None:
    torch.manual_seed(0)
    for make in (xl, rt):
        model = make(gates="+σ SDU", tie_embeddings=True)
        keys = list(model.state_dict())
        assert list(fuse(model).state_dict()) == keys
        assert "embedding.weight" in keys and "output.weight" in keys and "output.bias" in keys
        assert model.output.weight is model.embedding.weight


# ------------------------------------------------------------------------------------------------
# Segment-level memory


def test_memory_extends_the_attention_span() -> None:
    torch.manual_seed(0)
    model = xl().eval()
    first, second = tokens(2, 5, seed=1), tokens(2, 5, seed=2)
    state = model(first).state
    with_memory = model(second, state).logits
    without = model(second).logits
    assert not torch.allclose(with_memory[:, 0], without[:, 0])
    other_state = model(tokens(2, 5, seed=7)).state
    assert not torch.allclose(model(second, other_state).logits[:, 0], with_memory[:, 0])


def test_no_gradient_flows_into_memory_and_every_parameter_learns() -> None:
    torch.manual_seed(0)
    model = xl(gates="+σ SDU")
    state = model(tokens(2, 5, seed=1)).state  # built with autograd on
    assert all(not m.requires_grad and m.grad_fn is None for m in state)
    out = model(tokens(2, 5, seed=2), state)
    assert all(not m.requires_grad for m in out.state)
    F.cross_entropy(out.logits.reshape(-1, VOCAB), tokens(2, 5, seed=3).reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("rnn_type", ["gru", "lstm", "rnn"])
def test_every_rtransformer_parameter_learns(rnn_type: str) -> None:
    torch.manual_seed(0)
    model = rt(rnn_type=rnn_type, gates="+tanh SDU")
    logits = model(tokens(2, 6)).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), tokens(2, 6, seed=1).reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def window_losses(model: nn.Module, stream: LMStream, windows: range, state: object = None) -> tuple[list, object]:
    losses = []
    with torch.no_grad():
        for k in windows:
            x, y = stream.window(k)
            out = model(x, state)
            logits, state = out.logits, out.state
            losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item())
    return losses, state


def test_evaluation_resumed_midway_matches_one_pass(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = xl(dropout=0.1).eval()
    stream = LMStream(tokens(1, 2 * 6 * 5 + 3, seed=5)[0], batch_size=2, seq_len=5)  # last window shorter
    n = len(stream)
    whole, _ = window_losses(model, stream, range(n))
    head, state = window_losses(model, stream, range(3))
    tail, _ = window_losses(model, stream, range(3, n), state)
    assert head + tail == whole
    save_checkpoint(tmp_path, 3, model, {}, {}, state)
    carried = load_checkpoint(tmp_path / "ckpt" / "step-00000003", with_trainer=False).carry
    assert isinstance(carried, list) and all(torch.equal(a, b) for a, b in zip(carried, state, strict=True))
    resumed, _ = window_losses(model, stream, range(3, n), carried)
    assert head + resumed == whole
    fresh, _ = window_losses(model, stream, range(3, n))
    assert fresh[0] != whole[3]  # the memory does matter


# ------------------------------------------------------------------------------------------------
# Gate placement


@pytest.mark.parametrize("factory", [rt, xl], ids=["rtransformer", "transformer-xl"])
def test_gates_are_placed_by_spec(factory) -> None:
    base = n_params(factory())
    assert n_params(factory(gates="+tanh L2")) - base == 2 * 2 * D * (D + 1)
    assert n_params(factory(gates="+σ SDU")) - base == LAYERS * 2 * 2 * D * (D + 1)
    model = factory(gates="+tanh L2")
    for i, layer in enumerate(model.layers):
        for site in ("attn", "ffn"):
            sdu = getattr(layer, site).sdu
            assert (sdu is not None) == (i == 1)
            assert sdu is None or (isinstance(sdu, SDU) and sdu.gate == "tanh")
        if isinstance(model, RTransformerLM):
            assert layer.local_rnn.sdu is None and layer.local_rnn.highway is None
    model = factory(gates="+σ L1-2\\FFN")
    assert [layer.attn.sdu is not None for layer in model.layers] == [True, True, False]
    assert all(layer.ffn.sdu is None for layer in model.layers)


# ------------------------------------------------------------------------------------------------
# Training through the trainer


@pytest.fixture
def corpus(tmp_path: Path) -> str:
    words = ["ab", "cab", "bad", "dab", "a", "cd"]
    picks = torch.randint(0, len(words), (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    path = tmp_path / "tiny.txt"
    path.write_text(" ".join(words[i] for i in picks) + "\n", encoding="utf-8")
    return f"text:{path}"


def tiny_config(corpus: str, backbone: str) -> RunConfig:
    return validate(apply_overrides(RunConfig(), for_backbone(backbone, [
        f"data.corpus={corpus}", "data.batch_size=4", "data.seq_len=12", "data.eval_batch_size=4",
        "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "model.d_ffn=32", "model.dropout=0.1", "model.mem_len=12", "model.rnn_window=3", "model.gates=+σ L2",
        "optim.lr=0.01", "train.steps=16", "train.eval_every=8", "train.log_every=4", "train.eval_windows=2",
    ])))


@pytest.mark.parametrize("backbone", ["rtransformer", "transformer-xl"])
def test_trains_and_resumes(corpus: str, tmp_path: Path, backbone: str) -> None:
    import json

    whole = train(tiny_config(corpus, backbone), tmp_path / "whole", progress=False)
    log = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in log if r["event"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.15, losses
    assert train(tiny_config(corpus, backbone), tmp_path / "split", progress=False, stop_after=8) is None
    resumed = train(tiny_config(corpus, backbone), tmp_path / "split", progress=False, resume=True)
    assert (resumed.valid_loss, resumed.test_loss) == (whole.valid_loss, whole.test_loss)
