"""DALI decode + smart_resize throughput on the GPU (nvJPEG), against the CPU path of the same images.

    python bench/gpu/dali_decode.py [--images 512] [--batch 128] [--rounds 5] [--json-out PATH]
    python bench/gpu/dali_decode.py --tiny          # CPU smoke run: DALI's CPU decoder, 16 images, 2 rounds

The images are photo-like JPEGs at the resolutions training data has (448x448, 640x480, 1024x768, 1280x720,
bench/decode_throughput.py's recipe), decoded by extract_features' `DaliJpegDecoder` (nvJPEG, "mixed" device on
GPU 0) and resized by its `resize_for_qwen` (smart_resize at factor 28, Qwen's default min/max pixels; bicubic,
antialiased) on the GPU: what extract_features runs per batch. Baseline, in the same process: torchvision's CPU
decode + the same resize on the CPU, one image at a time (the stage's CPU path). On a GPU a third arm decodes the
same batches with torchvision's nvJPEG (`decode_jpeg(list, device="cuda")`) before the same resize: GPU decode
without DALI. Reported: images/s of each (median of `--rounds`, after one warm-up round; the GPU synchronised
before each clock read) and the ratios. Goal printed beside the numbers: >= 3,000 images/s on one H200. Where
`nvidia.dali` does not import, its arm is reported as null with the import error and the others still run. With
--tiny every arm is CPU and the number is only a smoke check (`"meaningful": false`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `components` and `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode_throughput import make_jpegs  # noqa: E402
from components.extract_features.decode import DaliJpegDecoder, decode_torchvision, resize_for_qwen  # noqa: E402

MIN_PIXELS, MAX_PIXELS, FACTOR = 56 * 56, 1280 * 28 * 28, 28
SIZES = [(448, 448), (640, 480), (1024, 768), (1280, 720)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(run, images: int, rounds: int, device: torch.device) -> float:
    """Median images/s of `run()` over `rounds` timed rounds after one warm-up."""
    run()
    rates = []
    for _ in range(rounds):
        _sync(device)
        started = time.perf_counter()
        run()
        _sync(device)
        rates.append(images / (time.perf_counter() - started))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: DALI CPU decoder, few images")
    parser.add_argument("--images", type=int, default=None, help="JPEGs (default 512; 16 with --tiny)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; 2 with --tiny)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    count = args.images or (16 if args.tiny else 512)
    rounds = args.rounds or (2 if args.tiny else 5)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    jpegs = make_jpegs(count, sizes=SIZES)
    batch = min(args.batch, count)
    try:
        decoder = DaliJpegDecoder(max_batch_size=batch, device_id=0 if gpu else None, num_threads=4)
        dali_error = None
    except ImportError as err:  # the wheel is not installed here: report it, measure the other arms
        decoder, dali_error = None, f"{type(err).__name__}: {err}"

    def resize(image: torch.Tensor) -> torch.Tensor:
        return resize_for_qwen(image, factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def dali() -> None:
        for start in range(0, count, batch):
            for image in decoder(jpegs[start : start + batch]):
                resize(image)

    def cpu() -> None:
        for data in jpegs:
            resize(decode_torchvision(data))

    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in jpegs]

    def nvjpeg() -> None:
        from torchvision import io as tvio

        for start in range(0, count, batch):
            for image in tvio.decode_jpeg(encoded[start : start + batch], mode=tvio.ImageReadMode.RGB, device=device):
                resize(image)

    dali_rate = rate(dali, count, rounds, device) if decoder is not None else None
    nvjpeg_rate = rate(nvjpeg, count, rounds, device) if gpu else None
    cpu_rate = rate(cpu, count, rounds, torch.device("cpu"))
    report = {
        "check": "dali_decode",
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "meaningful": gpu,
        "images": count,
        "batch": batch,
        "resolutions": [f"{w}x{h}" for w, h in SIZES],
        "dali_images_per_s": dali_rate,
        "dali_error": dali_error,
        "torchvision_nvjpeg_images_per_s": nvjpeg_rate,
        "cpu_torchvision_images_per_s": cpu_rate,
        "ratio_vs_cpu": dali_rate / cpu_rate if dali_rate else None,
        "nvjpeg_ratio_vs_cpu": nvjpeg_rate / cpu_rate if nvjpeg_rate else None,
        "goal_images_per_s": 3000,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    where = "GPU" if gpu else "CPU"
    dali_text = f"{dali_rate:,.0f} images/s" if dali_rate else f"not measured ({dali_error})"
    nvjpeg_text = f"; torchvision nvJPEG {nvjpeg_rate:,.0f} images/s" if nvjpeg_rate else ""
    print(
        f"DALI {where} decode + resize: {dali_text}{nvjpeg_text}; CPU torchvision path {cpu_rate:,.0f} images/s; "
        "goal >= 3,000 images/s on one H200"
    )
    print(json.dumps(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
