"""The share of training step time spent waiting for inputs: built in the step (synchronous) vs prefetched by data
workers, on a real-resolution image mix with Qwen's real processor settings, on the CPU.

    python bench/input_pipeline.py [--steps 12] [--samples-per-step 4] [--workers 0,1,2,1:float32] [--threads 1]
                                   [--model builtin:tiny-qwen2_5-vl] [--json]
    python bench/input_pipeline.py --stage rl [--steps 12] [--samples-per-step 4] [--workers 0,1]

Data: photo-like JPEGs at 448x448, 640x480, 1024x768 and 1280x720 (bench/decode_throughput.py's recipe), each with
a question and a sentence-long answer; a sample = decode (Pillow) + the model's processor at Qwen2.5-VL's
preprocessor defaults (min_pixels 3,136, max_pixels 12,845,056: these images keep their resolution, 256 to 1,196
visual tokens) + chat template and tokenisation, exactly what the sft stage's sampler does per record. Training:
the shared `TrainLoop` (AdamW, packed micro-batches of --budget tokens, no checkpoints until the end), one arm
per `--workers` value (`train.data_workers`; 0 = the synchronous baseline), each from the same initial weights, in
this process one after the other. Per arm: the summed `time/data_wait_s` over the summed `time/step_s` of the timed
steps (the first step, which also starts the workers, is untimed), the median step time, and whether the final
weights equal the baseline's bit for bit. Goal printed beside the numbers: wait <= 5% of step time with prefetch.

`--stage rl`: the rl stage's own loop (`RlTrainer.run`, PPO, 2 samples per prompt, efficacy + format rewards, the
tiny model) on a synthetic world rendered at 1024x768 (1,000 visual tokens per prompt at Qwen2.5-VL's min/max
pixels), `--samples-per-step` prompts per step. What a data worker builds ahead there is each step's prompts:
image decode, grounding frame, processor and chat template (rollouts, scoring and the update need the current
model and stay in the step). Step time = the wait + generation + scoring + update.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from PIL import Image

if __package__ in (None, ""):  # run as a script: make `components` and `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_throughput import make_jpegs  # noqa: E402
from components._shared.model.checkpoint import CheckpointStore  # noqa: E402
from components._shared.model.encoder import ConversationEncoder  # noqa: E402
from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig  # noqa: E402
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop  # noqa: E402
from components._shared.model.vlm import load_vlm  # noqa: E402

RL_IMAGE = (1024, 768)

SIZES = [(448, 448), (640, 480), (1024, 768), (1280, 720)]
MIN_PIXELS, MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL-Instruct's preprocessor_config.json
ANSWER = "The picture shows a few coloured shapes over a smooth gradient, with a short white label near the corner."


def run_arm(model, encoder, jpegs: list[bytes], workers: int, pixels: str, args, out: Path) -> dict:
    """One training run with `workers` data workers; `pixels` "float32" gives the samples the processor's normalised
    rows instead of the encoder's uint8 ones (the transfer through the workers' queue then carries 4x the bytes)."""

    def sample(i: int):
        image = Image.open(io.BytesIO(jpegs[i])).convert("RGB")
        turns = [
            {"role": "user", "text": f"<image>\nWhat is in picture {i}?"},
            {"role": "assistant", "text": ANSWER},
        ]
        return encoder.encode(turns, images=[image], sample_id=str(i))

    train = TrainConfig(
        steps=args.steps,
        samples_per_step=args.samples_per_step,
        max_tokens_per_micro_batch=args.budget,
        threads=args.threads,
        data_workers=workers,
        log_every=args.steps,
    )
    loop = TrainLoop(
        model,
        LoopSettings(train, OptimConfig(lr=1e-4), ScheduleConfig()),
        LoopData(phases=[Phase("all", args.steps, list(range(len(jpegs))))], sample=sample),
        CheckpointStore(out / "checkpoints", scratch=out / "scratch"),
    )
    norm = encoder.pixel_norm
    if pixels == "float32":
        encoder.pixel_norm = None  # the processor normalises: float32 rows, as before uint8 rows existed
    try:
        result = loop.run()
    finally:
        encoder.pixel_norm = norm
    timed = result.history[1:]
    wait = sum(h["time/data_wait_s"] for h in timed)
    total = sum(h["time/step_s"] for h in timed)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "workers": workers,
        "pixels": pixels,
        "wait_share": wait / total,
        "step_s_median": statistics.median(h["time/step_s"] for h in timed),
        "wait_s_median": statistics.median(h["time/data_wait_s"] for h in timed),
        "tokens": result.tokens,
        "_weights": weights,
    }


def run_rl_arm(workers: int, args, out: Path) -> dict:
    """The rl stage's loop with `train.data_workers = workers`, from the same initial weights and seed per arm."""
    from bench.gpu.rl_step import build_trainer

    setup = argparse.Namespace(
        model=args.model,
        tiny=True,
        algorithm="ppo",
        prompts=args.samples_per_step,
        samples=2,
        max_new_tokens=args.rl_new_tokens,
        pixels=None,
        threads=args.threads,
    )
    torch.manual_seed(0)
    trainer, _, policy = build_trainer(
        setup,
        torch.device("cpu"),
        out / "world",
        out / "checkpoints",
        steps=args.steps,
        data_workers=workers,
        image_size=RL_IMAGE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    torch.manual_seed(1)
    trainer.run(None)
    timed = trainer.loop.history[1:]
    steps = [h["time/data_wait_s"] + h["time/generation"] + h["time/scoring"] + h["time/update"] for h in timed]
    wait = [h["time/data_wait_s"] for h in timed]
    return {
        "workers": workers,
        "pixels": "uint8",
        "wait_share": sum(wait) / sum(steps),
        "step_s_median": statistics.median(steps),
        "wait_s_median": statistics.median(wait),
        "_weights": {n: p.detach().clone() for n, p in policy.named_parameters()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("sft", "rl"), default="sft", help="the training loop measured")
    parser.add_argument("--model", default="builtin:tiny-qwen2_5-vl")
    parser.add_argument("--rl-new-tokens", type=int, default=16, help="max_new_tokens of the RL rollouts")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples-per-step", type=int, default=4)
    parser.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch")
    parser.add_argument(
        "--workers",
        default="0,1,2,1:float32",
        help="train.data_workers per arm, the first the baseline; N:float32 = N workers carrying the processor's "
        "float32 rows instead of uint8 ones (sft only)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arms = []
    with tempfile.TemporaryDirectory(prefix="qvl-input-bench-") as tmp:
        specs = [(int(w), p or "uint8") for w, _, p in (a.partition(":") for a in args.workers.split(","))]
        unknown = sorted({p for _, p in specs} - {"uint8", "float32"})
        if unknown:
            parser.error(f"--workers: pixel rows {unknown} unknown; write N (uint8 rows) or N:float32.")
        if args.stage == "rl":
            specs = [(w, p) for w, p in specs if p == "uint8"]
            for workers, _ in specs:
                arms.append(run_rl_arm(workers, args, Path(tmp) / f"w{workers}"))
        else:
            torch.manual_seed(0)
            initial, processor, _ = load_vlm(args.model)
            encoder = ConversationEncoder(processor, initial, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
            jpegs = make_jpegs(args.steps * args.samples_per_step, sizes=SIZES)
            # uint8 row bytes from the sizes the model sees (headers only): patches x C*T*P*P values of one byte
            image_processor = encoder.image_processor
            values = 3 * image_processor.temporal_patch_size * image_processor.patch_size**2
            sizes = [encoder.model_image_size(Image.open(io.BytesIO(j))) for j in jpegs]
            patches = [w * h // image_processor.patch_size**2 for w, h in sizes]
            rows_mb = sum(patches) * values / len(jpegs) * args.samples_per_step / 1e6
            for k, (workers, pixels) in enumerate(specs):
                model = copy.deepcopy(initial)
                arms.append(run_arm(model, encoder, jpegs, workers, pixels, args, Path(tmp) / f"arm{k}"))
    baseline = arms[0]
    for arm in arms:
        same = arm["_weights"].keys() == baseline["_weights"].keys() and all(
            torch.equal(arm["_weights"][k], baseline["_weights"][k]) for k in baseline["_weights"]
        )
        arm["bit_identical_to_baseline"] = same
        arm["step_time_ratio"] = arm["step_s_median"] / baseline["step_s_median"]
    for arm in arms:
        del arm["_weights"]
    images = f"{RL_IMAGE[0]}x{RL_IMAGE[1]}" if args.stage == "rl" else ", ".join(f"{w}x{h}" for w, h in SIZES)
    print(
        f"{args.stage}: {args.steps - 1} timed steps x {args.samples_per_step} samples ({images}; "
        f"min/max_pixels {MIN_PIXELS}/{MAX_PIXELS}), {args.threads} training thread(s), model {args.model}"
    )
    if args.stage == "sft":
        print(f"pixel rows per step: {rows_mb:.1f} MB as uint8, {4 * rows_mb:.1f} MB as float32")
    header = f"{'data_workers':>12} {'pixels':>7} {'wait share':>10} {'step s':>7} {'wait s':>7} {'step x':>7}"
    print(f"{header} {'identical':>9}")
    for arm in arms:
        print(
            f"{arm['workers']:>12} {arm['pixels']:>7} {arm['wait_share']:>10.1%} {arm['step_s_median']:>7.2f} "
            f"{arm['wait_s_median']:>7.2f} "
            f"{arm['step_time_ratio']:>7.2f} {arm['bit_identical_to_baseline']!s:>9}"
        )
    print("goal: wait share <= 5% with prefetch (data_workers >= 1); the baseline (0) waits for every step's inputs")
    if args.json:
        print(
            json.dumps(
                {"stage": args.stage, "arms": arms, "steps": args.steps, "samples_per_step": args.samples_per_step}
            )
        )


if __name__ == "__main__":
    main()
