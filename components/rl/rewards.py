"""Reward functions of the RL stage: plain callables `(prompts, completions, **batch) -> list[float]`.

`batch` carries `records` (the prompt records: id, type, question, answer, pil image) and `finished` (whether
each completion ended with <|im_end|> rather than running into max_new_tokens). `build_rewards` picks the
configured ones from REWARD_BUILDERS by name; the RL stage sums them with their weights.

Task efficacy: on any task but the synthetic world's, the record's task scorer (data/tasks.py; grounding earns its
IoU). On the synthetic world's question types (TER; docs/references.md):
- VQA types: answer accuracy (exact match; grounding: the box IoU, so near misses earn part of the reward)
  times a length factor that only starts to bite past 1.5x the question's length,
  `1 - min(1, max(0, len - 1.5 * question_len) / (1.5 * question_len))` (words);
- captions: n-gram overlap with the reference (mean F1 over 1..4-grams, a cheap stand-in for CIDEr)
  times (1 - the share of repeated bigrams);
- text reading (ocr): word-level F1 against the reference.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from components._shared.data import metrics as M
from components._shared.data import tasks as T
from components._shared.data.scorers import ngram_overlap
from components._shared.model.reward_models import RewardModelScorer
from components.rl.shard import ONE_PROCESS, Shard

RewardFn = Callable[..., list[float]]
_WORDS = re.compile(r"[^\W_]+", re.UNICODE)
_QUOTED = re.compile(r"[\"\u201c]([^\"\u201d]{1,40})[\"\u201d]")


# ------------------------------------------------------------------------------------------ efficacy ---


def words(text: str) -> list[str]:
    return _WORDS.findall(text.lower())


def length_factor(answer: str, question: str) -> float:
    """1 up to 1.5x the question's length in words, then falling linearly to 0 at 3x."""
    allowed = 1.5 * max(1, len(words(question)))
    over = max(0.0, len(words(answer)) - allowed)
    return 1.0 - min(1.0, over / allowed)


def repeated_ngram_ratio(text: str, n: int = 2) -> float:
    """Share of the text's n-grams that repeat an earlier one (0 for text shorter than n + 1 words)."""
    tokens = M.cider_tokens(text)
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if len(grams) > 1 else 0.0


def word_f1(prediction: str, reference: str) -> float:
    pred, ref = Counter(words(prediction)), Counter(words(reference))
    common = sum((pred & ref).values())
    if not common:
        return 0.0
    precision, recall = common / sum(pred.values()), common / sum(ref.values())
    return 2 * precision * recall / (precision + recall)


def efficacy(record: dict, answer: str) -> float:
    """The efficacy of one answer to a prompt record: the synthetic world's shaped efficacy for its builtin tasks,
    else the record's task scorer (partial credit where it has one: a box's IoU); a grounding record with a pixel
    box needs its frame (ConversationEncoder.box_frame)."""
    if record["type"] in T.BUILTIN_TASKS:
        return task_efficacy(record["type"], answer, record["answer"], record["question"])
    return T.reward(answer, record)


def task_efficacy(question_type: str, answer: str, reference: str, question: str) -> float:
    """The efficacy of one answer to a synthetic-world question in [0, 1] (see the module docstring)."""
    if question_type == "caption":
        return ngram_overlap(answer, reference) * (1.0 - repeated_ngram_ratio(answer))
    if question_type == "ocr":
        return word_f1(answer, reference) * length_factor(answer, question)
    if question_type == "grounding":
        pred, gold = M.parse_box(answer), M.parse_box(reference)
        accuracy = M.box_iou(pred, gold) if pred is not None and gold is not None else 0.0
    else:
        accuracy = M.exact_match(answer, reference)
    return accuracy * length_factor(answer, question)


class EfficacyCache:
    """Efficacy of (prompt id, normalised answer), computed once (most sampled answers repeat)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], float] = {}
        self.hits = self.misses = 0

    def __call__(self, prompts: list[str], completions: list[str], *, records: list[dict], **_: Any) -> list[float]:
        out = []
        for record, answer in zip(records, completions, strict=True):
            key = (record["id"], " ".join(answer.split()))
            if key in self.values:
                self.hits += 1
            else:
                self.misses += 1
                self.values[key] = efficacy(record, answer)
            out.append(self.values[key])
        return out

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


# ---------------------------------------------------------------------------------------------- format ---


def format_reward(
    prompts: list[str], completions: list[str], *, records: list[dict], finished: list[bool], **_: Any
) -> list[float]:
    """1 for a complete answer (ended by <|im_end|>, not empty, in the form its task reads: a box the scorer parses
    in any Qwen generation's form for grounding, an option letter for multiple choice), else 0."""
    out = []
    for record, answer, done in zip(records, completions, finished, strict=True):
        ok = done and bool(answer.strip())
        if ok and record["type"] == "grounding":
            ok = M.parse_box(answer) is not None
        elif ok and record["type"] not in T.BUILTIN_TASKS:
            ok = T.parses(answer, record)
        out.append(float(ok))
    return out


# ------------------------------------------------------------------------------------------ reward model ---


class RewardModelReward(RewardModelScorer):
    """The reward model's score of (image, prompt, completion), standardised with the statistics the
    reward_model stage saved (so 0 is an average SFT-quality answer); see RewardModelScorer."""

    def __call__(
        self, prompts: list[str], completions: list[str], *, records: list[dict], shard: Shard = ONE_PROCESS, **_: Any
    ) -> list[float]:
        return self.standardised(records, completions, map_groups=shard.map)


def say_other_family(rewards: dict[str, Any], policy) -> None:
    """Say when the reward model is of another model family than the policy (thirteenth pass, R60): it scores the
    policy's answers with its own chat template and box convention, which may not be the policy's."""
    from components._shared.model.families import family_for

    scorer = next((fn for fn in rewards.values() if isinstance(fn, RewardModelScorer)), None)
    if scorer is None:
        return
    theirs, ours = family_for(scorer.model.backbone).name, family_for(policy).name
    if theirs != ours:
        print(
            f"warning: rl: the reward model is a {theirs} model and the policy a {ours} one: it scores the policy's "
            f"answers with {theirs}'s chat template and box convention; train the reward model on this policy's "
            "family (the DAG does: both start from the SFT model).",
            flush=True,
        )


# ----------------------------------------------------------------------------------------- OCR check ---


class OcrConsistencyReward:
    """The fact check: text the answer claims is written in the image must be there.

    Claims are the whole answer of a text-reading question and any quoted word in other answers. +1 when
    every claimed word is read in the image by the OCR model (one slip allowed on 4+ letters), -1 when one is
    not, 0 for answers that claim no text. Images are read once (cached by prompt id).
    """

    def __init__(self, *, detect_side: int = 736, threads: int = 0, cache_size: int = 4096) -> None:
        from components._shared.data.ocr import load_ocr

        self.reader = load_ocr(detect_side, threads)
        self.cache: OrderedDict[str, str] = OrderedDict()  # prompt id -> words read in its image
        self.cache_size = cache_size

    def claims(self, record: dict, answer: str) -> list[str]:
        if record["type"] == "ocr":
            return words(answer)
        return [w for quoted in _QUOTED.findall(answer) for w in words(quoted)]

    def read(self, record: dict) -> str:
        if record["id"] not in self.cache:
            found = self.reader.words(record["pil"], min_confidence=0.5, min_chars=2, min_box_aspect=1.2)
            self.cache[record["id"]] = " ".join(found).lower()
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return self.cache[record["id"]]

    def __call__(self, prompts: list[str], completions: list[str], *, records: list[dict], **_: Any) -> list[float]:
        from components._shared.data.ocr import unmentioned_words

        out = []
        for record, answer in zip(records, completions, strict=True):
            claimed = self.claims(record, answer)
            # a claimed word counts as read when the OCR text mentions it (the tolerance clean_data uses)
            out.append(0.0 if not claimed else -1.0 if unmentioned_words(claimed, self.read(record)) else 1.0)
        return out


def _reward_model_reward(reward_model_uri: str | None, **options: Any) -> RewardFn:
    if not reward_model_uri:
        raise ValueError(
            "rl.rewards uses reward_model but the stage got no reward model; connect the "
            "reward_model stage's output or set its weight to 0."
        )
    return RewardModelReward(reward_model_uri, **options)


# The one table of rewards: name -> builder(reward_model_uri, min_pixels=, max_pixels=, device=). Its names are
# config.REWARD_NAMES (the config validates against them without importing torch; a test checks both agree).
REWARD_BUILDERS: dict[str, Callable[..., RewardFn]] = {
    "efficacy": lambda uri, **_: EfficacyCache(),
    "format": lambda uri, **_: format_reward,
    "reward_model": _reward_model_reward,
    "ocr_consistency": lambda uri, **_: OcrConsistencyReward(),
}


def build_rewards(
    weights: dict[str, float], *, reward_model_uri: str | None, min_pixels: int, max_pixels: int, device: torch.device
) -> dict[str, RewardFn]:
    """The configured reward callables by name (weights zero or absent are not built)."""
    unknown = sorted(set(weights) - set(REWARD_BUILDERS))
    if unknown:
        raise ValueError(f"rl.rewards names unknown reward(s) {unknown}; choose from {tuple(REWARD_BUILDERS)}.")
    fns = {
        name: REWARD_BUILDERS[name](reward_model_uri, min_pixels=min_pixels, max_pixels=max_pixels, device=device)
        for name, weight in weights.items()
        if weight
    }
    if not fns:
        raise ValueError("rl.rewards has no reward with a non-zero weight; give at least one (e.g. efficacy: 1.0).")
    return fns
