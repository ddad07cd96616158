"""Decode kept images and turn them into the pixel rows the Qwen2-VL / Qwen2.5-VL vision tower reads.

Every decoder returns RGB uint8 [3, H, W] with the EXIF orientation applied and transparency composited
onto white, the pixels `components._shared.platform.image_decode.decode_image` gives (clean_data measured widths,
heights and visual tokens on those). `resize_for_qwen` and `patch_rows` then reproduce
`Qwen2VLImageProcessor` (its torchvision backend) step by step: smart_resize with factor patch*merge, a
bicubic antialiased resize of the uint8 image, `(x - mean/rescale) / (std/rescale)`, and patchify into
`[grid_h * grid_w, C * temporal_patch_size * patch^2]` rows in 2x2-merge order with the frame repeated
`temporal_patch_size` times. On the CPU the rows are bit-identical to the processor's; after DALI's GPU
decoder they differ by the IDCT and by float-vs-uint8 resize rounding (a level or so per pixel).

Backends: `torchvision` (libjpeg-turbo `decode_jpeg`, `decode_image` for PNG, Pillow for WebP), `pil` (Pillow via
imaging.decode_image), `dali` (`fn.decoders.image` on the GPU with device "mixed", on the CPU without a GPU).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from components._shared.model.families.base import CLIP_MEAN, CLIP_STD
from components._shared.model.pixel_norm import PixelNorm

BACKENDS = ("dali", "torchvision", "pil")
JPEG_MAGIC = b"\xff\xd8\xff"
MAX_DECODE_PIXELS = 1 << 30  # clean_data enforced the real limit; this only keeps Pillow's bomb guard out of the way


def dali_importable() -> bool:
    """True when `nvidia.dali` imports here."""
    try:
        importlib.import_module("nvidia.dali")
    except ImportError:
        return False
    return True


def choose_backend(requested: str, device: torch.device) -> str:
    """The backend to use: `auto` is DALI when it imports and the model runs on CUDA, else torchvision."""
    if requested == "auto":
        return "dali" if device.type == "cuda" and dali_importable() else "torchvision"
    if requested not in BACKENDS:
        raise ValueError(f"decode_backend='{requested}' is unknown; use one of auto, {', '.join(BACKENDS)}.")
    if requested == "dali" and not dali_importable():
        raise ValueError(
            "decode_backend='dali' but nvidia.dali does not import; "
            "install nvidia-dali-cuda130 or use decode_backend='torchvision'."
        )
    return requested


def _to_rgb_uint8(image: torch.Tensor) -> torch.Tensor:
    """[C, H, W] with C in 1..4 (and 8 or 16 bit) -> RGB uint8, alpha composited onto white."""
    if image.dtype != torch.uint8:  # 16-bit PNGs keep the high byte, as Pillow does
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    channels = image.shape[0]
    if channels in (2, 4):
        color, alpha = image[:-1].to(torch.int32), image[-1:].to(torch.int32)
        image = ((color * alpha + 255 * (255 - alpha) + 127) // 255).to(torch.uint8)
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    return image.contiguous()


def _png_pil_only(data: bytes) -> bool:
    """A palette PNG or one under 8 bits a sample (IHDR's colour type 3 or bit depth < 8): torchvision 0.29's
    `decode_image` returns other colours for these than Pillow (and than clean_data, which scored the Pillow ones),
    so they go to Pillow."""
    is_png = data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 26
    return is_png and (data[25] == 3 or data[24] < 8)


def decode_torchvision(data: bytes) -> torch.Tensor:
    """libjpeg-turbo for JPEG (`decode_jpeg`), `decode_image` for PNG (Pillow for palette and low-bit PNGs, and for
    WebP, whose EXIF orientation torchvision does not apply); RGB uint8 [3, H, W]."""
    from torchvision import io as tvio

    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if data[:3] == JPEG_MAGIC:
        return tvio.decode_jpeg(buffer, mode=tvio.ImageReadMode.RGB, apply_exif_orientation=True)
    if _png_pil_only(data) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return decode_pil(data)  # torchvision 0.29 does not apply a WebP's EXIF orientation
    # RGB_ALPHA, not UNCHANGED: palette PNGs would otherwise come back as palette indices.
    image = tvio.decode_image(buffer, mode=tvio.ImageReadMode.RGB_ALPHA, apply_exif_orientation=True)
    return _to_rgb_uint8(image)


def decode_pil(data: bytes) -> torch.Tensor:
    """Pillow through the shared safe decoder; RGB uint8 [3, H, W]."""
    from components._shared.platform.image_decode import decode_image

    decoded = decode_image(data, max_image_pixels=MAX_DECODE_PIXELS)
    return torch.from_numpy(np.asarray(decoded.image, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


class DaliJpegDecoder:
    """Batched JPEG decoding with DALI: nvJPEG on the GPU ("mixed") given a device_id, else its CPU decoder.

    Returns RGB uint8 [3, H, W] tensors on the GPU (or CPU), EXIF orientation applied, chroma upsampled like
    libjpeg-turbo (`jpeg_fancy_upsampling`). Only JPEGs go here; other formats have alpha to composite.
    """

    def __init__(self, *, max_batch_size: int, device_id: int | None, num_threads: int = 4) -> None:
        from nvidia.dali import fn, pipeline_def, types

        decoder_device = "cpu" if device_id is None else "mixed"

        @pipeline_def(
            batch_size=max_batch_size,
            num_threads=max(1, num_threads),
            device_id=device_id,
            prefetch_queue_depth=1,
        )
        def pipeline():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            return fn.decoders.image(
                encoded,
                device=decoder_device,
                output_type=types.RGB,
                adjust_orientation=True,
                jpeg_fancy_upsampling=True,
            )

        self.max_batch_size = max_batch_size
        self._pipeline = pipeline()
        self._pipeline.build()

    def __call__(self, blobs: list[bytes]) -> list[torch.Tensor]:
        images: list[torch.Tensor] = []
        for start in range(0, len(blobs), self.max_batch_size):
            chunk = [np.frombuffer(blob, dtype=np.uint8) for blob in blobs[start : start + self.max_batch_size]]
            self._pipeline.feed_input("encoded", chunk)
            (decoded,) = self._pipeline.run()
            # DALI reuses its output buffers on the next run: copy out before feeding again.
            images.extend(
                torch.from_dlpack(decoded[i]).permute(2, 0, 1).clone(memory_format=torch.contiguous_format)
                for i in range(len(chunk))
            )
        return images


@dataclass(frozen=True)
class PatchSpec:
    """How the model's image processor turns pixels into rows (preprocessor_config.json + vision config)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def norm(self) -> PixelNorm:
        return PixelNorm(mean=self.image_mean, std=self.image_std, rescale_factor=self.rescale_factor)

    @classmethod
    def from_model_dir(cls, model_dir: Path, vision_config) -> PatchSpec:
        """Geometry from the vision config (authoritative), mean/std/rescale from the saved processor."""
        saved = {}
        path = Path(model_dir) / "preprocessor_config.json"
        if path.is_file():
            saved = json.loads(path.read_text())
        return cls(
            patch_size=int(vision_config.patch_size),
            temporal_patch_size=int(vision_config.temporal_patch_size),
            merge_size=int(vision_config.spatial_merge_size),
            image_mean=tuple(float(v) for v in saved.get("image_mean", CLIP_MEAN)),
            image_std=tuple(float(v) for v in saved.get("image_std", CLIP_STD)),
            rescale_factor=float(saved.get("rescale_factor", 1 / 255)),
        )


def qwen_target_size(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after Qwen's smart_resize (the processor's own function)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def resize_for_qwen(image: torch.Tensor, *, factor: int, min_pixels: int, max_pixels: int) -> torch.Tensor:
    """smart_resize + bicubic antialiased resize, as the processor does.

    uint8 on the CPU (bit-identical to the processor); on CUDA the resize runs in float and is rounded to
    whole levels (torch has no uint8 antialiased bicubic kernel there), so the result stays float.
    """
    from torchvision.transforms.v2 import functional as tvF

    height, width = image.shape[-2:]
    target = list(qwen_target_size(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels))
    bicubic = tvF.InterpolationMode.BICUBIC
    if image.device.type == "cpu":
        return tvF.resize(image, target, interpolation=bicubic, antialias=True)
    if target == [height, width]:
        return image.to(torch.float32)
    return tvF.resize(image.to(torch.float32), target, interpolation=bicubic, antialias=True).round_().clamp_(0, 255)


def patch_rows(image: torch.Tensor, spec: PatchSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Patchify and normalise a resized [3, H, W] image -> (float32 rows [gh*gw, 3*T*P*P], (1, gh, gw))."""
    channels, height, width = image.shape
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image of {height}x{width} is not a multiple of patch*merge={p * m}; resize it first.")
    grid_h, grid_w = height // p, width // p
    n = grid_h * grid_w
    x = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    frames = x.reshape(n, channels * p * p)  # a copy in the processor's patch order, one frame per row
    # The processor's fused rescale+normalise: elementwise, so after patchifying it gives the same values; before
    # the frame is repeated temporal_patch_size times, so on half the elements.
    frames = spec.norm(frames, inplace=frames.data_ptr() != image.data_ptr())
    rows = frames.reshape(n, channels, 1, p * p).expand(-1, -1, t, -1).reshape(n, channels * t * p * p)
    return rows, (1, grid_h, grid_w)
