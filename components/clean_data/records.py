"""What the clean_data steps share: the rejection reasons, the Parquet schemas, a record that passed the cheap
checks, the per-filter timer, the model-size image, and exact + near dedup (within a shard, and again across
shards at the merge)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from components._shared.platform.image_decode import decode_image
from components.clean_data import filters
from components.clean_data.config import CleanDataConfig

REASONS = (
    "unsafe_member",
    "file_too_large",
    "missing_image",
    "missing_caption",
    "duplicate_key",
    "duplicate_member",
    "bad_metadata",
    "shard_error",
    "empty_file",
    "caption_not_utf8",
    "empty_caption",
    "caption_too_long",
    "garbage_caption",
    "decompression_bomb",
    "unsupported_format",
    "undecodable",
    "animated_image",
    "truncated_image",
    "too_small",
    "too_large",
    "extreme_aspect",
    "exact_duplicate",
    "near_duplicate",
    "low_clip_score",
    "nsfw",
    "ocr_caption_mismatch",
    "embedding_outlier",
    "self_judge",
)


MODEL_SIDE = 1024  # images are shrunk to this longer side before the model levels (all resize further)


REJECTED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("image_hash", pa.string()),
    ]
)


KEPT_FIELDS = [
    ("image_hash", pa.string()),
    ("key", pa.string()),
    ("shard", pa.string()),
    ("image", pa.binary()),
    ("image_format", pa.string()),
    ("caption", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("visual_tokens", pa.int32()),
    ("clip_score", pa.float32()),
    ("nsfw_score", pa.float32()),
    ("ocr_text", pa.string()),
    ("phash", pa.string()),
    ("metadata", pa.string()),
]


SHARD_KEPT_SCHEMA = pa.schema(KEPT_FIELDS + [("thumb", pa.binary()), ("clip_embedding", pa.list_(pa.float32()))])


FINAL_KEPT_SCHEMA = pa.schema(KEPT_FIELDS + [("outlier_score", pa.float32()), ("judge_loss", pa.float32())])


@dataclass
class Candidate:
    """A record that passed the cheap checks (the decoded pixels are not kept: memory stays ~ shard bytes)."""

    key: str
    shard: str
    image: bytes
    image_hash: str
    image_format: str
    caption: str
    width: int
    height: int
    visual_tokens: int
    phash: int
    thumb: bytes
    metadata: str
    clip_score: float | None = None
    nsfw_score: float | None = None
    ocr_text: str | None = None
    embedding: list[float] | None = None


class Timer:
    """Seconds and records per filter, for records/second in the report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.records: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str, records: int = 1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.records[name] += records

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: {"seconds": round(self.seconds[name], 4), "records": self.records[name]} for name in self.seconds}


def rejection(key: str, shard: str, reason: str, detail: str, image_hash: str | None) -> dict[str, Any]:
    assert reason in REASONS, reason
    return {"key": key, "shard": shard, "reason": reason, "detail": detail, "image_hash": image_hash}


def reason_counts(reasons) -> dict[str, int]:
    counts = Counter(reasons)
    return {reason: counts.get(reason, 0) for reason in REASONS}


def dedup(items: list, cfg: CleanDataConfig, timer: Timer, rejected: list[dict[str, Any]]) -> list:
    """Exact (sha256) then near (pHash) duplicates; items are visited by (key, shard), so the smallest key wins.

    `items` need .key .shard .image_hash .phash (int) .thumb; the rejected ones are appended to `rejected`.
    """
    max_diff = cfg.near_dedup_max_thumb_diff
    seen: dict[str, Any] = {}
    index = filters.PhashIndex(cfg.near_dedup_max_distance)
    kept = []
    with timer("dedup", len(items)):
        for item in sorted(items, key=lambda c: (c.key, c.shard)):
            first = seen.get(item.image_hash)
            if first is not None:
                rejected.append(
                    rejection(
                        item.key,
                        item.shard,
                        "exact_duplicate",
                        f"same sha256 as {first.key} ({first.shard})",
                        item.image_hash,
                    )
                )
                continue
            if cfg.near_dedup_enabled:
                match = index.find(
                    item.phash,
                    None
                    if max_diff is None
                    else lambda other, item=item: filters.thumb_difference(item.thumb, other.thumb) <= max_diff,
                )
                if match is not None:
                    original, distance = match
                    rejected.append(
                        rejection(
                            item.key,
                            item.shard,
                            "near_duplicate",
                            f"pHash distance {distance} to {original.key} ({original.shard})",
                            item.image_hash,
                        )
                    )
                    continue
                index.add(item.phash, item)
            seen[item.image_hash] = item
            kept.append(item)
    return kept


def model_image(data: bytes, cfg: CleanDataConfig):
    image = decode_image(data, max_image_pixels=cfg.max_image_pixels, allowed_formats=tuple(cfg.allowed_formats)).image
    if max(image.size) > MODEL_SIDE:
        image.thumbnail((MODEL_SIDE, MODEL_SIDE))
    return image


def sample_values(values: list[float], n: int, seed: int) -> list[float]:
    if len(values) <= n:
        return [round(v, 5) for v in values]
    picks = np.random.default_rng(seed).choice(len(values), size=n, replace=False)
    return [round(values[i], 5) for i in sorted(picks)]
