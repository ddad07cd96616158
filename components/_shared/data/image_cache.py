"""Decoded images of a stage's data, kept for reuse within a byte budget, not a count.

The training stages decode a record's images when a step needs them and keep them for the next record that names
the same image (LLaVA's records share COCO photographs). A cache of 4,096 images held 3.8 GB of COCO photos, and
147 GB of 12-megapixel ones: the same setting multiplied the peak by the photographs' size without a word. This one
keeps the most recently used images up to `max_bytes` of pixels (each process its own: data workers included) and
says once when an image alone is larger than a tenth of it (`warn_bytes`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

from PIL import Image

from components._shared.data import datasets
from components._shared.data import formats as F

DEFAULT_MAX_BYTES = 1 << 30


class DecodedImages:
    """`images(reference)` -> the decoded RGB image (`datasets.load_image`), reused while it fits the budget."""

    def __init__(self, data_dir: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, warn_bytes: int | None = None) -> None:
        self.data_dir, self.max_bytes = Path(data_dir), max_bytes
        self.warn_bytes = max_bytes // 10 if warn_bytes is None else warn_bytes
        self._kept: OrderedDict[F.ImageRef, Image.Image] = OrderedDict()
        self.bytes = 0
        self.decoded = 0
        self._warned = False

    def __call__(self, reference: F.ImageRef) -> Image.Image:
        if reference in self._kept:
            self._kept.move_to_end(reference)
            return self._kept[reference]
        image = datasets.load_image(self.data_dir, reference)
        self.decoded += 1
        size = _pixel_bytes(image)
        if size > self.warn_bytes and not self._warned:
            self._warned = True
            print(
                f"warning: image {reference!r} is {image.width}x{image.height} ({size / 1e6:.0f} MB decoded); a few "
                f"such images fill the {self.max_bytes / 1e9:.1f} GB of decoded images a process keeps, so images "
                "are decoded again more often. Downscale the data to about the model's max_pixels to save it.",
                file=sys.stderr,
                flush=True,
            )
        if size <= self.max_bytes:
            self._kept[reference] = image
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self.bytes -= _pixel_bytes(dropped)
        return image


def _pixel_bytes(image: Image.Image) -> int:
    return image.width * image.height * len(image.getbands())
