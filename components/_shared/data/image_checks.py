"""What makes a record's image unusable, found before any training from its header and its last bytes.

Training decodes images when a step needs them; an image that fails there stops the run at that step (or, under
`on_bad_record: skip`, could not be skipped any more). So every image is checked when its record is read:
- it exists inside the data directory and is an allowed format (JPEG, PNG, WebP) whose header Pillow reads;
- it is a still image (an animated WebP or PNG would be trained on its first frame alone);
- its pixel count is under the decompression-bomb limit the decoder enforces;
- its aspect ratio is at most 200:1, the most Qwen's image processor (`smart_resize`) accepts;
- it is whole: a JPEG ends with its end-of-image marker after its last scan, a PNG holds its IEND chunk, a WebP
  file is as long as its RIFF header says. A download or copy cut short fails these; the check reads the file's
  last 64 KiB, never decodes it (decoding every image up front would cost the training set's decode time again).
  Damage inside a complete file is found only by decoding; that error names the record's file and line too.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

from PIL import Image, ImageChops, UnidentifiedImageError

from components._shared.data import formats as F
from components._shared.platform.names import twin_of

MAX_IMAGE_PIXELS = 89_478_485  # Pillow's default bomb limit, enforced by imaging.decode_image
MAX_ASPECT_RATIO = 200  # transformers' Qwen smart_resize raises above this (every Qwen-VL family)
TAIL_BYTES = 64 << 10
EXIF_ORIENTATION = 0x0112  # values 5-8 turn the image a quarter: width and height swap


MAX_WHITE_DISTANCE = 8  # of 255: composited on white, no pixel further from white than this is seen (ninth pass)


def local_image_path(root: Path, reference: str) -> Path:
    """The file an image path names, inside the data directory; a ValueError when it leaves it or is missing."""
    if "\x00" in reference:
        raise ValueError(f"image path {reference!r} holds a NUL character (\\u0000); fix the path")
    path = (root / reference).resolve()
    if path == root.resolve():
        raise ValueError(f"image path {reference!r} names the data directory itself, not an image file")
    if root.resolve() not in path.parents:
        linked = (root / reference).absolute()
        via = next((p for p in (linked, *linked.parents) if p.is_symlink()), None)
        how = f" through the symlink {str(via.relative_to(root.absolute()))!r}" if via is not None else ""
        raise ValueError(
            f"image path {reference!r} leads outside the data directory {root}{how} (to {str(path)!r}); copy the "
            "file into the directory, or use an s3:// URI"
        )
    if path.exists() and not path.is_file():
        raise ValueError(
            f"image {reference!r} under the data directory {root} is not a regular file (a directory or a pipe?)."
        )
    if not path.is_file():
        raise ValueError(f"image {reference!r} does not exist under the data directory {root}{_other_form(path)}.")
    return path


def _other_form(path: Path) -> str:
    """Where a file of the same name in another Unicode form (a macOS NFD name for an NFC path) or case exists: said."""
    found = twin_of(path)
    return f" (a file {found[0].name!r} looks the same but is written in {found[1]}: rename one)" if found else ""


def probe_image(root: Path, reference: F.ImageRef) -> str | None:
    """Why the image cannot be used (the module's checks), or None. s3:// references are not fetched here."""
    return inspect_image(root, reference)[0]


def inspect_image(root: Path, reference: F.ImageRef) -> tuple[str | None, tuple[int, int] | None]:
    """(why the image cannot be used or None, its (width, height) as decoded, EXIF rotation applied, or None
    where not read: an s3:// reference, or an unusable image)."""
    from components._shared.platform import storage
    from components._shared.platform.credential_shapes import redact
    from components._shared.platform.image_decode import ALLOWED_FORMATS

    if isinstance(reference, str) and redact(reference) != reference:
        return (
            f"image {redact(reference)!r} carries a credential in its URI (hidden here); S3 credentials come from the "
            "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a Kubernetes secret on the cluster): give "
            "s3://BUCKET/KEY alone"
        ), None
    if isinstance(reference, str) and storage.is_s3(reference):
        return None, None
    name = repr(reference) if isinstance(reference, str) else type(reference).__name__
    try:
        if isinstance(reference, F.ParquetImage):
            if reference.null_list:
                where = f"{Path(reference.path).name} row {reference.row} column {reference.column!r}"
                return f"the image list in {where} is null; write [] for a row without images, or give them", None
            data, path_in_cell = F.read_parquet_image(reference)
            if not data:
                if not path_in_cell:
                    state = "empty" if data == b"" else "null"
                    return (
                        f"{_cell_name(reference)} holds no image (bytes {state}, no path); give it or drop the row",
                        None,
                    )
                return inspect_image(root, F.image_ref(path_in_cell, reference.root))
            source: Any = io.BytesIO(data)
            name = _cell_name(reference)
        elif isinstance(reference, bytes):
            source = io.BytesIO(reference)
        else:
            try:
                source = local_image_path(root, reference)
            except ValueError as error:
                return str(error).rstrip("."), None
        with Image.open(source, formats=list(ALLOWED_FORMATS)) as image:
            width, height, kind = image.width, image.height, image.format
            turned = _quarter_turned(image)
            frames = getattr(image, "n_frames", 1)
            invisible = width * height <= MAX_IMAGE_PIXELS and frames == 1 and _fully_transparent(image)
    except Exception as error:  # noqa: BLE001 - any failure to read an untrusted header is the record's problem
        other = _other_format(source) if isinstance(error, UnidentifiedImageError) else None
        label = name if name.startswith("image cell") else f"image {name}"
        if other:
            return _refused_format(label, other), None
        if isinstance(error, UnidentifiedImageError):
            return f"{label} is not an image Pillow can identify (its first bytes {_head_of(source)!r})", None
        return f"{label} is unreadable ({error})", None
    if width * height > MAX_IMAGE_PIXELS:
        return f"image {name} declares {width}x{height} pixels, over the {MAX_IMAGE_PIXELS} limit", None
    ratio = max(width, height) / max(min(width, height), 1)
    if ratio > MAX_ASPECT_RATIO or min(width, height) < 1:
        return (
            f"image {name} is {width}x{height}, an aspect ratio of {ratio:.0f}:1; Qwen's image processor refuses "
            f"more than {MAX_ASPECT_RATIO}:1: crop or pad it, or drop the record"
        ), None
    head, tail, size = _ends(source)
    if _cut_short(kind, head, tail, size) and not (kind == "JPEG" and _jpeg_ends_inside(source)):
        return (
            f"image {name} is truncated: its {kind} data ends before the format's end ({size} bytes; a download or "
            "copy cut short?); fetch it again or drop the record"
        ), None
    if frames > 1:
        return (
            f"image {name} is animated ({frames} frames); the model reads one still image: save the frame you mean "
            "as a PNG or JPEG, or drop the record"
        ), None
    if isinstance(turned, Exception):
        return f"image {name} is unreadable ({turned})", None
    if invisible:
        return (
            f"image {name} has no visible pixel (composited on white, every one within {MAX_WHITE_DISTANCE}/255 of "
            "white: nearly transparent everywhere): the model would "
            "see a flat white image; give the image with its content, or drop the record"
        ), None
    return None, ((height, width) if turned else (width, height))


def _fully_transparent(image: Image.Image) -> bool:
    """Whether transparency hides the whole image: composited on white, as the decoder does, no pixel is further
    than MAX_WHITE_DISTANCE from white, while its own colours (alpha ignored) are not all white (a cut-off on alpha
    alone passed red at 3/255, or one opaque white pixel on a transparent drawing; an opaque white picture is a
    picture, as a white RGB one is). Images without transparency are not decoded."""
    if "A" not in image.getbands() and "transparency" not in image.info:
        return False
    try:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        seen = ImageChops.difference(Image.alpha_composite(white, rgba), white)
        if max(high for _, high in seen.getextrema()) > MAX_WHITE_DISTANCE:
            return False
        own = ImageChops.difference(rgba.convert("RGB"), white.convert("RGB"))
        return max(high for _, high in own.getextrema()) > MAX_WHITE_DISTANCE
    except Exception:  # noqa: BLE001 - a truncated or broken image: the checks after this one name it
        return False


def _quarter_turned(image: Image.Image) -> bool | Exception:
    """Whether the image's EXIF orientation turns it a quarter (decode_image applies it: width and height swap);
    the exception where its EXIF cannot be read (a PNG's eXIf chunk sits after its data: reading it reads on)."""
    try:
        return image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)
    except Exception as error:  # noqa: BLE001 - untrusted bytes
        return error


def _refused_format(label: str, other: str) -> str:
    """What to do with a file of another format: convert an image, fetch again what is none (empty, a page)."""
    from components._shared.platform.image_decode import ALLOWED_FORMATS

    if other.startswith(("an empty file", "an HTML", "text,")):
        return f"{label} is {other}; fetch the image again or drop the record"
    return f"{label} is {other}; only {', '.join(ALLOWED_FORMATS)} are read: convert it"


def _other_format(source: Any) -> str | None:
    """The format Pillow finds in a file outside the allow-list (GIF, TIFF, BMP, ...), one it cannot read named from
    its first bytes (SVG, HEIC, AVIF), an empty file, or None."""
    try:
        if isinstance(source, io.BytesIO):
            source.seek(0)
        with Image.open(source) as image:
            return f"a {image.format} file"
    except Exception:  # noqa: BLE001 - not an image of any format Pillow knows
        pass
    head = bytes(source.getbuffer()[:512]) if isinstance(source, io.BytesIO) else _head(source)
    if not head:
        return "an empty file (0 bytes)"
    if b"<svg" in head.lower():
        return "an SVG file"
    lowered = head.lstrip().lower()
    if lowered.startswith((b"<!doctype html", b"<html", b"<head", b"<body", b"<?xml")) or b"<html" in lowered:
        return "an HTML or XML page, not an image (a failed download: the server's error page?)"
    if head.isascii() and all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return f"text, not an image (it starts {head[:40].decode()!r})"
    brand = head[8:12] if head[4:8] == b"ftyp" else b""
    if brand in (b"avif", b"avis"):
        return "an AVIF file"
    return "a HEIC file" if brand in (b"heic", b"heix", b"mif1", b"msf1") else None


def _head_of(source: Any) -> bytes:
    """The first 16 bytes of a file or buffer, for a message."""
    return bytes(source.getbuffer()[:16]) if isinstance(source, io.BytesIO) else _head(source)[:16]


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(512)


def _ends(source: Path | io.BytesIO) -> tuple[bytes, bytes, int]:
    """(first 16 bytes, last TAIL_BYTES bytes, size) of a file or buffer."""
    if isinstance(source, io.BytesIO):
        data = source.getbuffer()
        return bytes(data[:16]), bytes(data[-TAIL_BYTES:]), len(data)
    with open(source, "rb") as f:
        head = f.read(16)
        size = f.seek(0, 2)
        f.seek(max(0, size - TAIL_BYTES))
        return head, f.read(), size


def _cut_short(kind: str | None, head: bytes, tail: bytes, size: int) -> bool:
    """Whether the file ends before its format's end: no JPEG end-of-image marker after the last start-of-scan,
    no PNG IEND chunk, fewer bytes than WebP's RIFF header declares."""
    if kind == "JPEG":
        end = tail.rfind(b"\xff\xd9")
        return end < 0 or end < tail.rfind(b"\xff\xda")
    if kind == "PNG":
        return b"IEND" not in tail
    if kind == "WEBP" and len(head) >= 8:
        return struct.unpack("<I", head[4:8])[0] + 8 > size
    return False


def _jpeg_ends_inside(source: Path | io.BytesIO) -> bool:
    """Whether a JPEG whose last 64 KiB hold no end-of-image marker has one after its main image's first scan
    anyway: data appended after it (a phone's motion photo carries its video there). Scan data cannot hold the
    marker (an 0xFF byte in it is stuffed), so a file cut short has none."""
    data = bytes(source.getbuffer() if isinstance(source, io.BytesIO) else source.read_bytes())
    scan = _first_scan(data)
    return scan >= 0 and data.find(b"\xff\xd9", scan) >= 0


def _first_scan(data: bytes) -> int:
    """Where the main image's first start-of-scan marker is, found by walking the segments from the start-of-image
    by their lengths (an APPn or COM payload, such as an EXIF thumbnail, can hold a whole JPEG of its own: its scan
    and end marker are not the image's); -1 when the segments do not lead to one."""
    at = 2
    while at + 4 <= len(data) and data[at] == 0xFF:
        marker = data[at + 1]
        if marker == 0xDA:
            return at
        if marker == 0xFF:  # a fill byte before a marker
            at += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers: no length
            at += 2
        else:
            at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return -1


def _cell_name(ref: F.ParquetImage) -> str:
    """`image cell data.parquet row 3 column 'images' element 1`: where a Parquet image is."""
    element = "" if ref.index is None else f" element {ref.index}"
    return f"image cell {Path(ref.path).name} row {ref.row} column {ref.column!r}{element}"
