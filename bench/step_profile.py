"""Where the demo's training step goes on the CPU: inputs, forward, backward, optimizer, the loop around them.

    python bench/step_profile.py [--steps 60] [--world DIR] [--json]

Why: the demo's SFT trains a 0.38M-parameter model for 1,700 steps and is the longest stage of the README's main job
(docs/benchmarks.md); its arithmetic is a few hundred MFLOPs a step, so where the step's time goes decides what can
make the demo faster. This runs the sft stage in this process as the demo preset configures it
(pipelines/presets/demo.yaml: 32 samples a step, 1,024-token packed micro-batches, full fine-tuning, its thread
count), `--steps` steps of its `all` phase from the preset's base model, with timers around the loop's parts:
`inputs` (samples built and packed for the step: in the training process, the demo's CPU setting), `forward`
(the loss function: model forward and the chunked LM-head loss), `backward`, `optimizer` (clip, AdamW, schedule)
and `loop` (the rest of the step: moving the batch, reading the loss once, logging). The first 5 steps are left
out (first-call caches). Then, on one more step: the aten ops it dispatches (forward and backward, counted below
autograd) and its FLOPs (torch's FlopCounterMode), and the baseline, run in this process: the same FLOPs as
square fp32 matmuls of the step's typical width. `step / matmul-equivalent` says how far the step is from its
arithmetic: near 1, only fewer FLOPs help; far above 1, the time is per-op overhead (dispatch, autograd, small
kernels) that fewer or fused ops cut. Needs a world (`qvl lake synth`); without --world it writes one first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WARMUP = 5
PARTS = ("inputs", "forward", "backward", "optimizer", "loop")


class OpCount(TorchDispatchMode):
    """Aten ops dispatched (views included: each is a Python-to-C++ round trip on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "forward"
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.region] += 1
        return func(*args, **(kwargs or {}))


def instrument(loop, spent: list[dict[str, float]], probe: dict) -> None:
    """Wrap the loop's parts with timers: one dict of seconds per step into `spent`; the step after `probe["at"]`
    steps also counts ops and FLOPs into `probe`."""
    from torch.utils.flop_counter import FlopCounterMode

    current: dict[str, float] = defaultdict(float)

    def timed(part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[part] += time.perf_counter() - start

        return wrapper

    loop.loss_fn = timed("forward", loop.loss_fn)
    loop.backend.backward = timed("backward", loop.backend.backward)
    loop.backend.step = timed("optimizer", loop.backend.step)
    loop.prepare = timed("inputs", loop.prepare)
    loop._items = timed("inputs", loop._items)
    plain_step = loop.train_step

    def train_step(items):
        if len(spent) == probe["at"]:
            counter, flops = OpCount(), FlopCounterMode(display=False)
            backward = loop.backend.backward

            def counted_backward(loss):
                counter.region = "backward"
                try:
                    return backward(loss)
                finally:
                    counter.region = "forward"  # the next micro-batch's forward

            loop.backend.backward = counted_backward
            with flops, counter:
                result = plain_step(items)
            loop.backend.backward = backward
            probe.update(ops=dict(counter.counts), flops=flops.get_total_flops())
            inputs = current["inputs"]  # the probe's own forward/backward/optimizer time is not the step's
            current.clear()
            current["inputs"] = inputs
        start = time.perf_counter()
        result = plain_step(items)
        current["step"] = time.perf_counter() - start
        spent.append(dict(current))
        current.clear()
        return result

    loop.train_step = train_step


def matmul_seconds(flops: float, width: int) -> float:
    """Seconds this process takes for `flops` of square fp32 matmuls of side `width` (the baseline; the fastest of
    5 timings of 1/10 of the FLOPs each, times 10, so a busy moment of the machine does not count)."""
    a, b = torch.randn(width, width), torch.randn(width, width)
    for _ in range(3):
        a @ b
    count = max(1, round(flops / 10 / (2 * width**3)))
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        timings.append(time.perf_counter() - start)
    return min(timings) * flops / (count * 2 * width**3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world", type=Path, default=None, help="A `qvl lake synth` output (default: a new one).")
    parser.add_argument("--json", action="store_true", help="Print the results as JSON instead of a table.")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")

    from components._shared.model import training
    from components._shared.platform.presets import deep_merge, read_preset_yaml, validate
    from components._shared.platform.tracking import NullTracker
    from components.sft.config import SftConfig
    from components.sft.stage import run as sft

    spent: list[dict[str, float]] = []
    probe: dict = {"at": WARMUP}
    plain_init = training.TrainLoop.__init__

    def init(self, *a, **k):
        plain_init(self, *a, **k)
        instrument(self, spent, probe)

    training.TrainLoop.__init__ = init
    preset = read_preset_yaml(ROOT / "pipelines/presets/demo.yaml", search=(ROOT / "pipelines/presets",))
    steps = args.steps + 1  # one more for the op and FLOP probe
    section = deep_merge(
        preset["sft"],
        {
            "curriculum": [{"name": "all", "steps": steps}],
            "train": {"steps": steps, "checkpoint_every": 0, "eval_every": 0},
            "eval": {"per_type": 2},
            "calibration": {"enabled": False},
        },
    )
    cfg = validate(SftConfig, "sft", section)
    with tempfile.TemporaryDirectory(prefix="qvl-step-") as scratch:
        world = args.world
        if world is None:
            world = Path(scratch) / "world"
            subprocess.run(
                [sys.executable, "-m", "pipelines.qvl.app", "lake", "synth", "--records", "200", "--out", str(world)],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
        sft(
            cfg,
            base_model=preset["base_model_uri"],
            data=str(world / "heldout"),
            output_dir=Path(scratch) / "sft",
            tracker=NullTracker(),
        )
    timed = spent[WARMUP:]
    per_step = {part: statistics.median(s.get(part, 0.0) for s in timed) for part in (*PARTS[:-1], "step")}
    per_step["loop"] = max(0.0, per_step["step"] - sum(per_step[p] for p in PARTS[1:-1]))
    per_step["total"] = per_step["inputs"] + per_step["step"]  # the inputs are built before train_step
    width = 64  # the demo LM's hidden size: its matmuls are this wide
    baseline = matmul_seconds(probe["flops"], width)
    result = {
        "steps_timed": len(timed),
        "threads": cfg.train.threads,
        "seconds_per_step": {k: round(v, 4) for k, v in per_step.items()},
        "share_of_step": {p: round(per_step[p] / per_step["total"], 3) for p in PARTS},
        "ops_per_step": probe["ops"],
        "gflops_per_step": round(probe["flops"] / 1e9, 3),
        "matmul_equivalent_s": round(baseline, 4),
        "step_over_matmul_equivalent": round(per_step["total"] / baseline, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['steps_timed']} steps timed (median), {result['threads']} thread(s)")
    for part in PARTS:
        print(f"  {part:<10} {per_step[part] * 1000:8.1f} ms  {result['share_of_step'][part]:6.1%}")
    print(f"  {'total':<10} {per_step['total'] * 1000:8.1f} ms")
    print(f"aten ops per step: {probe['ops']}; {result['gflops_per_step']} GFLOP per step")
    print(
        f"the same FLOPs as {width}x{width} matmuls: {baseline * 1000:.1f} ms; "
        f"step / matmul-equivalent = {result['step_over_matmul_equivalent']}x"
    )


if __name__ == "__main__":
    main()
