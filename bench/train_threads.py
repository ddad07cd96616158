"""Training step speed of the demo's tiny model by torch intra-op thread count (`train.threads`), on the CPU.

    python bench/train_threads.py [--threads 2,1] [--steps 80] [--repeats 3] [--world DIR] [--json]

Why: the demo's model is 0.38M parameters (hidden 64, 2 LM layers, 2 ViT blocks); every matmul of its step is a
few hundred kFLOPs, so splitting ops over threads buys little arithmetic and pays a barrier per op. This runs the
sft stage as the demo preset configures it (pipelines/presets/demo.yaml: 32 samples a step, 1,024-token packed
micro-batches, full fine-tuning), `--steps` steps of its `all` phase from the builtin tiny Qwen2.5-VL, one process per
arm and repeat, the arms interleaved (arm A, arm B, arm A, ...) so a machine that slows down mid-run slows every arm;
only `train.threads` differs. Per arm: the stage's own tokens/s (training steps only), its median over the repeats,
the ratio to the first arm's median, and the final training loss (thread counts change float summation order, so
the losses differ in their last digits: a different, equally valid run, not a bug). Needs a world (`qvl lake
synth`); without --world it writes a 200-record one to a temporary folder first. About 4 minutes at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_arm(threads: int, world: Path, steps: int, out: Path) -> dict:
    """One sft stage run at `threads`; its tokens/s and final loss."""
    command = [
        sys.executable,
        "-m",
        "components.sft",
        "--config",
        str(ROOT / "pipelines/presets/demo.yaml"),
        "--data",
        str(world / "heldout"),
        "--base-model",
        "builtin:tiny-qwen2_5-vl",
        "--output-dir",
        str(out),
        f"curriculum=[{{name: all, steps: {steps}}}]",
        f"train.steps={steps}",
        f"train.threads={threads}",
        "train.checkpoint_every=0",
        "train.eval_every=0",
        "eval.per_type=2",
        "calibration.enabled=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{out.parent}/mlflow.db"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"sft at {threads} thread(s) failed:\n{proc.stderr[-3000:]}")
    metrics = json.loads((out / "_stage_result.json").read_text())["metrics"]
    return {"tokens_per_second": metrics["tokens_per_second"], "loss": metrics["train_loss_final"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="2,1", help="Comma-separated thread counts; the first is the baseline.")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=Path, default=None, help="A `qvl lake synth` output (default: a new one).")
    parser.add_argument("--json", action="store_true", help="Print the results as JSON instead of a table.")
    args = parser.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory(prefix="qvl-threads-") as scratch:
        world = args.world
        if world is None:
            world = Path(scratch) / "world"
            subprocess.run(
                [sys.executable, "-m", "pipelines.qvl.app", "lake", "synth", "--records", "200", "--out", str(world)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                check=True,
                capture_output=True,
            )
        runs: dict[int, list[dict]] = {t: [] for t in counts}
        for repeat in range(args.repeats):
            for threads in counts:
                runs[threads].append(run_arm(threads, world, args.steps, Path(scratch) / f"t{threads}-{repeat}"))
    base = statistics.median(r["tokens_per_second"] for r in runs[counts[0]])
    rows = []
    for threads in counts:
        speeds = [r["tokens_per_second"] for r in runs[threads]]
        rows.append(
            {
                "threads": threads,
                "tokens_per_second": [round(s) for s in speeds],
                "median": round(statistics.median(speeds)),
                "x_baseline": round(statistics.median(speeds) / base, 2),
                "loss_final": runs[threads][0]["loss"],
                "loss_same_every_repeat": len({r["loss"] for r in runs[threads]}) == 1,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'threads':>7} {'tokens/s per repeat':>28} {'median':>8} {'x':>6} {'final loss':>20} {'repeatable':>10}")
    for row in rows:
        speeds = " / ".join(str(s) for s in row["tokens_per_second"])
        print(
            f"{row['threads']:>7} {speeds:>28} {row['median']:>8} {row['x_baseline']:>6.2f} "
            f"{row['loss_final']:>20.16f} {row['loss_same_every_repeat']!s:>10}"
        )


if __name__ == "__main__":
    main()
