"""The share of training step time spent waiting for inputs: built in the step (synchronous) vs prefetched by data
workers, on a real-resolution image mix with Qwen's real processor settings, on the CPU.

    python bench/input_pipeline.py [--steps 12] [--samples-per-step 4] [--workers 0,1,2] [--threads 1]
                                   [--model builtin:tiny-qwen2_5-vl] [--json]

Data: photo-like JPEGs at 448x448, 640x480, 1024x768 and 1280x720 (bench/decode_throughput.py's recipe), each with
a question and a sentence-long answer; a sample = decode (Pillow) + the model's processor at Qwen2.5-VL's
preprocessor defaults (min_pixels 3,136, max_pixels 12,845,056: these images keep their resolution, 256 to 1,196
visual tokens) + chat template and tokenisation, exactly what the sft stage's sampler does per record. Training:
the shared `TrainLoop` (AdamW, packed micro-batches of --budget tokens, no checkpoints until the end), one arm
per `--workers` value (`train.data_workers`; 0 = the synchronous baseline), each from the same initial weights, in
this process one after the other. Per arm: the summed `time/data_wait_s` over the summed `time/step_s` of the timed
steps (the first step, which also starts the workers, is untimed), the median step time, and whether the final
weights equal the baseline's bit for bit. Goal printed beside the numbers: wait <= 5% of step time with prefetch.
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
from components._shared.model.packing import ConversationEncoder  # noqa: E402
from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig  # noqa: E402
from components._shared.model.training import Phase, TrainLoop  # noqa: E402
from components._shared.model.vlm import load_vlm  # noqa: E402

SIZES = [(448, 448), (640, 480), (1024, 768), (1280, 720)]
MIN_PIXELS, MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL-Instruct's preprocessor_config.json
ANSWER = "The picture shows a few coloured shapes over a smooth gradient, with a short white label near the corner."


def run_arm(model, encoder, jpegs: list[bytes], workers: int, args, out: Path) -> dict:
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
        train=train,
        optim=OptimConfig(lr=1e-4),
        schedule=ScheduleConfig(),
        sample=sample,
        phases=[Phase("all", args.steps, list(range(len(jpegs))))],
        checkpoints=CheckpointStore(out / "checkpoints", scratch=out / "scratch"),
    )
    result = loop.run()
    timed = result.history[1:]
    wait = sum(h["time/data_wait_s"] for h in timed)
    total = sum(h["time/step_s"] for h in timed)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "workers": workers,
        "wait_share": wait / total,
        "step_s_median": statistics.median(h["time/step_s"] for h in timed),
        "wait_s_median": statistics.median(h["time/data_wait_s"] for h in timed),
        "tokens": result.tokens,
        "_weights": weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-qwen2_5-vl")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples-per-step", type=int, default=4)
    parser.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch")
    parser.add_argument("--workers", default="0,1,2", help="train.data_workers per arm; the first is the baseline")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    initial, processor = load_vlm(args.model)
    encoder = ConversationEncoder(processor, initial, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    jpegs = make_jpegs(args.steps * args.samples_per_step, sizes=SIZES)
    arms = []
    with tempfile.TemporaryDirectory(prefix="qvl-input-bench-") as tmp:
        for workers in (int(w) for w in args.workers.split(",")):
            arms.append(run_arm(copy.deepcopy(initial), encoder, jpegs, workers, args, Path(tmp) / f"w{workers}"))
    baseline = arms[0]
    for arm in arms:
        same = arm["_weights"].keys() == baseline["_weights"].keys() and all(
            torch.equal(arm["_weights"][k], baseline["_weights"][k]) for k in baseline["_weights"]
        )
        arm["bit_identical_to_baseline"] = same
        arm["step_time_ratio"] = arm["step_s_median"] / baseline["step_s_median"]
    for arm in arms:
        del arm["_weights"]
    print(
        f"{args.steps - 1} timed steps x {args.samples_per_step} samples ({', '.join(f'{w}x{h}' for w, h in SIZES)}; "
        f"min/max_pixels {MIN_PIXELS}/{MAX_PIXELS}), {args.threads} training thread(s), model {args.model}"
    )
    print(f"{'data_workers':>12} {'wait share':>10} {'step s':>7} {'wait s':>7} {'step x':>7} {'identical':>9}")
    for arm in arms:
        print(
            f"{arm['workers']:>12} {arm['wait_share']:>10.1%} {arm['step_s_median']:>7.2f} "
            f"{arm['wait_s_median']:>7.2f} "
            f"{arm['step_time_ratio']:>7.2f} {arm['bit_identical_to_baseline']!s:>9}"
        )
    print("goal: wait share <= 5% with prefetch (data_workers >= 1); the baseline (0) waits for every step's inputs")
    if args.json:
        print(json.dumps({"arms": arms, "steps": args.steps, "samples_per_step": args.samples_per_step}))


if __name__ == "__main__":
    main()
