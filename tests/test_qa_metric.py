"""SQuAD v1.1's exact match and F1 on hand-worked cases, and the best span's decoding."""

from __future__ import annotations

import math

import pytest
import torch

from gatedformer.tasks.squad_eval import best_spans, exact_match, f1, normalize_answer, score_predictions


@pytest.mark.parametrize(("text", "normal"), [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an  apple, a day ", "apple day"),
    ("Theatre of the Absurd", "theatre of absurd"),  # "the" inside a word stays
    ("U.S.-based", "usbased"),  # punctuation goes, leaving no space
    ("“quoted” – dash", "“quoted” – dash"),  # not ASCII punctuation: kept, as the official script keeps it
    ("A", ""),
])
def test_normalisation_is_the_official_one(text: str, normal: str) -> None:
    assert normalize_answer(text) == normal


def test_exact_match_and_f1_by_hand() -> None:
    assert exact_match("the Eiffel tower.", "Eiffel Tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0
    # "in the 10th century" -> in 10th century; "10th and 11th centuries" -> 10th and 11th centuries:
    # one shared word, precision 1/3, recall 1/4, F1 = 2 (1/12) / (7/12) = 2/7
    assert f1("in the 10th century", "10th and 11th centuries") == pytest.approx(2 / 7)
    # words count with multiplicity: "a a b" -> [b]; "b b" -> [b, b]: shared 1, P 1, R 1/2, F1 2/3
    assert f1("b a b", "b") == pytest.approx(2 / 3)
    assert f1("the", "a") == 0.0  # both normalise to nothing: no shared word
    assert f1("Denver Broncos", "the Denver Broncos!") == 1.0


def test_the_scores_take_the_best_reference_and_count_a_missing_question_as_zero() -> None:
    references = [("q1", ["Denver Broncos", "Broncos"]), ("q2", ["1990s", "the 1990s era"]), ("q3", ["x"])]
    scores = score_predictions(references, {"q1": "Broncos", "q2": "1990s decade"})
    # q1: EM 1, F1 1; q2: EM 0, F1 max(P 1/2 R 1 -> 2/3, P 1/2 R 1/2 -> 1/2) = 2/3; q3 missing: 0
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)


def test_the_best_span_starts_before_it_ends_within_the_longest_span() -> None:
    ninf = -math.inf
    start = torch.tensor([[0.0, 5.0, 0.0, 0.0, 9.0, ninf]])
    end = torch.tensor([[0.0, 0.0, 0.0, 6.0, 0.0, ninf]])
    logits = torch.stack([start, end], 1)
    # the best start (4) lies after the best end (3): the best allowed pair is (1, 3) at 5 + 6 against 9 + 0
    s, e, score = best_spans(logits, max_span=15)
    assert (s.item(), e.item()) == (1, 3)
    assert score.item() == pytest.approx((start.log_softmax(-1)[0, 1] + end.log_softmax(-1)[0, 3]).item())
    s, e, _ = best_spans(logits, max_span=1)  # end <= start + 1: (1, 3) is too long; (4, 4) beats (3, 3) and (1, 2)
    assert (s.item(), e.item()) == (4, 4)
    s, e, _ = best_spans(logits, max_span=2)  # (1, 3) is start + 2
    assert (s.item(), e.item()) == (1, 3)


def test_the_best_span_is_the_best_allowed_pair_of_all() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 2, 30)
    logits[2, :, 11:] = -math.inf  # a shorter paragraph in the batch
    logits[4, :, 1:] = -math.inf  # a paragraph of one word
    for max_span in (0, 3, 15, 40):
        starts, ends, scores = best_spans(logits, max_span)
        for row in range(6):
            start, end = logits[row, 0].log_softmax(-1), logits[row, 1].log_softmax(-1)
            pairs = [(start[i] + end[j]).item() for i in range(30) for j in range(i, min(30, i + max_span + 1))]
            assert scores[row].item() == pytest.approx(max(pairs))
            s, e = starts[row].item(), ends[row].item()
            assert s <= e <= s + max_span and (start[s] + end[e]).item() == pytest.approx(max(pairs))
