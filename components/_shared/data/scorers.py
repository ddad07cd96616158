"""Per-answer scorers of the standard benchmarks, each written from its benchmark's own evaluation code.

Every scorer is a plain callable `(prediction, record) -> float in [0, 1]`; `record` is a held-out record of
data/formats.py: "answers" (every reference), and where the task needs them "choices" (multiple choice) or
"box" + "image_size" + "model_size" + "box_convention" (grounding against a box in image pixels). The one table
that names them is data/tasks.py (SCORERS).

Written by hand because no kept package scores these outside its own harness (lmms-eval, VLMEvalKit and the
benchmark repos ship them inside training-framework code). Pure Python: the eval stage and the tests import it
without torch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from components._shared.data import metrics as M

Record = Mapping[str, Any]


def answers_of(record: Record) -> list[str]:
    """The record's reference answers (a non-empty list of strings)."""
    answers = record.get("answers") or ([record["answer"]] if isinstance(record.get("answer"), str) else [])
    if not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"record {record.get('id')!r} has no reference answer strings (answers={answers!r}).")
    return list(answers)


# ------------------------------------------------------------------------------------------ exact match ---


def exact_match(prediction: str, record: Record) -> float:
    """1 if the normalised prediction equals any normalised reference (metrics.normalize_answer)."""
    pred = M.normalize_answer(prediction)
    return float(any(pred == M.normalize_answer(a) for a in answers_of(record)))


# ------------------------------------------------------------------------ VQA accuracy (VQAv2 / TextVQA) ---

# The official VQA evaluation (vqaEval.py, GT-Vision-Lab/VQA): contractions written without the apostrophe are
# restored, number words become digits, articles go, punctuation is dropped or spaced as the script does.
_VQA_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's",
    "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}  # fmt: skip
_VQA_NUMBERS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
_VQA_ARTICLES = ("a", "an", "the")
_VQA_PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")
_VQA_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")  # sic: the official pattern (a period not before a digit)
_VQA_COMMA = re.compile(r"(\d)(,)(\d)")


def vqa_normalize(text: str) -> str:
    """An answer as the official VQA evaluation compares it (processPunctuation + processDigitArticle)."""
    text = " ".join(text.replace("\n", " ").replace("\t", " ").strip().split())
    out = text
    for p in _VQA_PUNCT:
        if (p + " " in text or " " + p in text) or _VQA_COMMA.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _VQA_PERIOD.sub("", out)
    words = []
    for word in out.lower().split():
        word = _VQA_NUMBERS.get(word, word)
        if word not in _VQA_ARTICLES:
            words.append(_VQA_CONTRACTIONS.get(word, word))
    return " ".join(words)


def vqa_accuracy(prediction: str, record: Record) -> float:
    """VQAv2 / TextVQA accuracy: min(#humans who gave the answer / 3, 1), averaged over the leave-one-out subsets
    of the reference answers as the official script does (10 references: 1 match -> 0.3, 2 -> 0.6, 3 -> 0.9)."""
    golds = [vqa_normalize(a) for a in answers_of(record)]
    pred = vqa_normalize(prediction)
    if len(golds) == 1:
        return float(pred == golds[0])
    scores = []
    for left_out in range(len(golds)):
        matches = sum(g == pred for i, g in enumerate(golds) if i != left_out)
        scores.append(min(1.0, matches / 3.0))
    return sum(scores) / len(scores)


# --------------------------------------------------------------------------------------- ANLS (DocVQA) ---


def anls(prediction: str, record: Record) -> float:
    """ANLS with threshold 0.5 over the record's references (metrics.anls)."""
    return M.anls(prediction, answers_of(record))


# ---------------------------------------------------------------------------- relaxed accuracy (ChartQA) ---


def _to_float(text: str) -> float | None:
    """ChartQA's number parse: a trailing % divides by 100; anything else that float() refuses is no number."""
    text = text.strip()
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, record: Record, max_relative_change: float = 0.05) -> float:
    """ChartQA's relaxed correctness: numbers within 5% of the reference (relative), other answers exactly equal
    (case-insensitive); the best over the references. A reference of 0 needs exactly 0."""
    pred = prediction.strip().rstrip(".")
    best = 0.0
    for gold in answers_of(record):
        p, g = _to_float(pred), _to_float(gold)
        if p is not None and g is not None:
            ok = p == g if g == 0 else abs(p - g) / abs(g) <= max_relative_change
        else:
            ok = pred.lower() == gold.strip().lower()
        best = max(best, float(ok))
    return best


# ------------------------------------------------------------------------ multiple choice (MMBench / MMMU) ---

_MC_STRIP = (",", ".", "!", "?", ";", ":", "'")


def parse_choice(response: str, choices: Mapping[str, str]) -> str | None:
    """The option letter a free-form answer picks, by MMMU's `parse_multi_choice_response` rules without its random
    fallback: "(B)" first, then a bare " B ", then (answers longer than 5 words) an option's text; when several
    match, the one mentioned last. " B." and " B:" count as a bare letter (MMBench's answer forms). None when
    nothing matches (scored wrong, deterministically)."""
    text = response
    for char in _MC_STRIP:
        text = text.strip(char)
    text = f" {text} "
    letters = list(choices)
    found = [c for c in letters if f"({c})" in text]
    if not found:
        found = [c for c in letters if f" {c} " in text or f" {c}. " in text or f" {c}:" in text]
    by_text = False
    if not found and len(text.split()) > 5:
        found = [c for c in letters if choices[c] and choices[c].lower() in text.lower()]
        by_text = True
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    if by_text:
        return max(found, key=lambda c: text.lower().rfind(choices[c].lower()))
    return max(found, key=lambda c: max(text.rfind(form.format(c)) for form in ("({})", " {} ", " {}.", " {}:")))


def choice_golds(record: Record) -> set[str]:
    """The reference option letters of a multiple_choice record; ValueError when it has no options or an answer is
    not one of them (no prediction could score on it). The readers call it when a record is read."""
    choices = record.get("choices")
    if not isinstance(choices, Mapping) or not choices:
        raise ValueError(
            f"record {record.get('id')!r}: a multiple_choice task needs 'choices' ({{'A': text, ...}}), "
            f"got {choices!r}."
        )
    golds = {a.strip().strip("()").upper() for a in answers_of(record)}
    if not golds <= set(choices):
        texts = {text.strip().casefold(): key for key, text in choices.items()}
        named = [
            f"{a!r} is option {texts[a.strip().casefold()]}'s text"
            for a in answers_of(record)
            if a.strip().casefold() in texts
        ]
        raise ValueError(
            f"record {record.get('id')!r}: answer {sorted(golds)} is not one of the options {list(choices)}"
            f"{' (' + '; '.join(named) + ')' if named else ''}; give the answer as one of the options' keys."
        )
    return golds


def multiple_choice(prediction: str, record: Record) -> float:
    """1 if the option parsed from the prediction is the reference letter (record: "choices" {letter: text})."""
    golds = choice_golds(record)  # first: it names a record without choices
    return float(parse_choice(prediction, record["choices"]) in golds)


# ------------------------------------------------------------------------------- captions (COCO-style) ---


def ngram_overlap(prediction: str, reference: str, max_n: int = 4) -> float:
    """Mean over n = 1..max_n (those the reference has) of the clipped n-gram F1 (CIDEr's tokenisation)."""
    pred, ref = M.cider_tokens(prediction), M.cider_tokens(reference)
    scores = []
    for n in range(1, max_n + 1):
        ref_grams = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
        if not ref_grams:
            break
        pred_grams = Counter(tuple(pred[i : i + n]) for i in range(len(pred) - n + 1))
        matched = sum((pred_grams & ref_grams).values())
        if not matched:
            scores.append(0.0)
            continue
        precision, recall = matched / sum(pred_grams.values()), matched / sum(ref_grams.values())
        scores.append(2 * precision * recall / (precision + recall))
    return sum(scores) / len(scores) if scores else 0.0


def caption_overlap(prediction: str, record: Record) -> float:
    """A caption's per-record score: the best n-gram overlap with a reference (CIDEr-D itself is a corpus
    metric, reported over a task's rows)."""
    return max(ngram_overlap(prediction, a) for a in answers_of(record))


# ------------------------------------------------------------------------------------ yes / no (POPE) ---


def yes_no(text: str) -> str:
    """POPE's answer parse (its evaluate.py): the first sentence without commas, "no" if one of its space-separated
    words is `no`, `not` or `No`, else "yes"."""
    words = text.split(".")[0].replace(",", "").split(" ")
    return "no" if {"no", "not", "No"} & set(words) else "yes"


def yes_no_golds(record: Record) -> set[str]:
    """The reference answers of a yes_no record ({"yes"} / {"no"}); ValueError for any other answer (POPE's labels
    are yes / no). The readers call it when a record is read."""
    golds = {a.strip().lower().rstrip(".") for a in answers_of(record)}
    bad = golds - {"yes", "no"}
    if bad:
        raise ValueError(f"record {record.get('id')!r}: a yes_no task needs yes/no answers, got {sorted(bad)}.")
    return golds


def yes_no_accuracy(prediction: str, record: Record) -> float:
    return float(yes_no(prediction) in yes_no_golds(record))


def yes_no_report(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """POPE's table: precision, recall and F1 of "yes" (the object is present), and the share answered yes."""
    pred = [yes_no(r["prediction"]) == "yes" for r in rows]
    gold = [answers_of(r)[0].strip().lower().startswith("yes") for r in rows]
    tp = sum(p and g for p, g in zip(pred, gold, strict=True))
    precision = tp / sum(pred) if any(pred) else 0.0
    recall = tp / sum(gold) if any(gold) else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "yes_ratio": sum(pred) / len(pred)}


# ---------------------------------------------------------------------------------- grounding (RefCOCO) ---

_BOX_TAG = re.compile(r"<\|box_start\|>(.*?)<\|box_end\|>", re.S)
_JSON_BLOCK = re.compile(r"\[\s*\{.*?\}\s*\]|\{[^{}]*\"bbox_2d\"[^{}]*\}", re.S)


def parse_predicted_box(text: str) -> tuple[float, float, float, float] | None:
    """The first box an answer writes, in any of the Qwen generations' forms: Qwen2.5-VL / Qwen3-VL JSON
    `[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]`, Qwen2-VL `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`, or a bare
    "[x1, y1, x2, y2]" / "(x1,y1),(x2,y2)"."""
    for block in _JSON_BLOCK.findall(text):
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            continue
        for item in value if isinstance(value, list) else [value]:
            box = item.get("bbox_2d") if isinstance(item, dict) else None
            if isinstance(box, list) and len(box) == 4 and all(isinstance(v, int | float) for v in box):
                x1, y1, x2, y2 = (float(v) for v in box)
                return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)
    tagged = _BOX_TAG.search(text)
    return M.parse_box(tagged.group(1) if tagged else text)


def to_image_pixels(box, *, convention: str, image_size, model_size) -> tuple[float, float, float, float]:
    """A predicted box in the original image's pixels. `absolute` (Qwen2.5-VL): pixels of the resized image the
    model saw (`model_size`, w x h); `relative_1000` (Qwen2-VL, Qwen3-VL, Qwen3.5): thousandths of each side."""
    (w, h), (mw, mh) = image_size, model_size
    if convention == "absolute":
        sx, sy = w / mw, h / mh
    elif convention == "relative_1000":
        sx, sy = w / 1000.0, h / 1000.0
    else:
        raise ValueError(f"unknown box convention {convention!r}; expected 'absolute' or 'relative_1000'.")
    x1, y1, x2, y2 = box
    return x1 * sx, y1 * sy, x2 * sx, y2 * sy


def grounding_iou(prediction: str, record: Record) -> float:
    """IoU of the predicted box with the reference. With a "box" (image pixels, [x1, y1, x2, y2]) the prediction is
    read in the model family's convention ("box_convention", "image_size", "model_size"); without one, the
    reference is the answer text's box in the same frame as the prediction (the synthetic world's form)."""
    pred = parse_predicted_box(prediction)
    if record.get("box") is not None:
        x1, y1, x2, y2 = (float(v) for v in record["box"])
        gold: tuple[float, float, float, float] | None = (x1, y1, x2, y2)
        if pred is not None:
            missing = [k for k in ("box_convention", "image_size", "model_size") if not record.get(k)]
            if missing:
                raise ValueError(f"record {record.get('id')!r}: grounding against a pixel box needs {missing}.")
            pred = to_image_pixels(
                pred, convention=record["box_convention"], image_size=record["image_size"],
                model_size=record["model_size"],
            )  # fmt: skip
    else:
        gold = M.parse_box(answers_of(record)[0])
        if gold is None:
            raise ValueError(
                f"record {record.get('id')!r}: the grounding answer has no parsable box and no 'box' field."
            )
    return M.box_iou(pred, gold) if pred is not None and gold is not None else 0.0


def grounding_gold(record: Record) -> None:
    """ValueError when a grounding record has no reference box: no 'box' field and no box in its answer (every
    prediction would score 0, and RL would train on a reward that is always 0). The readers call it when a record is
    read."""
    if record.get("box") is None and M.parse_box(answers_of(record)[0]) is None:
        raise ValueError(
            f'record {record.get("id")!r}: a grounding answer needs a box, written "(x1,y1),(x2,y2)" or '
            f"\"[x1, y1, x2, y2]\", or a 'box' field; got {answers_of(record)[0][:60]!r}."
        )


def grounding(prediction: str, record: Record, threshold: float = 0.5) -> float:
    """1 if IoU >= 0.5 (RefCOCO's accuracy@0.5; 1e-9 float slack), else 0."""
    return float(grounding_iou(prediction, record) >= threshold - 1e-9)
