"""The ``text_similarity`` metrics: ``f(input, reference) -> score in 0..1``.

Each reads at most ``SIMILARITY_MAX_CHARS`` of each string. The n-gram packages (sacrebleu, nltk,
rouge-score) are imported on first use, so that parsing a grader costs none of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rapidfuzz import fuzz

__all__ = ["EVALUATION_METRICS", "MODEL_METRICS", "SIMILARITY_MAX_CHARS", "TEXT_SIMILARITY_METRICS"]


def _fuzzy_match(text: str, reference: str) -> float:
    """rapidfuzz ``fuzz.WRatio`` scaled to 0..1.

    Why WRatio and not ``fuzz.ratio``: OpenAI documents fuzzy_match as rapidfuzz-based, and WRatio
    is rapidfuzz's general-purpose scorer. It takes the best of the plain Indel ratio, a
    word-order-insensitive token ratio (x0.95) and, when one string is 1.5x+ longer, a substring
    (partial) ratio (x0.9, or x0.6 at 8x+). So "The answer is Paris" against "Paris" scores 0.9
    instead of ratio's 0.42, which is the behaviour a reward for "says the right thing" wants.
    No processor is applied (rapidfuzz's default), so case matters, as in ``string_check`` ``like``.
    Identical strings score 1.0 even when both are empty (WRatio returns 0 for empty input); each
    string is read up to ``SIMILARITY_MAX_CHARS``, as every metric does.
    """
    if text == reference:
        return 1.0
    return fuzz.WRatio(text[:SIMILARITY_MAX_CHARS], reference[:SIMILARITY_MAX_CHARS]) / 100.0


SIMILARITY_MAX_CHARS = 10_000
"""Every metric reads this much of each string: their costs grow with the product of the lengths
(ROUGE-L's and fuzzy_match's alignments), and a completion or a reference longer than this is no
sentence to compare."""


def _same_or(metric: Callable[[str, str], float]) -> Callable[[str, str], float]:
    """Identical strings score 1.0 (even both empty, where n-gram metrics have nothing to count);
    an empty string against a non-empty one scores 0.0; each string is read up to
    ``SIMILARITY_MAX_CHARS``."""

    def score(text: str, reference: str) -> float:
        if text == reference:
            return 1.0
        text, reference = text[:SIMILARITY_MAX_CHARS], reference[:SIMILARITY_MAX_CHARS]
        if not text.strip() or not reference.strip():
            return 0.0
        return float(metric(text, reference))

    return score


def _bleu(text: str, reference: str) -> float:
    """sacrebleu's sentence BLEU (13a tokenization, exponential smoothing, brevity penalty), / 100."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0


def _gleu(text: str, reference: str) -> float:
    """Google-BLEU (nltk ``sentence_gleu``, 1- to 4-grams) on whitespace tokens."""
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([reference.split()], text.split()))


class _NoSynonyms:
    """METEOR's WordNet stage, empty: the WordNet data is a download, and the service runs offline.
    METEOR then matches exact words and Porter stems (its first two stages)."""

    @staticmethod
    def synsets(*_: object, **__: object) -> list[object]:
        return []


def _meteor(text: str, reference: str) -> float:
    """METEOR (nltk ``single_meteor_score``: alpha 0.9, beta 3, gamma 0.5) on whitespace tokens,
    exact and stem matches (no WordNet synonyms: see ``_NoSynonyms``)."""
    from nltk.translate.meteor_score import single_meteor_score

    return float(single_meteor_score(reference.split(), text.split(), wordnet=_NoSynonyms()))


def _rouge(kind: str) -> Callable[[str, str], float]:
    """ROUGE-N or ROUGE-L F-measure, Google's ``rouge-score`` (its tokenizer: lowercase, alphanumeric)."""

    def score(text: str, reference: str) -> float:
        from rouge_score import rouge_scorer

        return float(_rouge_scorer(kind, rouge_scorer).score(reference, text)[kind].fmeasure)

    return score


@functools.cache
def _rouge_scorer(kind: str, module: Any) -> Any:
    return module.RougeScorer([kind])


TEXT_SIMILARITY_METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy_match,
    "bleu": _same_or(_bleu),
    "gleu": _same_or(_gleu),
    "meteor": _same_or(_meteor),
    **{f"rouge_{n}": _same_or(_rouge(f"rouge{n}")) for n in range(1, 6)},
    "rouge_l": _same_or(_rouge("rougeL")),
}
"""``evaluation_metric`` name -> ``f(input, reference) -> score``, for the metrics computed here."""

MODEL_METRICS = frozenset({"cosine"})
"""``evaluation_metric`` names that need a model (sentence embeddings): scored by the worker."""

EVALUATION_METRICS = tuple(sorted({*TEXT_SIMILARITY_METRICS, *MODEL_METRICS}))
"""Every ``evaluation_metric`` this server accepts."""
