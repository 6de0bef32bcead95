"""Extractive answers: the best span of a reader's scores, and SQuAD v1.1's exact match and F1.

The metric is the official v1.1 evaluation's definition (Rajpurkar et al. 2016; its ``evaluate-v1.1.py``): an answer
and a reference are compared after normalisation — lower-cased, ASCII punctuation removed, the words ``a``, ``an`` and
``the`` removed, whitespace collapsed —; exact match is their equality, F1 the harmonic mean of the precision and
recall of their shared words (counted with multiplicity); each question scores its best over its reference answers,
and the totals are percentages over every question of the dev set (a question without a prediction scores 0).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor

__all__ = ["best_spans", "exact_match", "f1", "normalize_answer", "score_predictions"]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace (in that order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1(prediction: str, reference: str) -> float:
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(reference).split()
    shared = sum((Counter(predicted) & Counter(wanted)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(wanted)
    return 2 * precision * recall / (precision + recall)


def score_predictions(references: Iterable[tuple[str, Sequence[str]]], predictions: Mapping[str, str]
                      ) -> dict[str, float]:
    """``{"exact_match", "f1"}`` in percent over ``references`` (``(question id, reference answers)``), each
    question's best over its references; a question ``predictions`` lacks scores 0."""
    total = em = f = 0.0
    for qid, answers in references:
        total += 1
        if qid not in predictions:
            continue
        em += max(exact_match(predictions[qid], a) for a in answers)
        f += max(f1(predictions[qid], a) for a in answers)
    return {"exact_match": 100.0 * em / total if total else 0.0, "f1": 100.0 * f / total if total else 0.0}


def best_spans(logits: Tensor, max_span: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``(start, end, score)`` of each row's best span with ``start <= end <= start + max_span`` (words):
    ``logits`` ``(B, 2, M)`` holds the start and end scores (``-inf`` at padding); the score is the span's
    log-probability, the sum of the start's and the end's log-softmax (DrQA's product of the two probabilities)."""
    start = logits[:, 0].float().log_softmax(-1)
    end = logits[:, 1].float().log_softmax(-1)
    rows, words = start.shape
    width = max_span + 1
    # Only the band end - start in [0, max_span] is scored: (B, M, max_span + 1), not the (B, M, M) of every pair.
    scores = start.new_full((rows, words, width), float("-inf"))
    for length in range(min(width, words)):
        scores[:, : words - length, length] = start[:, : words - length] + end[:, length:]
    best, flat = scores.flatten(1).max(-1)  # the first maximum: the earliest start, then the shortest span
    first = flat // width
    return first, first + flat % width, best
