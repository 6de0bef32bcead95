"""Gate placement: a spec touches exactly the layers and sublayers it names, and the sublayer
computes the paper's equation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from gatedformer import TransformerLM
from gatedformer.errors import ConfigError
from gatedformer.gates.kinds import GATE_KINDS
from gatedformer.gates.spec import SublayerGates, parse_gate_spec, resolve_placement
from gatedformer.nn.sublayer import FeedForward, Sublayer


def gate_sites(model: TransformerLM) -> dict[tuple[int, str], set[str]]:
    sites = {}
    for i, layer in enumerate(model.layers):
        for sub in ("attn", "ffn"):
            sublayer = getattr(layer, sub)
            present = {kind for kind in GATE_KINDS if getattr(sublayer, kind) is not None}
            if present:
                sites[(i + 1, sub)] = present
    return sites


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", {}),
        ("baseline", {}),
        ("+σ SDU", {(i, s): {"sdu"} for i in (1, 2, 3, 4) for s in ("attn", "ffn")}),
        ("+tanh L1-2", {(i, s): {"sdu"} for i in (1, 2) for s in ("attn", "ffn")}),
        ("+σ L1-4\\FFN", {(i, "attn"): {"sdu"} for i in (1, 2, 3, 4)}),
        ("+tanh L3-4", {(i, s): {"sdu"} for i in (3, 4) for s in ("attn", "ffn")}),  # top layers only
        ("+tanh L4", {(4, "attn"): {"sdu"}, (4, "ffn"): {"sdu"}}),
        ("sdu tanh L1,3 /ffn", {(1, "ffn"): {"sdu"}, (3, "ffn"): {"sdu"}}),
        ("+highway gate", {(i, s): {"highway"} for i in (1, 2, 3, 4) for s in ("attn", "ffn")}),
        ("+gated MHDPA L2", {(2, "attn"): {"gated_mhdpa"}, (2, "ffn"): {"gated_mhdpa"}}),
        ("+EAU", {(i, "attn"): {"eau"} for i in (1, 2, 3, 4)}),
        ("+GRC L1", {(1, "attn"): {"grc"}, (1, "ffn"): {"grc"}}),
        ("+EAU+GRC L2", {**{(i, "attn"): {"eau"} for i in (1, 3, 4)},
                         (2, "attn"): {"eau", "grc"}, (2, "ffn"): {"grc"}}),
        ("+σ SDU + EAU L1", {**{(i, s): {"sdu"} for i in (1, 2, 3, 4) for s in ("attn", "ffn")},
                             (1, "attn"): {"sdu", "eau"}}),
    ],
)
def test_spec_touches_exactly_the_named_sites(spec: str, expected: dict) -> None:
    model = TransformerLM(11, d_model=8, n_layers=4, n_heads=2, d_ffn=16, gates=spec)
    assert gate_sites(model) == expected


def test_ungated_layers_carry_no_gate_parameters() -> None:
    d = 8
    base = TransformerLM(11, d_model=d, n_layers=4, n_heads=2, d_ffn=16)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    top = TransformerLM(11, d_model=d, n_layers=4, n_heads=2, d_ffn=16, gates="+tanh L3-4")
    assert count(top) - count(base) == 4 * 2 * d * (d + 1)
    attn_only = TransformerLM(11, d_model=d, n_layers=4, n_heads=2, d_ffn=16, gates="+σ L1-4\\FFN")
    assert count(attn_only) - count(base) == 4 * 2 * d * (d + 1)
    eau_grc = TransformerLM(11, d_model=d, n_layers=4, n_heads=2, d_ffn=16, gates="+EAU+GRC")
    eau = d * (d // 2) + d // 2 + (d // 2) * d + d + d * d + d
    assert count(eau_grc) - count(base) == 4 * eau + 8 * d * (d + 1)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("+highway gate + GRC", "both replace the residual"),
        ("+gated MHDPA + GRC", "both replace the residual"),
        ("+σ SDU + highway", "choose one"),
        ("+EAU + EAU", "EAU twice"),
        ("eau /ffn", "after multi-head attention only"),
        ("tanh highway", "applies to SDU only"),
        ("+σ L0", "count from 1"),
        ("+σ L3-1", "count from 1"),
        ("+σ Lx", "bad layer set|unknown word"),
        ("+σ \\attn \\ffn", "leaves no sublayer"),
        # Two of a kind inside one item: refused rather than resolved as "the last one wins".
        ("sdu L1 L2", r"names layers twice \(L1 and L2\)"),
        ("eau grc", r"names two units \(eau and grc\).*'\+EAU\+GRC'"),
        ("grc highway", "names two units"),
        ("highway gated mhdpa", "names two units"),
        ("+tanh σ SDU", r"two gate functions \(tanh and sigmoid\)"),
        ("L1-2 tanh sigmoid", "two gate functions"),
        ("sdu sdu", "names sdu twice"),
        ("σ sigmoid", "names sigmoid twice"),
    ],
)
def test_nonsense_combinations_fail_loudly(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        resolve_placement(spec, 4)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="+σ\\/L0123456789-, sdutanhighwyGRCEAUMHDPAffnatl", max_size=30))
def test_any_spec_resolves_or_fails_with_one_line(spec: str) -> None:
    try:
        placement = resolve_placement(spec, 4)
    except ConfigError as err:
        assert "\n" not in str(err)
    else:
        for (layer, sub), site in placement.sites.items():
            assert 0 <= layer < 4 and sub in ("attn", "ffn")
            assert not (site.has("grc") and site.exclusive in ("highway", "gated_mhdpa"))


def test_paper_names_parse() -> None:
    assert parse_gate_spec("+σ SDU")[0].fn == "sigmoid"
    assert parse_gate_spec("+tanh L1-3")[0].layers == (1, 2, 3)
    item = parse_gate_spec("+σ L1-6\\FFN")[0]
    assert (item.unit, item.layers, item.sublayers) == ("sdu", (1, 2, 3, 4, 5, 6), ("attn",))
    assert parse_gate_spec("+highway gate")[0].unit == "highway"
    assert parse_gate_spec("+gated MHDPA")[0].unit == "gated_mhdpa"
    assert [i.unit for i in parse_gate_spec("+EAU+GRC")] == ["eau", "grc"]


def _ffn_sublayer(gates: SublayerGates, norm: str = "post") -> Sublayer:
    torch.manual_seed(0)
    sub = Sublayer(FeedForward(6, 12), 6, gates, dropout=0.0, norm=norm)
    with torch.no_grad():
        for p in sub.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-zero biases, so the equations are fully exercised
    return sub.eval()


def _ln(sub: Sublayer, y: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(y, (6,), sub.norm.weight, sub.norm.bias, sub.norm.eps)


def test_sdu_branch_equation() -> None:
    sub = _ffn_sublayer(SublayerGates.of("sdu", fn="tanh"))
    x = torch.randn(2, 5, 6)
    w, b = sub.sdu.proj.weight, sub.sdu.proj.bias
    sdu = torch.tanh(x @ w[:6].T + b[:6]) * (x @ w[6:].T + b[6:])
    assert torch.allclose(sub(x), _ln(sub, x + sub.body(x) + sdu), atol=1e-6)


def test_highway_gate_equation() -> None:
    sub = _ffn_sublayer(SublayerGates.of("highway"))
    x = torch.randn(2, 5, 6)
    w, b = sub.highway.proj.weight, sub.highway.proj.bias
    t = torch.sigmoid(x @ w[:6].T + b[:6])
    o = (1 - t) * x + t * (x @ w[6:].T + b[6:])
    assert torch.allclose(sub(x), _ln(sub, o + sub.body(x)), atol=1e-6)


def test_gated_mhdpa_equation() -> None:
    sub = _ffn_sublayer(SublayerGates.of("gated_mhdpa"))
    x = torch.randn(2, 5, 6)
    w, b = sub.gated_mhdpa.proj.weight, sub.gated_mhdpa.proj.bias
    t = torch.sigmoid(x @ w[:6].T + b[:6])
    o = (1 - t) * sub.body(x) + t * (x @ w[6:].T + b[6:])
    assert torch.allclose(sub(x), _ln(sub, o + x), atol=1e-6)


def test_eau_then_grc_equation() -> None:
    sub = _ffn_sublayer(SublayerGates.of("eau", "grc"))
    x = torch.randn(2, 5, 6)
    s = sub.eau(sub.body(x))
    gate = sub.grc.gate_proj
    g = torch.sigmoid(x @ gate.weight.T + gate.bias)
    assert torch.allclose(sub(x), _ln(sub, x + g * s), atol=1e-6)


def test_pre_ln_keeps_the_residual_stream_unnormalised() -> None:
    sub = _ffn_sublayer(SublayerGates.of("sdu"), norm="pre")
    x = torch.randn(2, 5, 6)
    h = _ln(sub, x)
    w, b = sub.sdu.proj.weight, sub.sdu.proj.bias
    sdu = torch.sigmoid(h @ w[:6].T + b[:6]) * (h @ w[6:].T + b[6:])
    assert torch.allclose(sub(x), x + sub.body(h) + sdu, atol=1e-6)


@pytest.mark.parametrize("spec", ["", "+σ SDU", "+highway gate", "+gated MHDPA", "+EAU+GRC", "+tanh L2\\FFN"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_gated_transformer_is_causal(spec: str, norm: str) -> None:
    torch.manual_seed(0)
    model = TransformerLM(13, d_model=8, n_layers=2, n_heads=2, d_ffn=16, dropout=0.0, norm=norm, gates=spec).eval()
    tokens = torch.randint(0, 13, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 13
    a = model(tokens).logits
    b = model(changed).logits
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])
