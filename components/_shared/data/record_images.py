"""A record's images, checked when the record is read: each one it names (image_checks.py: exists, readable,
still, whole, a usable aspect ratio; its size kept in the record's `image_sizes`), a box inside its image, and no
image under another field (a misspelled key would train text only)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from components._shared.data import formats as F
from components._shared.data.image_checks import inspect_image

logger = logging.getLogger(__name__)
SMALL_IMAGE_SHARE = 1 / 16  # an image under this share of min_pixels is upscaled more than 4x a side


def check_record_images(data_dir: Path, raw: dict, record: dict, data_file_folder: str = "") -> None:
    """Before any training: every image a record names exists and its header decodes (s3:// objects are read when
    used), and no field outside image / images holds an image (a misspelled key would train text only). The
    images' sizes go in `image_sizes`. `data_file_folder`: the data file's folder, when its entry names no
    `images:` folder (a missing image found there is said)."""
    refs = record.get("images") or ([record["image"]] if "image" in record else [])
    check_stray_images(raw, paths=not refs)  # a path beside the record's images may be metadata (file_name)
    sizes = []
    for ref in refs:
        problem, size = inspect_image(data_dir, ref)
        if problem:
            raise F.RecordError(problem + _beside_the_data_file(data_dir, ref, data_file_folder))
        sizes.append(size)
    record["image_sizes"] = sizes  # (width, height) from the headers, None for s3://: model/length_check.py
    if record.get("box") is not None and sizes and sizes[0] is not None:
        _check_box(record["box"], sizes[0])


def _beside_the_data_file(data_dir: Path, ref: Any, folder: str) -> str:
    """Where an image path missing from the data directory is there relative to the data file's own folder."""
    if folder in ("", ".") or not isinstance(ref, str) or ref.startswith(("s3://", "/")):
        return ""
    if (data_dir / ref).exists():  # there, but unusable for another reason
        return ""
    if (data_dir / folder / ref).is_file():
        return f" It is under {folder}/, beside the data file: add `images: {folder}` to the file's dataset.yaml entry."
    return ""


def _check_box(box: list[float], size: tuple[int, int]) -> None:
    """A box lies inside its image (pixels; half a pixel of rounding allowed): one outside it or partly off it
    would teach or score a place the image does not have."""
    width, height = size
    if min(box) < -0.5 or box[2] > width + 0.5 or box[3] > height + 0.5:
        raise F.RecordError(
            f"box {[round(v, 1) for v in box]} is not inside its {width}x{height} image; boxes are [x1, y1, x2, y2] "
            "in the image's pixels (0 <= x <= width, 0 <= y <= height): fix the box or the image"
        )


def check_stray_images(raw: dict, *, paths: bool) -> None:
    """No field but image / images holds an image (with `paths`, an image file path counts)."""
    for key, value in raw.items():
        what = None if key in ("image", "images") else _image_like(value, paths=paths)
        if what:
            raise F.RecordError(
                f"field {key!r} holds {what}, which is read only from 'image' (one) or 'images' (a list, one per "
                f"<image> marker): rename the field, or drop it"
            )


def _image_like(value: Any, *, paths: bool) -> str | None:
    """What image `value` holds, if it looks like one: a Parquet image column's cell, a data: URI, an HF {"bytes"}
    struct, a list of them, or (with `paths`) an image file path or a list of them; else None."""
    if isinstance(value, F.ParquetImage):
        return "a Parquet image column (binary or {bytes, path} structs)"
    if isinstance(value, str) and F._DATA_URI.match(value):
        return "a data: URI image"
    if isinstance(value, dict) and "bytes" in value:
        return "an image struct {bytes, path}"
    if paths and isinstance(value, str) and value.lower().endswith(F.IMAGE_SUFFIXES):
        return f"an image path ({value[:80]!r})"
    if paths and isinstance(value, dict) and isinstance(value.get("path"), str):
        return _image_like(value["path"], paths=True) and f"an image struct {{path: {value['path'][:80]!r}}}"
    if isinstance(value, list):
        found = next((w for w in (_image_like(v, paths=paths) for v in value) if w), None)
        return found and f"a list of images ({found})"
    return None


def say_small_images(records: list[dict], min_pixels: int, what: str) -> int:
    """Warn (once, with a count and an example) about images far under `min_pixels`: the image processor upscales
    them to it, more than 4x a side, so the model trains on a blur of a few pixels (a thumbnail or an icon saved in
    place of the picture?). Returns how many there are; sizes come from the records' `image_sizes`."""
    limit = min_pixels * SMALL_IMAGE_SHARE
    small = [
        (r, size)
        for r in records
        for size in r.get("image_sizes") or []
        if size is not None and size[0] * size[1] < limit
    ]
    if small:
        record, (width, height) = small[0]
        logger.warning(
            "%s: %d image(s) have fewer than 1/16 of min_pixels=%d pixels (e.g. %s (id=%r): %dx%d) and are "
            "upscaled more than 4x a side; check that they are the pictures you mean, or lower min_pixels",
            what,
            len(small),
            min_pixels,
            record.get("source", "?"),
            record.get("id"),
            width,
            height,
        )
    return len(small)
