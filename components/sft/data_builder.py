"""SFT conversations built from a cleaned lake: the templates and the selection (seed 000 3.2, seed 001 3.2 / 4.2,
seed 003 2.3). Model-free: build_data.py reads the lake, scores the candidates with the base model and writes them.

Each kept lake record gives candidates from its caption and its GRIT-style regions (`noun_chunks`): an object
region is a phrase with a box ("red circle"), a text region a quoted word of the caption. Templates ask what the
regions answer exactly (a box, a colour, a neighbour, a count, the word) and counterfactuals (an absent object, a
removed one). Selection then keeps each type's top `keep_fraction` by score, drops near duplicates within an image
(the harder one stays), holds every type under `max_type_share` and counterfactuals over `min_counterfactual`;
every candidate ends kept or dropped with one reason. Written here because no library builds instructions from
region annotations with this accounting.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from components._shared.data.regions import Region
from components.sft.config import BASIC_TYPES

# Attribute words the colour and shape templates understand (phrases "<colour> <noun>"); other phrases still get the
# grounding, position, relation and counterfactual-removal templates.
COLOR_WORDS = frozenset(
    "red green blue yellow purple orange black white gray grey brown pink cyan magenta violet gold silver".split()
)
SHAPE_WORDS = frozenset("circle square triangle cross rectangle star oval diamond hexagon pentagon heart".split())

TOO_LONG = "answer_too_long"
LOW_SCORE = "low_score"
NEAR_DUPLICATE = "near_duplicate"
TYPE_QUOTA = "type_quota"
COUNTERFACTUAL_QUOTA = "counterfactual_quota"
RECORD_CAP = "record_cap"
REASON_TEXT = {
    TOO_LONG: "answer over build_data.max_answer_tokens",
    LOW_SCORE: "under its type's top build_data.keep_fraction by model score",
    NEAR_DUPLICATE: "near duplicate (build_data.dedup_similarity) of a harder candidate of the same image",
    TYPE_QUOTA: "its type over build_data.max_type_share",
    COUNTERFACTUAL_QUOTA: "making room for build_data.min_counterfactual",
    RECORD_CAP: "over build_data.max_records",
}


@dataclass(frozen=True)
class Candidate:
    image: str  # the lake record's image_hash
    kind: str
    question: str
    answer: str

    @property
    def counterfactual(self) -> bool:
        return self.kind == "counterfactual"

    @property
    def difficulty(self) -> str:
        return "basic" if self.kind in BASIC_TYPES else "advanced"


@dataclass(frozen=True)
class _Object:
    phrase: str
    box: tuple[float, float, float, float]
    color: str | None
    noun: str

    @property
    def centre(self) -> tuple[float, float]:
        return (self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2


def split_regions(caption: str, regions: list[Region]) -> tuple[list[_Object], list[str]]:
    """(object regions in reading order, the quoted words) of a record: a region whose phrase stands in quotes in
    the caption is text drawn in the image."""
    objects, words = [], []
    for region in regions:
        if f'"{region.phrase}"' in caption:
            words.append(region.phrase)
            continue
        parts = region.phrase.lower().split()
        color = parts[0] if len(parts) == 2 and parts[0] in COLOR_WORDS else None
        objects.append(_Object(region.phrase, region.box, color, parts[-1]))
    return objects, list(dict.fromkeys(words))


def _unique(objects: list[_Object], key: Callable[[_Object], object]) -> list[_Object]:
    counts = Counter(key(o) for o in objects)
    return [o for o in objects if counts[key(o)] == 1]


def _placed(objects: list[_Object]) -> tuple[list[_Object], bool, set[str]] | None:
    """(the objects along their arrangement's axis, whether it is a row (they spread wider than tall), the phrases
    named once) for two or more objects; None unless each box ends before the next begins on that axis (so
    left/right and above/below are exact)."""
    if len(objects) < 2:
        return None
    xs, ys = [o.centre[0] for o in objects], [o.centre[1] for o in objects]
    row = max(xs) - min(xs) >= max(ys) - min(ys)
    axis = 0 if row else 1
    ordered = sorted(objects, key=lambda o: o.centre[axis])
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.box[axis + 2] > b.box[axis]:
            return None
    return ordered, row, {o.phrase for o in _unique(objects, lambda o: o.phrase)}


class Templates:
    """Question-answer pairs of one record. `colors_by_noun` are the colours the lake gives each noun (the
    counterfactuals' absent objects come from them); a call's `box_text` writes a relative box the way the model
    family answers for that image."""

    def __init__(self, colors_by_noun, seed: int):
        self.colors_by_noun, self.seed = colors_by_noun, seed
        self.box_text: Callable[[tuple[float, float, float, float]], str] = str

    def __call__(self, image: str, caption: str, regions: list[Region], kinds: list[str], box_text) -> list[Candidate]:
        self.box_text = box_text
        rng = np.random.default_rng([self.seed, int(image[:12], 16) if _hex(image[:12]) else len(image)])
        objects, words = split_regions(caption, regions)
        out: list[Candidate] = []
        for kind in kinds:
            for question, answer in getattr(self, "_" + kind)(caption, objects, words, rng):
                out.append(Candidate(image, kind, question, answer))
        return out

    @staticmethod
    def _caption(caption, objects, words, rng):
        return [(_pick(rng, ("Describe the image.", "Write a short caption for the image.")), caption)]

    @staticmethod
    def _color(caption, objects, words, rng):
        return [
            (_pick(rng, (f"What color is the {o.noun}?", f"Which color does the {o.noun} have?")), o.color)
            for o in _unique(objects, lambda o: o.noun)
            if o.color
        ]

    @staticmethod
    def _shape(caption, objects, words, rng):
        return [
            (_pick(rng, (f"What shape is the {o.color} object?", f"Which shape is {o.color}?")), o.noun)
            for o in _unique(objects, lambda o: o.color)
            if o.color and o.noun in SHAPE_WORDS
        ]

    @staticmethod
    def _count(caption, objects, words, rng):
        if not objects:
            return []
        return [(_pick(rng, ("How many shapes are there?", "How many objects are in the image?")), str(len(objects)))]

    def _grounding(self, caption, objects, words, rng):
        out = []
        for o in _unique(objects, lambda o: o.phrase):
            asks = (f"Give the bounding box of the {o.phrase}.", f"Where is the {o.phrase}? Answer with its box.")
            out.append((_pick(rng, asks), self.box_text(o.box)))
        return out

    @staticmethod
    def _position(caption, objects, words, rng):
        placed = _placed(objects)
        if placed is None:
            return []
        ordered, row, unique = placed
        ends = [(ordered[0], "left" if row else "top"), (ordered[-1], "right" if row else "bottom")]
        sides = "on the left or on the right" if row else "at the top or at the bottom"
        return [(f"Is the {o.phrase} {sides}?", side) for o, side in ends if o.phrase in unique]

    @staticmethod
    def _relation(caption, objects, words, rng):
        placed = _placed(objects)
        if placed is None:
            return []
        ordered, row, unique = placed
        before, after = ("to the left of", "to the right of") if row else ("above", "below")
        pairs = []
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.phrase in unique and b.phrase in unique:
                pairs.append(
                    (f"What is {before} the {b.phrase}?", a.phrase)
                    if rng.random() < 0.5
                    else (f"What is {after} the {a.phrase}?", b.phrase)
                )
        return pairs

    @staticmethod
    def _ocr(caption, objects, words, rng):
        if len(words) != 1:
            return []
        return [(_pick(rng, ("What word is written in the image?", "What does the text say?")), words[0])]

    def _counterfactual(self, caption, objects, words, rng):
        """An absent object ("Is there a purple circle ...?" when no purple circle is drawn: no) and a removed one
        (how many objects would be left)."""
        out = []
        present = {o.phrase.lower() for o in objects}
        coloured = [o for o in objects if o.color]
        if coloured:
            o = coloured[int(rng.integers(len(coloured)))]
            absent = sorted(c for c in self.colors_by_noun.get(o.noun, ()) if f"{c} {o.noun}" not in present)
            if absent:
                out.append((f"Is there a {_pick(rng, absent)} {o.noun} in the image?", "no"))
        unique = _unique(objects, lambda o: o.phrase)
        if unique:
            o = unique[int(rng.integers(len(unique)))]
            out.append((f"If the {o.phrase} were removed, how many objects would be left?", str(len(objects) - 1)))
        return out


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text.lower())


def colors_by_noun(records_objects: list[list[_Object]]) -> dict[str, set[str]]:
    """The colours each noun comes in across the lake."""
    out: dict[str, set[str]] = defaultdict(set)
    for objects in records_objects:
        for o in objects:
            if o.color:
                out[o.noun].add(o.color)
    return out


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' character trigrams (lower-cased, spaces collapsed)."""
    grams_a, grams_b = _trigrams(a), _trigrams(b)
    return len(grams_a & grams_b) / len(grams_a | grams_b) if grams_a | grams_b else 1.0


def _trigrams(text: str) -> set[str]:
    text = " ".join(text.lower().split())
    return {text[i : i + 3] for i in range(max(1, len(text) - 2))}


def select(
    candidates: list[Candidate], scores: list[float], answer_tokens: list[int], cfg
) -> tuple[list[int], dict[int, str]]:
    """(indices kept, in candidate order; reason of each dropped index). Higher score = more likely under the base
    model. Order: over-long answers, each type's top `keep_fraction`, near duplicates, the counterfactual and type
    quotas, then `max_records` (each type cut in proportion)."""
    dropped: dict[int, str] = {}
    alive = [i for i in range(len(candidates)) if answer_tokens[i] <= cfg.max_answer_tokens]
    dropped.update({i: TOO_LONG for i in range(len(candidates)) if answer_tokens[i] > cfg.max_answer_tokens})

    def by_score(indices):  # most likely first; ties by candidate order
        return sorted(indices, key=lambda i: (-scores[i], i))

    groups = _by_kind(candidates, alive)
    alive = []
    for indices in groups.values():
        ranked = by_score(indices)
        keep = math.ceil(cfg.keep_fraction * len(ranked))
        alive += ranked[:keep]
        dropped.update({i: LOW_SCORE for i in ranked[keep:]})
    alive = _dedup(candidates, scores, sorted(alive), cfg.dedup_similarity, dropped)
    alive = _counterfactual_quota(candidates, scores, alive, cfg.min_counterfactual, dropped)
    alive = _type_quota(candidates, scores, alive, cfg.max_type_share, dropped)  # after: it only raises their share
    if cfg.max_records is not None and len(alive) > cfg.max_records:
        alive = _proportional_cut(candidates, scores, alive, cfg.max_records, dropped)
    return sorted(alive), dropped


def _by_kind(candidates: list[Candidate], indices) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i in indices:
        groups[candidates[i].kind].append(i)
    return groups


def _dedup(candidates, scores, alive: list[int], threshold: float, dropped: dict[int, str]) -> list[int]:
    """Within each image, the hardest (least likely) candidate first; a later one too like a kept one is dropped."""
    per_image: dict[str, list[int]] = defaultdict(list)
    for i in alive:
        per_image[candidates[i].image].append(i)
    kept: list[int] = []
    for indices in per_image.values():
        chosen: list[int] = []
        for i in sorted(indices, key=lambda i: (scores[i], i)):
            text = f"{candidates[i].question} {candidates[i].answer}"
            twin = next(
                (j for j in chosen if similarity(text, f"{candidates[j].question} {candidates[j].answer}") > threshold),
                None,
            )
            if twin is None:
                chosen.append(i)
            else:
                dropped[i] = NEAR_DUPLICATE
        kept += chosen
    return sorted(kept)


def _type_quota(candidates, scores, alive: list[int], share: float, dropped: dict[int, str]) -> list[int]:
    """The most candidates with no type over `share` of them: every type cut to the same largest count m with
    m <= share x (what is kept), the least likely dropped first."""
    groups = _by_kind(candidates, alive)
    sizes = [len(g) for g in groups.values()]
    m = max(sizes, default=0)
    while m > 0 and m > share * sum(min(n, m) for n in sizes):
        m -= 1
    if alive and m == 0:
        raise ValueError(
            f"build_data.max_type_share={share}, but only {len(groups)} question type(s) could be built "
            f"({', '.join(sorted(groups))}): no mix of them keeps each under that share; raise max_type_share to at "
            f"least {1 / len(groups):.2f} or give data the other templates can use."
        )
    kept: list[int] = []
    for g in groups.values():
        ranked = sorted(g, key=lambda i: (-scores[i], i))
        kept += ranked[:m]
        dropped.update({i: TYPE_QUOTA for i in ranked[m:]})
    return sorted(kept)


def _counterfactual_quota(candidates, scores, alive: list[int], share: float, dropped: dict[int, str]) -> list[int]:
    """Drop the least likely others (from the largest types) until counterfactuals make `share` of the kept."""
    if share <= 0:
        return alive
    counterfactual = [i for i in alive if candidates[i].counterfactual]
    if not counterfactual:
        raise ValueError(
            f"build_data.min_counterfactual={share}, but no counterfactual question could be built (they need "
            "regions of two-word '<colour> <noun>' phrases or objects named once); set min_counterfactual: 0."
        )
    allowed = math.floor(len(counterfactual) / share)
    excess = len(alive) - allowed
    if excess <= 0:
        return alive
    groups = _by_kind(candidates, [i for i in alive if not candidates[i].counterfactual])
    ranked = {kind: sorted(g, key=lambda i: (-scores[i], i)) for kind, g in groups.items()}
    for _ in range(excess):
        kind = max(ranked, key=lambda k: (len(ranked[k]), k))
        dropped[ranked[kind].pop()] = COUNTERFACTUAL_QUOTA
    return sorted(counterfactual + [i for g in ranked.values() for i in g])


def _proportional_cut(candidates, scores, alive: list[int], limit: int, dropped: dict[int, str]) -> list[int]:
    """`limit` of the kept, each type keeping its share (largest remainders), the most likely of each."""
    groups = _by_kind(candidates, alive)
    quota = {kind: limit * len(g) / len(alive) for kind, g in groups.items()}
    counts = {kind: math.floor(q) for kind, q in quota.items()}
    for kind in sorted(quota, key=lambda k: (-(quota[k] - counts[k]), k))[: limit - sum(counts.values())]:
        counts[kind] += 1
    kept: list[int] = []
    for kind, g in groups.items():
        ranked = sorted(g, key=lambda i: (-scores[i], i))
        kept += ranked[: counts[kind]]
        dropped.update({i: RECORD_CAP for i in ranked[counts[kind] :]})
    return sorted(kept)


def accounting(candidates: list[Candidate], kept: list[int], dropped: dict[int, str]) -> dict:
    """Candidates = kept + dropped by reason, in all and per type; raises if any candidate is unaccounted for."""
    if len(kept) + len(dropped) != len(candidates) or set(kept) & set(dropped):
        raise AssertionError(f"{len(candidates)} candidates, {len(kept)} kept + {len(dropped)} dropped")
    per_type: dict[str, dict] = {}
    for i, c in enumerate(candidates):
        row = per_type.setdefault(c.kind, {"candidates": 0, "kept": 0, "dropped": Counter()})
        row["candidates"] += 1
        if i in dropped:
            row["dropped"][dropped[i]] += 1
        else:
            row["kept"] += 1
    return {
        "candidates": len(candidates),
        "kept": len(kept),
        "dropped": dict(sorted(Counter(dropped.values()).items())),
        "per_type": {k: {**v, "dropped": dict(sorted(v["dropped"].items()))} for k, v in sorted(per_type.items())},
        "counterfactual_share": sum(candidates[i].counterfactual for i in kept) / len(kept) if kept else 0.0,
        "reasons": REASON_TEXT,
    }
