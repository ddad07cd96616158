"""Safe decoding (formats, EXIF, bombs, truncation) and the visual-token count against the real processor."""

import io
import struct
import zlib

import pytest
from PIL import Image

from components._shared.platform.image_decode import ImageRejected, decode_image, sniff_format, visual_tokens

LIMIT = 4_000_000


def _encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares width x height (a decompression bomb if decoded)."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _reason(data: bytes) -> str:
    with pytest.raises(ImageRejected) as info:
        decode_image(data, max_image_pixels=LIMIT)
    return info.value.reason


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_decodes_allowed_formats_to_rgb(fmt):
    src = Image.new("RGB", (64, 48), (200, 30, 40))
    decoded = decode_image(_encode(src, fmt), max_image_pixels=LIMIT)
    assert (decoded.format, decoded.width, decoded.height, decoded.image.mode) == (fmt, 64, 48, "RGB")
    r, g, b = decoded.image.getpixel((10, 10))
    assert abs(r - 200) < 12 and abs(g - 30) < 12 and abs(b - 40) < 12


def test_transparent_png_becomes_white_rgb():
    decoded = decode_image(_encode(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG"), max_image_pixels=LIMIT)
    assert decoded.image.getpixel((3, 3)) == (255, 255, 255)


@pytest.mark.parametrize(("mode", "key"), [("RGB", (0, 0, 0)), ("L", 0)])
def test_a_png_colour_key_is_transparent_too(mode, key):
    """An RGB or grey PNG with a tRNS colour key decoded with its transparent pixels black, not white."""
    keyed = Image.new(mode, (8, 8), key)
    keyed.paste(128 if mode == "L" else (128, 128, 128), (0, 0, 4, 8))
    decoded = decode_image(_encode(keyed, "PNG", transparency=key), max_image_pixels=LIMIT)
    assert decoded.image.getpixel((6, 3)) == (255, 255, 255) and decoded.image.getpixel((1, 3)) == (128, 128, 128)


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 10, 20))  # left strip red
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = decode_image(_encode(img, "JPEG", exif=exif.tobytes(), quality=95), max_image_pixels=LIMIT)
    assert (decoded.width, decoded.height) == (20, 40)
    r, _, b = decoded.image.getpixel((10, 3))  # the red strip is now on top
    assert r > 200 and b < 60


def test_decompression_bomb_rejected_before_decoding():
    bomb = _png_declaring(100_000, 100_000)
    assert len(bomb) < 200
    assert _reason(bomb) == "decompression_bomb"
    assert _reason(_png_declaring(2001, 2000)) == "decompression_bomb"  # just above the 4 MP limit


@pytest.mark.parametrize("fmt,name", [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_unsupported_formats_rejected(fmt, name):
    data = _encode(Image.new("RGB", (32, 32), (1, 2, 3)), fmt)
    assert sniff_format(data) == name
    assert _reason(data) == "unsupported_format"


def test_truncated_and_garbage_and_empty():
    png = _encode(Image.new("RGB", (120, 90), (9, 9, 9)).effect_spread(3), "PNG")
    assert _reason(png[: len(png) // 2]) == "truncated_image"
    jpeg = _encode(Image.effect_noise((96, 96), 40).convert("RGB"), "JPEG")
    assert _reason(jpeg[: len(jpeg) // 2]) in {"truncated_image", "undecodable"}
    assert _reason(b"\x00garbage" * 10) == "undecodable"
    assert _reason(b"") == "empty_file"
    assert _reason(b"\xff\xd8\xff" + b"\x00" * 40) == "undecodable"  # JPEG magic, no JPEG behind it


@pytest.mark.parametrize(
    "height,width",
    [(112, 112), (200, 300), (480, 640), (1080, 1920), (33, 700), (700, 33), (28, 28), (57, 85), (4000, 3000)],
)
@pytest.mark.parametrize(
    "min_pixels,max_pixels", [(56 * 56, 28 * 28 * 64), (112 * 112, 112 * 112), (4 * 28 * 28, 1280 * 28 * 28)]
)
def test_visual_tokens_match_qwen_processor(height, width, min_pixels, max_pixels):
    import numpy as np
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    out = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    expected = int(out["image_grid_thw"].prod()) // 4
    assert visual_tokens(height, width, min_pixels=min_pixels, max_pixels=max_pixels) == expected


def test_visual_tokens_rejects_nonpositive_size():
    with pytest.raises(ValueError, match="positive"):
        visual_tokens(0, 10, min_pixels=3136, max_pixels=50176)
