"""Exported model cards: an example that runs on the model's own vocabulary and kind of text, counts with their
thousands, and scores named by their metric."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_pretrained import WORDS, _pretrained

import gatedformer
from gatedformer.data import Vocab
from gatedformer.data.corpora import Corpus
from gatedformer.pretrained import Pretrained

RESULTS = {"metric": "bpc", "valid_loss": 0.9876543, "valid_metric": 1.4249, "test_loss": 0.99, "test_metric": 1.43,
           "params": 2748940, "tokens_per_second": 123456.789, "steps": 4}


def _corpus(vocab: Vocab) -> Corpus:
    empty = torch.zeros(0, dtype=torch.long)
    return Corpus("ptb-char", "char", "bpc", vocab, empty, empty, empty)


def _card_and_example(model: Pretrained, folder: Path) -> tuple[str, str]:
    exported = model.save_pretrained(folder)
    card = (exported / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    return card, code.replace("THIS_FOLDER_OR_REPO_ID", str(exported))


def _run(code: str) -> str:
    printed: list[str] = []
    exec(code, {"print": lambda *args: printed.append(" ".join(map(str, args)))})  # noqa: S102
    return "\n".join(printed)


def test_a_ptb_char_card_prompts_with_letters_its_vocabulary_has(tmp_path: Path) -> None:
    # PTB's characters are lower case: "The " is not in the vocabulary, and the old card's example failed on it.
    vocab = Vocab(("<eos>", *"abcdefghijklmnopqrstuvwxyz_"), "ptb-char")
    model = _pretrained("ptb-char-tiny", ["model.d_model=16", "model.n_layers=2", "model.n_heads=2",
                                          "model.d_ffn=32"], _corpus(vocab))
    card, code = _card_and_example(model, tmp_path / "export")
    assert "model.generate('the ', max_tokens=200, seed=0)" in code
    assert _run(code).startswith("the")


def test_a_word_card_prompts_with_a_word_it_knows(tmp_path: Path) -> None:
    vocab = Vocab(("<unk>", "<eos>", *WORDS), "word")
    model = _pretrained("ptb-word-tiny", ["model.d_model=16", "model.n_layers=2", "model.n_heads=2",
                                          "model.d_ffn=32", "data.corpus=ptb"], _corpus(vocab))
    _, code = _card_and_example(model, tmp_path / "export")
    assert "model.generate('the ', " in code  # "The" would read as <unk>
    assert _run(code).startswith("the")


def test_a_card_without_a_spelled_prompt_generates_from_nothing(tmp_path: Path) -> None:
    vocab = Vocab(tuple("\nxyz"), "char")
    model = _pretrained("ptb-char-tiny", ["model.d_model=16", "model.n_layers=2", "model.n_heads=2",
                                          "model.d_ffn=32"], _corpus(vocab))
    _, code = _card_and_example(model, tmp_path / "export")
    assert "model.generate(max_tokens=200, seed=0)" in code
    assert set(_run(code)) <= set("\nxyz")


def test_a_trec_card_asks_a_question_and_names_its_classes(tmp_path: Path) -> None:
    from gatedformer.data.sentclass import sentence_set
    from gatedformer.tasks.sentclass import Encoded, SentenceData

    empty = Encoded([], torch.zeros(0, dtype=torch.long))
    data = SentenceData(sentence_set("trec"), ["<pad>", "<unk>", *WORDS], empty, empty, empty, 16)
    model = _pretrained("sentclass-sru-tiny", ["data.corpus=trec", "model.d_model=16",
                                               "sentclass.embedding_dim=16"], data)
    card, code = _card_and_example(model, tmp_path / "export")
    assert "How tall is the Sears Building ?" in code and "film" not in card
    label, names = _run(code).split(" ", 1)
    assert label in model.labels and "NUM" in names


def test_scores_name_their_metric_and_counts_print_whole(tmp_path: Path) -> None:
    vocab = Vocab(("<eos>", *"abcdefghijklmnopqrstuvwxyz_"), "ptb-char")
    model = _pretrained("ptb-char-tiny", ["model.d_model=16", "model.n_layers=2", "model.n_heads=2",
                                          "model.d_ffn=32"], _corpus(vocab))
    model = Pretrained(model.config, model.task, model.model, model.data, RESULTS)
    card, _ = _card_and_example(model, tmp_path / "export")
    assert "e+0" not in card
    assert "| valid bpc (`valid_metric`) | 1.4249 |" in card and "| test bpc (`test_metric`) | 1.4300 |" in card
    assert "| valid loss (`valid_loss`) | 0.9877 |" in card
    assert "| parameters (`params`) | 2,748,940 |" in card and "| steps (`steps`) | 4 |" in card
    assert "| tokens per second (`tokens_per_second`) | 123,456.8 |" in card
    n = sum(p.numel() for p in model.model.parameters())
    assert f"| parameters | {n:,} ({n / 1e6:.2f}M) |" in card
    assert gatedformer.from_pretrained(tmp_path / "export", device="cpu").results["params"] == 2748940


@pytest.mark.parametrize("corpus", ["glue-mrpc", "glue-stsb", "glue-cola", "mr", "subj"])
def test_each_classification_set_has_an_example_of_its_own_text(corpus: str) -> None:
    from gatedformer.pretrained import EXAMPLE_INPUTS

    pair = corpus in ("glue-mrpc", "glue-stsb")
    example = EXAMPLE_INPUTS.get(corpus, "A gripping, funny film.")
    assert isinstance(example, tuple) == pair
