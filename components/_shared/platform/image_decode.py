"""Safe image decoding and the Qwen2.5-VL visual-token count, shared by the data stages.

`decode_image` is the only place untrusted image bytes meet Pillow: it checks the declared size
before any pixel is decoded (decompression bombs), opens only allow-listed formats, loads the
whole image (so truncated files fail here, not later), applies the EXIF orientation and returns RGB.
Every failure is an `ImageRejected` carrying a rejection reason, never a crash.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")

# Magic numbers of formats we recognise but refuse to parse (they are reported as unsupported,
# everything else that Pillow's allow-listed plugins cannot open is undecodable).
_KNOWN_MAGIC = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\xff\x0a", "JXL"),
    (b"\x00\x00\x00\x0cJXL ", "JXL"),
    (b"%PDF", "PDF"),
    (b"<svg", "SVG"),
    (b"<?xml", "SVG/XML"),
    (b"P1", "PNM"),
    (b"P2", "PNM"),
    (b"P3", "PNM"),
    (b"P4", "PNM"),
    (b"P5", "PNM"),
    (b"P6", "PNM"),
    (b"\x76\x2f\x31\x01", "EXR"),
    (b"qoif", "QOI"),
    (b"DDS ", "DDS"),
)


class ImageRejected(Exception):
    """An image that cannot be used; `reason` is the rejection reason written to rejected.parquet."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, EXIF orientation applied
    format: str  # "JPEG" | "PNG" | "WEBP"
    width: int  # after orientation
    height: int


def sniff_format(data: bytes) -> str | None:
    """Name of a known image format from its magic bytes (also non-allowed ones), or None."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        return "AVIF" if brand in (b"avif", b"avis") else "HEIF"
    for magic, name in _KNOWN_MAGIC:
        if data.startswith(magic):
            return name
    return None


def _raise_pillow_pixel_limit(max_image_pixels: int) -> None:
    # Pillow's own guard (warning above the limit, error above twice the limit) must never be stricter
    # than ours, or it would reject images the config allows; our explicit check below is the real limit.
    current = Image.MAX_IMAGE_PIXELS
    if current is not None and current < max_image_pixels:
        Image.MAX_IMAGE_PIXELS = max_image_pixels


def decode_image(
    data: bytes, *, max_image_pixels: int, allowed_formats: tuple[str, ...] = ALLOWED_FORMATS
) -> DecodedImage:
    """Decode untrusted bytes into an RGB image, or raise `ImageRejected` with a reason.

    Reasons: empty_file, decompression_bomb, unsupported_format, animated_image, truncated_image, undecodable.
    """
    if not data:
        raise ImageRejected("empty_file", "image member has 0 bytes")
    sniffed = sniff_format(data)
    if sniffed is not None and sniffed not in allowed_formats:
        raise ImageRejected("unsupported_format", f"{sniffed} is not in the allow-list {list(allowed_formats)}")
    _raise_pillow_pixel_limit(max_image_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(allowed_formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRejected("decompression_bomb", str(exc)) from None
    except Image.UnidentifiedImageError:
        raise ImageRejected("undecodable", f"no {'/'.join(allowed_formats)} decoder recognises the bytes") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure on untrusted bytes is a rejection
        raise ImageRejected("undecodable", _describe(exc)) from None
    width, height = img.size
    if width * height > max_image_pixels:
        raise ImageRejected(
            "decompression_bomb",
            f"declares {width}x{height} = {width * height} pixels > max_image_pixels={max_image_pixels}",
        )
    if img.format not in allowed_formats:  # defensive: Pillow honoured `formats`, but never trust it blindly
        raise ImageRejected("unsupported_format", f"{img.format} is not in the allow-list {list(allowed_formats)}")
    fmt = img.format
    frames = getattr(img, "n_frames", 1)
    if frames > 1:  # kept, it would be its first frame alone; the model stages refuse it likewise
        raise ImageRejected("animated_image", f"an animated {fmt} of {frames} frames; the model reads one still image")
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
        img = _to_rgb(img)
    except Exception as exc:  # noqa: BLE001
        message = _describe(exc)
        reason = "truncated_image" if "truncated" in message.lower() else "undecodable"
        raise ImageRejected(reason, message) from None
    return DecodedImage(image=img, format=fmt, width=img.width, height=img.height)


def _describe(exc: Exception) -> str:
    """`Type: message` without memory addresses, so rejection details are the same on every run."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{type(exc).__name__}: {exc}")[:300]


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (not black) so captions still describe what a viewer sees."""
    keyed = img.mode in ("RGB", "L", "P") and "transparency" in img.info  # a PNG tRNS colour key, a GIF-style index
    if img.mode == "RGB" and not keyed:
        return img
    if img.mode in ("RGBA", "LA", "PA") or keyed:
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        img = img.point(lambda v: v / 256).convert("L")
    return img.convert("RGB")


def visual_tokens(height: int, width: int, *, min_pixels: int, max_pixels: int, patch_size: int = 14) -> int:
    """Visual tokens a Qwen VL model produces for an image of this size (after the 2x2 merge).

    Follows `qwen_vl_utils.smart_resize(h, w, factor=2 * patch_size, min_pixels, max_pixels)`, which is what the
    training data loader uses: tokens = (h'/factor) * (w'/factor); the factor is 28 for Qwen2-VL / Qwen2.5-VL
    (patch 14) and 32 for Qwen3-VL / Qwen3.5 (patch 16). Where that function floors a side of a long thin image to
    0 (it lacks the processor's `max(factor, ...)` when shrinking), the side is clamped to the factor like
    transformers' Qwen2VLImageProcessor does; for sides >= one patch the count then equals the processor's
    `image_grid_thw.prod() // 4`.
    """
    from qwen_vl_utils import smart_resize

    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    factor = 2 * patch_size
    resized_h, resized_w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    resized_h, resized_w = max(factor, resized_h), max(factor, resized_w)
    return (resized_h // factor) * (resized_w // factor)
