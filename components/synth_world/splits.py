"""Held-out splits of the shapes world, drawn from fresh scenes (never from lake records).

``write_splits(DIR/heldout, seed=0)`` writes, with image paths relative to DIR/heldout:
    eval.jsonl         {"id","image","question","answer","type"}, eval_per_type questions of every type
    sft.jsonl          {"id","image","conversations":[human "<image>\\n...", gpt answer],"type","difficulty"}
    rl.jsonl           the same format, other scenes: the RL stage's prompts (RL on prompts SFT trained on mostly
                       re-fits answers the SFT model memorised; docs/stages/rl.md)
    preferences.jsonl  {"id","image","prompt","chosen","rejected","kind"}
    images/*.png
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from components.synth_world.world import (
    COLORS,
    FLOWERY_CLOSERS,
    FLOWERY_OPENERS,
    HACKING_SUFFIXES,
    QUESTION_TYPES,
    SHAPES,
    WORDS,
    Scene,
    Shape,
    altered_scene,
    ask,
    caption,
    format_box,
    render,
    scene_for,
)

BASIC_TYPES = ("caption", "color", "count", "shape")
ADVANCED_TYPES = ("position", "relation", "grounding", "ocr")
PREFERENCE_KINDS = ("wrong_attribute", "hallucinated_object", "flowery_padding", "hacking_bait")
_OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


def _question(
    rng: np.random.Generator, kind: str, size: tuple[int, int], word_fraction: float, max_objects: int
) -> tuple[Scene, str, str]:
    """A fresh scene and one question of type ``kind`` it answers."""
    while True:
        scene = scene_for(rng, kind, *size, word_fraction=word_fraction, max_objects=max_objects)
        qa = ask(scene, kind, rng)
        if qa is not None:
            return scene, *qa


def wrong_answer(scene: Scene, kind: str, answer: str, rng: np.random.Generator) -> str:
    """A plausible answer of the same form that is wrong for this scene."""

    def other(options, exclude):
        options = [o for o in options if o not in exclude]
        return options[int(rng.integers(len(options)))]

    if kind == "color":
        return other(list(COLORS), {answer})
    if kind == "shape":
        return other(list(SHAPES), {answer})
    if kind == "count":
        return other([str(n) for n in range(1, 5)], {answer})
    if kind == "position":
        return _OPPOSITE[answer]
    if kind == "relation":
        return other([f"{c} {s}" for c in COLORS for s in SHAPES], {answer})
    if kind == "ocr":
        return other(list(WORDS), {answer})
    if kind == "grounding":
        x1, y1, x2, y2 = next(o.box for o in scene.objects if format_box(o.box) == answer)
        dx = max(8, (x2 - x1) // 2) * (1 if x1 < scene.width / 2 else -1)
        return format_box((x1 + dx, y1, x2 + dx, y2))
    if kind == "caption":
        return caption(altered_scene(scene, rng), rng)
    raise ValueError(f"unknown question type {kind!r}; expected one of {QUESTION_TYPES}")


def _with_extra_object(scene: Scene, rng: np.random.Generator) -> Scene:
    """The scene plus one object it lacks, at a random place in the reading order (for captions only)."""
    present = {(o.color, o.shape) for o in scene.objects}
    absent = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in present]
    color, shape = absent[int(rng.integers(len(absent)))]
    ordered = scene.ordered()
    ordered.insert(int(rng.integers(len(ordered) + 1)), Shape(shape, color, (0, 0, 1, 1)))
    # Boxes only fix the order the caption lists objects in; they are not drawn.
    objects = tuple(replace(o, box=(i * 10, i * 10, i * 10 + 8, i * 10 + 8)) for i, o in enumerate(ordered))
    return replace(scene, objects=objects)


def _preference(
    kind: str, rng: np.random.Generator, size: tuple[int, int], word_fraction: float, max_objects: int
) -> tuple[Scene, str, str, str]:
    """(scene, prompt, chosen, rejected) for one preference pair of ``kind``."""
    if kind == "hallucinated_object":
        scene, prompt, chosen = _question(rng, "caption", size, word_fraction, min(2, max_objects))
        return scene, prompt, chosen, caption(_with_extra_object(scene, rng), rng)
    if kind == "wrong_attribute":
        qtype = ("color", "shape", "count", "caption")[int(rng.integers(4))]
        scene, prompt, chosen = _question(rng, qtype, size, word_fraction, max_objects)
        return scene, prompt, chosen, wrong_answer(scene, qtype, chosen, rng)
    if kind == "flowery_padding":
        qtype = QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
        scene, prompt, chosen = _question(rng, qtype, size, word_fraction, max_objects)
        core = chosen if qtype == "caption" else f"The answer is {chosen}."
        opener = FLOWERY_OPENERS[int(rng.integers(len(FLOWERY_OPENERS)))]
        closer = FLOWERY_CLOSERS[int(rng.integers(len(FLOWERY_CLOSERS)))]
        return scene, prompt, chosen, f"{opener} {core} {closer}"
    if kind == "hacking_bait":
        qtype = ("color", "shape", "count", "position", "relation", "ocr")[int(rng.integers(6))]
        scene, prompt, chosen = _question(rng, qtype, size, word_fraction, max_objects)
        suffix = HACKING_SUFFIXES[int(rng.integers(len(HACKING_SUFFIXES)))]
        return scene, prompt, chosen, f"{wrong_answer(scene, qtype, chosen, rng)}, {suffix}."
    raise ValueError(f"unknown preference kind {kind!r}; expected one of {PREFERENCE_KINDS}")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")


def write_splits(
    out_dir: str | Path,
    *,
    seed: int,
    eval_per_type: int = 100,
    sft_records: int = 2000,
    preference_pairs: int = 500,
    rl_records: int | None = None,
    image_size: tuple[int, int] = (112, 112),
    word_fraction: float = 0.3,
    max_objects: int = 3,
) -> dict[str, Any]:
    """Write eval.jsonl, sft.jsonl, rl.jsonl, preferences.jsonl and images/ into ``out_dir``; return the counts.
    ``rl_records`` defaults to a quarter of ``sft_records``."""
    out = Path(out_dir)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    if any(images.iterdir()):
        raise ValueError(f"{images} is not empty; write the held-out splits into an empty directory")
    size = (int(image_size[0]), int(image_size[1]))

    def save(scene: Scene, name: str) -> str:
        render(scene).save(images / f"{name}.png", format="PNG")
        return f"images/{name}.png"

    rng = np.random.default_rng([seed, 2])
    eval_rows = []
    for kind in QUESTION_TYPES:
        for i in range(eval_per_type):
            scene, question, answer = _question(rng, kind, size, word_fraction, max_objects)
            row_id = f"eval-{kind}-{i:05d}"
            eval_rows.append(
                {
                    "id": row_id,
                    "image": save(scene, row_id),
                    "question": question,
                    "answer": answer,
                    "type": kind,
                }
            )
    _write_jsonl(out / "eval.jsonl", eval_rows)

    def conversations(stream: int, prefix: str, count: int) -> list[dict[str, Any]]:
        rng = np.random.default_rng([seed, stream])
        rows = []
        for i in range(count):
            kind = QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
            scene, question, answer = _question(rng, kind, size, word_fraction, max_objects)
            row_id = f"{prefix}-{i:05d}"
            rows.append(
                {
                    "id": row_id,
                    "image": save(scene, row_id),
                    "type": kind,
                    "difficulty": "basic" if kind in BASIC_TYPES else "advanced",
                    "conversations": [
                        {"from": "human", "value": f"<image>\n{question}"},
                        {"from": "gpt", "value": answer},
                    ],
                }
            )
        return rows

    sft_rows = conversations(3, "sft", sft_records)
    _write_jsonl(out / "sft.jsonl", sft_rows)
    rl_rows = conversations(5, "rl", sft_records // 4 if rl_records is None else rl_records)
    _write_jsonl(out / "rl.jsonl", rl_rows)

    rng = np.random.default_rng([seed, 4])
    pref_rows = []
    for i in range(preference_pairs):
        kind = PREFERENCE_KINDS[i % len(PREFERENCE_KINDS)]
        scene, prompt, chosen, rejected = _preference(kind, rng, size, word_fraction, max_objects)
        row_id = f"pref-{i:05d}"
        pref_rows.append(
            {
                "id": row_id,
                "image": save(scene, row_id),
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "kind": kind,
            }
        )
    _write_jsonl(out / "preferences.jsonl", pref_rows)

    return {
        "eval": {kind: sum(r["type"] == kind for r in eval_rows) for kind in QUESTION_TYPES},
        "sft": {level: sum(r["difficulty"] == level for r in sft_rows) for level in ("basic", "advanced")},
        "rl": len(rl_rows),
        "preferences": {kind: sum(r["kind"] == kind for r in pref_rows) for kind in PREFERENCE_KINDS},
        "images": len(eval_rows) + len(sft_rows) + len(rl_rows) + len(pref_rows),
    }
