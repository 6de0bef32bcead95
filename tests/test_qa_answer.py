"""A trained reader in users' hands: `gatedformer answer` (a typed paragraph and question, or JSON lines),
`Pretrained.answer` from Python, export and `from_pretrained` with the vocabulary and the tuned-word state (the
same answers as the run), and bad input as one error line or a bounded answer, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import one_error_line, text_corpus, tiny_overrides  # noqa: F401 - text_corpus is a fixture
from test_qa import _document

from gatedformer.cli import main
from gatedformer.data.squad import tokenize_with_offsets
from gatedformer.errors import ConfigError, DataError
from gatedformer.pretrained import export_run, from_pretrained, load

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = "The capital of France is Paris. It was founded in 1185 and has 4 million people."
QUESTION = "What is the capital of France?"


def _train(folder: Path, *overrides: str) -> Path:
    squad = folder / "squad"
    squad.mkdir(parents=True)
    (squad / "train.json").write_text(json.dumps(_document(6, 0)), encoding="utf-8")
    (squad / "dev.json").write_text(json.dumps(_document(2, 3)), encoding="utf-8")
    run = folder / "run"
    sets = [a for o in ("train.steps=6", "train.eval_every=3", "data.batch_size=6", *overrides) for a in ("--set", o)]
    assert main(["train", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad}", "--out", str(run),
                 "--quiet", *sets]) == 0
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("qa-answer"))


def _is_span(found: dict[str, Any], context: str, max_words: int = 16) -> bool:
    words = tokenize_with_offsets(context[found["start"]: found["end"]])
    return (found["answer"] == context[found["start"]: found["end"]] != "" and 0 < found["score"] <= 1
            and 1 <= len(words) <= max_words)


def test_answer_prints_a_span_of_the_typed_paragraph(run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["answer", "--run", str(run), "--context", CONTEXT, "--question", QUESTION, "--device", "cpu"]) == 0
    typed = json.loads(capsys.readouterr().out)
    assert set(typed) == {"answer", "start", "end", "score"} and _is_span(typed, CONTEXT)
    paragraph = tmp_path / "paragraph.txt"
    paragraph.write_text(CONTEXT, encoding="utf-8")
    assert main(["answer", "--run", str(run), "--context", str(paragraph), "--question", QUESTION]) == 0
    assert json.loads(capsys.readouterr().out) == typed
    assert load(run, "cpu").answer(CONTEXT, QUESTION) == typed


def test_json_lines_in_one_answer_line_each(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    asked = [{"id": "a", "context": CONTEXT, "question": QUESTION},
             {"context": "Oslo is the capital of Norway. Zürich is not.", "question": "Which city is not?"},
             {"id": 7, "context": "Rome", "question": "What is the capital of Italy, the country in the south?"}]
    lines = [json.dumps(asked[0]), json.dumps(asked[1], ensure_ascii=False), "", json.dumps(asked[2])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    outputs = []
    for batch in ("1", "32"):  # padding changes no answer (and its probability only in the last bits)
        assert main(["answer", "--run", str(run), "--input", str(tmp_path / "in.jsonl"), "--batch-size", batch]) == 0
        outputs.append(capsys.readouterr().out.splitlines())
    assert len(outputs[0]) == len(outputs[1]) == 4 and outputs[0][2] == outputs[1][2] == ""
    answers = [json.loads(outputs[0][i]) for i in (0, 1, 3)]
    for one, batched in zip(answers, [json.loads(outputs[1][i]) for i in (0, 1, 3)], strict=True):
        assert one == {**batched, "score": pytest.approx(batched["score"], rel=1e-5)}
    assert [a.get("id") for a in answers] == ["a", None, 7]
    assert all(_is_span(a, q["context"]) for a, q in zip(answers, asked, strict=True))
    assert answers[2]["answer"] == "Rome"  # a question longer than its context: the context's one word
    model = load(run, "cpu")
    expected = model.answer([q["context"] for q in asked], [q["question"] for q in asked], batch_size=1)
    assert [{k: v for k, v in a.items() if k != "id"} for a in answers] == expected


def test_an_export_answers_as_the_run_does(run: Path, tmp_path: Path) -> None:
    exported = from_pretrained(export_run(run, tmp_path / "export"), "cpu")
    assert json.loads((tmp_path / "export" / "vocab.json").read_text())["words"] == load(run, "cpu").data.words
    assert exported.answer(CONTEXT, QUESTION) == load(run, "cpu").answer(CONTEXT, QUESTION)
    assert "model.answer(" in (tmp_path / "export" / "README.md").read_text()


def test_an_export_keeps_the_pretrained_vectors_and_the_tuned_words(tmp_path: Path) -> None:
    vectors = tmp_path / "vectors.txt"
    vectors.write_text("capital " + " ".join(["0.5"] * 64) + "\nmillion " + " ".join(["-0.5"] * 64) + "\n")
    run = _train(tmp_path, f"qa.word_vectors={vectors}", "qa.tune_top_k=3")
    export_run(run, tmp_path / "export")
    vectors.unlink()  # the weights hold the vectors: the export needs no file of them
    exported = from_pretrained(tmp_path / "export", "cpu")
    assert exported.data.fixed_from == load(run, "cpu").data.fixed_from == 5
    assert exported.model.fixed_from == 5
    assert exported.answer(CONTEXT, QUESTION) == load(run, "cpu").answer(CONTEXT, QUESTION)


@pytest.mark.parametrize(("args", "message"), [
    (["--context", "   ", "--question", QUESTION], "the context is empty; give the paragraph"),
    (["--context", CONTEXT, "--question", ""], "the question is empty"),
    (["--context", CONTEXT, "--question", "Who?\udcff"], "the question is not UTF-8 text"),
    (["--context", "no/such/paragraph.txt", "--question", QUESTION], "no such file"),
    (["--context", CONTEXT], "give --context and --question, or --input"),
    (["--context", CONTEXT, "--question", QUESTION, "--input", "-"], "not both"),
    (["--context", "x " * 40_000, "--question", QUESTION], "more than the 65,536 a reader reads at once"),
])
def test_bad_arguments_are_one_error_line(run: Path, args: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["answer", "--run", str(run), *args]) != 0
    assert message in one_error_line(capsys)


@pytest.mark.parametrize(("content", "message"), [
    (b'{"context": "Paris.", "question": "Where?"}\n\xff\xfe{"context"\n', "line 2 of --input"),
    (b'{"context": "' + b"word " * 2_000_000 + b'", "question": "Where?"}\n', "longer than 65536 bytes"),
    (b'{"context": "Paris.", "question": "Where?"}\n{"context": "Paris."\n', "input line 2: not JSON"),
    (b'{"context": "Paris.", "question": "Where?"}\n["Paris.", "Where?"]\n', "input line 2: not an object"),
    (b'{"context": "", "question": "Where?"}\n', "input line 1: the context is empty"),
    (b'{"context": 3, "question": "Where?"}\n', "input line 1: the context is int, not text"),
    (b'{"context": "Paris \\udcff", "question": "Where?"}\n', "input line 1: the context is not UTF-8 text"),
])
def test_bad_lines_are_one_error_line_after_the_answers_before_them(run: Path, tmp_path: Path, content: bytes,
                                                                    message: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in.jsonl").write_bytes(content)
    assert main(["answer", "--run", str(run), "--input", str(tmp_path / "in.jsonl"), "--batch-size", "1"]) != 0
    out = capsys.readouterr()
    assert message in "\n".join(line for line in out.err.splitlines() if line.strip())
    assert len([line for line in out.err.splitlines() if line.strip()]) == 1 and "Traceback" not in out.err
    if content.startswith(b'{"context": "Paris.", "question": "Where?"}'):
        assert json.loads(out.out.splitlines()[0])["answer"] == "Paris"


def test_a_context_file_too_big_or_not_utf8_is_one_error_line(run: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"word " * 2_000_000)  # 10 MB
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Zürich is in Switzerland.".encode("latin-1"))
    for path, message in ((big, "it is over 262144 bytes"), (bad, "byte 1 is not UTF-8")):
        assert main(["answer", "--run", str(run), "--context", str(path), "--question", QUESTION]) != 0
        assert f"--context {path}: {message}" in one_error_line(capsys)


def test_answer_from_python_refuses_what_it_cannot_answer(run: Path, tmp_path: Path, text_corpus: str,  # noqa: F811
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = load(run, "cpu")
    with pytest.raises(DataError, match="the context is empty"):
        model.answer("", QUESTION)
    with pytest.raises(ConfigError, match="two lists of as many"):
        model.answer([CONTEXT, CONTEXT], [QUESTION])
    with pytest.raises(ConfigError, match="batch_size must be at least 1"):
        model.answer([CONTEXT], [QUESTION], batch_size=0)
    lm = tmp_path / "lm"
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(lm), "--quiet",
                 *[a for o in tiny_overrides(text_corpus, steps=2) for a in ("--set", o)]]) == 0
    with pytest.raises(ConfigError, match=r"answer\(\) needs a question-answering model"):
        load(lm, "cpu").answer(CONTEXT, QUESTION)
    assert main(["answer", "--run", str(lm), "--context", CONTEXT, "--question", QUESTION]) != 0
    assert "not a question-answering one" in one_error_line(capsys)
