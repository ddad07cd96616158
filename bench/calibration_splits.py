"""Does temperature scaling carry to unseen questions? An SFT model's short held-out answers split in half many times:
fit the temperature on one half (by ECE, as `sft.calibration.fit_temperature` does, and by log loss), measure ECE
on the other.

    python bench/calibration_splits.py RUN/pipeline_root/<run>/sft-op/model HELDOUT_DIR [--preset demo] [--splits 30]

RUN is a `qvl run --local` directory (the sft task's output: model/, eval_predictions.jsonl), HELDOUT_DIR the
world's held-out data (`qvl lake synth --out W` writes W/heldout). Prints the mean and spread of the other half's
ECE without a temperature, with the ECE-fitted one and with the log-loss-fitted one, and the mean confidence
against accuracy (docs/stages/sft.md, Calibration).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `components` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components._shared.data import datasets  # noqa: E402
from components._shared.eval import evaluation as E  # noqa: E402
from components._shared.model.encoder import ConversationEncoder  # noqa: E402
from components._shared.model.vlm import set_pixel_bounds  # noqa: E402
from components._shared.platform.presets import read_section  # noqa: E402
from components.sft.config import SftConfig  # noqa: E402
from components.sft.stage import build_model  # noqa: E402

GRID = [round(0.05 * k, 2) for k in range(10, 201)]  # 0.5 .. 10


def answer_pairs(sft_dir: Path, heldout: Path, preset: str) -> tuple[list, list[float]]:
    """(answer logits and tokens, correctness) of the sft run's short held-out answers, as `sft` calibrates them."""
    cfg = SftConfig(**read_section(Path("pipelines/presets") / f"{preset}.yaml", "sft"))
    model, processor, _ = build_model(cfg, str(sft_dir / "model"))
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    records = datasets.load_eval_records(heldout, per_type=cfg.eval.per_type)
    rows = [json.loads(line) for line in (sft_dir / "eval_predictions.jsonl").read_text().splitlines()]
    picked = [(r, row) for r, row in zip(records, rows, strict=True) if r["type"] != "caption"]
    model.eval()
    with torch.no_grad():
        samples = E.answer_samples(encoder, [r for r, _ in picked], [row["prediction"] for _, row in picked])
        pairs = E.answer_logits(model, samples)
    return pairs, [row["score"] for _, row in picked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sft_dir", type=Path)
    parser.add_argument("heldout", type=Path)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--splits", type=int, default=30)
    args = parser.parse_args()
    pairs, correct = answer_pairs(args.sft_dir, args.heldout, args.preset)
    conf = {t: E.confidences(pairs, t) for t in GRID}

    def ece(idx: list[int], t: float) -> float:
        return E.expected_calibration_error([conf[t][i] for i in idx], [correct[i] for i in idx])

    def log_loss(idx: list[int], t: float) -> float:
        clipped = [(min(max(conf[t][i], 1e-6), 1 - 1e-6), correct[i]) for i in idx]
        return -sum(c * math.log(p) + (1 - c) * math.log(1 - p) for p, c in clipped) / len(idx)

    results: dict[str, list[float]] = {"no temperature": [], "fitted by ECE": [], "fitted by log loss": []}
    for seed in range(args.splits):
        order = list(range(len(pairs)))
        random.Random(seed).shuffle(order)
        fit, test = order[: len(order) // 2], order[len(order) // 2 :]
        by_ece = min(GRID, key=lambda t: (ece(fit, t), abs(t - 1.0)))
        by_loss = min(GRID, key=lambda t: log_loss(fit, t))
        for name, t in (("no temperature", 1.0), ("fitted by ECE", by_ece), ("fitted by log loss", by_loss)):
            results[name].append(ece(test, t))
    for name, values in results.items():
        print(f"{name:>20}: held-out ECE {statistics.mean(values):.4f} (sd {statistics.pstdev(values):.4f})")
    mean_conf, accuracy = sum(conf[1.0]) / len(pairs), sum(correct) / len(correct)
    print(f"{len(pairs)} answers: mean confidence {mean_conf:.3f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
