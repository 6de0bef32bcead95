"""Translation: the encoder-decoder with EAU/GRC, Multi30K data, decoding, BLEU, training and the CLI.

Training tests run on a small synthetic parallel corpus laid out like Multi30K (so they take seconds
and need no shared data); a few tests read the real Multi30K files when they are present.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA, needs_shared
from torch import nn

from gatedformer.config import RunConfig, apply_overrides, build_config, load_recipe, validate
from gatedformer.data import translation as mt
from gatedformer.errors import CheckpointError, ConfigError, DataError
from gatedformer.gates import EAU, SDU, GatedResidual
from gatedformer.gates.spec import resolve_placement
from gatedformer.models.seq2seq import Seq2SeqTransformer, seq2seq_parameter_count
from gatedformer.runs import load_trained
from gatedformer.tasks import translation as translation_task
from gatedformer.tasks.translation import beam_search, corpus_bleu, greedy_decode
from gatedformer.tasks.weights import recorded_config
from gatedformer.train.loop import train as train_translation


def translate_lines(run_dir: Path, lines: list[str], **options: object) -> list[str]:
    run = load_trained(run_dir)
    return translation_task.translate_lines(run.model, run.config, run.data, lines, **options)


def load_translation_run(run_dir: Path) -> object:
    return load_trained(run_dir)


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _model(eau: bool = False, grc: bool = False, gates: str = "", layers: int = 2, tie: bool = False,
           dropout: float = 0.0) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(23, 29, layers=layers, d_model=16, ffn=32, heads=2, max_len=24, dropout=dropout,
                              eau=eau, grc=grc, gates=gates, tie_embeddings=tie)


def _count(module: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in module.modules())


# ---------------------------------------------------------------------------------------------
# Model structure


@pytest.mark.parametrize(("eau", "grc"), [(False, False), (True, False), (False, True), (True, True)])
def test_eau_after_every_attention_and_grc_on_every_residual(eau: bool, grc: bool) -> None:
    model = _model(eau, grc, layers=3)
    for layer in model.encoder_layers:
        assert _count(layer, EAU) == (1 if eau else 0)
        assert _count(layer, GatedResidual) == (2 if grc else 0)
        assert (layer.attn.eau is not None) == eau and layer.ffn.eau is None
    for layer in model.decoder_layers:
        assert _count(layer, EAU) == (2 if eau else 0)
        assert _count(layer, GatedResidual) == (3 if grc else 0)
        assert (layer.attn.eau is not None) == eau and (layer.cross_attn.eau is not None) == eau
        assert layer.ffn.eau is None
        for sub in (layer.attn, layer.cross_attn, layer.ffn):
            assert (sub.grc is not None) == grc
    assert _count(model, EAU) == 3 * 3 * eau and _count(model, GatedResidual) == 5 * 3 * grc


def test_gate_spec_reaches_the_cross_attention() -> None:
    assert _count(_model(gates="eau /cross"), EAU) == 2  # decoder cross-attention of both layers only
    only_cross = _model(gates="eau /cross")
    assert all(layer.cross_attn.eau is not None and layer.attn.eau is None for layer in only_cross.decoder_layers)
    sdu = _model(gates="+σ SDU")
    assert _count(sdu, SDU) == 2 * 2 + 2 * 3  # every sublayer of both stacks
    no_cross = _model(gates="grc \\cross")
    assert _count(no_cross, GatedResidual) == 2 * 2 + 2 * 2
    assert _count(_model(gates="+EAU", grc=True), EAU) == 6


def test_decoder_less_placement_is_unchanged_and_rejects_cross() -> None:
    placement = resolve_placement("+EAU+GRC", 2)
    assert {sub for _, sub in placement.sites} == {"attn", "ffn"}
    with pytest.raises(ConfigError, match="cross-attention"):
        resolve_placement("eau /cross", 2)
    assert set(resolve_placement("+EAU+GRC", 2, cross_attention=True).sites) == {
        (i, s) for i in range(2) for s in ("attn", "cross", "ffn")}


@pytest.mark.parametrize(("eau", "grc", "tie"), [(False, False, False), (True, False, False), (False, True, False),
                                                 (True, True, False), (True, True, True)])
def test_parameter_count_matches_the_closed_form(eau: bool, grc: bool, tie: bool) -> None:
    model = _model(eau, grc, layers=3, tie=tie)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert total == seq2seq_parameter_count(23, 29, 3, 16, 32, eau, grc, tie)
    k, h = 16, 8
    eau_params = k * h + h + h * k + k + k * k + k
    assert seq2seq_parameter_count(23, 29, 3, 16, 32, True, True) - seq2seq_parameter_count(23, 29, 3, 16, 32) == (
        3 * 3 * eau_params + 5 * 3 * (k * k + k))


def test_layout_has_the_parameters_of_torch_transformer() -> None:
    reference = nn.Transformer(16, 2, 3, 3, 32)
    body = sum(p.numel() for p in reference.parameters())
    embeddings_and_output = 23 * 16 + 29 * 16 + 16 * 29 + 29
    assert seq2seq_parameter_count(23, 29, 3, 16, 32) == body + embeddings_and_output


def test_decoder_is_causal_and_source_padding_is_masked() -> None:
    model = _model(True, True).eval()
    src = torch.randint(4, 23, (2, 7))
    tgt = torch.randint(4, 29, (2, 9))
    changed = tgt.clone()
    changed[:, 5] = (changed[:, 5] + 1 - 4) % 25 + 4
    a, b = model(src, tgt).logits, model(src, changed).logits
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    padded = torch.cat([src, torch.full((2, 4), mt.PAD_ID)], dim=1)
    assert torch.allclose(model(padded, tgt).logits, a, atol=1e-5)


def test_incremental_decoding_equals_the_full_decoder() -> None:
    model = _model(True, True, gates="+σ SDU \\ffn").eval()
    src = torch.randint(4, 23, (3, 6))
    src[1, 4:] = mt.PAD_ID
    tgt = torch.randint(4, 29, (3, 8))
    memory, mask = model.encode(src)
    cache = model.new_cache()
    steps = [model.decode_step(tgt[:, i], i, memory, mask, cache) for i in range(8)]
    assert torch.allclose(torch.stack(steps, dim=1), model(src, tgt).logits, atol=1e-5)


def test_sequences_longer_than_n_are_refused_by_the_model() -> None:
    with pytest.raises(ValueError, match="max_len n=24"):
        _model()(torch.randint(4, 23, (1, 25)), torch.randint(4, 29, (1, 3)))


# ---------------------------------------------------------------------------------------------
# Decoding and BLEU


def test_beam_search_at_beam_one_equals_greedy() -> None:
    for seed in range(3):
        model = _model(True, True)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3, alpha=seed)
        model.eval()
        src = torch.randint(4, 23, (5, 6))
        src[2, 3:] = mt.PAD_ID
        greedy = greedy_decode(model, src)
        assert beam_search(model, src, beam=1, length_penalty=0.6) == greedy
        assert beam_search(model, src, beam=1, length_penalty=0.0) == greedy
        wide = beam_search(model, src, beam=4)
        assert len(wide) == 5 and all(mt.EOS_ID not in h and mt.PAD_ID not in h for h in wide)


def test_bleu_of_a_reference_against_itself_is_100() -> None:
    path = SHARED_DATA / "multi30k" / "val.de"
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else [
        "Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch im Park."]
    assert corpus_bleu(lines, lines) == pytest.approx(100.0)
    assert corpus_bleu([line.lower() for line in lines], lines) == pytest.approx(100.0)  # case-insensitive
    assert corpus_bleu(["völlig anders"] * len(lines), lines) < 5


@needs_shared("multi30k/val.en", "multi30k/tok/val.lc.norm.tok.en", "multi30k/val.de",
              "multi30k/tok/val.lc.norm.tok.de")
def test_tokenizer_and_detokenizer_agree_with_the_multi30k_files() -> None:
    for lang in ("en", "de"):
        raw = (SHARED_DATA / "multi30k" / f"val.{lang}").read_text(encoding="utf-8").splitlines()
        tok = (SHARED_DATA / "multi30k" / "tok" / f"val.lc.norm.tok.{lang}").read_text(encoding="utf-8").splitlines()
        same = sum(" ".join(mt.tokenize(r, lang)) == t for r, t in zip(raw, tok, strict=True))
        assert same >= 0.99 * len(raw)
        detok = [mt.detokenize(t.split(), lang) for t in tok]
        assert corpus_bleu(detok, raw) > 99.5


def test_tokenize_examples() -> None:
    assert mt.tokenize("A man's \"big\" dog, running.", "en") == [
        "a", "man", "&apos;s", "&quot;", "big", "&quot;", "dog", ",", "running", "."]
    assert mt.tokenize("Ein Mann bei McDonald's.", "de") == ["ein", "mann", "bei", "mcdonald", "&apos;", "s", "."]
    assert mt.detokenize(["ein", "&quot;", "t-shirt", "&quot;", "von", "mcdonald", "&apos;", "s", "."]) == (
        'ein "t-shirt" von mcdonald\'s.')
    assert mt.tokenize("   ", "en") == []


# ---------------------------------------------------------------------------------------------
# Data

EN = ["a", "man", "woman", "dog", "cat", "runs", "sits", "on", "the", "grass", "red", "big", "small", "ball"]
DE = {"a": "ein", "man": "mann", "woman": "frau", "dog": "hund", "cat": "katze", "runs": "läuft", "sits": "sitzt",
      "on": "auf", "the": "dem", "grass": "gras", "red": "rot", "big": "groß", "small": "klein", "ball": "ball"}


def _write_corpus(root: Path, train: int = 160, evaluation: int = 12, long_train: int = 0, long_eval: int = 0) -> Path:
    rng = random.Random(0)

    def pair(length: int) -> tuple[str, str]:
        words = [rng.choice(EN) for _ in range(length)]
        return " ".join(words) + " .", " ".join(DE[w] for w in words) + " ."

    folder = root / "multi30k"
    (folder / "tok").mkdir(parents=True)
    for split, count, long in (("train", train, long_train), ("val", evaluation, long_eval),
                               ("test_2016_flickr", evaluation, long_eval)):
        pairs = [pair(rng.randint(2, 6)) for _ in range(count)] + [pair(20) for _ in range(long)]
        for index, lang in ((0, "en"), (1, "de")):
            lines = [p[index] for p in pairs]
            (folder / "tok" / f"{split}.lc.norm.tok.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
            if split != "train":
                raw = [mt.detokenize(line.split(), lang).capitalize() for line in lines]
                (folder / f"{split}.{lang}").write_text("\n".join(raw) + "\n", encoding="utf-8")
    return root


@pytest.fixture
def corpus_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(mt, "MULTI30K_SHA256", {})
    return _write_corpus(tmp_path / "data")


def _config(*extra: str) -> RunConfig:
    config = apply_overrides(RunConfig(), [
        "data.corpus=multi30k", "data.batch_size=16", "data.eval_batch_size=8", "model.d_model=16",
        "model.n_layers=1", "model.n_heads=2", "model.d_ffn=32", "model.dropout=0.1", "translation.max_len=12",
        "translation.min_freq=1", "translation.beam_size=2", "translation.bleu_sentences=4", "train.steps=6",
        "train.eval_every=3", "train.log_every=1", "optim.lr=0.003", "optim.schedule=noam", "optim.warmup_steps=4",
        "model.gates=+EAU+GRC", *extra])
    return validate(config)


def test_unknown_language_pair_is_one_clear_error(corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no en→fr pair; available pairs: en→de, de→en") as info:
        mt.load_translation_data("en", "fr", corpus_dir)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="available pairs"):
        train_translation(_config("translation.tgt_lang=fr"), tmp_path / "run", corpus_dir, progress=False)
    assert not (tmp_path / "run" / "results.json").exists()


def test_vocabulary_specials_min_freq_and_reverse_direction(corpus_dir: Path) -> None:
    data = mt.load_translation_data("de", "en", corpus_dir, min_freq=1)
    assert data.src_vocab.itos[:4] == mt.SPECIALS and "hund" in data.src_vocab.stoi and "dog" in data.tgt_vocab.stoi
    vocab = mt.build_vocab([["a", "a", "b"], ["a", "c", "c"]], min_freq=2)
    assert vocab.itos == (*mt.SPECIALS, "a", "c")
    assert mt.encode(["a", "zzz"], vocab) == [4, mt.UNK_ID]
    assert mt.build_vocab([["a", "a", "b", "b", "c"]], min_freq=1, max_size=6).itos == (*mt.SPECIALS, "a", "b")


def test_sentences_longer_than_n_skipped_in_training_truncated_in_evaluation(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mt, "MULTI30K_SHA256", {})
    root = _write_corpus(tmp_path / "data", long_train=5, long_eval=2)
    with pytest.warns(UserWarning, match="truncated to 10 tokens"):
        data = mt.load_translation_data("en", "de", root, min_freq=1, max_len=12)
    assert data.train.skipped == 5 and len(data.train) == 160
    assert data.valid.truncated == 2 and len(data.valid) == 14
    assert max(len(s) for s in data.valid.src) == 10


def test_length_batches_are_deterministic_and_cover_every_sentence(corpus_dir: Path) -> None:
    data = mt.load_translation_data("en", "de", corpus_dir, min_freq=1)
    a = mt.length_batches(data.train, 16, max_tokens=60, seed=3, epoch=1)
    assert a == mt.length_batches(data.train, 16, max_tokens=60, seed=3, epoch=1)
    assert a != mt.length_batches(data.train, 16, max_tokens=60, seed=3, epoch=2)
    assert sorted(i for batch in a for i in batch) == list(range(len(data.train)))
    for batch in a:
        longest = max(max(len(data.train.src[i]), len(data.train.tgt[i])) + 1 for i in batch)
        assert longest * len(batch) <= 60 or len(batch) == 1
    assert all(len(b) <= 16 for b in mt.length_batches(data.train, 16, seed=0))


def test_missing_corpus_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="multi30k/tok/train.lc.norm.tok.en|not found"):
        mt.locate_multi30k("en", "de", tmp_path / "empty")


# ---------------------------------------------------------------------------------------------
# Training, resume, translate, CLI


def test_tiny_end_to_end_train_writes_results_with_bleu(corpus_dir: Path, tmp_path: Path) -> None:
    from gatedformer.train.loop import train

    out = tmp_path / "run"
    result = train(_config("translation.train_sentences=100"), out, data_dir=corpus_dir, progress=False)
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert saved["metric"] == result.metric == "bleu"
    assert 0.0 <= saved["valid_metric"] <= 100.0 and 0.0 <= saved["test_metric"] <= 100.0
    assert math.isfinite(saved["valid_loss"]) and math.isfinite(saved["test_loss"])
    assert saved["steps"] == 6
    records = [json.loads(line) for line in (out / "log.jsonl").read_text(encoding="utf-8").splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and "valid_bleu" in evals[0]
    assert any("eau" in name for name in evals[0]["gates"])
    assert records[0]["train_pairs"] == 100
    assert len((out / "test.hyp.txt").read_text(encoding="utf-8").splitlines()) == 12
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert vocab["src"][:4] == list(mt.SPECIALS)


def test_resume_equals_an_uninterrupted_run(corpus_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = _config("train.steps=8", "train.eval_every=4", "translation.max_tokens=60")
    straight = train_translation(config, tmp_path / "straight", corpus_dir, progress=False)
    assert train_translation(config, tmp_path / "split", corpus_dir, progress=False, stop_after=2) is None
    assert not (tmp_path / "split" / "results.json").exists()
    with pytest.raises(ConfigError, match="--resume"):
        train_translation(config, tmp_path / "split", corpus_dir, progress=False)
    resumed = train_translation(config, tmp_path / "split", corpus_dir, resume=True, progress=False)
    for key in ("valid_loss", "valid_metric", "test_loss", "test_metric", "steps", "params"):
        assert getattr(resumed, key) == getattr(straight, key), key
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "straight" / "test.hyp.txt").read_text() == (tmp_path / "split" / "test.hyp.txt").read_text()


@pytest.fixture
def trained_run(corpus_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "trained"
    train_translation(_config("train.steps=3", "train.eval_every=3"), out, corpus_dir, progress=False)
    return out


def test_translate_lines_keeps_empty_lines_and_refuses_long_ones(trained_run: Path) -> None:
    out = translate_lines(trained_run, ["A dog runs.", "", "   ", "A big red ball."], beam=2)
    assert len(out) == 4 and out[1] == "" and out[2] == ""
    assert translate_lines(trained_run, ["A dog runs."], beam=1) == translate_lines(trained_run, ["A dog runs."],
                                                                                   beam=1)
    with pytest.raises(DataError, match=r"input line 2 has 11 tokens, but this model takes at most 10") as info:
        translate_lines(trained_run, ["a dog .", "a " * 11])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="--beam"):
        translate_lines(trained_run, ["a dog"], beam=0)


def test_translate_cli_prints_one_line_per_input_line(trained_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from gatedformer.cli import main

    source = tmp_path / "in.en"
    source.write_text("A man sits on the grass.\n\nA small cat.\n", encoding="utf-8")
    assert main(["translate", "--run", str(trained_run), "--input", str(source), "--beam", "1"]) == 0
    printed = capsys.readouterr().out.split("\n")
    assert len(printed) == 4 and printed[1] == "" and printed[3] == ""
    assert main(["translate", "--run", str(tmp_path / "nowhere"), "--input", str(source)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_translate_cli_reads_stdin_strictly_and_takes_a_length_penalty(
        trained_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from gatedformer.cli import main

    def stdin(data: bytes) -> None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))

    stdin(b"A man sits on the grass.\nA small cat.\n")
    assert main(["translate", "--run", str(trained_run), "--beam", "3", "--length-penalty", "2"]) == 0
    wanted = translate_lines(trained_run, ["A man sits on the grass.", "A small cat."], beam=3, length_penalty=2.0)
    assert capsys.readouterr().out.splitlines() == wanted
    translation = translation_task

    decode, penalties = translation.translate_ids, []
    monkeypatch.setattr(translation, "translate_ids", lambda *a: penalties.append(a[3]) or decode(*a))
    stdin(b"A small cat.\n")
    assert main(["translate", "--run", str(trained_run), "--length-penalty", "1.5"]) == 0
    assert penalties == [1.5]
    stdin(b"a dog \xff\xfe runs\n")  # not UTF-8: refused, not translated as <unk>
    assert main(["translate", "--run", str(trained_run)]) == 2
    assert "standard input is not UTF-8 text" in capsys.readouterr().err
    stdin(b"a dog\n")
    assert main(["translate", "--run", str(trained_run), "--length-penalty", "-1"]) == 2
    assert "--length-penalty must be a finite number >= 0" in capsys.readouterr().err


def test_translate_answers_each_typed_line_at_once(trained_run: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from gatedformer.cli import main

    class Terminal(io.TextIOWrapper):
        def isatty(self) -> bool:
            return True

    batches, stream = [], translation_task.translate_stream
    monkeypatch.setattr(translation_task, "translate_stream",
                        lambda *a, **k: batches.append(k["batch_size"]) or stream(*a, **k))
    for given, typed, wanted in ((None, True, 1), (None, False, 64), (8, True, 8)):
        kind = Terminal if typed else io.TextIOWrapper
        monkeypatch.setattr("sys.stdin", kind(io.BytesIO(b"A small cat.\n"), encoding="utf-8"))
        extra = [] if given is None else ["--batch-size", str(given)]
        assert main(["translate", "--run", str(trained_run), "--beam", "1", *extra]) == 0
        assert batches[-1] == wanted and len(capsys.readouterr().out.splitlines()) == 1
    assert main(["translate", "--run", str(trained_run), "--batch-size", "0"]) == 2
    assert "--batch-size must be at least 1, got 0" in capsys.readouterr().err


def test_translate_reads_bounded_lines_as_they_come_and_beams_up_to_the_vocabulary(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from gatedformer.cli import main

    def one_line() -> str:
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("gatedformer: error: "), lines
        return lines[0]

    started = time.monotonic()
    assert main(["translate", "--run", str(trained_run), "--input", "/dev/zero"]) == 2  # endless, no line breaks
    assert "line 1 of --input /dev/zero is longer than 65536 bytes" in one_line()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a dog .\n" + b"\0" * 10**6), encoding="utf-8"))
    assert main(["translate", "--run", str(trained_run)]) == 2
    assert "line 2 of standard input is longer than 65536 bytes" in one_line()
    assert time.monotonic() - started < 60
    assert main(["translate", "--run", str(trained_run), "--input", str(tmp_path)]) == 2
    assert "cannot read --input" in one_line()
    vocabulary = len(load_translation_run(trained_run).data.tgt)
    source = tmp_path / "in.en"
    source.write_text("a dog .\n", encoding="utf-8")
    assert main(["translate", "--run", str(trained_run), "--input", str(source), "--beam", "100000"]) == 2
    assert f"--beam must be from 1 (greedy) to the target vocabulary's {vocabulary} tokens" in one_line()
    assert main(["translate", "--run", str(trained_run), "--input", str(source), "--beam", str(vocabulary)]) == 0

    run = load_translation_run(trained_run)
    pulled = []

    def lines():  # an input that goes on: the first translations come before it ends
        for k in itertools.count():
            pulled.append(k)
            yield "a big dog ." if k % 2 else "a cat ."

    translations = translation_task.translate_stream(run.model, run.config, run.data, lines(), beam=1, batch_size=2)
    first = [next(translations), next(translations)]
    assert first == translate_lines(trained_run, ["a cat .", "a big dog ."], beam=1) and len(pulled) == 2


def test_translation_weights_of_another_architecture_are_refused_by_name(trained_run: Path) -> None:
    assert recorded_config(trained_run / "model.safetensors")["model"]["d_model"] == 16
    config = json.loads((trained_run / "config.json").read_text())
    config["model"].update(d_ffn=48, dropout=0.3)  # dropout does not change the weights
    (trained_run / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"another architecture .*model\.d_ffn \(32 saved, 48 now\)") as info:
        load_translation_run(trained_run)
    assert "dropout" not in str(info.value)
    (trained_run / "model.safetensors").unlink()  # the checkpoint records its config too
    with pytest.raises(CheckpointError, match=r"ckpt.*another architecture"):
        load_translation_run(trained_run)


def test_the_translation_mfu_script_times_real_batches_against_their_counted_flops(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/translation_mfu.py: the recipe's model on its first batches; the FLOPs are counted with PyTorch's
    operations in place of the compiled kernels (kernels.build.pytorch_operations, tested in test_kernel_build),
    whose arithmetic the counter cannot see."""
    import importlib.util

    from gatedformer.kernels import attention as _attention_kernel

    cpu = torch.device("cpu")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "translation_mfu.py"
    spec = importlib.util.spec_from_file_location("translation_mfu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    out = tmp_path / "mfu.json"
    overrides = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ffn=32", "data.batch_size=16",
                 "translation.max_len=12", "translation.min_freq=1"]
    assert script.main(["--data-dir", str(corpus_dir), "--threads", "1", "--batches", "3", "--repeats", "1",
                        "--warmup", "0", "--json", str(out), "--set", *overrides]) == 0
    figures = json.loads(out.read_text())
    assert figures["recipe"] == "multi30k-tiny" and figures["batches"] == 3
    assert figures["target_positions"] > 0 and 0 <= figures["padding_share"] < 1
    assert figures["step_q1_ms"] <= figures["step_ms"] <= figures["step_q3_ms"]
    assert figures["gflop_per_step"] > 0 and figures["peak_gflops"] > 0 and 0 < figures["train_mfu"] < 1.5
    if _attention_kernel.KERNEL.pick_backend(cpu) == "native":  # counted through the kernels, FLOPs go missing
        monkeypatch.setattr(script, "pytorch_operations", contextlib.nullcontext)
        assert script.main(["--data-dir", str(corpus_dir), "--threads", "1", "--batches", "3", "--repeats", "1",
                            "--warmup", "0", "--json", str(out), "--set", *overrides]) == 0
        assert json.loads(out.read_text())["gflop_per_step"] < figures["gflop_per_step"]


def test_eval_and_generate_on_a_translation_run(trained_run: Path, corpus_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from gatedformer.cli import main

    assert main(["eval", "--run", str(trained_run), "--split", "test", "--data-dir", str(corpus_dir)]) == 0
    scores = json.loads(capsys.readouterr().out)
    saved = json.loads((trained_run / "results.json").read_text())
    assert scores["loss"] == pytest.approx(saved["test_loss"], rel=1e-5)
    assert scores["bleu"] == pytest.approx(saved["test_metric"], abs=1e-6)
    assert main(["generate", "--run", str(trained_run), "--data-dir", str(corpus_dir)]) == 2
    assert ("is a translation run (multi30k), not a language-model run as generate needs; use `gatedformer translate"
            in capsys.readouterr().err)


def test_config_validation_for_translation() -> None:
    validate(apply_overrides(RunConfig(), ["data.corpus=multi30k", "model.gates=eau /cross"]))
    for override, fragment in (("translation.decode=sample", "translation.decode"),
                               ("translation.beam_size=0", "beam_size"), ("translation.max_len=2", "max_len"),
                               ("translation.src_vocab=3", "src_vocab")):
        with pytest.raises(ConfigError, match=fragment):
            validate(apply_overrides(RunConfig(), ["data.corpus=multi30k", override]))
    with pytest.raises(ConfigError, match="cross"):
        validate(apply_overrides(RunConfig(), ["model.gates=eau /cross"]))  # a language model has none


def test_recipes_list_the_four_variants() -> None:
    for name in ("multi30k-tiny", "multi30k-paper"):
        recipe = load_recipe(name)
        assert [v.name for v in recipe.variants][:4] == ["baseline", "+EAU", "+GRC", "+EAU+GRC"]
        for variant in recipe.variants:
            assert build_config(recipe, [], variant).data.corpus == "multi30k"
    assert load_recipe("multi30k-tiny").variants[4].match_params == "+EAU+GRC"  # and Table 3's other sizes:
    assert [v.name for v in load_recipe("multi30k-paper").variants][4:] == [
        "baseline l2", "+EAU+GRC l2", "baseline l2 n64 k128 f512", "+EAU+GRC l2 n64 k128 f512"]
    paper = build_config(load_recipe("multi30k-paper"))
    assert (paper.model.n_layers, paper.translation.max_len, paper.model.d_model, paper.model.d_ffn) == (3, 128, 256,
                                                                                                          1024)
    assert (paper.data.batch_size, paper.optim.lr, paper.optim.weight_decay) == (128, 2e-5, 0.01)
    assert (paper.optim.name, paper.optim.beta1, paper.optim.beta2) == ("adamw", 0.9, 0.999)


def test_params_report_shows_the_paper_sizes_side_by_side() -> None:
    from gatedformer.analysis.params import parameter_report

    report = parameter_report("multi30k-tiny", ["translation.src_vocab=1000", "translation.tgt_vocab=1200"])
    assert [row["variant"] for row in report["variants"]] == ["baseline", "+EAU", "+GRC", "+EAU+GRC",
                                                            "baseline, params of +EAU+GRC"]
    assert [(r["l"], r["n"], r["k"], r["f"]) for r in report["paper_sizes"]] == [
        (3, 128, 256, 1024), (2, 128, 256, 1024), (2, 64, 128, 512)]
    for row in report["paper_sizes"]:
        assert row["baseline"] == seq2seq_parameter_count(1000, 1200, row["l"], row["k"], row["f"])
        assert row["+EAU+GRC"] == seq2seq_parameter_count(1000, 1200, row["l"], row["k"], row["f"], True, True)
    assert "+EAU+GRC" in report["text"] and "1,000" in report["text"]


@pytest.mark.slow
def test_compare_runs_translation_variants(corpus_dir: Path, tmp_path: Path) -> None:
    from gatedformer.analysis.compare import run_comparison

    recipe = load_recipe("multi30k-tiny")
    overrides = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ffn=32", "translation.max_len=12",
                 "translation.min_freq=1", "train.steps=2", "train.eval_every=2", "translation.beam_size=1",
                 "translation.bleu_sentences=4", "data.eval_batch_size=8", "data.batch_size=16"]
    report = run_comparison(recipe, tmp_path / "cmp", overrides=overrides, data_dir=corpus_dir, progress=False,
                            only=["baseline", "+EAU+GRC"])
    assert "valid bleu" in report.table and "+EAU+GRC" in report.table
    assert "higher is better" in report.report_path.read_text(encoding="utf-8")
