"""uint8 pixel rows until the model: the image processor's rescale + normalise, applied where the rows reach it.

The Qwen image processor resizes an image as uint8 and patchifies it into rows (patches, C * T * P * P), but
normalises before patchifying, so its rows are float32: four bytes per value through the data workers' queues,
pinned memory and the host-to-device copy. `ConversationEncoder` asks it for the same rows without rescale and
normalise (uint8, a quarter of the bytes) and the samples carry a `PixelNorm`; `model_pixels` applies it on the
device the rows were copied to, just before the vision tower. The arithmetic is the processor's own fused
`(x - mean / rescale) / (std / rescale)` in float32, element by element, so the rows the model reads are
bit-identical to the processor's (tested per family) wherever they are normalised.

Only the torchvision backend with rescale and normalise both on gets this path (its fused arithmetic is what
`PixelNorm` reproduces); any other processor keeps giving normalised float rows, which pass through unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PixelNorm:
    """The processor's per-channel rescale + normalise of rows in its layout (channel-major: C blocks of T*P*P)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float

    @classmethod
    def of(cls, image_processor) -> PixelNorm | None:
        """The norm of a torchvision-backend processor that rescales and normalises, else None (float rows)."""
        from transformers.image_processing_backends import TorchvisionBackend

        if not isinstance(image_processor, TorchvisionBackend):
            return None
        if not (getattr(image_processor, "do_rescale", False) and getattr(image_processor, "do_normalize", False)):
            return None
        mean, std = image_processor.image_mean, image_processor.image_std
        channels = 3
        mean = tuple(float(v) for v in (mean if isinstance(mean, (list, tuple)) else [mean] * channels))
        std = tuple(float(v) for v in (std if isinstance(std, (list, tuple)) else [std] * channels))
        return cls(mean=mean, std=std, rescale_factor=float(image_processor.rescale_factor))

    def __call__(self, rows: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """float32 rows (patches, C*T*P*P) of uint8 (or unnormalised float) rows, on the rows' device; `inplace`
        lets float32 rows be overwritten (otherwise they are copied first)."""
        channels = len(self.mean)
        patches, width = rows.shape
        if width % channels:
            raise ValueError(f"pixel rows of width {width} do not split into {channels} channels.")
        mean, std = _fused_mean_std(self, rows.device)
        x = rows.reshape(patches, channels, width // channels).to(torch.float32)
        if x.data_ptr() == rows.data_ptr() and not inplace:  # already float32: keep the caller's rows
            x = x.clone()
        return x.sub_(mean).div_(std).reshape(patches, width)


@functools.lru_cache(maxsize=16)
def _fused_mean_std(norm: PixelNorm, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's fused form (image_processing_backends: mean and std times 1/rescale, then one sub and one
    div), built once per device: a tensor made from Python numbers on a GPU is a synchronous copy."""
    mean = torch.tensor(norm.mean, dtype=torch.float32) * (1.0 / norm.rescale_factor)
    std = torch.tensor(norm.std, dtype=torch.float32) * (1.0 / norm.rescale_factor)
    return mean.to(device)[:, None], std.to(device)[:, None]


def model_pixels(rows: torch.Tensor, norm: PixelNorm | None) -> torch.Tensor:
    """The float rows the vision tower reads: uint8 rows normalised by `norm` on their device; float rows (an
    already normalising processor, synthetic benchmark rows) as they are."""
    if rows.dtype != torch.uint8:
        return rows
    if norm is None:
        raise ValueError(
            "uint8 pixel rows without their PixelNorm; build samples with ConversationEncoder (it sets pixel_norm) "
            "or pass normalised float rows."
        )
    return norm(rows)
