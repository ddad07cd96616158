"""Metric primitives: answer normalisation, exact match, boxes and IoU, ANLS, CIDEr-D, the majority answer and
the paired bootstrap. Pure Python (no torch). The per-task scorers built on them are data/scorers.py, their table and
the metric summary data/tasks.py.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

Box = tuple[float, float, float, float]

_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_TRAILING_PUNCT = ".,;:!?"
_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BOX_RE = re.compile(rf"\({_NUM},{_NUM}\)\s*,?\s*\({_NUM},{_NUM}\)|\[{_NUM},{_NUM},{_NUM},{_NUM}\]")
_PUNCT_RE = re.compile(r"[^\w\s]|_")
_CIDER_N, _CIDER_SIGMA = 4, 6.0


def _require_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {value!r}")
    return value


def normalize_answer(text: str) -> str:
    """Lowercase, collapse whitespace, drop surrounding quotes and trailing punctuation ('"Fish".' -> fish)."""
    s = " ".join(_require_str(text, "answer").lower().split())
    while True:
        stripped = s.rstrip(_TRAILING_PUNCT).strip(_QUOTES).strip()
        if stripped == s:
            return s
        s = stripped


def exact_match(pred: str, gold: str) -> float:
    """1.0 if the normalized strings are equal, else 0.0."""
    return float(normalize_answer(pred) == normalize_answer(gold))


def parse_box(text: str) -> Box | None:
    """First box written "(x1,y1),(x2,y2)" or "[x1, y1, x2, y2]" in `text`, ordered so x1<=x2, y1<=y2."""
    match = _BOX_RE.search(_require_str(text, "box text"))
    if match is None:
        return None
    x1, y1, x2, y2 = (float(g) for g in match.groups() if g is not None)
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes; 0.0 when the union has no area."""
    for box in (a, b):
        if len(box) != 4 or not all(math.isfinite(float(v)) for v in box):
            raise ValueError(f"a box must be 4 finite numbers (x1, y1, x2, y2), got {box!r}")
    ax1, ay1, ax2, ay2 = min(a[0], a[2]), min(a[1], a[3]), max(a[0], a[2]), max(a[1], a[3])
    bx1, by1, bx2, by2 = min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]), max(b[1], b[3])
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return float(inter / union) if union > 0 else 0.0


def grounding_correct(pred: str, gold: str, threshold: float = 0.5) -> float:
    """1.0 if IoU(pred box, gold box) >= threshold (1e-9 float slack); an unparsable prediction scores 0."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"IoU threshold must be in (0, 1], got {threshold!r}")
    gold_box = parse_box(gold)
    if gold_box is None:
        raise ValueError(f"gold grounding answer has no parsable box: {gold!r}")
    pred_box = parse_box(pred)
    return float(pred_box is not None and box_iou(pred_box, gold_box) >= threshold - 1e-9)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; unit costs), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls(pred: str, gold_or_golds: str | Sequence[str], tau: float = 0.5) -> float:
    """ANLS: max over golds of 1 - NL (NL = edit distance / longer length), 0 where NL >= tau.

    Strings are lowercased, stripped and whitespace-collapsed first (as the ST-VQA/DocVQA scripts do).
    """
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"ANLS tau must be in (0, 1], got {tau!r}")
    golds = [gold_or_golds] if isinstance(gold_or_golds, str) else list(gold_or_golds)
    if not golds:
        raise ValueError(f"ANLS needs at least one gold answer, got {gold_or_golds!r}")
    p = " ".join(_require_str(pred, "prediction").lower().split())
    best = 0.0
    for gold in golds:
        g = " ".join(_require_str(gold, "gold answer").lower().split())
        longest = max(len(p), len(g))
        nl = levenshtein(p, g) / longest if longest else 0.0
        best = max(best, 1.0 - nl if nl < tau else 0.0)
    return best


def cider_tokens(text: str) -> list[str]:
    """CIDEr tokenisation: lowercase, punctuation replaced by spaces, split on whitespace."""
    return _PUNCT_RE.sub(" ", _require_str(text, "caption").lower()).split()


def _ngrams(text: str) -> Counter[tuple[str, ...]]:
    words = cider_tokens(text)
    return Counter(tuple(words[i : i + k]) for k in range(1, _CIDER_N + 1) for i in range(len(words) - k + 1))


def _tfidf(counts: Counter, df: Mapping[tuple[str, ...], int], log_n: float):
    """Per-n tf-idf vectors, their norms and the 'length' the reference code uses (its bigram count)."""
    vec: list[dict[tuple[str, ...], float]] = [{} for _ in range(_CIDER_N)]
    norm = [0.0] * _CIDER_N
    for ngram, tf in counts.items():
        k = len(ngram) - 1
        vec[k][ngram] = value = tf * (log_n - math.log(max(1.0, df.get(ngram, 0))))
        norm[k] += value * value
    length = sum(tf for ngram, tf in counts.items() if len(ngram) == 2)  # sic: reference `if n == 1`
    return vec, [math.sqrt(x) for x in norm], length


def _cider_sim(hyp, ref) -> float:
    """Clipped cosine per n times the Gaussian length penalty, averaged over n."""
    (vh, nh, lh), (vr, nr, lr) = hyp, ref
    penalty = math.exp(-((lh - lr) ** 2) / (2 * _CIDER_SIGMA**2))
    total = 0.0
    for k in range(_CIDER_N):
        val = sum(min(v, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, v in vh[k].items())
        if nh[k] != 0 and nr[k] != 0:
            val /= nh[k] * nr[k]
        total += val * penalty
    return total / _CIDER_N


Key = TypeVar("Key", bound=Hashable)


def cider_d(candidates: Mapping[Key, str], references: Mapping[Key, Sequence[str]]) -> tuple[float, dict[Key, float]]:
    """CIDEr-D as in coco-caption's cider_scorer.py (corpus document frequency, n=1..4, sigma=6).

    Document frequency = number of images whose reference set contains the n-gram; idf uses
    log(number of images), so a one-image corpus scores 0. Returns (mean score, score per id); an id is any key
    (a (benchmark, id) pair where ids repeat across benchmarks).
    """
    if set(candidates) != set(references):
        only_c = sorted(set(candidates) - set(references), key=str)
        only_r = sorted(set(references) - set(candidates), key=str)
        raise ValueError(f"candidate and reference ids differ: only in candidates {only_c}, only in refs {only_r}")
    if not candidates:
        raise ValueError("cider_d needs at least one candidate, got none")
    ref_counts: dict[Key, list[Counter]] = {}
    df: Counter[tuple[str, ...]] = Counter()
    for key, refs in references.items():
        if isinstance(refs, str) or not refs:
            raise ValueError(f"references for id {key!r} must be a non-empty list of strings, got {refs!r}")
        ref_counts[key] = [_ngrams(r) for r in refs]
        df.update({g for counts in ref_counts[key] for g in counts})
    log_n = math.log(len(references))
    scores: dict[Key, float] = {}
    for key, cand in candidates.items():
        hyp = _tfidf(_ngrams(cand), df, log_n)
        sims = [_cider_sim(hyp, _tfidf(r, df, log_n)) for r in ref_counts[key]]
        scores[key] = 10.0 * sum(sims) / len(sims)
    return sum(scores.values()) / len(scores), scores


def majority_answer(answers: Iterable[str]) -> str:
    """Most frequent normalized answer (ties -> lexicographically smallest); "" when there are none."""
    counts = Counter(normalize_answer(a) for a in answers)
    return min(counts, key=lambda a: (-counts[a], a)) if counts else ""


def paired_bootstrap(
    before: Sequence[float], after: Sequence[float], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """The mean change after - before over the same questions, with a percentile bootstrap interval.

    Resampling questions (not the two runs separately) is the paired test a before/after comparison on one
    held-out set needs: the question-to-question spread cancels, so a +0.02 change can be real on 800 questions
    whose unpaired standard error is itself ~0.02. Returns gain, ci_low, ci_high, improved, worsened.
    """
    import random

    if len(before) != len(after) or not before:
        raise ValueError(
            f"paired_bootstrap needs two equally long, non-empty score lists; got {len(before)} and "
            f"{len(after)} (score the same questions before and after)."
        )
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    diffs = [a - b for b, a in zip(before, after, strict=True)]
    n, rng = len(diffs), random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - confidence) / 2
    return {
        "gain": sum(diffs) / n,
        "ci_low": means[int(math.floor(tail * (resamples - 1)))],
        "ci_high": means[int(math.ceil((1 - tail) * (resamples - 1)))],
        "improved": float(sum(d > 0 for d in diffs)),
        "worsened": float(sum(d < 0 for d in diffs)),
    }
