"""The gates of issue 53 (attention output gate, GLU-variant feed-forwards, GRU gate, ReZero), each held to its
paper's equation by a plain PyTorch computation written here from the equation (never by calling the unit), and
each parsed, placed, counted and trained on the models it goes on."""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, tiny_overrides
from torch import Tensor
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from gatedformer import Seq2SeqTransformer, TransformerLM, TransformerXLLM
from gatedformer.analysis.bench import GATE_VARIANTS, BenchOptions, BenchSize, run_bench
from gatedformer.analysis.bench.flops import count_flops
from gatedformer.cli import main as cli_main
from gatedformer.config import ModelConfig, RunConfig, apply_overrides, validate
from gatedformer.errors import ConfigError
from gatedformer.fused import fuse
from gatedformer.gates import FFNGEGLU, FFNGLU, FFNBilinear, FFNReGLU, FFNSwiGLU, GRUGate, ReZero
from gatedformer.gates.glu_variants import glu_hidden
from gatedformer.gates.kinds import GATE_KINDS
from gatedformer.gates.spec import SublayerGates, parse_gate_spec, resolve_placement
from gatedformer.models import BertForMaskedLM, build_model
from gatedformer.nn.attention import CausalSelfAttention
from gatedformer.nn.sublayer import FeedForward, GELUFeedForward, Sublayer
from gatedformer.ops import explain
from gatedformer.train.loop import train
from gatedformer.train.runlog import read_log, series

pytestmark = pytest.mark.usefixtures("one_thread_module")

NEW_SPECS = {"+SDPA gate": "sdpa_gate", "+SDPA gate headwise": "sdpa_gate_headwise", "+GLU": "ffn_glu",
             "+Bilinear": "ffn_bilinear", "+ReGLU": "ffn_reglu", "+GEGLU": "ffn_geglu", "+SwiGLU": "ffn_swiglu",
             "+GRU gate": "gru_gate", "+ReZero": "rezero"}


def _layer_norm(x: Tensor, norm: torch.nn.LayerNorm) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def _causal_heads(x: Tensor, qkv: torch.nn.Linear, heads: int) -> Tensor:
    """softmax(QKᵀ/√dh + causal mask) V per head, heads side by side: the attention before W_O, written out."""
    batch, length, d = x.shape
    dh = d // heads
    q, k, v = (x @ qkv.weight.T + qkv.bias).split(d, dim=-1)
    q, k, v = (t.reshape(batch, length, heads, dh).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, d)


# ---------------------------------------------------------------------------------------------------------------
# Each kind exact to its equation.


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("headwise", [False, True], ids=["elementwise", "headwise"])
def test_the_attention_output_gate_is_y_times_sigmoid_of_x_w_theta_before_the_output_projection(
        headwise: bool, norm: str) -> None:
    torch.manual_seed(0)
    d, heads = 12, 3
    name = "sdpa_gate_headwise" if headwise else "sdpa_gate"
    sub = Sublayer(CausalSelfAttention(d, heads), d, SublayerGates.of(name), norm=norm).eval()
    x = torch.randn(2, 5, d)
    h = _layer_norm(x, sub.norm) if norm == "pre" else x  # X: the sublayer's (normalised) input
    y = _causal_heads(h, sub.body.qkv, heads)
    w_theta = getattr(sub, name).proj.weight  # (d, d) elementwise, (heads, d) headwise
    scores = torch.sigmoid(h @ w_theta.T)
    # headwise: one score per head, on all of its d/heads features
    gated = (y.reshape(2, 5, heads, d // heads) * scores[..., None]).reshape(2, 5, d) if headwise else y * scores
    s = gated @ sub.body.out.weight.T + sub.body.out.bias
    expected = x + s if norm == "pre" else _layer_norm(x + s, sub.norm)
    torch.testing.assert_close(sub(x), expected, rtol=1e-5, atol=1e-5)
    assert w_theta.shape == ((heads, d) if headwise else (d, d)) and getattr(sub, name).proj.bias is None
    # fused, the same (the sublayer declines its one-pass paths and runs the gate as written)
    torch.testing.assert_close(fuse(copy.deepcopy(sub))(x), sub(x), rtol=1e-5, atol=1e-6)


_ACTS = {FFNGLU: torch.sigmoid, FFNBilinear: lambda z: z, FFNReGLU: torch.relu,
         FFNGEGLU: lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))), FFNSwiGLU: lambda z: z * torch.sigmoid(z)}


@pytest.mark.parametrize("cls", list(_ACTS), ids=lambda c: c.__name__)
def test_each_glu_variant_is_act_of_xw_times_xv_through_w2_at_two_thirds_of_d_ffn(cls: type) -> None:
    torch.manual_seed(0)
    d, f = 12, 48
    ffn = cls(d, f).eval()
    assert ffn.hidden == 32  # 2/3 of d_ffn
    w, v = ffn.inner.weight[:32], ffn.inner.weight[32:]
    x = torch.randn(3, 4, d)
    expected = (_ACTS[cls](x @ w.T) * (x @ v.T)) @ ffn.outer.weight.T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-6)
    # no biases (as the paper writes them): 3 d h parameters, within the ReLU FFN's biases of its 2 d f
    assert sum(p.numel() for p in ffn.parameters()) == 3 * d * 32
    relu = sum(p.numel() for p in FeedForward(d, f).parameters())
    assert relu - (f + d) == sum(p.numel() for p in ffn.parameters())


def test_a_glu_variant_takes_the_place_of_the_feed_forward_at_its_width_and_dropout() -> None:
    sub = Sublayer(GELUFeedForward(10, 30, dropout=0.0), 10, SublayerGates.of("ffn_swiglu"), dropout=0.1)
    assert isinstance(sub.body, FFNSwiGLU) and sub.body.hidden == glu_hidden(30) == 20
    assert sub.body.dropout.p == 0.0 and sub.ffn_swiglu is None  # the body is the unit; no slot beside it
    sub = Sublayer(FeedForward(10, 31, dropout=0.2), 10, SublayerGates.of("ffn_reglu"))
    assert isinstance(sub.body, FFNReGLU) and sub.body.hidden == 21 and sub.body.dropout.p == 0.2
    assert all(not name.startswith("body.inner.bias") for name, _ in sub.named_parameters())


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_gru_gate_is_gtrxl_gating_of_x_and_relu_of_the_sublayer_output(norm: str) -> None:
    torch.manual_seed(0)
    d = 8
    sub = Sublayer(FeedForward(d, 16), d, SublayerGates.of("gru_gate"), norm=norm).eval()
    gate = sub.gru_gate
    assert torch.equal(gate.b_g.detach(), torch.full((d,), 2.0))  # b_g = 2, as in the paper
    with torch.no_grad():
        gate.b_g.uniform_(-1, 3)
    x = torch.randn(2, 5, d)
    h = _layer_norm(x, sub.norm) if norm == "pre" else x
    inner, outer = sub.body.inner, sub.body.outer
    y = torch.relu(torch.relu(h @ inner.weight.T + inner.bias) @ outer.weight.T + outer.bias)  # y = ReLU(F(h))
    w_r, w_z, w_g = gate.w.weight.split(d)
    u_r, u_z = gate.u.weight.split(d)
    r = torch.sigmoid(y @ w_r.T + x @ u_r.T)
    z = torch.sigmoid(y @ w_z.T + x @ u_z.T - gate.b_g)
    h_hat = torch.tanh(y @ w_g.T + (r * x) @ gate.u_g.weight.T)
    g = (1 - z) * x + z * h_hat
    expected = g if norm == "pre" else _layer_norm(g, sub.norm)
    torch.testing.assert_close(sub(x), expected, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in gate.parameters()) == 6 * d * d + d


def test_rezero_is_x_plus_alpha_times_the_sublayer_starting_as_the_identity() -> None:
    torch.manual_seed(0)
    d = 8
    sub = Sublayer(FeedForward(d, 16), d, SublayerGates.of("rezero"), norm="pre").eval()
    x = torch.randn(2, 5, d)
    assert sub.rezero.alpha.shape == () and sub.rezero.alpha.item() == 0.0
    torch.testing.assert_close(sub(x), x, rtol=0, atol=0)  # pre-LN: the identity at initialisation
    with torch.no_grad():
        sub.rezero.alpha.fill_(0.7)
    inner, outer = sub.body.inner, sub.body.outer
    f = torch.relu(_layer_norm(x, sub.norm) @ inner.weight.T + inner.bias) @ outer.weight.T + outer.bias
    torch.testing.assert_close(sub(x), x + 0.7 * f, rtol=1e-5, atol=1e-6)
    post = Sublayer(FeedForward(d, 16), d, SublayerGates.of("rezero")).eval()  # post-LN keeps its LN: LN(x + αF)
    torch.testing.assert_close(post(x), _layer_norm(x, post.norm), rtol=1e-5, atol=1e-5)
    assert isinstance(post.rezero, ReZero) and sum(p.numel() for p in post.rezero.parameters()) == 1


# ---------------------------------------------------------------------------------------------------------------
# The attention output gate on every attention: relative (Transformer-XL), bidirectional (BERT), self and cross
# (translation). The gate's equation applied by hand to the body's own heads' outputs, W_O after it.


def _gated_by_hand(sub: Sublayer, name: str, x: Tensor, *body_args: object) -> Tensor:
    h = _layer_norm(x, sub.norm) if sub.pre_norm else x
    y = sub.body.features(h, *body_args)
    w_theta = getattr(sub, name).proj.weight
    if name == "sdpa_gate":
        gated = y * torch.sigmoid(h @ w_theta.T)
    else:
        heads = w_theta.shape[0]
        gated = (y.unflatten(-1, (heads, -1)) * torch.sigmoid(h @ w_theta.T)[..., None]).flatten(-2)
    s = F.linear(gated, sub.body.out.weight, sub.body.out.bias)
    return x + s if sub.pre_norm else _layer_norm(x + s, sub.norm)


@pytest.mark.parametrize("name", ["sdpa_gate", "sdpa_gate_headwise"])
def test_the_attention_output_gate_sits_on_transformer_xl_bert_and_translation_attention(name: str) -> None:
    torch.manual_seed(0)
    spec = {"sdpa_gate": "+SDPA gate", "sdpa_gate_headwise": "+SDPA gate headwise"}[name]
    xl = TransformerXLLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.0, gates=spec, mem_len=4).eval()
    attn = xl.layers[0].attn
    assert getattr(attn, name) is not None and xl.layers[0].ffn.kinds == ()
    x, memory, pos = torch.randn(2, 5, 16), torch.randn(2, 4, 16), xl._relative_positions(9, torch.float32)
    # the body's features are its forward before W_O
    torch.testing.assert_close(attn.body.out(attn.body.features(x, memory, pos)), attn.body(x, memory, pos))
    torch.testing.assert_close(attn(x, memory, pos), _gated_by_hand(attn, name, x, memory, pos), rtol=1e-5,
                               atol=1e-5)

    bert = BertForMaskedLM(30, d_model=16, n_layers=2, n_heads=4, d_ffn=32, max_positions=20, gates=spec).eval()
    layer = bert.bert.layers[1].attn
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(layer(x, mask), _gated_by_hand(layer, name, x, mask), rtol=1e-5, atol=1e-5)
    rows = x[:, 2:4]  # the last layer's few query rows (masked LM), keys and values from every row
    torch.testing.assert_close(layer(rows, mask, x), _gated_by_hand(layer, name, rows, mask, x), rtol=1e-5,
                               atol=1e-5)

    mt = Seq2SeqTransformer(23, 19, layers=2, d_model=16, ffn=32, heads=2, max_len=16, dropout=0.0, gates=spec,
                            pad_id=1).eval()
    decoder = mt.decoder_layers[0]
    assert getattr(decoder.cross_attn, name) is not None and getattr(mt.encoder_layers[1].attn, name) is not None
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    torch.testing.assert_close(decoder.attn(x, None, True, None), _gated_by_hand(decoder.attn, name, x, None, True),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoder.cross_attn(x, memory, src_mask),
                               _gated_by_hand(decoder.cross_attn, name, x, memory, src_mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_the_gated_attention_decodes_incrementally_as_it_computes_whole_sequences(fused: bool) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(2, 19, (2, 6))
    for model in (TransformerLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.0, gates="+SDPA gate"),
                  TransformerXLLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.0, mem_len=4,
                                  gates="+SDPA gate headwise+SwiGLU+GRU gate")):
        model = fuse(model.eval()) if fused else model.eval()
        state = model(tokens).state  # Transformer-XL: the next window after a memory
        cache = model.new_cache(state) if state is not None else model.new_cache()
        steps = torch.cat([model.step(tokens[:, i : i + 1], cache) for i in range(6)], dim=1)
        torch.testing.assert_close(steps, model(tokens, state).logits, rtol=1e-5, atol=1e-5)
    mt = Seq2SeqTransformer(23, 19, layers=2, d_model=16, ffn=32, heads=2, max_len=16, dropout=0.0,
                            gates="+SDPA gate", pad_id=1).eval()
    mt = fuse(mt) if fused else mt
    memory, src_mask = mt.encode(tokens)
    cache = mt.new_cache()
    steps = torch.stack([mt.decode_step(tokens[:, i], i, memory, src_mask, cache) for i in range(6)], dim=1)
    torch.testing.assert_close(steps, mt.decode(tokens, memory, src_mask), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Parse, place, count.


def test_the_spec_words_parse_as_the_papers_write_them() -> None:
    for spec, name in NEW_SPECS.items():
        assert [item.unit for item in parse_gate_spec(spec)] == [name]
    assert parse_gate_spec("+sdpa gate headwise L1 /cross")[0].sublayers == ("cross",)
    assert [i.unit for i in parse_gate_spec("+SwiGLU+SDPA gate+GRU gate")] == ["ffn_swiglu", "sdpa_gate", "gru_gate"]
    placement = resolve_placement("+SwiGLU+SDPA gate+ReZero", 2, cross_attention=True)
    assert placement.at(0, "ffn").kinds == {"ffn_swiglu": "", "rezero": ""}
    assert placement.at(1, "cross").kinds == {"sdpa_gate": "", "rezero": ""}


@pytest.mark.parametrize(("spec", "message"), [
    ("+SDPA gate /ffn", "SDPA gate goes on multi-head attention only"),
    ("+SwiGLU /attn", "SwiGLU goes on feed-forward sublayers only"),
    ("+SwiGLU+GEGLU", "puts both SwiGLU and GEGLU on layer 1 ffn: both replace the feed-forward"),
    ("+SDPA gate+SDPA gate headwise", "both gate the heads"),
    ("+GRU gate+GRC", "both replace the residual connection"),
    ("+ReZero+GRU gate", "both replace the residual connection"),
    ("+ReZero+highway gate", "both replace the residual connection"),
    ("+σ SwiGLU", "a gate function (sigmoid) applies to SDU only"),
])
def test_conflicting_or_misplaced_new_gates_are_refused_with_the_fix(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_placement(spec, 2)


def test_a_glu_variant_on_an_sru_or_glu_feed_forward_is_one_error_naming_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ModelConfig(backbone="sru-transformer", d_model=8, n_layers=1, n_heads=2, d_ffn=16, gates="+SwiGLU")
    with pytest.raises(ConfigError, match=r"\+SwiGLU is a feed-forward of its own, in place of a ReLU or GELU one, not "
                                          r"of an SRU one \(model.ffn=sru, or the sru-transformer backbone\); drop "
                                          r"\+SwiGLU from model.gates"):
        build_model(cfg, 11)
    with pytest.raises(ConfigError, match=r"\+GEGLU .* not of a GLU one \(model.ffn=glu\)"):
        TransformerLM(11, d_model=8, n_layers=1, n_heads=2, d_ffn=16, ffn="glu", gates="+GEGLU")
    # the translation model's SRU feed-forward too, from the command line: one line, no traceback
    assert cli_main(["params", "--recipe", "multi30k-sru-tiny", "--set", "model.gates=+SwiGLU", "--vocab-size",
                     "100"]) != 0
    assert "in place of a ReLU or GELU one, not of an SRU one" in one_error_line(capsys)


@pytest.mark.parametrize("spec", list(NEW_SPECS))
def test_the_flop_count_of_each_new_gate_is_what_torch_counts_it_adds(spec: str) -> None:
    sizes = {"d_model": 12, "n_layers": 2, "n_heads": 3, "d_ffn": 30}
    counts, measured = [], []
    for gates in ("", spec):
        cfg = ModelConfig(gates=gates, **sizes)
        counts.append(count_flops(cfg, 11, 2, 4).forward_total)
        model = TransformerLM(11, dropout=0.0, gates=gates, **sizes).eval()
        with FlopCounterMode(display=False) as counter:
            model(torch.randint(0, 11, (2, 4)))
        measured.append(counter.get_total_flops())
    assert counts[1] - counts[0] == measured[1] - measured[0]
    kind = GATE_KINDS[NEW_SPECS[spec]]
    model = TransformerLM(11, dropout=0.0, gates=spec, **sizes)
    baseline = TransformerLM(11, dropout=0.0, **sizes)
    added = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in baseline.parameters())
    per_layer = {"attn": 1, "ffn": 1, "cross": 0}
    sites = sum(per_layer[s] for s in kind.sublayers) * 2
    replaced = 2 * 12 * 30 + 30 + 12 if kind.role == "body" else 0  # the ReLU feed-forward a GLU variant replaces
    assert added == sites * (kind.parameters(12, 30, 3) - replaced)


# ---------------------------------------------------------------------------------------------------------------
# Training: a few steps of the loop on the Transformer LM; the attention gate also on XL, BERT and translation.


@pytest.mark.parametrize("spec", ["+SDPA gate", "+SDPA gate headwise", "+SwiGLU", "+GEGLU", "+GRU gate", "+ReZero"])
def test_each_new_gate_trains_on_the_transformer_lm(spec: str, text_corpus: str, tmp_path: Path) -> None:
    config = validate(apply_overrides(RunConfig(), [*tiny_overrides(text_corpus, 10), f"model.gates={spec}"]))
    train(config, tmp_path / "run", progress=False)
    losses = series(read_log(tmp_path / "run"), "train", "train_loss")[1]
    assert len(losses) == 10 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]


def _steps(model: torch.nn.Module, loss_of, steps: int = 6) -> list[float]:  # noqa: ANN001
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = loss_of(model)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("spec", ["+SDPA gate", "+SDPA gate headwise"])
def test_the_attention_gate_trains_on_xl_bert_and_translation_fused(spec: str) -> None:
    torch.manual_seed(0)
    data = torch.randint(2, 19, (4, 12))
    models = {
        "transformer-xl": (TransformerXLLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, gates=spec, mem_len=4),
                           lambda m: m(data[:, :-1], targets=data[:, 1:]).loss),
        "bert": (BertForMaskedLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, max_positions=16, gates=spec),
                 lambda m: F.cross_entropy(m(data).logits.flatten(0, 1), data.flatten())),
        "translation": (Seq2SeqTransformer(23, 19, layers=2, d_model=16, ffn=32, heads=2, max_len=16, gates=spec,
                                           pad_id=1),
                        lambda m: m(data, data[:, :-1], targets=data[:, 1:], ignore_index=1).loss),
    }
    for name, (model, loss_of) in models.items():
        gates = [m for m in model.modules() if isinstance(m, Sublayer) and m.kinds]
        assert gates, name
        losses = _steps(fuse(model.train()), loss_of)
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], (name, losses)


def test_the_gru_gate_and_rezero_train_on_transformer_xl() -> None:
    torch.manual_seed(0)
    data = torch.randint(2, 19, (4, 12))
    for spec in ("+GRU gate", "+ReZero", "+SwiGLU"):
        model = TransformerXLLM(23, d_model=16, n_layers=2, n_heads=2, d_ffn=32, gates=spec, mem_len=4, norm="pre")
        losses = _steps(fuse(model.train()), lambda m: m(data[:, :-1], targets=data[:, 1:]).loss)
        assert losses[-1] < losses[0], (spec, losses)
    assert isinstance(model.layers[0].ffn.body, FFNSwiGLU)
    assert isinstance(TransformerXLLM(23, d_model=16, n_layers=1, n_heads=2, d_ffn=32, gates="+GRU gate")
                      .layers[0].attn.gru_gate, GRUGate)


def test_the_benchs_gate_overhead_rows_include_the_new_gates() -> None:
    new = ["+SDPA gate", "+SDPA gate headwise", "+SwiGLU", "+GRU gate", "+ReZero"]
    assert set(new) <= set(GATE_VARIANTS)
    size = BenchSize(d_model=16, n_layers=2, n_heads=2, d_ffn=32, seq_len=8, batch=2, vocab=11, mem_len=8)
    report = run_bench(size, BenchOptions(repeats=1, warmup=1, memory="none", threads=1), sections=["models"],
                       backbones=["transformer", "transformer-xl"], variants=new)
    rows = {(r["backbone"], r["variant"]): r for r in report.section("models")}
    for backbone in ("transformer", "transformer-xl"):
        for variant in new:
            row = rows[(backbone, variant)]
            assert row["status"] == "ok" and "extra_time_paired_pct" in row, row
        # the SDPA gate's d x d product per layer; SwiGLU's three d x 2/3 d_ffn in place of the ReLU FFN's two
        assert rows[(backbone, "+SDPA gate")]["extra_flops_pct"] > 0
        assert rows[(backbone, "+ReZero")]["extra_flops_pct"] == 0


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_fused_paths_decline_the_new_gates_saying_why(norm: str, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(explain.ENV_VAR, "1")
    monkeypatch.setattr(explain, "_SAID", set())
    caplog.set_level(logging.INFO, logger="gatedformer.ops")
    for spec in ("+SDPA gate headwise+GRU gate", "+ReZero", "+SwiGLU"):
        model = fuse(TransformerLM(11, d_model=16, n_layers=1, n_heads=2, d_ffn=32, gates=spec, norm=norm)).train()
        tokens = torch.randint(0, 11, (2, 9))
        model(tokens, targets=tokens).loss.backward()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "an attention output gate (sdpa_gate_headwise) sits between the heads and the output projection" in text
    assert "no fused tail is listed for gru_gate (FUSED_KINDS)" in text
    assert "no fused tail is listed for rezero (FUSED_KINDS)" in text
    assert "nn.Sublayer (its body) declined: no fused function computes the ffn_swiglu feed-forward" in text
    # alone on its sublayer, the attention output gate is taken by the path that joins W_O to the dropout, the
    # residual add and the LayerNorm (it acts before W_O); not by the whole-sublayer function
    gated = fuse(TransformerLM(11, d_model=16, n_layers=1, n_heads=2, d_ffn=32, gates="+SDPA gate")).layers[0].attn
    assert gated.fuse_linear and not gated.fuse_sublayer


def test_bert_starts_from_a_hugging_face_checkpoint_with_fresh_new_gates_but_not_with_a_glu_variant(
        tmp_path: Path, text_corpus: str) -> None:
    transformers = pytest.importorskip("transformers")
    from gatedformer.config import build_config, load_recipe
    from gatedformer.data.wordpiece import encode_corpus

    torch.manual_seed(0)
    tokenizer, _ = encode_corpus(text_corpus, None, None, 80)
    folder = tmp_path / "hf"
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32)).save_pretrained(folder)
    (folder / "vocab.txt").write_text(tokenizer.vocab_txt(), encoding="utf-8")
    overrides = [f"data.corpus={text_corpus}", "data.seq_len=24", "data.batch_size=4", "data.eval_batch_size=8",
                 "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.max_positions=32",
                 "tokenizer.vocab_size=80", "train.steps=1", "train.eval_every=1", "train.eval_windows=1",
                 "train.threads=1", f"model.init_from_hf={folder}"]
    recipe = load_recipe("bert-mlm-tiny")
    gates = "model.gates=+SDPA gate headwise+GRU gate /attn+ReZero /ffn"
    train(build_config(recipe, [*overrides, gates]), tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "results.json").is_file()
    with pytest.raises(ConfigError, match="holds no weights for the SwiGLU feed-forward; drop it from model.gates"):
        train(build_config(recipe, [*overrides, "model.gates=+SwiGLU"]), tmp_path / "glu", progress=False)
