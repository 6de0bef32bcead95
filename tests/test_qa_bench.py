"""``gatedformer bench --sections qa``: the document reader's training step with SRU layers beside DrQA's bi-LSTM,
each reader built through ``fuse`` with its SRUs on our kernel, the ratio to the LSTM printed; at a tiny shape (the
test checks what is reported, never how fast anything is)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gatedformer.analysis.bench import BenchOptions, format_report, run_bench
from gatedformer.analysis.bench import qa as bench_qa
from gatedformer.analysis.bench.options import DEFAULT_SECTIONS
from gatedformer.cli import main
from gatedformer.models.reader import DocumentReader
from gatedformer.ops.sru import kernel_backend

TINY = dataclasses.replace(bench_qa.CPU, name="tiny", batch=2, paragraph=9, question=4, vocab=30, tuned=5,
                           embedding=8, hidden=4)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> list[DocumentReader]:
    """The tiny shape, and every model the section fuses."""
    monkeypatch.setattr(bench_qa, "CPU", TINY)
    fused: list[DocumentReader] = []
    real = bench_qa.fuse

    def spy(model):  # noqa: ANN001, ANN202
        fused.append(model)
        return real(model)

    monkeypatch.setattr(bench_qa, "fuse", spy)
    return fused


def test_the_section_times_sru_beside_the_lstm_with_the_ratio(tiny: list[DocumentReader]) -> None:
    report = run_bench(options=BenchOptions(repeats=2, warmup=1, memory="none", threads=1, device="cpu"),
                       sections=["qa"])
    rows = report.section("qa")
    assert [(r["name"], r["rnn"], r["layers"]) for r in rows] == [(n, rnn, layers) for n, rnn, layers, _, _
                                                                  in bench_qa.READERS]
    assert [type(m) for m in tiny] == [DocumentReader] * 3  # every reader built through fuse
    for row, model in zip(rows, tiny, strict=True):
        assert row["status"] == "ok" and row["shape"] == "tiny", row
        assert row["params"] == sum(p.numel() for p in model.parameters())
        assert row["train_questions_per_s"] == pytest.approx(2 / (row["train_ms"] / 1000))
        assert row["epoch_s"] == pytest.approx(87_599 / 2 * row["train_ms"] / 1000)
        assert row["recurrence"] == (kernel_backend("cpu") if row["rnn"] == "sru" else "torch.nn.LSTM")
    assert rows[0]["speedup_vs_lstm"] == 1.0 and all(r["speedup_vs_lstm"] > 0 for r in rows)
    assert rows[1]["params"] < rows[2]["params"]  # three SRU layers, then six
    text = format_report(report)
    assert "== question answering" in text and "SRU, 6 layers (B.2)" in text and "vs bi-LSTM" in text
    assert "qa: shape tiny: batch 2" in text and "the paper's shape: batch 32" in text


def test_the_command_line_runs_it_by_name_only(tiny: list[DocumentReader], capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    assert "qa" not in DEFAULT_SECTIONS  # readers of the paper's size are asked for by name
    assert main(["bench", "--sections", "qa", "--repeats", "1", "--warmup", "1", "--threads", "1", "--quiet",
                 "--optimizer", "none", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["section"] for r in report["rows"]} == {"qa"} and len(report["rows"]) == 3
    assert any("no optimiser step" in note for note in report["notes"])
