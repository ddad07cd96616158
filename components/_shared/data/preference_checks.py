"""What a preference pair says beyond prompt, chosen and rejected, checked instead of dropped (thirteenth pass):
UltraFeedback-binarized's per-answer scores that mark a tie or the wrong order, TRL RewardTrainer's per-pair margin
(this reward model's loss is plain Bradley-Terry), and a pair given twice (under another id, or with its answers
swapped) that would train twice or land on both sides of the held-out split."""

from __future__ import annotations

import hashlib
import math

from components._shared.data.formats import RecordError, visible_text


def check_pair_fields(raw: dict) -> None:
    """Refuse a pair whose own scores say it prefers neither answer or the other one, or that asks for a margin."""
    if "margin" in raw and raw["margin"] not in (None, 0, 0.0):
        raise RecordError(
            f"'margin' {raw['margin']!r} (TRL RewardTrainer's per-pair margin) is not read: this reward model trains "
            "plain Bradley-Terry pairs; drop the field (or 0) to train the pair without it"
        )
    chosen, rejected = raw.get("score_chosen"), raw.get("score_rejected")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in (chosen, rejected)):
        return
    assert isinstance(chosen, int | float) and isinstance(rejected, int | float)
    if chosen == rejected:
        raise RecordError(
            f"a tie: score_chosen == score_rejected ({chosen}): the pair prefers neither answer; drop it "
            "(UltraFeedback-binarized's own builder leaves ties out)"
        )
    if chosen < rejected:
        raise RecordError(
            f"score_chosen {chosen} < score_rejected {rejected}: the pair is the wrong way round; swap chosen and "
            "rejected, or drop it"
        )


def _image_key(image) -> str:
    if isinstance(image, bytes):
        return hashlib.sha256(image).hexdigest()
    return str(image)


def repeated_pairs(records: list[dict]) -> list[tuple[dict, dict, str]]:
    """(first, repeat, how) for each pair given again: the same image, prompt and answers as an earlier pair (what a
    reader sees of the text), or the same with chosen and rejected swapped."""
    seen: dict[tuple[str, ...], dict] = {}
    repeats = []
    for record in records:
        key = (_image_key(record["image"]), *(visible_text(record[k]) for k in ("prompt", "chosen", "rejected")))
        swapped = (key[0], key[1], key[3], key[2])
        if key in seen:
            repeats.append((seen[key], record, "the same pair"))
        elif swapped in seen:
            repeats.append((seen[swapped], record, "the same pair with chosen and rejected swapped"))
        else:
            seen[key] = record
    return repeats
