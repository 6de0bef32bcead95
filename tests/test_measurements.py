"""The gated-attention papers' measurements (issue 53, item 2): the attention weights worked out from an attention's
inputs are the ones its forward averages the values with, for every attention of the package; the sink share,
largest activation and gate sparsity per layer are what an independent computation gives; loss spikes are found
where the loss rises over its running mean; ``analyze`` reports all of it for attention runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, tiny_overrides
from torch.nn import functional as F

from gatedformer.analysis.measurements import (
    RunMeasurements,
    attention_weights,
    loss_spikes,
    measure_model,
    measure_run,
    uniform_sink,
)
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.errors import ConfigError
from gatedformer.fused import fuse
from gatedformer.models.seq2seq import CrossAttention, SelfAttention, Seq2SeqTransformer
from gatedformer.models.transformer import TransformerLM
from gatedformer.models.transformer_xl import RelativeMultiHeadAttention, relative_positions
from gatedformer.nn.attention import BidirectionalSelfAttention, CausalSelfAttention
from gatedformer.train.loop import train


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = t.shape
    return t.view(batch, length, heads, width // heads).transpose(1, 2)


def _merged(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    attended = weights @ v
    batch, heads, length, d_head = attended.shape
    return attended.transpose(1, 2).reshape(batch, length, heads * d_head)


def test_the_weights_of_every_self_attention_average_its_values_as_its_forward_does() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    causal = CausalSelfAttention(16, 4).eval()
    weights, rows = attention_weights(causal, {"x": x}, None)
    v = _heads(causal.qkv(x).chunk(3, dim=-1)[2], 4)
    torch.testing.assert_close(causal.out(_merged(weights, v)), causal(x))
    assert rows.all() and torch.equal(weights[..., 0, 1:], torch.zeros_like(weights[..., 0, 1:]))  # causal

    key_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    encoder = BidirectionalSelfAttention(16, 4).eval()
    weights, rows = attention_weights(encoder, {"x": x, "key_mask": key_mask}, None)
    v = _heads(encoder.qkv(x).chunk(3, dim=-1)[2], 4)
    torch.testing.assert_close(encoder.out(_merged(weights, v)), encoder(x, key_mask))
    assert torch.equal(rows, key_mask) and weights[1, ..., 4:].abs().max() == 0
    queries = x[:, :2]  # BERT's last layer: a few query rows against every key
    weights, rows = attention_weights(encoder, {"x": queries, "key_mask": key_mask, "context": x}, None)
    torch.testing.assert_close(encoder.out(_merged(weights, v)), encoder(queries, key_mask, x))
    assert rows.shape == (2, 2) and rows.all()

    decoder = SelfAttention(16, 4).eval()
    weights, _ = attention_weights(decoder, {"x": x, "key_mask": None, "causal": True, "cache": None}, None)
    v = _heads(decoder.qkv(x).chunk(3, dim=-1)[2], 4)
    torch.testing.assert_close(decoder.out(_merged(weights, v)), decoder(x, None, True))
    assert attention_weights(decoder, {"x": x, "cache": {}}, None) is None  # incremental decoding is not measured


def test_the_weights_of_cross_and_relative_attention_are_their_forwards() -> None:
    torch.manual_seed(1)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 6, 16)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    cross = CrossAttention(16, 2).eval()
    weights, _ = attention_weights(cross, {"x": x, "memory": memory, "memory_mask": mask}, None)
    v = _heads(cross.kv(memory).chunk(2, dim=-1)[1], 2)
    torch.testing.assert_close(cross.out(_merged(weights, v)), cross(x, memory, mask))

    relative = RelativeMultiHeadAttention(16, 2).eval()
    pos = relative_positions(11, 16)
    weights, rows = attention_weights(relative, {"h": x, "memory": memory, "pos": pos}, None)
    _, _, v, _ = relative.project(x, memory, pos)
    torch.testing.assert_close(relative.out(_merged(weights, v)), relative(x, memory, pos))
    assert weights.shape == (2, 2, 5, 11) and rows.shape == (2, 5)


def _gated_lm() -> TransformerLM:
    torch.manual_seed(2)
    return TransformerLM(30, d_model=16, n_layers=3, n_heads=2, d_ffn=32, gates="+σ SDU L1-2 + tanh L3").eval()


def test_measurements_per_layer_are_what_an_independent_computation_gives() -> None:
    model = _gated_lm()
    tokens = torch.randint(0, 30, (3, 12))
    result = measure_model(fuse(model), lambda m: m(tokens), RunMeasurements(Path(".")))
    # Independently: the hidden states layer by layer, the softmax of the scaled products, σ(X W1 + b1).
    x = model.embedding(tokens, math.sqrt(16), model.positions[:12])
    sinks, peaks, means, shares = [], [], [], []
    for layer in model.layers:
        body = layer.attn.body
        q, k, _ = (_heads(t, 2) for t in body.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(
            torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
        sinks.append(scores.softmax(-1)[..., 0].mean().item())
        if layer.attn.sdu is not None and layer.attn.sdu.gate == "sigmoid":
            score = torch.sigmoid(F.linear(x, layer.attn.sdu.proj.weight[:16], layer.attn.sdu.proj.bias[:16]))
            means.append(score.mean().item())
            shares.append((score < 0.1).float().mean().item())
        x = layer(x)
        peaks.append(x.abs().max().item())
    assert result.sink == {"attention": pytest.approx(sinks, rel=1e-5)}
    assert result.max_activation == {"": pytest.approx(peaks, rel=1e-6)}
    # The tanh SDU of layer 3 has no score in [0, 1]: not measured, so layer 3 has none
    assert result.gate_mean["attention (SDU)"][:2] == pytest.approx(means, rel=1e-5)
    assert len(result.gate_mean["attention (SDU)"]) == 2
    assert result.gate_sparse["attention (SDU)"][:2] == pytest.approx(shares, abs=1e-6)
    assert result.query_length == 12
    assert uniform_sink(12) == pytest.approx(sum(1 / (i + 1) for i in range(12)) / 12)
    # The hooks are gone: the model computes as before, with no side effect on a later call
    assert not any(m._forward_hooks for m in model.modules())


def test_encoder_decoder_attention_is_measured_per_stack() -> None:
    torch.manual_seed(3)
    model = Seq2SeqTransformer(20, 20, layers=2, d_model=16, ffn=32, heads=2, dropout=0.0).eval()
    src, tgt = torch.randint(4, 20, (2, 6)), torch.randint(4, 20, (2, 5))
    result = measure_model(model, lambda m: m(src, tgt), RunMeasurements(Path(".")))
    assert set(result.sink) == {"encoder attention", "decoder attention", "decoder cross-attention"}
    assert all(len(v) == 2 and all(0 < x <= 1 for x in v) for v in result.sink.values())
    assert set(result.max_activation) == {"encoder", "decoder"}


def test_loss_spikes_are_rises_over_the_running_mean() -> None:
    steps = list(range(10, 130, 10))
    losses = [3.0, 2.6, 2.3, 2.1, 2.0, 1.9, 1.85, 3.1, 1.9, 1.8, 1.75, 1.7]
    spikes = loss_spikes(steps, losses)
    assert [(s.step, s.loss) for s in spikes] == [(80, 3.1)]
    assert spikes[0].running_mean == pytest.approx(sum(losses[:7]) / 7) and spikes[0].ratio > 1.25
    assert loss_spikes(steps, losses, factor=2.0) == []  # a rise of x1.43 is under a factor of 2
    assert loss_spikes(steps, sorted(losses, reverse=True)) == []  # a falling loss has none
    with pytest.raises(ConfigError, match="above 1"):
        loss_spikes(steps, losses, factor=0.9)


@pytest.mark.parametrize("recipe", ["ptb-char-tiny", "enwik8-xl6-tiny"])
def test_analyze_reports_sink_activation_and_gate_sparsity_per_layer(recipe: str, text_corpus: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    overrides = [*tiny_overrides(text_corpus, steps=4), "model.gates=+σ SDU"]
    if recipe.startswith("enwik8"):
        overrides += ["model.mem_len=16"]
    train(build_config(load_recipe(recipe), overrides), tmp_path / "run", progress=False)
    assert main(["analyze", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    for heading in ("### Attention sink", "### Largest activation", "### Gate scores", "### Loss spikes"):
        assert heading in out
    sink_row = next(line for line in out.splitlines() if line.startswith("| run | attention |"))
    assert len(sink_row.split("|")) == 2 + 2 + 2 + 1  # variant, where, L1, L2, mean
    assert "| run | attention (SDU) |" in out and "| run | FFN (SDU) |" in out
    assert (tmp_path / "figs" / "measurements.png").stat().st_size > 5000
    assert (tmp_path / "figs" / "loss_spikes.png").is_file()


def test_a_masked_lm_run_is_measured_on_its_validation_windows(text_corpus: str, tmp_path: Path) -> None:
    overrides = [f"data.corpus={text_corpus}", "data.seq_len=24", "data.batch_size=4", "data.eval_batch_size=8",
                 "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.max_positions=32",
                 "tokenizer.vocab_size=80", "train.steps=2", "train.eval_every=2", "train.log_every=1",
                 "train.eval_windows=4", "model.gates=+EAU+GRC"]
    train(build_config(load_recipe("bert-mlm-tiny"), overrides), tmp_path / "run", progress=False)
    result = measure_run(tmp_path / "run")
    layers = len(result.sink["attention"])
    assert layers == build_config(load_recipe("bert-mlm-tiny"), overrides).model.n_layers
    assert set(result.gate_mean) == {"attention (EAU)", "attention (GRC)", "FFN (GRC)"}
    assert result.query_length == 24 and not result.notes


def test_a_bad_spike_factor_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["analyze", "--run", str(tmp_path), "--spike-factor", "1"]) == 2
    assert "--spike-factor must be a number above 1" in one_error_line(capsys)


@pytest.mark.parametrize("gate", ["+SDPA gate", "+SDPA gate headwise"])
def test_attention_under_an_output_gate_and_its_scores_are_measured(gate: str) -> None:
    # The gated sublayer runs its attention's features and output projection apart, never the attention's forward:
    # the sink is still measured, from the sublayer's input.
    torch.manual_seed(4)
    model = TransformerLM(30, d_model=16, n_layers=2, n_heads=2, d_ffn=32, gates=gate, norm="pre").eval()
    tokens = torch.randint(0, 30, (2, 9))
    result = measure_model(model, lambda m: m(tokens), RunMeasurements(Path(".")))
    sublayer = model.layers[0].attn
    h = sublayer.norm(model.embedding(tokens, math.sqrt(16), model.positions[:9]))
    q, k, _ = (_heads(t, 2) for t in sublayer.body.qkv(h).chunk(3, dim=-1))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1),
                                                                   -math.inf)
    assert result.sink["attention"][0] == pytest.approx(scores.softmax(-1)[..., 0].mean().item(), rel=1e-5)
    unit = sublayer.sdpa_gate if gate == "+SDPA gate" else sublayer.sdpa_gate_headwise
    score = torch.sigmoid(unit.proj(h))  # σ(X W_θ), X the normalised input (Qiu et al. 2025)
    label = "attention (SDPA gate)" if gate == "+SDPA gate" else "attention (SDPA gate headwise)"
    assert result.gate_mean[label][0] == pytest.approx(score.mean().item(), rel=1e-5)
    assert result.gate_sparse[label][0] == pytest.approx((score < 0.1).float().mean().item(), abs=1e-6)


def test_runs_of_the_same_data_share_one_validation_batch(text_corpus: str, tmp_path: Path) -> None:
    recipe = load_recipe("ptb-char-tiny")
    for name, gates in (("a", ""), ("b", "+σ SDU")):
        train(build_config(recipe, [*tiny_overrides(text_corpus, steps=2), f"model.gates={gates}"]), tmp_path / name,
              progress=False)
    batches: dict = {}
    first = measure_run(tmp_path / "a", batches=batches)
    second = measure_run(tmp_path / "b", batches=batches)
    assert len(batches) == 1  # a comparison reads its corpus once for the measurements of all its runs
    assert first.query_length == second.query_length == 16 and set(second.gate_mean) == {"attention (SDU)",
                                                                                         "FFN (SDU)"}
    assert measure_run(tmp_path / "b").sink == second.sink  # the same batch as a run measured alone reads


def test_a_translation_run_is_measured_on_its_validation_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_translation import _config, _write_corpus

    from gatedformer.data import translation as mt

    monkeypatch.setattr(mt, "MULTI30K_SHA256", {})
    data_dir = _write_corpus(tmp_path / "data")
    train(_config("train.steps=2", "train.eval_every=2"), tmp_path / "run", data_dir=data_dir, progress=False)
    result = measure_run(tmp_path / "run", data_dir)
    assert set(result.sink) == {"encoder attention", "decoder attention", "decoder cross-attention"}
    assert set(result.max_activation) == {"encoder", "decoder"}
    assert {"encoder attention (EAU)", "decoder cross-attention (EAU)"} <= set(result.gate_mean)
    assert not result.notes
