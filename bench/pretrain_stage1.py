"""Pretrain stage 1: optimizer steps per second with cached ViT features vs the ViT on the fly.

Both arms train the same thing (ViT frozen; the merger, and the LM with --train-lm) on the same samples with the
same shared TrainLoop; the baseline decodes each image and runs the frozen ViT every step (what stage 1 would
cost without extract_features), the cached arm reads the pre-merger rows from extract_features' safetensors
shards and runs only the merger. Measured in one process, the same number of steps each, after a warm-up step.

    python bench/pretrain_stage1.py [--model builtin:demo-qwen2_5-vl] [--steps 20] [--threads 1]

Goal: cached >= 2x the steps/s of the ViT on the fly.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop
from components._shared.model.vlm import freeze, load_vlm
from components._shared.platform.image_decode import decode_image
from components._shared.platform.tracking import NullTracker
from components.extract_features.config import ExtractFeaturesConfig
from components.extract_features.stage import run as extract
from components.pretrain.feature_store import FeatureStore
from components.synth_world.world import sample_clean_pairs

SIZES = ((112, 112), (224, 224), (168, 112), (112, 196))  # 16..64 visual tokens, lake-like aspect ratios


def build_inputs(
    root: Path, model: str, records: int, min_pixels: int, max_pixels: int, sizes: tuple[tuple[int, int], ...] = SIZES
) -> list[dict]:
    rows = []
    for k, size in enumerate(sizes):
        for image, caption in sample_clean_pairs(records // len(SIZES), seed=10 + k, size=size):
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=90)
            data = buf.getvalue()
            rows.append({"image_hash": hashlib.sha256(data).hexdigest(), "image": data, "caption": caption})
    (root / "clean/kept").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "clean/kept/part-00000.parquet")
    extract(
        ExtractFeaturesConfig(min_pixels=min_pixels, max_pixels=max_pixels, dtype="float32", decode_workers=0),
        clean_data=root / "clean",
        base_model=model,
        output_dir=root / "features",
        tracker=NullTracker(),
    )
    return rows


def time_arm(name: str, model_uri: str, rows: list[dict], root: Path, args) -> float:
    torch.manual_seed(0)
    model, processor, _ = load_vlm(model_uri)
    freeze(model, ("vision_lower", "vision_upper") + (() if args.train_lm else ("lm_lower", "lm_upper")))
    encoder = ConversationEncoder(processor, model, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    store = FeatureStore(root / "features")

    def turns(caption):
        return [{"role": "user", "text": "<image>\nDescribe the image."}, {"role": "assistant", "text": caption}]

    def cached(i):
        features, grid = store.get(rows[i]["image_hash"])
        return encoder.encode(turns(rows[i]["caption"]), grids=[grid], features=[features])

    def on_the_fly(i):
        image = decode_image(rows[i]["image"], max_image_pixels=10**8).image
        return encoder.encode(turns(rows[i]["caption"]), images=[image])

    train = TrainConfig(
        steps=args.steps + 1,
        samples_per_step=args.batch,
        max_tokens_per_micro_batch=args.budget,
        threads=args.threads,
        log_every=10**6,
    )
    sample = cached if name == "cached" else on_the_fly
    loop = TrainLoop(
        model,
        LoopSettings(train, OptimConfig(lr=1e-3), ScheduleConfig()),
        LoopData(phases=[Phase("all", args.steps + 1, list(range(len(rows))))], sample=sample),
        CheckpointStore(Path(tempfile.mkdtemp(dir=root))),
    )
    loop.train_step([sample(i) for i in range(args.batch)])  # warm-up (allocator, kernels)
    started = time.perf_counter()
    for _ in range(args.steps):
        indices, _ = loop.next_indices()
        loop.train_step([sample(i) for i in indices])
    return args.steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:demo-qwen2_5-vl")
    parser.add_argument("--records", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-pixels", type=int, default=3136)
    parser.add_argument("--max-pixels", type=int, default=50176)
    parser.add_argument("--train-lm", action="store_true", help="Also train the LM (default: merger only, as prod-7b).")
    parser.add_argument("--sizes", default="112x112,224x224,168x112,112x196", help="Image sizes HxW, comma-separated.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sizes = tuple(tuple(int(v) for v in size.split("x")) for size in args.sizes.split(","))
        rows = build_inputs(root, args.model, args.records, args.min_pixels, args.max_pixels, sizes)
        vit = time_arm("on_the_fly", args.model, rows, root, args)
        cached = time_arm("cached", args.model, rows, root, args)
    result = {
        "model": args.model,
        "steps": args.steps,
        "samples_per_step": args.batch,
        "threads": args.threads,
        "trains": "merger + LM" if args.train_lm else "merger",
        "sizes": args.sizes,
        "vit_on_the_fly_steps_per_s": round(vit, 3),
        "cached_features_steps_per_s": round(cached, 3),
        "speedup": round(cached / vit, 2),
        "goal": 2.0,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
