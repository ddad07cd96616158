"""Decode + smart_resize throughput per CPU-second for each decode backend, against qwen-vl-utils' PIL path.

    python bench/decode_throughput.py [--images 24] [--rounds 5] [--threads 1]

Every backend turns the same in-process ~1 MP JPEGs into smart_resized RGB images (factor 28, Qwen's default
min/max pixels). The baseline is `qwen_vl_utils.fetch_image` (Pillow decode, RGB convert, PIL bicubic resize),
measured in the same run; the table prints the median images per CPU-second (`time.process_time`, all
threads of this process) and the ratio to the baseline. `torchvision` is extract_features' default CPU path.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageDraw

from components.extract_features.decode import (
    DaliJpegDecoder,
    dali_importable,
    decode_pil,
    decode_torchvision,
    qwen_target_size,
    resize_for_qwen,
)

MIN_PIXELS, MAX_PIXELS, FACTOR = 56 * 56, 1280 * 28 * 28, 28
SIZES = [(1200, 840), (1024, 1024), (900, 1110), (1280, 800)]


def make_jpegs(count: int, seed: int = 0, sizes: list[tuple[int, int]] = SIZES) -> list[bytes]:
    """Photo-like JPEGs (~1 MP by default; `sizes` cycles width x height): gradients, filled shapes, a little sensor
    noise, quality 90."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        ramp = (x / width * 0.6 + y / height * 0.4)[..., None]
        pixels = c0 * (1 - ramp) + c1 * ramp + rng.normal(0, 6, (height, width, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(12):
            x0, y0 = int(rng.integers(0, width - 200)), int(rng.integers(0, height - 200))
            box = [x0, y0, x0 + int(rng.integers(40, 200)), y0 + int(rng.integers(40, 200))]
            fill = tuple(int(v) for v in rng.integers(0, 255, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
        draw.text((20, 20), f"sample {i}", fill=(255, 255, 255))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def baseline_qwen_vl_utils(data: bytes):
    from qwen_vl_utils import fetch_image

    return fetch_image({"image": Image.open(io.BytesIO(data)), "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS})


def stage_path(decode: Callable[[bytes], torch.Tensor]) -> Callable[[bytes], torch.Tensor]:
    return lambda data: resize_for_qwen(decode(data), factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def simplejpeg_cv2(data: bytes) -> np.ndarray:
    import cv2
    import simplejpeg

    image = simplejpeg.decode_jpeg(data, colorspace="RGB")
    height, width = qwen_target_size(*image.shape[:2], factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_CUBIC)


def measure(candidates: list[tuple[str, Callable]], jpegs: list[bytes], rounds: int) -> dict[str, float]:
    """Median images per CPU-second of each candidate (a batch function); rounds interleave the candidates so
    that load from other processes hits all of them alike. One warm-up image each first."""
    for _, batch in candidates:
        batch(jpegs[:1])
    rates: dict[str, list[float]] = {name: [] for name, _ in candidates}
    for _ in range(rounds):
        for name, batch in candidates:
            started = time.process_time()
            assert len(batch(jpegs)) == len(jpegs)
            rates[name].append(len(jpegs) / (time.process_time() - started))
    return {name: float(np.median(values)) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch/cv2/DALI threads (1 = per-core throughput).")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import cv2

    cv2.setNumThreads(args.threads)
    jpegs = make_jpegs(args.images)
    megapixels = np.mean([Image.open(io.BytesIO(d)).size[0] * Image.open(io.BytesIO(d)).size[1] for d in jpegs]) / 1e6

    def each(per_image: Callable) -> Callable[[list[bytes]], list]:
        return lambda items: [per_image(data) for data in items]

    candidates: list[tuple[str, Callable]] = [
        ("pil-bicubic (qwen-vl-utils, BASELINE)", each(baseline_qwen_vl_utils)),
        ("torchvision (stage default on CPU)", each(stage_path(decode_torchvision))),
        ("simplejpeg+cv2 (bicubic, no antialias)", each(simplejpeg_cv2)),
        ("pil (stage pil backend)", each(stage_path(decode_pil))),
    ]
    if dali_importable():
        try:
            dali = DaliJpegDecoder(max_batch_size=len(jpegs), device_id=None, num_threads=args.threads)
            resize = stage_path(lambda image: image)
            candidates.append(("dali-cpu", lambda items: [resize(image) for image in dali(items)]))
        except Exception as err:  # noqa: BLE001 - report, do not fail the benchmark
            print(f"dali-cpu skipped: {type(err).__name__}: {err}")

    results = list(measure(candidates, jpegs, args.rounds).items())
    baseline = results[0][1]
    print(
        f"{len(jpegs)} JPEGs, mean {megapixels:.2f} MP, median of {args.rounds} interleaved rounds, "
        f"threads={args.threads}, "
        f"min_pixels={MIN_PIXELS}, max_pixels={MAX_PIXELS}"
    )
    print(f"{'backend':42s} {'img/CPU-s':>10s} {'vs baseline':>12s}")
    for name, rate in results:
        print(f"{name:42s} {rate:10.1f} {rate / baseline:11.2f}x")


if __name__ == "__main__":
    main()
