"""The gated convolutional LM, its GLU initialisation, and the per-layer variance check at initialisation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from gatedformer.analysis.init_check import format_init_check, init_check, layer_sites, measure_layers
from gatedformer.cli import main
from gatedformer.config import InitConfig, ModelConfig, RunConfig, build_config, load_recipe
from gatedformer.fused import fuse
from gatedformer.fused import gcnn as fused_gcnn
from gatedformer.models import backbone_names, build_model
from gatedformer.models.gcnn import EMBEDDING_STD, GatedConvLayer, GatedConvLM, causal_conv1d, glu_init_std
from gatedformer.ops import causal_conv
from gatedformer.train.init import initialise

V = 50


pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def _convs(model: GatedConvLM) -> list[GatedConvLayer]:
    return [m for m in model.modules() if isinstance(m, GatedConvLayer)]


@pytest.mark.parametrize("bottleneck", [0, 4])
def test_shapes_and_interface(bottleneck: int) -> None:
    model = GatedConvLM(V, 16, 3, kernel_size=3, bottleneck=bottleneck)
    out = model(_tokens(3, 7))
    assert out.logits.shape == (3, 7, V) and out.state is None and out.loss is None
    assert model.receptive_field == 3 * 2 + 1
    if bottleneck:
        shapes = [tuple(c.conv.weight.shape) for c in _convs(model)[:3]]
        assert shapes == [(2 * 4, 16, 1), (2 * 4, 4, 3), (2 * 16, 4, 1)]
        assert model.layers[0].branch(torch.randn(2, 5, 16)).shape == (2, 5, 16)  # channels-last
    else:
        assert [tuple(c.conv.weight.shape) for c in _convs(model)] == [(32, 16, 3)] * 3


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 9), channels=st.integers(1, 6), out=st.integers(1, 6),
       width=st.integers(1, 5), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_causal_conv1d_matches_conv1d(batch: int, length: int, channels: int, out: int, width: int, bias: bool,
                                      seed: int) -> None:
    """Values and all three gradients against ``conv1d`` of the left-padded, channels-first input."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, channels, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(out, channels, width, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(out, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    grad = torch.randn(batch, length, out, generator=gen, dtype=torch.float64)
    want = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight, b).transpose(1, 2)
    inputs = [x, weight] + ([b] if bias else [])
    # The model's reference and the fused one (matrix products over shifted windows).
    for function in (causal_conv1d, causal_conv.causal_conv1d):
        got = function(x, weight, b)
        torch.testing.assert_close(got, want)
        want_grads = torch.autograd.grad(want, inputs, grad, retain_graph=True)
        for g_got, g_want in zip(torch.autograd.grad(got, inputs, grad), want_grads, strict=True):
            torch.testing.assert_close(g_got, g_want)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fused_glu_residual_matches_the_modules(dropout: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain block's ``x + GLU(conv(x))`` in one pass (no hooks) against the modules (a hook forces them)."""
    from gatedformer.ops import fused_gates

    fused_calls = []
    split_tail = fused_gates._SplitTail.apply
    monkeypatch.setattr(fused_gates._SplitTail, "apply", lambda *args: fused_calls.append(args[2]) or split_tail(*args))
    torch.manual_seed(3)
    model = fuse(GatedConvLM(V, 16, 2, kernel_size=3, dropout=dropout))
    tokens = _tokens(2, 9)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # the same dropout masks on both paths
        logits = model(tokens).logits
        F.cross_entropy(logits.reshape(-1, V), tokens.reshape(-1)).backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    fused_logits, fused_grads = run()
    assert fused_calls == ["sdu-sigmoid"] * 2 or fused_gates.KERNEL.pick_backend(torch.device("cpu")) != "native"
    hooks = [block.branch.register_forward_hook(lambda *args: None) for block in model.layers]
    plain_logits, plain_grads = run()
    assert len(fused_calls) <= 2
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_causal_conv1d_rejects_mismatched_shapes() -> None:
    for function in (causal_conv1d, causal_conv.causal_conv1d):
        with pytest.raises(ValueError, match="causal_conv1d takes x"):
            function(torch.randn(2, 5, 3), torch.randn(4, 2, 3))


FUSED_CASES = {
    "plain": {},
    "bottleneck": {"bottleneck": 6},
    "weight norm": {"weight_norm": True},
    "tied, width 1": {"tie_embeddings": True, "kernel_size": 1},
}


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_the_fused_model_computes_what_the_reference_computes(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without dropout: the same loss and gradients to float rounding, the fused convolutions taken; and the fused
    model's incremental steps give the reference's full recomputation."""
    torch.manual_seed(4)
    reference = GatedConvLM(V, 16, 3, **{"kernel_size": 3, **FUSED_CASES[case]})
    fused = fuse(copy.deepcopy(reference))
    assert list(fused.state_dict()) == list(reference.state_dict())
    calls = []
    convolve = fused_gcnn.causal_conv1d
    monkeypatch.setattr(fused_gcnn, "causal_conv1d", lambda *args: calls.append(1) or convolve(*args))
    tokens = _tokens(3, 9)
    losses = [m(tokens[:, :-1], targets=tokens[:, 1:]).loss for m in (fused, reference)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    assert calls
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(fused.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        cache = fused.new_cache()
        steps = torch.cat([fused.step(tokens[:, :4], cache)] + [fused.step(tokens[:, t : t + 1], cache)
                                                               for t in range(4, 9)], dim=1)
        torch.testing.assert_close(steps, reference(tokens).logits, rtol=1e-5, atol=1e-6)


def test_builder_and_recipe() -> None:
    cfg = ModelConfig(backbone="gcnn", d_model=8, n_layers=2, kernel_size=2, bottleneck=4, weight_norm=True,
                      tie_embeddings=True, dropout=0.2)
    model = build_model(cfg, V)
    assert isinstance(model, GatedConvLM) and "gcnn" in backbone_names()
    assert model.output.weight is model.embedding.weight
    assert model.bottleneck == 4 and model.weight_norm and model.kernel_size == 2
    recipe = load_recipe("wikitext2-gcnn-tiny")
    for variant in recipe.variants:
        config = build_config(recipe, [], variant)
        assert config.model.backbone == "gcnn" and config.init.scheme == "default"
    assert {build_config(recipe, [], v).model.weight_norm for v in recipe.variants} == {False, True}


@pytest.mark.parametrize("bottleneck", [0, 3])
def test_causal(bottleneck: int) -> None:
    torch.manual_seed(0)
    model = GatedConvLM(V, 12, 3, kernel_size=3, bottleneck=bottleneck).eval()
    tokens = _tokens(2, 10)
    for t in (0, 4, 8):
        changed = tokens.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % V
        a = model(tokens).logits
        b = model(changed).logits
        assert torch.equal(a[:, : t + 1], b[:, : t + 1])
        assert not torch.allclose(a[:, t + 1], b[:, t + 1])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("bottleneck", [0, 24])
def test_glu_init_std_on_weights(dropout: float, bottleneck: int) -> None:
    torch.manual_seed(1)
    model = GatedConvLM(V, 48, 2, kernel_size=4, dropout=dropout, bottleneck=bottleneck)
    initialise(model, InitConfig("default"))  # what the trainer does: must leave the GLU init alone
    keep = 1.0 - dropout
    for layer in _convs(model):
        w = layer.conv.weight
        n = w.shape[1] * w.shape[2]  # fan-in: input channels x kernel width
        expected = math.sqrt(4 * keep / n)
        assert layer.init_std == pytest.approx(expected) == pytest.approx(glu_init_std(n, dropout))
        # the std of N >= 2304 draws is within a few percent of sigma
        assert w.std().item() == pytest.approx(expected, rel=0.08)
        assert abs(w.mean().item()) < 0.1 * expected
        assert torch.count_nonzero(layer.conv.bias) == 0
    out = model.output.weight
    assert out.std().item() == pytest.approx(math.sqrt(keep / 48), rel=0.05)  # not followed by a GLU
    assert model.embedding.weight.std().item() == pytest.approx(EMBEDDING_STD, rel=0.05)


def test_weight_norm_keeps_init_and_trains() -> None:
    torch.manual_seed(2)
    plain = GatedConvLM(V, 16, 2, kernel_size=3)
    torch.manual_seed(2)
    normed = GatedConvLM(V, 16, 2, kernel_size=3, weight_norm=True)
    conv = normed.layers[0].branch[0].conv
    names = {name for name, _ in normed.named_parameters()}
    assert "layers.0.branch.0.conv.parametrizations.weight.original0" in names  # g
    assert "layers.0.branch.0.conv.parametrizations.weight.original1" in names  # v
    for a, b in zip(_convs(plain), _convs(normed), strict=True):
        assert torch.allclose(a.conv.weight, b.conv.weight, atol=1e-6)  # same effective init
    initialise(normed, InitConfig("default"))
    assert torch.allclose(conv.weight, plain.layers[0].branch[0].conv.weight, atol=1e-6)

    tokens = _tokens(4, 10)
    g_before = conv.parametrizations.weight.original0.detach().clone()
    losses = []
    for _ in range(2):  # one plain SGD step, then the loss after it
        logits = normed(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
        normed.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in normed.parameters():
                p -= 0.5 * p.grad
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0]
    assert not torch.equal(g_before, conv.parametrizations.weight.original0)


def test_other_init_schemes_reach_weight_normed_convs() -> None:
    model = GatedConvLM(V, 16, 2, weight_norm=True)
    initialise(model, InitConfig("uniform", 0.01))
    w = model.layers[1].branch[0].conv.weight
    assert w.abs().max().item() <= 0.01 + 1e-6 and w.std().item() > 0.004
    assert model.layers[1].branch[0].conv.parametrizations.weight.original1.requires_grad


@pytest.mark.parametrize("bottleneck", [0, 4])
def test_gradient_flow(bottleneck: int) -> None:
    torch.manual_seed(3)
    model = GatedConvLM(V, 8, 3, kernel_size=2, dropout=0.1, bottleneck=bottleneck, tie_embeddings=True)
    tokens = _tokens(2, 9)
    logits = model(tokens[:, :-1]).logits
    F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if not name.endswith("bias"):  # biases at zero still get gradients, weights must
            assert p.grad.abs().sum() > 0, name


def test_init_check_sites_and_near_one_forward(text_corpus: str) -> None:
    config = RunConfig()
    overrides = {"data.corpus": text_corpus, "data.batch_size": 8, "data.seq_len": 32, "model.backbone": "gcnn",
                 "model.d_model": 64, "model.n_layers": 5, "model.dropout": 0.1}
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    rows = init_check(config, batches=2)
    assert [r["layer"] for r in rows] == [f"layers.{i}.branch" for i in range(5)]
    keep = 0.9
    for r in rows:
        for key in ("var_in", "var_out", "forward", "grad_in_var", "grad_out_var", "backward"):
            assert r[key] is not None and math.isfinite(r[key]) and r[key] > 0, (r["layer"], key)
        assert r["forward_predicted"] == 1.0 and r["backward_predicted"] == 1.0
        # The prediction is first order in the gate input; the next order adds about E[x^2]/p, and the
        # residual stream doubles its variance each block (0.01, 0.02, ...). Allow that plus sampling noise.
        slack = 0.15 + 2.0 * r["var_in"] / keep
        assert abs(r["forward"] - 1.0) < slack, r
        assert abs(r["backward"] - 1.0) < 0.25 + 2.0 * r["var_in"] / keep, r
    assert rows[0]["var_in"] == pytest.approx(EMBEDDING_STD**2, rel=0.3)
    assert all(abs(r["forward"] - 1.0) < 0.15 for r in rows[:3])  # gate inputs still near 0
    table = format_init_check(rows)
    assert "layers.4.branch" in table and "fwd pred" in table


def test_init_check_transformer_post_ln(text_corpus: str) -> None:
    config = RunConfig()
    config.data.corpus, config.data.batch_size, config.data.seq_len = text_corpus, 4, 16
    config.model.d_model, config.model.n_layers, config.model.n_heads, config.model.d_ffn = 16, 2, 2, 32
    rows = init_check(config, batches=1)
    assert [r["layer"] for r in rows] == ["layers.0", "layers.1"]
    assert rows[1]["forward"] == pytest.approx(1.0, abs=0.05)
    assert rows[1]["forward_predicted"] == pytest.approx(1.0, abs=0.01)
    # layer 0 reads sqrt(d)-scaled embeddings; LayerNorm still puts its output at unit variance
    assert rows[0]["forward"] == pytest.approx(rows[0]["forward_predicted"], rel=0.05)


def test_sru_alpha_keeps_deep_stack_variance(monkeypatch: pytest.MonkeyPatch) -> None:
    sru = pytest.importorskip("gatedformer.nn.sru")
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "torch")  # same numbers; no kernel build in a fresh cache
    results = {}
    for rescale in (True, False):
        torch.manual_seed(0)
        stack = sru.SRU(32, 32, num_layers=8, rescale=rescale)
        x = torch.randn(48, 6, 32, requires_grad=True)
        rows = measure_layers(stack, [(x,)])
        assert len(rows) == 8 and all(r["forward"] is not None and r["backward"] is not None for r in rows)
        results[rescale] = rows
    with_alpha, without = results[True], results[False]
    assert with_alpha[0]["forward_predicted"] == pytest.approx(1.0)
    assert without[0]["forward_predicted"] == pytest.approx(0.5)
    per_layer = {k: math.prod(r["forward"] for r in rows) ** (1 / 8) for k, rows in results.items()}
    whole = {k: rows[-1]["var_out"] / rows[0]["var_in"] for k, rows in results.items()}
    # alpha = sqrt(3), b = 0: each layer keeps Var[h]/Var[x] near 1, so 8 layers stay within a small factor
    assert 0.85 < per_layer[True] < 1.25 and 0.4 < whole[True] < 3.0
    # alpha = 1: each layer roughly halves the variance and the stack collapses
    assert per_layer[False] < 0.6 and whole[False] < 0.02


def test_init_check_sru_backbone(text_corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if "sru" not in backbone_names():
        pytest.skip("the sru backbone is not registered yet")
    monkeypatch.setenv("GATEDFORMER_SRU_BACKEND", "torch")
    config = RunConfig()
    config.data.corpus, config.data.batch_size, config.data.seq_len = text_corpus, 4, 16
    config.model.backbone, config.model.d_model, config.model.n_layers = "sru", 16, 3
    rows = init_check(config, batches=2)
    assert len(rows) == 3 and all(r["forward"] is not None and math.isfinite(r["forward"]) for r in rows)
    assert all(r["forward_predicted"] == pytest.approx(1.0) for r in rows)


def test_layer_sites_falls_back_to_layers_list() -> None:
    from gatedformer.models.transformer import TransformerLM

    sites = layer_sites(TransformerLM(V, d_model=8, n_layers=2, n_heads=2, d_ffn=16))
    assert [s["name"] for s in sites] == ["layers.0", "layers.1"]
    assert sites[0]["kind"] == "Transformer layer (post-LN)"
    from gatedformer.models.rtransformer import RTransformerLM

    recurrent = layer_sites(RTransformerLM(V, d_model=8, n_layers=1, n_heads=2, d_ffn=16))
    assert recurrent[0]["kind"] == "R-Transformer layer (post-LN)"


def test_cli_init_check(text_corpus: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["init-check", "--recipe", "wikitext2-gcnn-tiny", "--data", text_corpus, "--batches", "1",
            "--set", "data.batch_size=4", "--set", "data.seq_len=16", "--set", "model.d_model=16",
            "--set", "model.n_layers=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "layers.0.branch" in out and "layers.1.branch" in out and "GCNN GLU branch" in out
    assert main([*args, "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and rows[0]["forward_predicted"] == 1.0


def test_cli_init_check_refuses_a_bad_batch_count(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked before any corpus is read (translation recipes are measured too: see test_translation_models.py).
    assert main(["init-check", "--recipe", "wikitext2-gcnn-tiny", "--batches", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "batches must be at least 1" in err
