"""The synthetic lake: img2dataset-style WebDataset shards with labelled, injected defects.

    from components.synth_world.lake import write_world
    write_world("out/world", records=2000, seed=0)   # what `qvl lake synth --out out/world` runs

writes ``DIR/lake/NNNNN.tar`` (members ``KEY.jpg|png``, ``KEY.txt``, ``KEY.json``), ``DIR/ground_truth.jsonl``
(the defect label of every record), ``DIR/heldout/`` (see splits.py) and ``DIR/world.json``. The same seed
gives the same bytes. Originals of duplicates are clean records with smaller keys.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from PIL import Image
from pydantic import Field, field_validator

from components._shared.platform.config import StageConfig
from components.synth_world.splits import write_splits
from components.synth_world.world import (
    WORDS,
    Scene,
    altered_scene,
    caption,
    noun_chunks,
    random_scene,
    render,
    scale_scene,
)

DEFECTS = (
    "corrupt",
    "truncated",
    "zero_byte",
    "exact_duplicate",
    "near_duplicate",
    "mismatched_caption",
    "unmentioned_text",
    "tiny",
    "extreme_aspect",
    "empty_caption",
    "garbage_caption",
)
DUPLICATES = ("exact_duplicate", "near_duplicate")
TINY_MAX_SIDE = 23  # tiny records have both sides <= this
EXTREME_MIN_RATIO = 6.0  # extreme_aspect records have long/short >= this
NORMAL_SIDES = (112, 336)  # clean records: both sides in this range, aspect <= 2:1
EMPTY_CAPTIONS = ("", " ", "\n", "  \t ")


class WorldConfig(StageConfig):
    """Settings of one synthetic world (lake + held-out splits)."""

    records: Annotated[int, Field(ge=1, description="Lake records (clean + defective).")] = 2000
    records_per_shard: Annotated[int, Field(ge=1, description="Records per NNNNN.tar shard.")] = 250
    defect_rate: Annotated[float, Field(ge=0.0, le=0.5, description="Share of lake records given a defect.")] = 0.22
    word_fraction: Annotated[float, Field(ge=0.0, le=1.0, description="Share of images with a drawn word.")] = 0.3
    max_objects: Annotated[int, Field(ge=1, le=3, description="Most shapes in one scene.")] = 3
    eval_per_type: Annotated[int, Field(ge=0, description="Held-out eval questions per question type.")] = 100
    sft_records: Annotated[int, Field(ge=0, description="Held-out instruction conversations.")] = 2000
    preference_pairs: Annotated[int, Field(ge=0, description="Held-out preference pairs.")] = 500
    image_size: tuple[int, int] = (112, 112)

    @field_validator("image_size")
    @classmethod
    def _image_size_fits(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not all(56 <= side <= 1024 for side in value):
            raise ValueError(f"image_size={value}: both sides must lie in 56..1024 (e.g. [112, 112] or [224, 224])")
        return value


@dataclass(frozen=True)
class _Record:
    defect: str | None
    scene: Scene
    caption: str
    data: bytes
    ext: str  # "jpg" or "png"
    quality: int | None  # JPEG quality, None for PNG
    duplicate_of: str | None = None


def _encode(image: Image.Image, ext: str, quality: int | None) -> bytes:
    buffer = io.BytesIO()
    if ext == "jpg":
        image.save(buffer, format="JPEG", quality=quality)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


def _normal_size(rng: np.random.Generator) -> tuple[int, int]:
    low, high = NORMAL_SIDES
    width = int(rng.integers(low, high + 1))
    height = int(rng.integers(max(low, math.ceil(width / 2)), min(high, 2 * width) + 1))
    return width, height


def lake_like_pairs(
    n: int, seed: int, *, altered: int = 1, word_fraction: float = 0.3, max_objects: int = 3
) -> list[tuple]:
    """``n`` (picture, caption, mismatched caption x ``altered``) tuples drawn like the lake's records: the same
    sizes and aspect ratios, 70% JPEG at the same qualities (encoded and decoded again), the rest PNG; each
    mismatched caption is made as the lake's `mismatched_caption` defect is (every object's colour and/or shape
    changed, a fresh draw each). The builtin CLIP trains on these (the mismatches as hard negatives) and
    calibrates its threshold on them, so the threshold holds on lake images and lake mismatches."""
    rng = np.random.default_rng([seed, 23])
    pairs = []
    for _ in range(n):
        word = WORDS[int(rng.integers(len(WORDS)))] if rng.random() < word_fraction else None
        scene = random_scene(rng, *_normal_size(rng), max_objects=max_objects, word=word)
        image = render(scene)
        if rng.random() < 0.7:
            image = Image.open(io.BytesIO(_encode(image, "jpg", int(rng.integers(80, 96))))).convert("RGB")
        mismatched = [caption(altered_scene(scene, rng), rng) for _ in range(altered)]
        pairs.append((image, caption(scene, rng), *mismatched))
    return pairs


def _garbage_caption(rng: np.random.Generator) -> str:
    n = int(rng.integers(0, 100000))
    kind = int(rng.integers(7))
    if kind == 0:
        return f"IMG_{n % 10000:04d}.JPG"
    if kind == 1:
        return f"DSC{n:05d}" + ("" if rng.random() < 0.5 else ".jpg")
    if kind == 2:
        return rng.bytes(int(rng.integers(8, 21))).hex()
    if kind == 3:
        return str("ax!.?*"[int(rng.integers(6))]) * int(rng.integers(6, 30))
    if kind == 4:
        symbols = "#$%&*@^~+=<>|/\\{}[]"
        return "".join(symbols[int(i)] for i in rng.integers(0, len(symbols), size=int(rng.integers(6, 24))))
    if kind == 5:
        return f"https://cdn{n % 9}.example.com/{rng.bytes(4).hex()}/{n}.jpg"
    return f"Screenshot 2021-0{n % 9 + 1}-1{n % 10} at {n % 12 + 1}.{n % 60:02d}.{n % 57:02d}.png"


def _fresh_record(defect: str | None, rng: np.random.Generator, word_fraction: float, max_objects: int) -> _Record:
    """A record of class ``defect`` (None: clean) built from a new scene."""
    word = (
        WORDS[int(rng.integers(len(WORDS)))] if (defect == "unmentioned_text" or rng.random() < word_fraction) else None
    )
    if defect == "extreme_aspect":
        short = int(rng.integers(56, 113))
        long = math.ceil(short * rng.uniform(EXTREME_MIN_RATIO, 9.0))
        size = (long, short) if rng.random() < 0.5 else (short, long)
        scene = random_scene(rng, *size, max_objects=max_objects)
    else:
        scene = random_scene(rng, *_normal_size(rng), max_objects=max_objects, word=word)
    ext = "jpg" if rng.random() < 0.7 else "png"
    quality = int(rng.integers(80, 96)) if ext == "jpg" else None
    image = render(scene)
    if defect == "tiny":
        width = int(rng.integers(8, TINY_MAX_SIDE + 1))
        height = min(TINY_MAX_SIDE, max(8, round(width * scene.height / scene.width)))
        scene = scale_scene(scene, width, height)
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    data = _encode(image, ext, quality)
    text = caption(scene, rng)
    if defect == "corrupt":
        data = rng.bytes(len(data)) if rng.random() < 0.5 else rng.bytes(16) + data[16:]
    elif defect == "truncated":
        data = data[: int(len(data) * rng.uniform(0.3, 0.7))]
    elif defect == "zero_byte":
        data = b""
    elif defect == "mismatched_caption":
        text = caption(altered_scene(scene, rng), rng)
    elif defect == "unmentioned_text":
        text = caption(scene, rng, mention_word=False)
    elif defect == "empty_caption":
        text = EMPTY_CAPTIONS[int(rng.integers(len(EMPTY_CAPTIONS)))]
    elif defect == "garbage_caption":
        text = _garbage_caption(rng)
    return _Record(defect, scene, text, data, ext, quality)


def _duplicate_record(defect: str, original: _Record, original_key: str, rng: np.random.Generator) -> _Record:
    """An exact (same bytes) or near (re-encoded and/or resized) copy of a clean earlier record."""
    if defect == "exact_duplicate":
        return _Record(
            defect,
            original.scene,
            caption(original.scene, rng),
            original.data,
            original.ext,
            original.quality,
            original_key,
        )
    image = Image.open(io.BytesIO(original.data)).convert("RGB")
    scene = original.scene
    if rng.random() < 0.6:
        factor = rng.uniform(1.03, 1.08) if rng.random() < 0.5 else rng.uniform(0.92, 0.97)
        size = (max(1, round(scene.width * factor)), max(1, round(scene.height * factor)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        scene = scale_scene(scene, *size)
    quality = int(rng.integers(55, 96))
    while original.quality is not None and abs(quality - original.quality) < 10:
        quality = int(rng.integers(55, 96))
    return _Record(defect, scene, caption(scene, rng), _encode(image, "jpg", quality), "jpg", quality, original_key)


def _plan(records: int, defect_rate: float, rng: np.random.Generator) -> list[str | None]:
    """The defect label of every record position, spread evenly over classes, position 0 always clean."""
    total = round(defect_rate * records)
    counts = dict.fromkeys(DEFECTS, total // len(DEFECTS))
    for index in rng.choice(len(DEFECTS), size=total % len(DEFECTS), replace=False):
        counts[DEFECTS[int(index)]] += 1
    labels = [d for d in DEFECTS for _ in range(counts[d])] + [None] * (records - total)
    labels = [labels[int(i)] for i in rng.permutation(records)]
    if labels[0] is not None:  # duplicates need a clean record before them
        first_clean = labels.index(None)
        labels[0], labels[first_clean] = None, labels[0]
    return labels


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_lake(
    out_dir: str | Path,
    *,
    records: int,
    seed: int,
    records_per_shard: int = 250,
    defect_rate: float = 0.22,
    word_fraction: float = 0.3,
    max_objects: int = 3,
    ground_truth_path: str | Path | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/NNNNN.tar`` shards and the ground truth (default ``out_dir/../ground_truth.jsonl``).

    Returns counts: records, shards, clean, defects (per class), cross_shard_duplicates.
    """
    cfg = WorldConfig(
        records=records,
        seed=seed,
        records_per_shard=records_per_shard,
        defect_rate=defect_rate,
        word_fraction=word_fraction,
        max_objects=max_objects,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.tar")):
        raise ValueError(f"{out} already holds .tar shards; write the lake into an empty directory")
    truth_path = Path(ground_truth_path) if ground_truth_path else out.parent / "ground_truth.jsonl"
    rng = np.random.default_rng([cfg.seed, 1])
    labels = _plan(cfg.records, cfg.defect_rate, rng)
    kept: dict[str, _Record] = {}  # clean records, candidates for duplication
    unused: list[str] = []  # clean keys not yet duplicated
    defects = dict.fromkeys(DEFECTS, 0)
    cross_shard = 0
    tar: tarfile.TarFile | None = None
    with open(truth_path, "w", encoding="utf-8") as truth:
        for index, defect in enumerate(labels):
            key, shard = f"{index:09d}", f"{index // cfg.records_per_shard:05d}.tar"
            if index % cfg.records_per_shard == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(out / shard, "w", format=tarfile.USTAR_FORMAT)
            if defect in DUPLICATES:
                pool = unused or list(kept)
                original_key = pool[int(rng.integers(len(pool)))]
                if original_key in unused:
                    unused.remove(original_key)
                record = _duplicate_record(defect, kept[original_key], original_key, rng)
                cross_shard += int(original_key) // cfg.records_per_shard != index // cfg.records_per_shard
            else:
                record = _fresh_record(defect, rng, cfg.word_fraction, cfg.max_objects)
                if defect is None:
                    kept[key] = record
                    unused.append(key)
            meta = {
                "key": key,
                "url": f"https://shapes.example.com/{key}.{record.ext}",
                "status": "success",
                "width": record.scene.width,
                "height": record.scene.height,
                "sha256": hashlib.sha256(record.data).hexdigest(),
                "noun_chunks": noun_chunks(record.scene, record.caption),  # GRIT's boxes of the caption's phrases
            }
            assert tar is not None  # opened at index 0 (records_per_shard >= 1)
            _add_member(tar, f"{key}.{record.ext}", record.data)
            _add_member(tar, f"{key}.txt", record.caption.encode("utf-8"))
            _add_member(tar, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"))
            row = {
                "key": key,
                "shard": shard,
                "defect": defect,
                "duplicate_of": record.duplicate_of,
                "image_format": record.ext,
                "scene": record.scene.to_dict(),
            }
            truth.write(json.dumps(row, sort_keys=True) + "\n")
            if defect:
                defects[defect] += 1
    if tar is not None:
        tar.close()
    shards = math.ceil(cfg.records / cfg.records_per_shard)
    return {
        "records": cfg.records,
        "shards": shards,
        "clean": cfg.records - sum(defects.values()),
        "defects": defects,
        "cross_shard_duplicates": cross_shard,
    }


def write_world(out_dir: str | Path, *, records: int = 2000, seed: int = 0, **sizes: Any) -> dict[str, Any]:
    """Write a world under ``out_dir``: lake/, ground_truth.jsonl, heldout/, world.json; return its counts.

    ``sizes`` are the other WorldConfig fields (records_per_shard, defect_rate, eval_per_type, sft_records,
    preference_pairs, image_size, word_fraction, max_objects).
    """
    cfg = WorldConfig(records=records, seed=seed, **sizes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lake = write_lake(
        out / "lake",
        records=cfg.records,
        seed=cfg.seed,
        records_per_shard=cfg.records_per_shard,
        defect_rate=cfg.defect_rate,
        word_fraction=cfg.word_fraction,
        max_objects=cfg.max_objects,
        ground_truth_path=out / "ground_truth.jsonl",
    )
    splits = write_splits(
        out / "heldout",
        seed=cfg.seed,
        eval_per_type=cfg.eval_per_type,
        sft_records=cfg.sft_records,
        preference_pairs=cfg.preference_pairs,
        image_size=cfg.image_size,
        word_fraction=cfg.word_fraction,
        max_objects=cfg.max_objects,
    )
    counts = {"lake": lake, "splits": splits}
    world = {
        "generator": "components.synth_world",
        "format_version": 1,
        "seed": cfg.seed,
        "settings": cfg.model_dump(mode="json"),
        **counts,
    }
    (out / "world.json").write_text(json.dumps(world, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return counts
