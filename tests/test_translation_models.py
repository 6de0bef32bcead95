"""The translation models of the research beside the Transformer: ConvS2S (its initialisation, multi-step attention,
incremental decoding, attention figure) and the Transformer with SRU; and the trainer features they need for every
task: gradient accumulation, a shared vocabulary and embeddings, Nesterov SGD with plateau annealing.

Training runs use a small synthetic corpus laid out like Multi30K (seconds each, no shared data needed).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from conftest import for_backbone, tiny_overrides
from test_translation import _write_corpus
from torch import nn

from gatedformer.analysis.init_check import init_check, layer_sites, measure_layers
from gatedformer.cli import main
from gatedformer.config import OptimConfig, RunConfig, apply_overrides, build_config, load_recipe, validate
from gatedformer.data import translation as mt
from gatedformer.errors import ConfigError
from gatedformer.models.convs2s import ConvS2S, parse_conv_layers
from gatedformer.models.seq2seq import Seq2SeqTransformer, seq2seq_parameter_count
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sru import SRULayer
from gatedformer.tasks.translation import (
    TranslationTask,
    attention_maps,
    beam_search,
    build_seq2seq,
    greedy_decode,
)
from gatedformer.train.init import initialise
from gatedformer.train.loop import train
from gatedformer.train.optim import Schedule, build_optimizer, build_scheduler

BACKBONES = ("transformer", "sru-transformer", "convs2s")


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _model(backbone: str, dropout: float = 0.0, *extra: str) -> nn.Module:
    config = validate(apply_overrides(RunConfig(), for_backbone(backbone, [
        "data.corpus=multi30k", "model.d_model=16", "model.n_heads=2", "model.d_ffn=24",
        "model.n_layers=2", "model.kernel_size=3", f"model.dropout={dropout}", "translation.max_len=24",
        "model.decoder_conv_layers=16x3,20x2"], "translation") + list(extra)))
    torch.manual_seed(0)
    model = build_seq2seq(config, 23, 29)
    initialise(model, config.init)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Every translation model: causal, padding-blind, incrementally decoded exactly as a whole, one decoder for all


@pytest.mark.parametrize("backbone", BACKBONES)
def test_every_decoder_is_causal_padding_blind_and_decodes_incrementally_as_a_whole(backbone: str) -> None:
    model = _model(backbone).eval()
    src = torch.randint(4, 23, (3, 7))
    src[1, 5:] = mt.PAD_ID
    tgt = torch.randint(4, 29, (3, 9))
    full = model(src, tgt).logits
    for position in (0, 4, 8):  # a change to a later target token never changes an earlier output
        changed = tgt.clone()
        changed[:, position] = (changed[:, position] - 4 + 1) % 25 + 4
        other = model(src, changed).logits
        torch.testing.assert_close(other[:, :position], full[:, :position], rtol=0, atol=1e-6)
        assert not torch.allclose(other[:, position:], full[:, position:])
    padded = torch.cat([src, torch.full((3, 3), mt.PAD_ID)], dim=1)
    torch.testing.assert_close(model(padded, tgt).logits, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(src[1:2, :5], tgt[1:2]).logits, full[1:2], rtol=1e-5, atol=1e-5)
    memory, mask = model.encode(src)
    cache = model.new_cache()
    steps = [model.decode_step(tgt[:, i], i, memory, mask, cache) for i in range(tgt.shape[1])]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    # the same beam search over every model; beam 1 is greedy
    assert beam_search(model, src, beam=1) == greedy_decode(model, src)
    assert len(beam_search(model, src, beam=5)) == 3


@pytest.mark.parametrize("backbone", BACKBONES)
def test_attention_maps_are_one_distribution_over_the_real_source_per_layer_and_position(backbone: str) -> None:
    model = _model(backbone).eval()
    src = torch.randint(4, 23, (2, 6))
    src[0, 4:] = mt.PAD_ID
    maps = model.attention_maps(src, torch.randint(4, 29, (2, 5)))
    assert len(maps) == 2 and all(m.shape == (2, 5, 6) for m in maps)
    for weights in maps:
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 5))
        assert float(weights[0, :, 4:].detach().abs().max()) == 0.0  # padded source tokens get no attention
    vocab = mt.build_vocab([[f"w{i}" for i in range(25)]], min_freq=1)
    figure = attention_maps(model, [5, 6, 7], ["a", "b", "c"], vocab, beam=2)
    assert figure.source == ["a", "b", "c", "<eos>"] and figure.output[-1] == "<eos>"
    assert [tuple(m.shape) for m in figure.layers] == [(len(figure.output), 4)] * 2


# ---------------------------------------------------------------------------------------------------------------
# The Transformer with SRU


def test_sru_without_skip_term_matches_the_official_sru_cell() -> None:
    from test_sru import _import_sru_package

    sru = _import_sru_package()
    torch.manual_seed(0)
    ours = SRULayer(6, 10, skip=False).double()
    with torch.no_grad():
        for p in (ours.v_f, ours.v_r, ours.b_f, ours.b_r):
            p.normal_()
    theirs = sru.SRUCell(6, 10, has_skip_term=False).double()
    assert (theirs.num_matrices, ours.num_streams) == (3, 3)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight.view(1, 3, 10, 6).permute(3, 0, 2, 1).reshape(6, 30))
        theirs.weight_c.copy_(torch.stack([ours.v_f, ours.v_r]).reshape(-1))
        theirs.bias.copy_(torch.stack([ours.b_f, ours.b_r]).reshape(-1))
    x = torch.randn(5, 3, 6, dtype=torch.float64)
    c0 = torch.randn(3, 10, dtype=torch.float64)
    h, c = ours(x, c0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h_ref, c_ref = theirs(x, c0)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(c, c_ref)


def test_the_sru_feed_forward_counts_as_the_closed_form() -> None:
    model = Seq2SeqTransformer(23, 29, layers=3, d_model=16, ffn=24, heads=2, ffn_kind="sru")
    assert sum(p.numel() for p in model.parameters()) == seq2seq_parameter_count(23, 29, 3, 16, 24, ffn_kind="sru")
    # the SRU (3·k·f weights and four f-vectors) replaces the hidden layer W1, b1 (k·f + f) in all 2l sublayers
    assert (seq2seq_parameter_count(23, 29, 3, 16, 24, ffn_kind="sru") - seq2seq_parameter_count(23, 29, 3, 16, 24)
            == 6 * (3 * 16 * 24 + 4 * 24 - 16 * 24 - 24))


# ---------------------------------------------------------------------------------------------------------------
# ConvS2S: the layers, the appendix's initialisation and its variance ratios


def test_conv_layer_specs() -> None:
    assert parse_conv_layers("512x3*9, 1024x3*4, 2048x1*2", 0, 0, 0) == [(512, 3)] * 9 + [(1024, 3)] * 4 + [
        (2048, 1)] * 2
    assert parse_conv_layers("", 3, 64, 5) == [(64, 5)] * 3
    for bad in ("512", "512x0", "ax3", "512x3*"):
        with pytest.raises(ConfigError, match="model.conv_layers"):
            validate(apply_overrides(RunConfig(), ["data.corpus=multi30k", "model.backbone=convs2s",
                                                   f"model.conv_layers={bad}"]))
    with pytest.raises(ConfigError, match="has no attention/FFN sublayers to gate"):
        validate(apply_overrides(RunConfig(), ["data.corpus=multi30k", "model.backbone=convs2s", "model.gates=+EAU"]))
    with pytest.raises(ConfigError, match="model.out_dim=32"):
        validate(apply_overrides(RunConfig(), ["data.corpus=multi30k", "model.backbone=convs2s",
                                               "model.tie_embeddings=true", "model.out_dim=32"]))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_convs2s_initialisation_is_the_appendix(dropout: float) -> None:
    """N(0, √(4p/n)) before a GLU, N(0, √(p/n)) elsewhere with p the keep probability of the layer's input's dropout
    (1 where none is), embeddings N(0, 0.1), zero biases; weight normalisation leaves the effective weights so."""
    torch.manual_seed(0)
    model = ConvS2S(300, 400, embed_dim=48, encoder_layers=[(64, 3), (96, 5)], decoder_layers=[(64, 3)], out_dim=40,
                    dropout=dropout)
    p = 1.0 - dropout
    expected = {
        "encoder.convolutions.0.conv": math.sqrt(4 * p / (3 * 64)),
        "encoder.convolutions.1.conv": math.sqrt(4 * p / (5 * 64)),
        "decoder.convolutions.0.conv": math.sqrt(4 * p / (3 * 64)),
        "encoder.fc1": math.sqrt(p / 48), "decoder.fc1": math.sqrt(p / 48),  # read dropped embeddings
        "encoder.fc2": math.sqrt(1 / 96), "decoder.fc2": math.sqrt(1 / 64),  # read the last block: no dropout
        "encoder.projections.1": math.sqrt(1 / 64),  # the residual where the channels change
        "attention.0.in_projection": math.sqrt(1 / 64), "attention.0.out_projection": math.sqrt(1 / 48),
        "output": math.sqrt(p / 40),  # reads the dropped output of fc2
    }
    modules = dict(model.named_modules())
    for name, std in expected.items():
        module = modules[name]
        assert nn.utils.parametrize.is_parametrized(module, "weight"), name  # weight-normalised
        assert float(module.weight.detach().std()) == pytest.approx(std, rel=0.08), name
        assert float(module.bias.abs().max()) == 0.0, name
    for table in (model.encoder.embed_tokens, model.decoder.embed_positions):
        assert float(table.weight.std()) == pytest.approx(0.1, rel=0.05)
        assert not nn.utils.parametrize.is_parametrized(table)


def test_convs2s_variance_ratios_match_the_appendix_with_and_without_dropout() -> None:
    """Per GLU block, forward Var[out]/Var[in] and backward Var[∂in]/Var[∂out] through the block alone: 1 and
    C_out/C_in with dropout (eq. 32-33), p and p·C_out/C_in without it (the weights were drawn for dropout)."""
    torch.manual_seed(0)
    model = ConvS2S(200, 200, embed_dim=64, encoder_layers=[(96, 3)] * 2, decoder_layers=[(96, 3), (192, 3)],
                    dropout=0.25)
    batches = [(torch.randint(4, 200, (8, 60)), torch.randint(4, 200, (8, 60))) for _ in range(3)]
    sites = layer_sites(model)
    assert [s["name"] for s in sites] == ["encoder.convolutions.0", "encoder.convolutions.1",
                                          "decoder.convolutions.0", "decoder.convolutions.1"]

    def loss(out: ModelOutput, index: int) -> torch.Tensor:
        logits = out.logits
        targets = torch.randint(4, 200, logits.shape[:2], generator=torch.Generator().manual_seed(index))
        return nn.functional.cross_entropy(logits.reshape(-1, 200), targets.reshape(-1))

    for training, scale in ((True, 1.0), (False, 0.75)):
        rows = measure_layers(model.train(training), batches, loss, sites)
        for row in rows:
            grows = 2.0 if row["layer"] == "decoder.convolutions.1" else 1.0  # 96 -> 192 channels
            assert row["forward_predicted"] == pytest.approx(scale) and row["dropout"] is training
            assert row["backward_predicted"] == pytest.approx(scale * grows)
            # long sentences: few of the convolution's taps read the zero padding at the ends
            assert row["forward"] == pytest.approx(row["forward_predicted"], rel=0.08), row
            assert row["backward"] == pytest.approx(row["backward_predicted"], rel=0.1), row


def test_convs2s_scales_the_encoders_gradients_by_the_attention_layers() -> None:
    def encoder_gradient(scale: float | None) -> torch.Tensor:
        model = _model("convs2s")
        if scale is not None:
            model.gradient_scale = scale
        src, tgt = torch.randint(4, 23, (2, 6)), torch.randint(4, 29, (2, 5))
        model(src, tgt).logits.square().sum().backward()
        return model.encoder.fc1.weight.grad

    assert _model("convs2s").gradient_scale == 0.5  # two decoder layers, two attentions
    torch.testing.assert_close(encoder_gradient(None), 0.5 * encoder_gradient(1.0))


# ---------------------------------------------------------------------------------------------------------------
# Trainer features for every task


@pytest.fixture
def corpus_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(mt, "MULTI30K_SHA256", {})
    return _write_corpus(tmp_path / "data")


def _config(*extra: str) -> RunConfig:
    backbone = next((o.partition("=")[2] for o in extra if o.startswith("model.backbone=")), "transformer")
    return validate(apply_overrides(RunConfig(), for_backbone(backbone, [
        "data.corpus=multi30k", "data.batch_size=16", "data.eval_batch_size=8", "model.d_model=16",
        "model.n_layers=1", "model.n_heads=2", "model.d_ffn=32", "model.dropout=0.1", "model.kernel_size=3",
        "translation.max_len=12", "translation.min_freq=1", "translation.beam_size=2", "translation.bleu_sentences=4",
        "train.steps=4", "train.eval_every=2", "train.log_every=1", "optim.lr=0.003"], "translation") + list(extra)))


def test_a_shared_vocabulary_and_embeddings(corpus_dir: Path) -> None:
    data = TranslationTask().load_data(_config("translation.shared_vocab=true"), corpus_dir)
    assert data.src_vocab is data.tgt_vocab and {"dog", "hund"} <= set(data.src_vocab.stoi)
    for backbone in BACKBONES:
        config = _config(f"model.backbone={backbone}", "translation.shared_vocab=true", "model.share_embeddings=true",
                         "model.tie_embeddings=true")
        model = TranslationTask().build_model(config, data)
        names = {id(p): n for n, p in model.named_parameters()}
        tables = [m.weight for n, m in model.named_modules() if isinstance(m, nn.Embedding)
                  and ("pos" not in n)]
        assert len({id(t) for t in tables}) == 1 and id(tables[0]) in names, backbone  # one table, used thrice
        assert model.output.weight is tables[0]
    with pytest.raises(ConfigError, match="set translation.shared_vocab=true"):
        _config("model.share_embeddings=true")
    with pytest.raises(ConfigError, match="a language model has one embedding"):
        validate(apply_overrides(RunConfig(), ["model.share_embeddings=true"]))


def test_nesterov_sgd_and_the_plateau_schedule() -> None:
    model = nn.Linear(3, 3)
    cfg = OptimConfig(name="sgd", lr=0.25, momentum=0.99, nesterov=True, schedule="plateau", plateau_factor=0.1,
                      plateau_patience=2, min_lr_ratio=0.004)
    optimizer = build_optimizer(model, cfg)
    assert optimizer.param_groups[0]["nesterov"] is True
    schedule = build_scheduler(optimizer, cfg, total_steps=100)
    annealed = [schedule.observe(loss) for loss in (5.0, 4.0, 4.5, 4.2, 3.9, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0)]
    # two evaluations without a new best anneal (the third and fourth after 4.0; then 3.9 is a best), to the floor
    assert annealed == [False, False, False, True, False, False, True, False, True, False, False]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25 * 0.004) == schedule.get_last_lr()[0]
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)
    state = schedule.state_dict()
    assert "_plateau" not in state and state["plateau_scale"] == pytest.approx(0.004)
    fresh = build_scheduler(build_optimizer(model, cfg), cfg, total_steps=100)
    fresh.load_state_dict(state)
    assert (fresh.plateau_scale, fresh.plateau_best, fresh.plateau_bad) == (
        schedule.plateau_scale, schedule.plateau_best, schedule.plateau_bad)
    other = build_scheduler(optimizer, OptimConfig(schedule="constant"), 100)
    assert isinstance(other, Schedule) and not other.observe(1.0) and not other.observe(2.0)
    with pytest.raises(ConfigError, match="optim.nesterov=true needs optim.name=sgd"):
        validate(apply_overrides(RunConfig(), ["optim.nesterov=true", "optim.name=adamw"]))
    with pytest.raises(ConfigError, match="optim.plateau_factor must be in"):
        validate(apply_overrides(RunConfig(), ["optim.schedule=plateau", "optim.plateau_factor=1"]))


def test_gradient_accumulation_equals_one_batch_of_both_micro_batches(corpus_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = _config("model.dropout=0", "train.steps=1", "train.grad_accum=2", "translation.max_tokens=90",
                     "optim.name=sgd", "optim.lr=0.5", "optim.clip=0.7")
    assert train(config, tmp_path / "run", corpus_dir, progress=False) is not None
    trained = load_file(str(tmp_path / "run" / "model.safetensors"))
    task = TranslationTask()
    data = task.load_data(config, corpus_dir)
    torch.manual_seed(config.train.seed)
    model = task.build_model(config, data)
    initialise(model, config.init)
    batches = task.train_batches(data, config, 0, None)
    micro = [next(batches) for _ in range(2)]
    assert micro[0].tokens != micro[1].tokens  # token batches: the weights differ from a half each

    def joined(part: int) -> torch.Tensor:
        rows = [row for batch in micro for row in batch.inputs[part]]
        width = max(len(row) for row in rows)
        return torch.stack([nn.functional.pad(row, (0, width - len(row)), value=mt.PAD_ID) for row in rows])

    optimizer = build_optimizer(model, config.optim)
    model(joined(0), joined(1), targets=joined(2), ignore_index=mt.PAD_ID, label_smoothing=0.1).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.7)
    optimizer.step()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_accumulated_plateau_runs_resume_exactly(text_corpus: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = validate(apply_overrides(RunConfig(), [
        *tiny_overrides(text_corpus, steps=8), "train.eval_every=2", "train.grad_accum=3", "optim.name=sgd",
        "optim.lr=2.0", "optim.momentum=0.9", "optim.nesterov=true", "optim.schedule=plateau",
        "optim.plateau_factor=0.5"]))
    straight = train(config, tmp_path / "straight", progress=False)
    assert train(config, tmp_path / "split", progress=False, stop_after=4) is None
    resumed = train(config, tmp_path / "split", resume=True, progress=False)
    assert resumed.valid_loss == straight.valid_loss and resumed.steps_per_epoch == straight.steps_per_epoch
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    tokens = [r["tokens"] for r in log if r["event"] == "train"]
    assert tokens[1] - tokens[0] == 3 * 4 * 16  # three micro-batches of 4 windows of 16 per step


# ---------------------------------------------------------------------------------------------------------------
# Recipes, commands and figures


def test_recipes_of_the_three_models() -> None:
    convs2s = build_config(load_recipe("multi30k-convs2s-tiny"))
    assert (convs2s.model.backbone, convs2s.optim.name, convs2s.optim.nesterov, convs2s.optim.schedule) == (
        "convs2s", "sgd", True, "plateau")
    sru = load_recipe("multi30k-sru-tiny")
    assert [build_config(sru, [], v).model.backbone for v in sru.variants] == ["transformer", "sru-transformer"]


def test_one_recipe_compares_the_three_models_each_as_its_own_recipe_trains_it() -> None:
    from dataclasses import asdict

    recipe = load_recipe("multi30k-models-tiny")
    alone = [build_config(load_recipe("multi30k-tiny")),
             build_config(load_recipe("multi30k-sru-tiny"), [], load_recipe("multi30k-sru-tiny").variants[1]),
             build_config(load_recipe("multi30k-convs2s-tiny"))]
    together = [build_config(recipe, [], variant) for variant in recipe.variants]
    assert [c.model.backbone for c in together] == ["transformer", "sru-transformer", "convs2s"]
    for mine, theirs in zip(together, alone, strict=True):
        for section in ("data", "translation", "optim", "init", "train"):
            ours, recipes = asdict(getattr(mine, section)), asdict(getattr(theirs, section))
            if section == "optim" and mine.optim.name == "sgd":  # Adam's betas do not apply
                for beta in ("beta1", "beta2"):
                    ours.pop(beta), recipes.pop(beta)
            assert ours == recipes, (mine.model.backbone, section)
        fields = ("backbone", "d_model", "n_layers", "dropout") + (
            ("kernel_size", "weight_norm") if mine.model.backbone == "convs2s" else ("n_heads", "d_ffn", "norm"))
        assert [getattr(mine.model, f) for f in fields] == [getattr(theirs.model, f) for f in fields]


@pytest.fixture
def convs2s_run(corpus_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "convs2s"
    train(_config("model.backbone=convs2s", "train.steps=2"), out, corpus_dir, progress=False)
    return out


def test_translate_draws_the_attention_of_the_first_sentence(convs2s_run: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.en"
    source.write_text("\nA dog runs on the grass.\nA cat.\n", encoding="utf-8")
    figure = tmp_path / "figures" / "attention.png"
    figure.parent.mkdir()
    assert main(["translate", "--run", str(convs2s_run), "--input", str(source), "--beam", "2",
                 "--attention-plot", str(figure)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split("\n")) == 4 and f"attention figure: {figure}" in captured.err
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["translate", "--run", str(convs2s_run), "--input", str(source), "--attention-plot",
                 str(tmp_path / "attention.pdf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must name a .png file" in err


def test_analyze_draws_a_translation_runs_attention(convs2s_run: Path, corpus_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--run", str(convs2s_run), "--data-dir", str(corpus_dir)]) == 0
    out = capsys.readouterr().out
    assert f"figure: {convs2s_run / 'attention.png'}" in out
    assert "nothing to draw" not in out  # it said so, then drew the attention figure
    assert (convs2s_run / "attention.png").stat().st_size > 0


def test_init_check_measures_a_translation_model(corpus_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config("model.backbone=convs2s", "model.dropout=0.2")
    rows = init_check(config, corpus_dir, batches=2)
    assert [r["layer"] for r in rows] == ["encoder.convolutions.0", "decoder.convolutions.0"]
    assert all(r["forward_predicted"] == 1.0 and r["forward"] > 0 for r in rows)
    args = ["init-check", "--recipe", "multi30k-convs2s-tiny", "--data-dir", str(corpus_dir), "--batches", "1",
            "--set", "model.d_model=16", "--set", "translation.min_freq=1", "--no-dropout"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ConvS2S decoder GLU block (16→16, w=3)" in out and "dropout off (--no-dropout)" in out
    assert main(["init-check", "--recipe", "multi30k-sru-tiny", "--data-dir", str(corpus_dir), "--batches", "1",
                 "--set", "translation.min_freq=1", "--set", "model.backbone=sru-transformer"]) == 0
    assert "Transformer decoder layer (post-LN)" in capsys.readouterr().out


def test_params_counts_each_translation_recipe_without_the_corpus(capsys: pytest.CaptureFixture[str]) -> None:
    parts = {}
    for recipe in ("multi30k-convs2s-tiny", "multi30k-sru-tiny"):
        assert main(["params", "--recipe", recipe, "--vocab-size", "5000", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        parts[recipe] = [row["components"] for row in report["variants"]]
        assert all(row["vocab_size"] == [5000, 5000] for row in report["variants"])
    assert set(parts["multi30k-convs2s-tiny"][0]) == {"convolutions", "attention", "embeddings", "projections",
                                                      "output"}
    transformer, with_sru = parts["multi30k-sru-tiny"]
    assert "SRU" in with_sru and "SRU" not in transformer
    assert with_sru["feed-forward"] == 2 * 2 * (512 * 128 + 128)  # only the output projections W2 stay
    totals = {}
    for recipe in ("wmt14-paper", "wmt14-sru-paper", "wmt14-convs2s-paper", "multi30k-convs2s-paper"):
        assert main(["params", "--recipe", recipe, "--vocab-size", "40000", "--json"]) == 0
        totals[recipe] = [row["total"] for row in json.loads(capsys.readouterr().out)["variants"]]
    # the Transformer base with one shared 40k vocabulary, tied: about 64M, as Vaswani et al.'s 65M at 37k
    assert 60e6 < totals["wmt14-paper"][0] < 66e6
    # Table 6 shares the encoder's and decoder's embeddings (-share_embedding) but not the output layer's
    assert totals["wmt14-sru-paper"][0] == totals["wmt14-paper"][0] + 40000 * 512
    assert totals["wmt14-sru-paper"][1] < totals["wmt14-sru-paper"][2]  # 4 SRU layers, then 5


def test_bench_times_every_translation_model_and_its_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.analysis.bench import BenchOptions, BenchSize, run_bench
    from gatedformer.analysis.bench import translation as bench_translation
    from gatedformer.analysis.bench.report import format_report

    for name, value in (("SENTENCES", 6), ("LENGTH", 5), ("VOCAB", 40), ("DECODE_SENTENCES", 2)):
        monkeypatch.setattr(bench_translation, name, value)
    size = BenchSize(d_model=16, n_layers=2, n_heads=2, d_ffn=32)
    report = run_bench(size, BenchOptions(repeats=2, warmup=1, memory="none", threads=1), sections=["translation"])
    rows = report.section("translation")
    assert [row["backbone"] for row in rows] == list(BACKBONES)
    for row in rows:
        assert row["status"] == "ok" and row["params"] > 0, row
        assert row["train_mfu"] > 0 and row["eval_mfu"] > 0 and row["train_gflop"] == 3 * row["eval_gflop"]
        assert row["train_tokens_per_s"] == pytest.approx(6 * 5 / (row["train_ms"] / 1000))
        assert row["decode_sentences_per_s"] == pytest.approx(2 / (row["decode_ms"] / 1000))
    text = format_report(report)
    assert "== translation" in text and "beam 5 over 2 sentences" in text and "convs2s" in text
