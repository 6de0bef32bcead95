"""The command line as a user runs it: one clear error line and a non-zero exit for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_shared, sets, tiny_overrides

from gatedformer.analysis.params import count_by_component
from gatedformer.cli import main
from gatedformer.config import ModelConfig
from gatedformer.models import build_model


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The installed entry point in a fresh process, as a user would call it."""
    return subprocess.run([sys.executable, "-m", "gatedformer", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, cwd=cwd)


def in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``main(args)`` in this process, as ``run_cli`` would report it (a fresh process costs seconds)."""
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gatedformer: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.loss_plot
def test_train_eval_generate_params(text_corpus: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(text_corpus) + ["model.gates=+σ SDU"]
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(out), "--quiet", *sets(overrides)]) == 0
    printed = capsys.readouterr().out
    assert "valid bpc" in printed and "test  bpc" in printed
    assert (out / "results.json").is_file() and (out / "loss.png").stat().st_size > 1000

    assert main(["eval", "--run", str(out), "--split", "test"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    saved = json.loads((out / "results.json").read_text())
    assert line["split"] == "test" and line["bpc"] == pytest.approx(saved["test_metric"], rel=1e-6)

    assert main(["generate", "--run", str(out), "--prompt", "the cat", "--tokens", "20"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the cat") and len(text.strip()) > len("the cat")

    assert main(["params", "--recipe", "ptb-char-tiny", "--json", *sets(tiny_overrides(text_corpus))]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [v["variant"] for v in report["variants"]]
    assert names == ["baseline", "+σ SDU", "+tanh SDU", "baseline, params of +σ SDU"]
    base, sdu, _, matched = report["variants"]
    assert sdu["total"] - base["total"] == 2 * 2 * 2 * 16 * 17  # 2 layers x 2 sublayers x 2d(d+1)
    assert sdu["components"]["gate: SDU"] == 2 * 2 * 2 * 16 * 17
    assert abs(matched["total"] - sdu["total"]) <= 0.005 * sdu["total"] and "gate: SDU" not in matched["components"]
    assert "gate: SDU" not in base["components"]


@pytest.mark.parametrize("backbone, part, size", [
    ("rtransformer", "local RNN", 3 * 8 * 8 * 2 + 3 * 8 * 2),  # GRU: W_ih, W_hh (3d x d) and their biases
    ("sru", "SRU", None), ("sru-transformer", "SRU", None), ("gcnn", "convolutions", None),
])
def test_parameter_components_name_the_recurrent_and_convolutional_parts(backbone: str, part: str,
                                                                         size: int | None) -> None:
    model = build_model(ModelConfig(backbone=backbone, d_model=8, n_layers=1, n_heads=2, d_ffn=16), 10)
    components = count_by_component(model)
    assert part in components and (size is None or components[part] == size)
    assert sum(components.values()) == sum(p.numel() for p in model.parameters())
    assert not {"layers", "sru"} & set(components)  # no bare module names left over


def test_resume_from_the_command_line(text_corpus: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--recipe", "ptb-char-tiny", "--out", str(out), "--quiet", *sets(tiny_overrides(text_corpus))]
    assert main(args) == 0
    assert_one_line_error(run_cli(*args), "already holds a finished run")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["train", "--recipe", "no-such-recipe", "--out", "x"], "unknown recipe 'no-such-recipe'"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.widht=3"], "unknown config key"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.d_model=big"], "whole number"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.d_model=0"], "must be positive"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.dropout=1"], "in [0, 1)"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.n_heads=5"], "not divisible"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.gates=+sdu L9"], "names layer 9"),
        (["train", "--recipe", "ptb-char-tiny", "--out", "x", "--data", "nonsense"], "unknown corpus"),
        (["eval", "--run", "does-not-exist"], "not a gatedformer run"),
    ],
)
def test_bad_input_is_one_line(args: list[str], fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    # in this process (a fresh one costs seconds a case): the entry point's own test is below
    assert_one_line_error(in_process(capsys, *args), fragment)
    # A command refused on its input leaves nothing behind: no half-made run folder "x" holding only a lock.
    assert list(tmp_path.iterdir()) == []


def test_bad_input_from_the_entry_point_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("train", "--recipe", "ptb-char-tiny", "--out", "x", "--set", "model.widht=3",
                                  cwd=tmp_path), "unknown config key")
    assert list(tmp_path.iterdir()) == []


def test_an_output_path_blocked_by_a_file_is_one_line(text_corpus: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    blocked = tmp_path / "notes.txt"
    blocked.write_text("mine")
    run = tmp_path / "run"
    overrides = sets(tiny_overrides(text_corpus, steps=2))
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(run), "--quiet", *overrides,
                 "--set", "model.gates=+σ SDU"]) == 0
    capsys.readouterr()
    for args, fragment in [
        (["train", "--recipe", "ptb-char-tiny", "--out", str(blocked), "--quiet", *overrides],
         f"{blocked} is a file, not a folder; choose another run folder"),
        (["train", "--recipe", "ptb-char-tiny", "--out", str(blocked / "run"), "--quiet", *overrides],
         f"cannot create the run folder {blocked / 'run'} (Not a directory)"),
        (["compare", "--recipe", "ptb-char-tiny", "--out", str(blocked), "--quiet", *overrides],
         "is a file, not a folder; choose another comparison folder"),
        (["analyze", "--run", str(run), "--out", str(blocked)], "is a file, not a folder"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("gatedformer: error: ") and fragment in err, err
    assert blocked.read_text() == "mine"


def test_bad_sampling_device_and_corpus_names_are_one_line(text_corpus: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(run), "--quiet",
                 *sets(tiny_overrides(text_corpus, steps=2))]) == 0
    capsys.readouterr()
    for args, fragment in [
        (["generate", "--run", str(run), "--top-k", "-3"], "--top-k must be 0 (sample among all tokens) or positive"),
        (["generate", "--run", str(run), "--device", "tpu"], "device=tpu is not a device gatedformer runs on"),
        (["eval", "--run", str(run), "--device", "cuda:7" if torch.cuda.is_available() else "cuda"],
         "device=cuda"),
        (["train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "r2"), "--set", "train.device=cudax",
          *sets(tiny_overrides(text_corpus, steps=2))], "train.device=cudax is not a device"),
        (["data", "check", "ptb-chars"], "unknown corpus 'ptb-chars'; check one of: ptb, ptb-char"),
        (["data", "list", "ptb"], "data list takes no corpus name"),
        (["data", "fetch", "multi31k"], "fetchable corpora: ptb, ptb-char, wikitext2, wikitext2-char, wikitext103, "
                                        "enwik8, glue-cola"),
    ]:
        assert main(args) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("gatedformer: error: ") and fragment in err, err


def test_missing_corpus(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "r"), "--data-dir", str(empty))
    assert_one_line_error(result, "corpus 'ptb-char' not found")
    assert "gatedformer data fetch ptb-char" in result.stderr


def test_corrupt_and_empty_corpora(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "data" / "ptb"
    folder.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (folder / f"ptb.char.{split}.txt").write_text("a b c _ d \n")
    result = run_cli("train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "r"),
                     "--data-dir", str(tmp_path / "data"))
    assert_one_line_error(result, "checksum mismatch")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(in_process(capsys, "train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "e"),
                                     "--data", f"text:{empty}"), "empty")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff world" * 10)
    assert_one_line_error(in_process(capsys, "train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "b"),
                                     "--data", f"text:{bad}"), "UTF-8")


def test_seq_len_longer_than_a_split(text_corpus: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = in_process(capsys, "train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "r"),
                        "--data", text_corpus, "--set", "data.seq_len=100000")
    assert_one_line_error(result, "seq_len")


def test_truncated_checkpoint_and_mismatched_config(text_corpus: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    base = ["train", "--recipe", "ptb-char-tiny", "--out", str(out), "--quiet", *sets(tiny_overrides(text_corpus))]
    assert main([*base, "--set", "train.steps=4"]) == 0
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    # The run's checkpoint is still there: the error says so, and following it evaluates the run.
    assert_one_line_error(run_cli("eval", "--run", str(out)),
                          f"truncated or corrupt (Error while deserializing header: invalid header length); "
                          f"delete it to use the run's latest checkpoint ({out / 'ckpt'}) instead")
    weights.unlink()
    assert in_process(capsys, "eval", "--run", str(out)).returncode == 0

    half = tmp_path / "half"
    from gatedformer.config import apply_overrides, load_recipe
    from gatedformer.train.loop import train

    config = apply_overrides(load_recipe("ptb-char-tiny").config, tiny_overrides(text_corpus))
    train(config, half, progress=False, stop_after=4)
    result = in_process(capsys, "train", "--recipe", "ptb-char-tiny", "--out", str(half), "--resume",
                        *sets(tiny_overrides(text_corpus)), "--set", "model.n_layers=3")
    assert_one_line_error(result, "model.n_layers (2 saved, 3 now)")


@pytest.mark.slow
@needs_shared("ptb/ptb.char.train.txt", "ptb/ptb.char.valid.txt", "ptb/ptb.char.test.txt")
def test_main_job_on_real_data_in_miniature(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The README's main command (compare on char PTB), cut to a few steps: the table and plot appear."""
    args = ["compare", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "cmp"), "--quiet",
            "--set", "train.steps=6", "--set", "train.eval_every=3", "--set", "train.log_every=1",
            "--set", "data.seq_len=32", "--set", "model.d_model=32", "--set", "model.d_ffn=64",
            "--set", "data.eval_seq_len=256", "--set", "data.eval_batch_size=256"]
    assert main(args) == 0
    table = capsys.readouterr().out
    for name in ("baseline", "+σ SDU", "+tanh SDU", "valid bpc", "test bpc", "params",
                 "step time × base (interleaved)"):
        assert name in table
    assert (tmp_path / "cmp" / "report.md").is_file()
    assert (tmp_path / "cmp" / "convergence.png").stat().st_size > 5000


@pytest.mark.parametrize("command", ["params", "compare"])
def test_a_set_of_what_the_variants_set_is_refused(command: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    # --set applies after each variant's own settings: every row would train these gates under its own name.
    out = tmp_path / "comparison"
    args = [command, "--recipe", "ptb-char-tiny", "--set", "model.gates=+tanh L1-2"]
    assert main(args + (["--out", str(out), "--quiet"] if command == "compare" else [])) == 2
    error = capsys.readouterr().err
    assert "--set model.gates would replace what variant '+σ SDU' of ptb-char-tiny sets" in error
    assert "[[variants]]" in error and not out.exists()
    # A field no variant sets is still the user's to change.
    assert main(["params", "--recipe", "ptb-char-tiny", "--set", "model.d_model=32", "--set", "model.n_heads=2"]) == 0


def test_params_output_cut_short_by_its_reader_is_no_traceback() -> None:
    reader = subprocess.Popen([sys.executable, "-m", "gatedformer", "params", "--recipe", "ptb-char-tiny"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.close()  # as `| head -0` would
    assert b"Traceback" not in reader.stderr.read()
    assert reader.wait(timeout=300) != 0


def test_a_model_too_big_for_memory_is_one_line(text_corpus: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    # A feed-forward weight of 16 x 10^11 floats: the allocator refuses it at once.
    args = ["train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "run"), "--quiet",
            *sets(tiny_overrides(text_corpus)), "--set", "model.d_ffn=100000000000"]
    assert main(args) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("gatedformer: error: out of memory (") and "\n" not in error
    assert "lower the model's sizes" in error
    # Counting parameters builds no weights, so it still answers.
    assert main(["params", "--recipe", "ptb-char-tiny", "--vocab-size", "50", "--set", "model.d_ffn=100000000000"]) == 0
    assert "baseline" in capsys.readouterr().out


def test_params_reads_data_and_vocab_size(text_corpus: str, capsys: pytest.CaptureFixture) -> None:
    def report(*args: str) -> dict:
        assert main(["params", "--recipe", "ptb-char-tiny", "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)

    from gatedformer.data import load_corpus

    assert report("--data", text_corpus)["variants"][0]["vocab_size"] == len(load_corpus(text_corpus).vocab)
    small, large = (report("--vocab-size", str(n))["variants"][0] for n in (50, 60))
    d_model = 128  # the recipe's: ten more rows of the input embedding, ten more outputs with their biases
    assert large["total"] - small["total"] == 10 * d_model + 10 * (d_model + 1)
    assert main(["params", "--recipe", "ptb-char-tiny", "--vocab-size", "0"]) == 2
    assert "--vocab-size must be a positive number" in capsys.readouterr().err
    assert main(["params", "--recipe", "multi30k-tiny", "--vocab-size", "100", "--set", "translation.src_lang=fr"]) == 2
    assert "multi30k has no fr→de pair" in capsys.readouterr().err


def test_resume_with_nothing_to_resume_says_it_starts_afresh(text_corpus: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "new"
    args = ["train", "--recipe", "ptb-char-tiny", "--out", str(out), "--quiet", "--resume",
            *sets(tiny_overrides(text_corpus, steps=2))]
    assert main(args) == 0
    assert f"note: {out} holds no checkpoint to resume; starting a new run" in capsys.readouterr().err


def test_data_check_of_one_missing_corpus_fails(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no ../shared/data beside it
    assert main(["data", "check", "enwik8", "--data-dir", str(tmp_path / "empty")]) == 1
    assert "missing" in capsys.readouterr().out
    assert main(["data", "check", "--data-dir", str(tmp_path / "empty")]) == 0  # all: not fetched yet is fine
