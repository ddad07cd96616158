"""Sample images of clean_data's rejected records, as small inline thumbnails (for pipelines/qvl/run_report.py).

rejected/*.parquet holds key, shard, reason and detail per record, not the image (a record is rejected before its
bytes are worth keeping), so the image comes from an image column where a part has one, else from the lake itself:
the record's shard read with clean_data's own reader, never extracted, stopping once the wanted keys are found.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from components._shared.data.lake import PARQUET_IMAGE_COLUMNS, read_shard

PER_REASON, THUMB_PX, MAX_IMAGE_BYTES, MAX_THUMB_SOURCE_PIXELS = 3, 96, 20 << 20, 40_000_000
Sample = tuple[str, str, Any]  # (key, detail, image bytes or None)


def rejected_samples(
    clean_dir: Path, lake_uri: str, per_reason: int = PER_REASON
) -> tuple[dict[str, list[Sample]], str]:
    """reason -> up to `per_reason` samples from clean_dir/rejected/*.parquet, and a note on what could not be read
    ("" when everything was)."""
    import pyarrow.parquet as pq

    samples: dict[str, list[Sample]] = {}
    wanted: dict[str, set[str]] = {}
    for part in sorted((clean_dir / "rejected").glob("part-*.parquet")):
        try:
            rows = pq.read_table(part).to_pylist()
        except Exception as error:  # noqa: BLE001 - an unreadable part is reported; the page still renders
            return samples, f"{part.name}: unreadable ({type(error).__name__})"
        for row in rows:
            reason, key = str(row.get("reason")), str(row.get("key"))
            picked = samples.setdefault(reason, [])
            if len(picked) < per_reason:
                image = next((row[c] for c in PARQUET_IMAGE_COLUMNS if row.get(c) is not None), None)
                image = image.get("bytes") if isinstance(image, dict) else image  # Hugging Face's image struct
                picked.append((key, str(row.get("detail") or reason), image))
                if image is None:
                    wanted.setdefault(str(row.get("shard")), set()).add(key)
    if not wanted:
        return samples, ""
    if not lake_uri or "://" in lake_uri or not Path(lake_uri).exists():
        return samples, f"sample images are read from a local lake; {lake_uri or 'no lake'} is not one."
    found = _lake_images(Path(lake_uri), wanted)
    return {r: [(k, d, img if img is not None else found.get(k)) for k, d, img in p] for r, p in samples.items()}, ""


def _lake_images(lake: Path, wanted: dict[str, set[str]]) -> dict[str, bytes | None]:
    """key -> image bytes of the wanted records (shard name -> keys), from the lake's tar or Parquet shards."""
    found: dict[str, bytes | None] = {}
    for shard, keys in wanted.items():
        path = lake if lake.is_file() else lake / shard
        if not path.is_file() and lake.is_dir():
            path = next(iter(sorted(lake.rglob(shard))), path)
        if not path.is_file():
            continue
        if path.name.endswith((".tar", ".tar.gz", ".tgz")):
            found.update(_tar_images(path, keys))
            continue
        for record in read_shard(str(path), max_member_bytes=MAX_IMAGE_BYTES, errors=[]):
            if record.key in keys:
                found[record.key] = record.image
                if keys <= found.keys():
                    break
    return found


def _tar_images(path: Path, keys: set[str]) -> dict[str, bytes | None]:
    """key -> the bytes of its image member (KEY.jpg / .png / ...), read straight from the tar: the clean_data reader
    drops the bytes of a record it rejects at the shard's end (a missing caption, a split key)."""
    import tarfile

    from components._shared.data.lake import IMAGE_EXTENSIONS, _split_member, unsafe_reason

    found: dict[str, bytes | None] = {}
    with tarfile.open(path, mode="r|*") as tar:
        for member in tar:
            key, ext = _split_member(member.name)
            if key not in keys or key in found or ext not in IMAGE_EXTENSIONS or unsafe_reason(member):
                continue
            handle = tar.extractfile(member) if member.size <= MAX_IMAGE_BYTES else None
            found[key] = handle.read() if handle is not None else None
            if keys <= found.keys():
                break
    return found


def thumbnail(data: Any, size: int = THUMB_PX) -> str | None:
    """A PNG data URI of the image scaled to fit `size` px, or None when there are no bytes or they do not decode."""
    if not isinstance(data, bytes) or not data:
        return None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_THUMB_SOURCE_PIXELS:  # a decompression bomb is what gets rejected
                return None
            image.thumbnail((size, size))
            buffer = io.BytesIO()
            image.convert("RGBA" if "A" in image.getbands() else "RGB").save(buffer, "PNG")
    except Exception:  # noqa: BLE001 - undecodable, truncated or hostile images are what clean_data rejects
        return None
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
