"""GRIT-style region annotations of a cleaned lake record: the `noun_chunks` of its JSON, checked.

Each chunk is `[start, end, x1, y1, x2, y2, score]`: a character span of the caption and its box relative to the
image (0-1), with the detector's score. clean_data keeps the JSON in its `metadata` column. Read by pretrain's
region term and by sft's data builder; every chunk not used is given a reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from components._shared.data.metrics import box_iou
from components._shared.platform.names import draws_nothing

MALFORMED = "malformed (not [start, end, x1, y1, x2, y2, score] numbers)"
SPAN = "span outside the caption"
BOX = "box not inside the image (relative 0-1, x1 < x2, y1 < y2)"
SCORE = "score under region.min_score"
EMPTY = "the span is blank"
DUPLICATE = "the same phrase as another chunk of the record over nearly its box (IoU > 0.9)"
TOO_MANY = "past the record's first 256 chunks (a detector's output runs to tens)"
MAX_CHUNKS, SAME_BOX_IOU = 256, 0.9


@dataclass(frozen=True)
class Region:
    phrase: str
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 relative to the image (0-1)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _chunks(record: dict) -> Any:
    """The record's `noun_chunks` (None when it has none or its metadata is not a JSON object)."""
    try:
        meta = json.loads(record.get("metadata") or "{}")
    except ValueError:
        return None
    return meta.get("noun_chunks") if isinstance(meta, dict) else None


def record_regions(record: dict, min_score: float) -> tuple[list[Region], list[str]]:
    """The usable regions of one kept record, and the reason each of its other chunks is not used."""
    chunks, caption = _chunks(record), record["caption"]
    if chunks is None:
        return [], []
    if not isinstance(chunks, list):
        return [], [MALFORMED]
    regions: list[Region] = []
    dropped: list[str] = [TOO_MANY] * max(0, len(chunks) - MAX_CHUNKS)
    for chunk in chunks[:MAX_CHUNKS]:
        if not isinstance(chunk, list) or len(chunk) not in (6, 7) or not all(_number(v) for v in chunk):
            dropped.append(MALFORMED)
            continue
        if len(chunk) == 7 and not 0 <= chunk[6] <= 1:  # GRIT's score is a probability
            dropped.append(MALFORMED)
            continue
        start, end, x1, y1, x2, y2 = chunk[:6]
        if start != int(start) or end != int(end) or not 0 <= start < end <= len(caption):
            dropped.append(SPAN)
            continue
        phrase = caption[int(start) : int(end)].strip()
        if not (0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1):
            dropped.append(BOX)
        elif (chunk[6] if len(chunk) == 7 else 1.0) < min_score:
            dropped.append(SCORE)
        elif not "".join(c for c in phrase if not draws_nothing(c)).strip():  # zero-width spaces name nothing
            dropped.append(EMPTY)
        elif any(r.phrase == phrase and box_iou(r.box, (x1, y1, x2, y2)) > SAME_BOX_IOU for r in regions):
            dropped.append(DUPLICATE)  # one object boxed twice (jittered) is one object: counts stay true
        else:
            regions.append(Region(phrase, (x1, y1, x2, y2)))
    return regions, dropped
