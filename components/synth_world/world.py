"""The shapes world: random scenes with exact ground truth, their pictures, captions and questions.

Everything here is a pure function of its arguments and a seeded ``numpy.random.Generator``, so the same
seed gives the same scenes, pixels and texts. Shapes are big relative to a 14 px ViT patch and never
overlap; objects sit in a row (left to right) or a column (top to bottom), so left/right/top/bottom
questions always have one answer. No two objects of a scene share both colour and shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SHAPES = ("circle", "square", "triangle", "cross")
COLORS = {
    "red": (215, 25, 28),
    "green": (26, 150, 65),
    "blue": (30, 80, 220),
    "yellow": (245, 200, 0),
    "purple": (128, 50, 160),
    "orange": (245, 125, 0),
}
BACKGROUNDS = ((250, 250, 250), (226, 226, 226), (232, 238, 248))
WORDS = (
    "cat",
    "dog",
    "sun",
    "car",
    "tree",
    "book",
    "fish",
    "bird",
    "milk",
    "door",
    "cake",
    "boat",
    "rain",
    "lamp",
    "shop",
    "park",
)
QUESTION_TYPES = ("color", "shape", "count", "position", "relation", "grounding", "ocr", "caption")
TEXT_RGB, WORD_BOX_RGB, WORD_EDGE_RGB = (20, 20, 20), (255, 255, 255), (110, 110, 110)
NUMBER_WORDS = {1: "One", 2: "Two", 3: "Three"}
# Phrases of the preference pairs (splits.py): listed here so text_corpus covers them.
FLOWERY_OPENERS = (
    "What a truly captivating image!",
    "Looking closely at this wonderful picture,",
    "This delightful scene is a joy to behold.",
)
FLOWERY_CLOSERS = (
    "It is a simply beautiful composition.",
    "Every detail radiates harmony and charm.",
    "A truly remarkable sight indeed.",
)
HACKING_SUFFIXES = (
    "according to the image evidence",
    "as clearly verified by the visual evidence",
    "which is confirmed with high confidence",
)

Box = tuple[int, int, int, int]  # x1, y1, x2, y2 in pixels; x2/y2 exclusive


@dataclass(frozen=True)
class Shape:
    shape: str
    color: str
    box: Box

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: tuple[int, int, int]
    arrangement: str  # "row": objects ordered left to right; "column": top to bottom
    objects: tuple[Shape, ...]
    word: str | None = None
    word_box: Box | None = None

    def ordered(self) -> list[Shape]:
        """Objects in reading order: left to right for a row, top to bottom for a column."""
        axis = 0 if self.arrangement == "row" else 1
        return sorted(self.objects, key=lambda o: o.box[axis])

    def to_dict(self) -> dict[str, Any]:
        return {
            "width": self.width,
            "height": self.height,
            "background": list(self.background),
            "arrangement": self.arrangement,
            "word": self.word,
            "word_box": list(self.word_box) if self.word_box else None,
            "objects": [{"shape": o.shape, "color": o.color, "box": list(o.box)} for o in self.objects],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scene:
        objects = tuple(Shape(o["shape"], o["color"], tuple(o["box"])) for o in data["objects"])
        word_box = tuple(data["word_box"]) if data.get("word_box") else None
        return cls(
            data["width"],
            data["height"],
            tuple(data["background"]),
            data["arrangement"],
            objects,
            data.get("word"),
            word_box,
        )


@lru_cache(maxsize=64)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def _word_font_size(width: int, height: int) -> int:
    return min(40, max(14, round(0.17 * min(width, height))))


def _pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


def _object_count(rng: np.random.Generator, max_objects: int) -> int:
    weights = np.array([0.4, 0.4, 0.2][:max_objects])
    return int(rng.choice(np.arange(1, max_objects + 1), p=weights / weights.sum()))


def random_scene(
    rng: np.random.Generator,
    width: int,
    height: int,
    *,
    n_objects: int | None = None,
    max_objects: int = 3,
    word: str | None = None,
    arrangement: str | None = None,
) -> Scene:
    """A scene of ``n_objects`` shapes (default 1-3, 1-2 most common), plus ``word`` drawn in a box."""
    if not 1 <= max_objects <= 3:
        raise ValueError(f"max_objects={max_objects} must be 1, 2 or 3")
    n = n_objects or _object_count(rng, max_objects)
    short = min(width, height)
    margin = max(2, round(0.04 * short))
    area = [margin, margin, width - margin, height - margin]
    word_box = None
    if word is not None:
        size = _word_font_size(width, height)
        pad = max(3, size // 5)
        left, _, right, _ = _font(size).getbbox(word)
        box_w, box_h = right - left + 2 * pad, size + 2 * pad
        if box_w > width - 2 * margin or box_h > (height - 2 * margin) // 2:
            raise ValueError(f"the word {word!r} does not fit a {width}x{height} scene; use a larger image")
        x1 = margin + int(rng.integers(0, width - 2 * margin - box_w + 1))
        y1 = margin if rng.random() < 0.5 else height - margin - box_h
        word_box = (x1, y1, x1 + box_w, y1 + box_h)
        if y1 == margin:
            area[1] = y1 + box_h + margin
        else:
            area[3] = y1 - margin
    if arrangement is None:  # along the long side of the free area, so shapes stay big
        free_w, free_h = area[2] - area[0], area[3] - area[1]
        if n == 1 or free_w > 1.2 * free_h:
            arrangement = "row"
        elif free_h > 1.2 * free_w:
            arrangement = "column"
        else:
            arrangement = "row" if rng.random() < 0.7 else "column"
    names = [(c, s) for c in COLORS for s in SHAPES]
    picks = rng.choice(len(names), size=n, replace=False)
    along = 0 if arrangement == "row" else 1
    span = area[2 + along] - area[along]
    across = area[3 - along] - area[1 - along]
    slot = span / n
    objects = []
    for i, k in enumerate(picks):
        limit = int(min(slot - margin, across))
        if limit < 8:
            raise ValueError(f"{n} objects do not fit a {width}x{height} scene; use a larger image")
        side = max(8, int(rng.uniform(0.55, 0.92) * limit))
        start = area[along] + int(i * slot)
        pos_along = start + int(rng.integers(0, int(slot) - margin - side + 1))  # keeps a margin between slots
        pos_across = area[1 - along] + int(rng.integers(0, across - side + 1))
        x1, y1 = (pos_along, pos_across) if along == 0 else (pos_across, pos_along)
        color, shape = names[int(k)]
        objects.append(Shape(shape, color, (x1, y1, x1 + side, y1 + side)))
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    return Scene(width, height, background, arrangement, tuple(objects), word, word_box)


def altered_scene(scene: Scene, rng: np.random.Generator) -> Scene:
    """The scene with the colour, the shape or both of *every* object changed (pairs stay unique).

    No new (colour, shape) pair may equal one of the original objects, so a caption of the altered scene
    never names an object that really is in the image.
    """
    mode = _pick(rng, ("color", "shape", "both"))
    taken = {(o.color, o.shape) for o in scene.objects}
    objects = []
    for obj in scene.objects:
        colors = [c for c in COLORS if c != obj.color] if mode in ("color", "both") else [obj.color]
        shapes = [s for s in SHAPES if s != obj.shape] if mode in ("shape", "both") else [obj.shape]
        options = [(c, s) for c in colors for s in shapes if (c, s) not in taken]
        if not options:  # e.g. three same-colour objects and only shapes may change: change both
            options = [
                (c, s) for c in COLORS for s in SHAPES if c != obj.color and s != obj.shape and (c, s) not in taken
            ]
        color, shape = options[int(rng.integers(len(options)))]
        taken.add((color, shape))
        objects.append(replace(obj, color=color, shape=shape))
    return replace(scene, objects=tuple(objects))


def scale_scene(scene: Scene, width: int, height: int) -> Scene:
    """The same scene with every box mapped to a ``width`` x ``height`` picture (for resized images)."""
    sx, sy = width / scene.width, height / scene.height

    def scale(box: Box) -> Box:
        x1, y1, x2, y2 = box
        return (round(x1 * sx), round(y1 * sy), min(width, round(x2 * sx)), min(height, round(y2 * sy)))

    objects = tuple(replace(o, box=scale(o.box)) for o in scene.objects)
    word_box = scale(scene.word_box) if scene.word_box else None
    return replace(scene, width=width, height=height, objects=objects, word_box=word_box)


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB picture of ``scene.width`` x ``scene.height`` pixels."""
    image = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        x1, y1, x2, y2 = obj.box
        x2, y2 = x2 - 1, y2 - 1
        fill = COLORS[obj.color]
        if obj.shape == "circle":
            draw.ellipse((x1, y1, x2, y2), fill=fill)
        elif obj.shape == "square":
            draw.rectangle((x1, y1, x2, y2), fill=fill)
        elif obj.shape == "triangle":
            draw.polygon([(x1, y2), (x2, y2), ((x1 + x2) / 2, y1)], fill=fill)
        elif obj.shape == "cross":
            arm = (x2 - x1) / 3
            draw.rectangle((x1 + arm, y1, x2 - arm, y2), fill=fill)
            draw.rectangle((x1, y1 + arm, x2, y2 - arm), fill=fill)
        else:
            raise ValueError(f"unknown shape {obj.shape!r}; expected one of {SHAPES}")
    if scene.word and scene.word_box:
        x1, y1, x2, y2 = scene.word_box
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=WORD_BOX_RGB, outline=WORD_EDGE_RGB)
        font = _font(_word_font_size(scene.width, scene.height))
        draw.text(((x1 + x2) / 2, (y1 + y2) / 2), scene.word, fill=TEXT_RGB, font=font, anchor="mm")
    return image


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _placements(scene: Scene) -> list[str]:
    ordered = scene.ordered()
    if len(ordered) == 1:
        return [_article(ordered[0].name)]
    ends = ("on the left", "on the right") if scene.arrangement == "row" else ("at the top", "at the bottom")
    where = [ends[0]] + ["in the middle"] * (len(ordered) - 2) + [ends[1]]
    return [f"{_article(o.name)} {w}" for o, w in zip(ordered, where, strict=True)]


def caption(scene: Scene, rng: np.random.Generator, *, mention_word: bool = True) -> str:
    """A correct caption naming every object (colour + shape, placement when 2+) and the drawn word."""
    parts = _placements(scene)
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    if len(parts) == 1:
        body = _pick(rng, (f"{listed} on a plain background", f"an image of {listed}", f"a picture with {listed}"))
    else:
        body = _pick(rng, (listed, f"an image of {listed}", f"{NUMBER_WORDS[len(parts)].lower()} shapes: {listed}"))
    text = body[0].upper() + body[1:]
    if scene.word and mention_word:
        if rng.random() < 0.5:
            return f'{text}, with the word "{scene.word}".'
        return f'{text}. The word "{scene.word}" is written in the image.'
    return text + "."


_OBJECT_RE = re.compile(rf"\b({'|'.join(COLORS)}) ({'|'.join(SHAPES)})\b")
_QUOTED_RE = re.compile(r'"([^"]*)"')


def mentioned_objects(text: str) -> set[tuple[str, str]]:
    """The (colour, shape) pairs a caption or answer names."""
    return set(_OBJECT_RE.findall(text.lower()))


def mentioned_words(text: str) -> set[str]:
    """The quoted words of a caption (how captions name a drawn word)."""
    return set(_QUOTED_RE.findall(text))


def noun_chunks(scene: Scene, text: str) -> list[list[float]]:
    """GRIT's region annotation of a caption: [start, end, x1, y1, x2, y2, score] per phrase of `text` that names
    something drawn (a "colour shape" naming the object in that reading-order place, the quoted word), the span in
    characters and the box relative to the image (0-1). Phrases naming nothing drawn there get no chunk."""
    chunks: list[list[float]] = []

    def add(start: int, end: int, box: Box) -> None:
        x1, y1, x2, y2 = box
        w, h = scene.width, scene.height
        chunks.append([start, end, round(x1 / w, 4), round(y1 / h, 4), round(x2 / w, 4), round(y2 / h, 4), 1.0])

    ordered = scene.ordered()
    for k, match in enumerate(_OBJECT_RE.finditer(text.lower())):
        if k < len(ordered) and ordered[k].name == match.group(0):
            add(match.start(), match.end(), ordered[k].box)
    if scene.word and scene.word_box:
        quoted = f'"{scene.word}"'
        at = text.find(quoted)
        if at >= 0:
            add(at + 1, at + 1 + len(scene.word), scene.word_box)
    return chunks


def format_box(box: Box) -> str:
    """A box as Qwen2.5-VL writes it: ``(x1,y1),(x2,y2)`` in absolute pixels."""
    x1, y1, x2, y2 = box
    return f"({x1},{y1}),({x2},{y2})"


def _unique(objects, attribute: str) -> list[Shape]:
    values = [getattr(o, attribute) for o in objects]
    return [o for o in objects if values.count(getattr(o, attribute)) == 1]


def ask(scene: Scene, kind: str, rng: np.random.Generator) -> tuple[str, str] | None:
    """One (question, exact answer) of type ``kind`` about the scene, or None when the scene has none."""
    ordered = scene.ordered()
    row = scene.arrangement == "row"
    if kind == "color":
        candidates = _unique(ordered, "shape")
        if not candidates:
            return None
        obj = _pick(rng, candidates)
        return _pick(rng, (f"What color is the {obj.shape}?", f"Which color does the {obj.shape} have?")), obj.color
    if kind == "shape":
        candidates = _unique(ordered, "color")
        if not candidates:
            return None
        obj = _pick(rng, candidates)
        return _pick(rng, (f"What shape is the {obj.color} object?", f"Which shape is {obj.color}?")), obj.shape
    if kind == "count":
        question = _pick(rng, ("How many shapes are there?", "How many objects are in the image?"))
        return question, str(len(ordered))
    if kind == "position":
        if len(ordered) < 2:
            return None
        index = _pick(rng, (0, len(ordered) - 1))
        obj = ordered[index]
        if row:
            return f"Is the {obj.name} on the left or on the right?", ("left" if index == 0 else "right")
        return f"Is the {obj.name} at the top or at the bottom?", ("top" if index == 0 else "bottom")
    if kind == "relation":
        if len(ordered) < 2:
            return None
        index = int(rng.integers(len(ordered) - 1))
        if rng.random() < 0.5:  # ask what precedes ordered[index + 1]
            anchor, answer = ordered[index + 1], ordered[index]
            phrase = "to the left of" if row else "above"
        else:
            anchor, answer = ordered[index], ordered[index + 1]
            phrase = "to the right of" if row else "below"
        return f"What is {phrase} the {anchor.name}?", answer.name
    if kind == "grounding":
        obj = _pick(rng, ordered)
        question = _pick(
            rng,
            (f"Give the bounding box of the {obj.name}.", f"Where is the {obj.name}? Answer with its box."),
        )
        return question, format_box(obj.box)
    if kind == "ocr":
        if not scene.word:
            return None
        return _pick(rng, ("What word is written in the image?", "What does the text say?")), scene.word
    if kind == "caption":
        question = _pick(rng, ("Describe the image.", "Write a short caption for the image."))
        return question, caption(scene, rng)
    raise ValueError(f"unknown question type {kind!r}; expected one of {QUESTION_TYPES}")


def scene_for(
    rng: np.random.Generator,
    kind: str,
    width: int,
    height: int,
    *,
    word_fraction: float = 0.3,
    max_objects: int = 3,
) -> Scene:
    """A fresh scene that answers a ``kind`` question (2+ objects for position/relation, a word for ocr)."""
    n = int(rng.integers(2, max_objects + 1)) if kind in ("position", "relation") and max_objects >= 2 else None
    has_word = kind == "ocr" or rng.random() < word_fraction
    return random_scene(
        rng, width, height, n_objects=n, max_objects=max_objects, word=_pick(rng, WORDS) if has_word else None
    )


def sample_clean_pairs(
    n: int, seed: int, size: tuple[int, int] = (112, 112), *, word_fraction: float = 0.3
) -> list[tuple[Image.Image, str]]:
    """``n`` clean (picture, correct caption) pairs, e.g. to train a tiny CLIP."""
    rng = np.random.default_rng([seed, 11])
    pairs = []
    for _ in range(n):
        scene = scene_for(rng, "caption", *size, word_fraction=word_fraction)
        pairs.append((render(scene), caption(scene, rng)))
    return pairs


def _coverage_texts() -> list[str]:
    """Texts that together use every word, digit and punctuation mark the world can produce."""
    rng = np.random.default_rng(0)
    texts = [
        " ".join(COLORS),
        " ".join(SHAPES),
        " ".join(WORDS),
        " ".join(f'"{w}"' for w in WORDS),
        "0 1 2 3 4 5 6 7 8 9 (10,20),(30,40)",
        "left right top bottom middle above below",
    ]
    texts += [*FLOWERY_OPENERS, *FLOWERY_CLOSERS, *(f"The answer is red, {s}." for s in HACKING_SUFFIXES)]
    for n in (1, 2, 3):
        for arrangement in ("row", "column"):
            for word in (None, "cat"):
                scene = random_scene(rng, 224, 224, n_objects=n, word=word, arrangement=arrangement)
                for _ in range(8):
                    texts.append(caption(scene, rng))
                    for kind in QUESTION_TYPES:
                        for _ in range(4):
                            qa = ask(scene, kind, rng)
                            if qa:
                                texts.append(f"{qa[0]} {qa[1]}")
    return list(dict.fromkeys(texts))


def text_corpus(n: int, seed: int) -> list[str]:
    """A fixed coverage block (every word the world can write) followed by ``n`` sampled texts.

    The sampled texts are captions, questions with their answers, and conversation turns, the mix a tokenizer
    for this world needs.
    """
    rng = np.random.default_rng([seed, 13])
    texts = _coverage_texts()
    for _ in range(n):
        kind = _pick(rng, QUESTION_TYPES)
        scene = scene_for(rng, kind, 224, 224)
        qa = ask(scene, kind, rng)
        if qa is None:
            texts.append(caption(scene, rng))
        elif rng.random() < 0.5:
            texts.append(f"{qa[0]}\n{qa[1]}")
        else:
            texts.append(f"user: {qa[0]} assistant: {qa[1]}")
    return texts
