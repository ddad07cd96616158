"""Training records that are held-out questions: the same image (path, bytes or Parquet cell) asked the same question
(as a reader sees it). Files that are the same file are refused elsewhere (file_checks.py); a record copied from the
held-out set into the training data is found here, said with examples and counted, since its held-out score then
measures recall of a trained answer. A warning, not a refusal: small curated sets (a few photographs asked their one
question, as the real-photo set does) may train on what they show on purpose."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from components._shared.data import formats as F

logger = logging.getLogger(__name__)


def _image_key(image: Any) -> Any:
    if isinstance(image, bytes):
        return hashlib.sha256(image).hexdigest()
    if isinstance(image, str):
        return os.path.normpath(image)
    return repr(image)  # a ParquetImage: its file, row, column and element


def _question_key(text: str) -> str:
    return F.visible_text(text.replace(F.IMAGE_MARKER, " "))


def _training_key(record: dict[str, Any]) -> tuple[Any, str] | None:
    """(image, first question) of a conversation record ("images", "turns") or a question record ("image",
    "question"); None for a text-only record."""
    images = record.get("images") or ([record["image"]] if record.get("image") is not None else [])
    if not images:
        return None
    if "question" in record:
        return _image_key(images[0]), _question_key(record["question"])
    first = next((t["text"] for t in record.get("turns", []) if t["role"] == "user"), None)
    return None if first is None else (_image_key(images[0]), _question_key(first))


def held_out_overlap(training: list[dict[str, Any]], held_out: list[dict[str, Any]], *, what: str) -> int:
    """How many `training` records ask a `held_out` record's question of its image; a warning names the first few."""
    asked = {(_image_key(r["image"]), _question_key(r["question"])): r for r in held_out if r.get("image") is not None}
    hits = [(record, asked[key]) for record in training if (key := _training_key(record)) is not None and key in asked]
    if hits:
        examples = "; ".join(f"{t.get('source', t.get('id'))} = {h.get('source', h.get('id'))}" for t, h in hits[:3])
        logger.warning(
            "%d %s record(s) ask a held-out question of the same image (e.g. %s): their held-out scores measure "
            "recall of a trained answer, not generalisation; drop them from the training data (counted as "
            "data/held_out_overlap).",
            len(hits),
            what,
            examples,
        )
    return len(hits)
