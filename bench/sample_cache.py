"""SFT steps with encoded samples kept for reuse vs built at every draw, on the demo's SFT recipe.

    python bench/sample_cache.py [--records 1000] [--passes 6.8] [--threads 2] [--json]

The demo's SFT draws each of its 8,000 records ~6.8 times (1,700 steps x 32 samples); building a sample (decode,
resize, normalise, tokenise, M-RoPE index) was ~40% of a CPU step. Both arms train the demo preset's SFT section
(`builtin:tiny-qwen2_5-vl`, the demo's pixels, budget and learning rate; no curriculum, no evals, no checkpoints)
on a synthetic world of `--records` records for `--passes` passes over it, in one process, the baseline
(`train.sample_cache_mb: 0`) first; each arm starts from the same fresh model. Prints seconds per step of each arm,
the ratio, the cache's hits, and checks that both arms end at the same loss (the cache changes no number).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `components` and `pipelines` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _arm(cfg_data: dict, data_dir: Path, work: Path, cache_mb: int) -> dict:
    from components._shared.data import datasets
    from components._shared.model.checkpoint import CheckpointStore
    from components._shared.model.encoder import ConversationEncoder
    from components._shared.model.vlm import set_pixel_bounds
    from components._shared.platform.tracking import NullTracker
    from components.sft.config import SftConfig
    from components.sft.stage import build_loop, build_model, load_sft_records

    cfg = SftConfig.model_validate({**cfg_data, "train": {**cfg_data["train"], "sample_cache_mb": cache_mb}})
    records = load_sft_records(data_dir, None)
    held_out = datasets.load_eval_records(data_dir, per_type=1)
    model, processor, _ = build_model(cfg, "builtin:tiny-qwen2_5-vl")
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    out = work / f"cache{cache_mb}"
    store = CheckpointStore(str(out / "checkpoints"), keep=1, scratch=out / "scratch", key="bench")
    loop, _ = build_loop(cfg, model, encoder, records, held_out, data_dir, store, NullTracker())
    started = time.perf_counter()
    result = loop.run()
    seconds = time.perf_counter() - started
    return {
        "sample_cache_mb": cache_mb,
        "steps": result.steps,
        "seconds": round(seconds, 2),
        "seconds_per_step": round(seconds / result.steps, 4),
        "final_loss": result.history[-1]["loss"],
        "cache_hits": loop.samples.hits,
        "samples_built": loop.samples.built,
        "cache_mb_used": round(loop.samples.bytes / 1e6, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--passes", type=float, default=6.8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from components.synth_world.splits import write_splits
    from pipelines.presets import load_preset

    section = dict(load_preset("demo").stages["sft"])
    per_step = section["train"]["samples_per_step"]
    steps = max(1, round(args.passes * args.records / per_step))
    section["curriculum"] = []
    section["calibration"] = {**section.get("calibration", {}), "enabled": False}
    section["train"] = {
        **section["train"],
        "steps": steps,
        "checkpoint_every": 0,
        "eval_every": 0,
        "threads": args.threads,
        "data_workers": 0,
    }
    work = Path(tempfile.mkdtemp(prefix="sample-cache-"))
    try:
        data_dir = work / "data"
        write_splits(data_dir, seed=0, eval_per_type=1, sft_records=args.records, preference_pairs=4)
        arms = [
            _arm(section, data_dir, work, cache_mb) for cache_mb in (0, section["train"].get("sample_cache_mb", 1024))
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    built, cached = arms
    summary = {
        "records": args.records,
        "passes": args.passes,
        "steps": steps,
        "arms": arms,
        "speedup": round(built["seconds_per_step"] / cached["seconds_per_step"], 2),
        "same_loss": built["final_loss"] == cached["final_loss"],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{args.records} records, {args.passes} passes = {steps} steps of {per_step} samples")
        for arm in arms:
            print(
                f"  sample_cache_mb={arm['sample_cache_mb']:>5}: {arm['seconds_per_step'] * 1000:6.1f} ms/step, "
                f"{arm['samples_built']} built, {arm['cache_hits']} from the cache ({arm['cache_mb_used']} MB), "
                f"final loss {arm['final_loss']:.6f}"
            )
        print(f"  cached / built: {summary['speedup']}x faster; same final loss: {summary['same_loss']}")
    return summary


if __name__ == "__main__":
    main()
