"""``gatedformer bench``: rows and fields, JSON, the FLOP counter, the peers, the memory probes.

Tiny sizes and one or two timed rounds: these tests check what is reported, never how fast anything is.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gatedformer.analysis.bench import (
    BenchOptions,
    BenchReport,
    BenchSize,
    RNNSize,
    Timing,
    TorchReferenceLM,
    count_flops,
    format_report,
    main,
    measure_memory,
    paired_ratio,
    run_bench,
    time_round_robin,
)
from gatedformer.cli import main as cli_main
from gatedformer.config import ModelConfig
from gatedformer.errors import ConfigError
from gatedformer.models import TransformerLM, backbone_names, build_model

TINY = BenchSize(d_model=16, n_layers=2, n_heads=2, d_ffn=32, seq_len=8, batch=2, vocab=11, mem_len=8, rnn_window=3)
QUICK = BenchOptions(repeats=2, warmup=1, memory="tensors", threads=1)  # one thread: no waits on a busy machine
TINY_ARGS = ["--d-model", "16", "--layers", "2", "--heads", "2", "--d-ffn", "32", "--seq-len", "8", "--batch", "2",
             "--vocab", "11", "--repeats", "1", "--warmup", "1", "--threads", "1", "--quiet"]

MODEL_FIELDS = {"section", "backbone", "variant", "gates", "status", "params", "train_ms", "train_q1_ms",
                "train_q3_ms", "train_tokens_per_s", "eval_ms", "eval_tokens_per_s", "train_gflop", "eval_gflop",
                "peak_gflops", "train_mfu", "eval_mfu", "peak_mem_mb", "mem_method"}


@pytest.mark.slow
def test_every_backbone_and_variant_gets_a_row_with_the_documented_fields() -> None:
    threads = torch.get_num_threads()
    report = run_bench(TINY, QUICK, sections=["models"], variants=["baseline", "+σ SDU", "+EAU+GRC"])
    assert torch.get_num_threads() == threads  # the bench's thread count is not left behind
    rows = report.section("models")
    seen = {(r["backbone"], r["variant"]) for r in rows}
    for backbone in backbone_names():
        built = (backbone, "baseline") in seen or any(backbone in note for note in report.notes)
        assert built, f"{backbone}: neither a row nor a note"
    gated = {"transformer", "rtransformer", "transformer-xl"} & set(backbone_names())
    for backbone in gated:
        assert {(backbone, v) for v in ("baseline", "+σ SDU", "+EAU+GRC")} <= seen
    assert ("gcnn", "+σ SDU") not in seen  # no sublayers to gate: baseline only, with a note
    assert any("gcnn has no sublayers to gate" in note for note in report.notes)
    for row in rows:
        if row["status"] != "ok":
            continue
        assert row.keys() >= MODEL_FIELDS, MODEL_FIELDS - row.keys()
        assert row["train_ms"] > 0 and row["eval_ms"] > 0 and row["params"] > 0
        assert row["train_mfu"] > 0 and row["eval_mfu"] > 0
        assert row["peak_mem_mb"] > 0
        assert row["train_gflop"] == pytest.approx(3 * row["eval_gflop"])
        if row["variant"] != "baseline":
            assert {"extra_flops_pct", "extra_time_pct", "extra_time_paired_pct", "gate_target_met"} <= row.keys()
            assert row["extra_flops_pct"] > 0
            assert row["gate_target_met"] == (row["extra_time_paired_pct"] <= row["extra_flops_pct"] + 10.0)


def _model_row(variant: str, mfu: float, met: bool | None = None) -> dict:
    row = {"section": "models", "backbone": "transformer", "variant": variant, "status": "ok", "params": 1000,
           "train_ms": 10.0, "train_q1_ms": 9.0, "train_q3_ms": 11.0, "train_tokens_per_s": 1e5, "train_mfu": mfu,
           "eval_ms": 3.0, "eval_q1_ms": 2.9, "eval_q3_ms": 3.1, "eval_tokens_per_s": 3e5, "eval_mfu": mfu}
    if met is not None:
        row |= {"extra_flops_pct": 15.2, "extra_time_pct": 40.0, "extra_time_paired_pct": 38.9, "gate_target_met": met}
    return row


@pytest.mark.parametrize(("mfu", "met", "noted"), [(0.024, False, True), (0.024, True, False), (0.45, False, False)])
def test_gate_misses_behind_an_idle_device_get_a_note_on_per_call_overhead(mfu: float, met: bool, noted: bool) -> None:
    meta = {"date": "2026-11-22", "device_name": "a GPU", "device": "cuda", "threads": 1, "torch": "2.x",
            "size": {"d_model": 128, "n_layers": 3, "n_heads": 4, "d_ffn": 512, "batch": 16, "seq_len": 128,
                     "vocab": 50}}
    report = BenchReport(meta, [_model_row("baseline", mfu), _model_row("+EAU", mfu * 0.8, met)])
    text = format_report(report)
    assert ("bound by per-call overhead" in text) == noted
    if noted:
        assert "transformer 2.4%" in text and "--compile" in text


def test_json_output_parses_and_the_cli_has_the_subcommand(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench", *TINY_ARGS, "--sections", "models", "--backbones", "transformer",
                     "--variants", "+tanh L1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"meta", "rows", "notes"}
    assert report["meta"]["size"]["d_model"] == 16 and report["meta"]["torch"] == torch.__version__
    assert [r["variant"] for r in report["rows"]] == ["baseline", "+tanh L1"]  # the baseline is always measured
    assert main([*TINY_ARGS, "--sections", "models", "--backbones", "gcnn"]) == 0
    text = capsys.readouterr().out
    assert "== models" in text and "gcnn" in text and "notes:" in text


def test_flop_counter_matches_a_hand_count() -> None:
    # V=11, d=8, 2 layers, 2 heads, FFN 16, batch 2 x 4 tokens: n = 8 token positions.
    cfg = ModelConfig(d_model=8, n_layers=2, n_heads=2, d_ffn=16)
    count = count_flops(cfg, vocab=11, batch=2, seq_len=4)
    qkv = 2 * 8 * 8 * 24  # 3072
    out = 2 * 8 * 8 * 8  # 1024
    pairs = 4 * 5 // 2  # causal (query, key) pairs per head and sequence: 10
    scores = values = 2 * 2 * pairs * 8  # 2 FLOPs x batch 2 x 10 pairs x (2 heads x 4 dims): 320 each
    ffn = 2 * 8 * 8 * 16 * 2  # 4096
    output = 2 * 8 * 8 * 11  # 1408
    assert count.forward == {"attn.proj": 2 * (qkv + out), "attn.scores": 2 * scores, "attn.values": 2 * values,
                             "ffn": 2 * ffn, "output": output}
    assert count.forward_total == 19072 and count.train_total == 3 * 19072
    # Gates: SDU on both sublayers of layer 1 is one d -> 2d product per sublayer.
    gated = count_flops(ModelConfig(d_model=8, n_layers=2, n_heads=2, d_ffn=16, gates="+σ L1"), 11, 2, 4)
    assert gated.forward["gates"] == 2 * (2 * 8 * 8 * 16)
    # torch's own counter sees the same products, except the fused CPU attention kernel it does not count.
    model = TransformerLM(11, d_model=8, n_layers=2, n_heads=2, d_ffn=16, dropout=0.0).eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 11, (2, 4)))
    assert counter.get_total_flops() == count.forward_total - 2 * scores - 2 * values


def test_flop_counter_other_backbones() -> None:
    n, d = 2 * 4, 8
    gcnn = count_flops(ModelConfig(backbone="gcnn", d_model=d, n_layers=3, kernel_size=4), 11, 2, 4)
    assert gcnn.forward == {"conv": 3 * 2 * n * (d * 4) * (2 * d), "output": 2 * n * d * 11}
    rt = count_flops(ModelConfig(backbone="rtransformer", d_model=d, n_layers=1, n_heads=2, d_ffn=16,
                                 rnn_type="gru", rnn_window=3), 11, 2, 4)
    assert rt.forward["local_rnn"] == 3 * 2 * n * d * (3 * d)  # input projection + 2 hidden products, GRU: 3d
    xl = count_flops(ModelConfig(backbone="transformer-xl", d_model=d, n_layers=1, n_heads=2, d_ffn=16, mem_len=4),
                     11, 2, 4)
    keys, pairs = 4 + 4, 4 * 4 + 4 * 5 // 2
    assert xl.forward["attn.proj"] == 2 * n * d * d * 2 + 2 * (2 * keys) * d * (2 * d) + 2 * keys * d * d
    assert xl.forward["attn.scores"] == 2 * 2 * 2 * pairs * d
    sru_t = count_flops(ModelConfig(backbone="sru-transformer", d_model=d, n_layers=2, n_heads=2, d_ffn=16), 11, 2, 4)
    plain = count_flops(ModelConfig(backbone="transformer", d_model=d, n_layers=2, n_heads=2, d_ffn=16), 11, 2, 4)
    # The SRU takes the place of the feed-forward's hidden layer: one d -> 3f product, then W2 (f -> d) as before.
    assert sru_t.forward == {**plain.forward, "ffn": 2 * (2 * n * 16 * d), "sru.proj": 2 * (2 * n * d * (3 * 16))}
    with pytest.raises(ValueError, match="no FLOP formula"):
        count_flops(ModelConfig(backbone="nothing-like-it"), 11, 2, 4)


def test_plain_pytorch_reference_has_our_parameter_count() -> None:
    ours = TransformerLM(50, d_model=32, n_layers=3, n_heads=4, d_ffn=64, dropout=0.1)
    reference = TorchReferenceLM(50, 32, 3, 4, 64, 0.1, max_len=16)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(reference) == count(ours)
    tokens = torch.randint(0, 50, (2, 16))
    out = reference.eval()(tokens)
    logits = out.logits
    assert logits.shape == (2, 16, 50) and out.state is None and out.loss is None
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 50
    assert torch.allclose(reference(changed).logits[:, :9], logits[:, :9], atol=1e-5)  # causal


def test_x_transformers_peer_is_equally_sized() -> None:
    pytest.importorskip("x_transformers")
    from gatedformer.analysis.bench.peers import XTransformersLM

    size = BenchSize(d_model=32, n_layers=3, n_heads=4, d_ffn=128, seq_len=16, vocab=50)
    ours = build_model(size.model_config("transformer"), size.vocab)
    theirs = XTransformersLM(size)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # No attention or output biases and bias-free LayerNorms over there: within 2 % of ours.
    assert abs(count(theirs) - count(ours)) <= 0.02 * count(ours)
    assert theirs(torch.randint(0, 50, (2, 16))).logits.shape == (2, 16, 50)


def test_peers_that_are_not_installed_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "x_transformers", None)  # makes ``import x_transformers`` fail
    monkeypatch.setitem(sys.modules, "sru", None)
    report = run_bench(TINY, QUICK, sections=["transformer-peers", "rnn-peers"],
                       rnn=RNNSize(hidden=8, length=4, batch=2, layers=1))
    status = {r["name"]: r["status"] for r in report.rows}
    assert status["x-transformers"].startswith("skipped: not installed")
    assert status["sru (official)"].startswith("skipped: not installed")
    for name in ("gatedformer TransformerLM", "torch.nn.TransformerEncoder", "gatedformer SRU", "torch.nn.LSTM",
                 "torch.nn.GRU"):
        assert status[name] == "ok", (name, status[name])
    reference = next(r for r in report.rows if r["name"] == "torch.nn.TransformerEncoder")
    assert reference["ours_train_speedup"] > 0 and reference["train_mfu"] > 0
    lstm = next(r for r in report.rows if r["name"] == "torch.nn.LSTM")
    assert lstm["forward_ms"] > 0 and lstm["fwd_bwd_ms"] > 0 and lstm["ours_fwd_bwd_speedup"] > 0
    assert any("x-transformers skipped" in note for note in report.notes)


@pytest.mark.slow
def test_memory_sweeps() -> None:
    report = run_bench(TINY, QUICK, sections=["memory"], mem_lens=(0, 8, 32), windows=(1, 4))
    xl = [r for r in report.section("memory") if r["backbone"] == "transformer-xl"]
    assert [r["value"] for r in xl] == [0, 8, 32]
    assert xl[0]["train_peak_mb"] < xl[1]["train_peak_mb"] < xl[2]["train_peak_mb"]
    rt = [r for r in report.section("memory") if r["backbone"] == "rtransformer"]
    assert [r["value"] for r in rt] == [1, 4] and all(r["eval_peak_mb"] > 0 for r in rt)
    assert rt[1]["window_copy_mb"] == pytest.approx(4 * rt[0]["window_copy_mb"])
    recomputed = [r for r in report.section("memory") if r["backbone"] == "rtransformer rnn_recompute"]
    assert [r["value"] for r in recomputed] == [1, 4]
    assert recomputed[1]["train_peak_mb"] < rt[1]["train_peak_mb"]  # the steps are not kept for backward
    assert recomputed[1]["eval_peak_mb"] == pytest.approx(rt[1]["eval_peak_mb"])
    assert any(note.startswith("memory: transformer-xl train peak") for note in report.notes)


def test_tensor_memory_probe_counts_live_storage() -> None:
    def step() -> torch.Tensor:
        a = torch.ones(256, 1024)  # 1 MiB
        b = a * 2  # another, both alive at once
        return b.view(-1)[:10].clone()  # a view adds nothing; the clone adds 40 bytes

    assert measure_memory(step, "cpu", "tensors") == pytest.approx(2.0, abs=0.01)
    assert measure_memory(step, "cpu", "none") is None
    with pytest.raises(ConfigError):
        measure_memory(step, "cpu", "cuda")


def test_round_robin_timing_and_failing_contenders() -> None:
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("no such kernel")

    failed: dict[str, str] = {}
    times = time_round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "broken": broken},
                             repeats=4, warmup=1, failed=failed)
    assert set(times) == {"a", "b"} and failed == {"broken": "RuntimeError: no such kernel"}
    assert calls[:2] == ["a", "b"]  # warm-up in the given order
    assert all(sorted(calls[i : i + 2]) == ["a", "b"] for i in range(2, 10, 2))  # then each once a round
    assert all(len(t.samples) == 4 and t.first_call is not None for t in times.values())
    timing = Timing([1.0, 2.0, 3.0, 4.0])
    assert timing.median == 2.5 and timing.quartiles == (1.75, 3.25)


def test_no_contender_follows_the_peak_product_in_most_rounds() -> None:
    # The peak product leaves the caches cold for whatever runs next. In a fixed order (reversed every other round)
    # the first model followed it in half the rounds, and its training step was timed slow at small sizes.
    calls: list[str] = []
    names = ["peak", "baseline", "+σ SDU", "+highway gate", "+EAU", "+GRC"]
    time_round_robin({name: functools.partial(calls.append, name) for name in names}, repeats=40, warmup=0)
    rounds = [calls[i : i + len(names)] for i in range(0, len(calls), len(names))]
    assert all(sorted(r) == sorted(names) for r in rounds) and len(rounds) == 40
    after_peak = Counter(calls[i + 1] for i in range(len(calls) - 1) if calls[i] == "peak")
    assert max(after_peak.values()) <= 14  # 8 expected of each of the five; a fixed order gives one of them 20
    assert len({tuple(r) for r in rounds}) > 30


def test_paired_ratio_cancels_drift_shared_by_a_round() -> None:
    """The median over rounds of variant / baseline in the same round: a variant 10 % slower in every round of a
    machine whose speed drifts threefold gives 1.1, and a round where only the variant was disturbed moves it
    no more than any other single round."""
    drift = [1.0, 3.0, 1.2, 2.5, 1.1]
    base = Timing([0.1 * d for d in drift])
    assert paired_ratio(Timing([0.11 * d for d in drift]), base) == pytest.approx(1.1)
    disturbed = Timing([0.11 * d * (5.0 if i == 1 else 1.0) for i, d in enumerate(drift)])
    assert paired_ratio(disturbed, base) == pytest.approx(1.1)
    assert paired_ratio(Timing([0.2, 0.3, 0.4]), Timing([0.1, 0.3, 0.8])) == pytest.approx(1.0)  # ratios 2, 1, 0.5


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="section"):
        run_bench(TINY, QUICK, sections=["everything"])
    with pytest.raises(ConfigError, match="optimizer"):
        run_bench(TINY, BenchOptions(optimizer="lion"), sections=["models"])
    with pytest.raises(ConfigError, match="divisible"):
        run_bench(BenchSize(d_model=10, n_heads=4), QUICK, sections=["models"])
    with pytest.raises(ConfigError, match="kernel_size"):
        run_bench(BenchSize(kernel_size=0), QUICK, sections=["models"])


@pytest.mark.parametrize(("args", "named"), [
    (["--d-model", "-4"], "--d-model must be at least 1, got -4"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--seq-len", "0"], "--seq-len must be at least 1"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--vocab", "1"], "--vocab must be at least 2"),
    (["--d-ffn", "-1"], "--d-ffn must be at least 0"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--mem-len", "-3"], "--mem-len must be at least -1"),
    (["--rnn-window", "0"], "--rnn-window must be at least 1"),
    (["--rnn-hidden", "0"], "--rnn-hidden must be at least 1"),
    (["--rnn-layers", "0"], "--rnn-layers must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--threads", "-1"], "--threads must be at least 0"),
    (["--mem-lens", "0", "-1"], "--mem-lens must be at least 0, got -1"),
    (["--windows", "3", "0"], "--windows must be at least 1, got 0"),
    (["--device", "tpu"], "--device tpu is not a device gatedformer runs on"),
    (["--backbones", "transformer", "transfomer"], "unknown --backbones value(s) 'transfomer'; choose from"),
    (["--variants", "+SDU", "+nonsense"], "--variants '+nonsense': unknown word 'nonsense'"),
    (["--variants", "+σ L1-9"], "--variants '+σ L1-9' with --layers 2: gate spec '+σ L1-9' names layer 9"),
])
def test_bad_command_lines_stop_with_one_error_line_before_anything_runs(
        capsys: pytest.CaptureFixture, args: list[str], named: str) -> None:
    # A typo must stop the run with the option named, not become a skipped row in a table that exits 0.
    assert cli_main(["bench", *TINY_ARGS, "--backbones", "transformer", "--quiet", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("gatedformer: error: ") and named in err


def test_variants_are_not_checked_against_backbones_without_gates() -> None:
    # The SRU LM has no sublayers to gate: it runs its baseline whatever the variants say, as before.
    report = run_bench(TINY, QUICK, sections=["models"], backbones=["sru"], variants=["+σ L1-9"])
    assert [(row["variant"], row["status"]) for row in report.rows] == [("baseline", "ok")]
    assert "models: sru has no sublayers to gate; only its baseline is measured" in report.notes


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_every_gate_variant_runs_under_bf16_autocast(norm: str) -> None:
    # The highway gate once mixed a float32 residual stream with a bf16 projection in one lerp.
    for spec in ("", "+σ SDU", "+highway gate", "+gated MHDPA", "+EAU+GRC"):
        model = TransformerLM(11, d_model=16, n_layers=2, n_heads=2, d_ffn=32, gates=spec, norm=norm)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.randint(0, 11, (2, 8))).logits
        logits.float().sum().backward()
        assert logits.shape == (2, 8, 11)


@pytest.mark.slow
def test_bf16_option_reports_mfu_against_both_peaks() -> None:
    options = BenchOptions(repeats=1, warmup=1, memory="none", threads=1, bf16=True)
    report = run_bench(TINY, options, sections=["models"], backbones=["transformer"],
                       variants=["+highway gate"])
    for row in report.section("models"):
        assert row["status"] == "ok", row["status"]
        assert row["peak_bf16_gflops"] > 0 and row["train_mfu_vs_bf16_peak"] > 0


def test_the_recipes_script_benches_each_recipes_baseline_at_its_size(tmp_path, monkeypatch) -> None:
    """benchmarks/recipes_mfu.py: the recipe's sizes and its corpus's vocabulary go into the bench; a recipe
    whose corpus is missing is a skipped row, not a failure."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from gatedformer.errors import DataError

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes_mfu.py"
    spec = importlib.util.spec_from_file_location("recipes_mfu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class _Corpus:
        vocab = list(range(37))

    def fake_corpus(name, data_dir):
        if name == "ptb":
            raise DataError("corpus 'ptb' not found; run `gatedformer data fetch ptb`")
        return _Corpus()

    monkeypatch.setattr(script, "load_corpus", fake_corpus)
    backbone, size = script.recipe_size("ptb-char-rtransformer-tiny", None)
    assert backbone == "rtransformer"
    assert (size.d_model, size.n_layers, size.seq_len, size.batch, size.vocab, size.rnn_window) == (128, 3, 64, 16,
                                                                                                      37, 7)
    assert size.rnn_type == "gru" and size.model_config("rtransformer").rnn_type == "gru"
    with monkeypatch.context() as patch:  # the LocalRNN's cell comes from the recipe too
        patch.setattr(script, "load_corpus", lambda name, data_dir: _Corpus())
        word = script.recipe_size("ptb-word-rtransformer-tiny", None)[1]
    assert (word.rnn_type, word.rnn_window, word.model_config("rtransformer").rnn_type) == ("lstm", 9, "lstm")
    run_bench = script.run_bench  # the recipe's model, on a smaller window, to keep the test short
    monkeypatch.setattr(script, "run_bench", lambda size, *args, **kwargs: run_bench(
        dataclasses.replace(size, batch=2, seq_len=16), *args, **kwargs))
    out = tmp_path / "rows.json"
    assert script.main(["--recipes", "ptb-char-rtransformer-tiny", "ptb-word-tiny", "--repeats", "1",
                        "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["recipe"] == "ptb-char-rtransformer-tiny" and 0 < rows[0]["train_mfu"] < 1.5
    assert rows[0]["size"]["vocab"] == 37
    assert rows[1]["status"].startswith("skipped: corpus 'ptb' not found")


def _benchmark_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("name", ["recipes_mfu", "xl_step", "translation_mfu"])
def test_the_benchmark_scripts_refuse_bad_input_in_one_line_before_measuring(
        name: str, tmp_path, capsys: pytest.CaptureFixture) -> None:
    script = _benchmark_script(name)
    blocked = tmp_path / "a-file"
    blocked.write_text("kept")
    recipe = {"recipes_mfu": "--recipes", "xl_step": "--recipe", "translation_mfu": "--recipe"}[name]
    cases = [
        (["--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["--threads", "-1"], "--threads must be at least 0"),
        ([recipe, "no-such-recipe"], "unknown recipe 'no-such-recipe'"),
        (["--json", str(blocked / "out.json")], f"{blocked} is a file, not a folder"),
    ]
    if name != "recipes_mfu":
        count = "--steps" if name == "xl_step" else "--batches"
        cases.append(([count, "0"], f"{count} must be at least 1, got 0"))
    for args, fragment in cases:
        assert script.main(args) == 2, args
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith(f"{name}.py: error: ") and fragment in err, err
        assert out == ""  # nothing measured, not even the table's header
    assert blocked.read_text() == "kept"


def test_the_xl_step_script_splits_the_step_around_the_compiled_stack(tmp_path, monkeypatch) -> None:
    """benchmarks/xl_step.py: the step, the compiled stack's two calls, the rest with them skipped, and the step side
    by side with the Python stack; a recipe of another backbone is refused. The stack's kernels are put back after."""
    import importlib.util
    from pathlib import Path

    from gatedformer.kernels import blas as _blas
    from gatedformer.kernels import epilogue as _epilogue_kernel
    from gatedformer.kernels import relative_attention as _relative_attention_kernel
    from gatedformer.ops import layer_stack

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "xl_step.py"
    spec = importlib.util.spec_from_file_location("xl_step", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tiny = BenchSize(d_model=32, n_layers=2, n_heads=2, d_ffn=64, seq_len=16, batch=4, vocab=29, dropout=0.1,
                     mem_len=16)
    monkeypatch.setattr(script, "recipe_size", lambda name, data_dir: ("transformer-xl", tiny))
    streams, library = layer_stack._streams_whole_stack, _epilogue_kernel.KERNEL.library
    out = tmp_path / "xl.json"
    status = script.main(["--steps", "2", "--repeats", "2", "--threads", "1", "--json", str(out)])
    assert layer_stack._streams_whole_stack is streams and _epilogue_kernel.KERNEL.library == library
    native = all(kernel.pick_backend(torch.device("cpu")) == "native"
                 for kernel in (_epilogue_kernel.KERNEL, _relative_attention_kernel.KERNEL))
    if not native or _blas.packed_gemm() is None:
        assert status == 1 and not out.exists()
        return
    assert status == 0
    figures = json.loads(out.read_text())
    assert figures["forward_call_ms"] > 0 and figures["backward_call_ms"] > 0
    assert 0 < figures["around_calls_ms"] < figures["step_ms"]
    assert figures["rest_alone_ms"] > 0  # timed apart from the step: at this size no faster for sure
    assert figures["python_stack_speedup"] > 0
    monkeypatch.setattr(script, "recipe_size", lambda name, data_dir: ("transformer", tiny))
    assert script.main(["--steps", "1"]) == 2
