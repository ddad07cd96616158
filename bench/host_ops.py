"""Host-side work of one SFT step at Qwen2.5-VL-7B's geometry: the aten ops dispatched, SDPA loops vs varlen kernel.

    python bench/host_ops.py [--steps 2] [--seed 0] [--json]

Why: on the H200 the 7B-shaped SFT forward took ~2.1 s while its backward, with twice the arithmetic, took ~0.4 s
(docs/benchmarks.md, GPU checks): the forward is bound by the host launching work, not by the GPU. Every aten op
the host dispatches costs it Python and dispatcher time and, on a GPU, roughly one kernel launch; what a step
dispatches depends on the model's geometry (layers, ViT blocks, images, windows, samples per packed row), not on
its widths. So this counts them on the CPU, on a model with the 7B's geometry and small widths:
bench/gpu/sft_workload.py's config with every width cut (LM 28 layers, 28 / 4 heads; ViT 32 blocks with full
attention in 7/15/23/31, 112 px windows, patch 14, merge 2) and its FULL data profile (4,096-token packed rows of
4 to 12 images, 224..896 px sides: the rows sft_mfu.py trains on the GPU).

Three arms, the same model and rows: `loops` = the attention as it ran on the H200 (one SDPA call per packed sample
per LM layer, per image / window per ViT block), `varlen` = components/_shared/model/attention.py's varlen path
(one kernel call per layer and per block) with the packed row's sample bounds and target positions given by
`pack()` on the host, `varlen_found` = the same path finding them on the device (as it did before they were
given). torch's varlen kernel runs only on CUDA, so here a stand-in takes its place and counts as one op per call
each way (the kernel is one call forward and one backward); every op around it (bounds, layouts, casts) is counted
as it runs. The stand-in has the signature of torch's newer kernel API
(window_size, enable_gqa); with torch 2.10's the varlen path also repeats the KV heads (a few ops per layer more).

Counted with a TorchDispatchMode, per step, after one uncounted step (first-call work such as caches stays out):
forward + loss, split into ViT, LM and `other` (pixel normalisation, embeddings, image-token scatter, head and
loss), and backward; `kernels` = ops that are not views (a view launches nothing); `attention calls` = attention
kernels, forward and backward; `scalar reads` = `_local_scalar_dense` + `nonzero` + boolean-mask indexing (a host
sync each on a GPU; `.tolist()` of a CPU tensor dispatches nothing, so this is a lower bound).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):  # run as a script: make `components` and `bench` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.sft_workload import FULL, config_7b, step_groups  # noqa: E402
from components._shared.model import attention  # noqa: E402
from components._shared.model.head_loss import sequence_loss  # noqa: E402
from components._shared.model.packing import pack  # noqa: E402
from components._shared.model.vlm import qwen_model  # noqa: E402

SYNCS = ("_local_scalar_dense", "nonzero", "bool_index")
# What pack() gives the forward from the host (a packed row's sample bounds, its target positions); without them the
# forward finds them on the device (the `varlen_found` arm: the path before they were given).
HOST_GIVEN = ("sample_lengths", "cu_seqlens", "max_seqlen", "target_positions")
ATTENTION_OPS = ("_scaled_dot_product", "_efficient_attention", "_flash_attention", "varlen_attn")  # fwd and bwd


def geometry_config():
    """Qwen2.5-VL-7B's config with its geometry kept and its widths cut (op counts do not depend on widths)."""
    config = config_7b()
    text, vision = config.text_config, config.vision_config
    text.hidden_size, text.intermediate_size, text.vocab_size = 28 * 8, 64, 4096
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [1, 1, 2]}  # head dim 8
    special = {"image_token_id": 4000, "video_token_id": 4001, "vision_start_token_id": 4002}
    special["vision_end_token_id"] = 4003
    for name, value in special.items():
        setattr(config, name, value)
        setattr(text, name, value)
    text.bos_token_id = text.pad_token_id = 4004
    text.eos_token_id = 4005
    vision.hidden_size, vision.intermediate_size, vision.out_hidden_size = 16 * 4, 64, text.hidden_size
    return config


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched below autograd, per region; `stand_in` calls are counted as one op each."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "other"
        self.counts: Counter[tuple[str, str]] = Counter()
        self.kernels: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            self.counts[(self.region, name)] += 1
            if func is torch.ops.aten.index.Tensor and any(t is not None and t.dtype == torch.bool for t in args[1]):
                self.counts[(self.region, "bool_index")] += 1  # a nonzero inside, on the device
            if not func.is_view:
                self.kernels[self.region] += 1
        return func(*args, **(kwargs or {}))

    def count_call(self, name: str) -> None:
        self.counts[(self.region, name)] += 1
        self.kernels[self.region] += 1


class _VarlenStandIn(torch.autograd.Function):
    """Shapes of torch's varlen kernel, one counted op each way; values are not the point here."""

    @staticmethod
    def forward(ctx, counter, q, k, v):
        ctx.counter, ctx.shapes = counter, (k.shape, v.shape)
        counter.count_call("varlen_attn")
        counter.paused = True
        try:
            return q.clone()
        finally:
            counter.paused = False

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.count_call("varlen_attn_backward")
        ctx.counter.paused = True
        try:
            return None, grad.clone(), grad.new_zeros(ctx.shapes[0]), grad.new_zeros(ctx.shapes[1])
        finally:
            ctx.counter.paused = False


@contextmanager
def varlen_stand_in(counter: OpCounter, enabled: bool):
    """attention.py's varlen path on the CPU, its kernel replaced by the counting stand-in (or the loops)."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        return _VarlenStandIn.apply(counter, q, k, v)

    saved = attention._torch_varlen, attention.varlen_applies
    attention._torch_varlen = lambda: kernel
    attention.varlen_applies = lambda query, dropout: enabled and not dropout
    attention._varlen_parameters.cache_clear()
    try:
        yield
    finally:
        attention._torch_varlen, attention.varlen_applies = saved
        attention._varlen_parameters.cache_clear()


def _regions(model, counter: OpCounter) -> list:
    """Forward hooks that name the region (vit, lm) the counter is in; the rest of forward + loss is 'other'."""
    qwen = qwen_model(model)
    handles = []
    for name, module in (("vit", qwen.visual), ("lm", qwen.language_model)):
        handles.append(module.register_forward_pre_hook(lambda *_, n=name: setattr(counter, "region", n)))
        handles.append(module.register_forward_hook(lambda *_: setattr(counter, "region", "other")))
    return handles


def count_step(model, batch: dict, enabled: bool) -> dict:
    counter = OpCounter()
    handles = _regions(model, counter)
    try:
        with varlen_stand_in(counter, enabled), counter:
            counter.region = "other"
            loss_sum, n_targets = sequence_loss(model, batch, chunk_rows=1024)
            counter.region = "backward"
            (loss_sum / n_targets).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    regions = ("vit", "lm", "other", "backward")
    ops = {
        r: sum(n for (region, op), n in counter.counts.items() if region == r and op != "bool_index") for r in regions
    }
    return {
        "ops": ops,
        "ops_total": sum(ops.values()),
        "kernels": {r: counter.kernels[r] for r in regions},
        "kernels_total": sum(counter.kernels.values()),
        "scalar_reads": sum(n for (_, name), n in counter.counts.items() if name in SYNCS),
        "attention_calls": sum(n for (_, name), n in counter.counts.items() if name.startswith(ATTENTION_OPS)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="packed rows counted per arm (the fullest first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoModelForImageTextToText

    attention.register()
    torch.manual_seed(args.seed)
    model = AutoModelForImageTextToText.from_config(geometry_config(), attn_implementation=attention.PACKED_SDPA)
    attention.enable_vision_varlen(model)
    model.train()
    groups = step_groups(model, FULL, FULL.budget, args.steps, args.seed)
    rows = []
    count_step(model, pack(groups[0]), False)  # uncounted: first-call work (caches, lazy init) stays out
    for samples in groups:
        batch = pack(samples)
        device_bounds = {k: v for k, v in batch.items() if k not in HOST_GIVEN}  # as the forward ran before
        arms = {name: count_step(model, batch, name == "varlen") for name in ("loops", "varlen")}
        arms["varlen_found"] = count_step(model, device_bounds, True)
        rows.append(
            {
                "samples": len(samples),
                "images": int(batch["image_grid_thw"].shape[0]),
                "tokens": int(batch["input_ids"].numel()),
                "patches": int(batch["image_grid_thw"].prod(-1).sum()),
                **arms,
            }
        )
    print(
        f"SFT step at Qwen2.5-VL-7B's geometry (widths cut), {len(rows)} packed rows of {FULL.budget} tokens, "
        "ops dispatched per step"
    )
    header = f"{'row':>3} {'samples':>7} {'patches':>7} {'arm':>12} {'ViT fwd':>8} {'LM fwd':>7} {'other':>6}"
    print(f"{header} {'backward':>8} {'total':>7} {'kernels':>7} {'attn calls':>10} {'scalar reads':>12}")
    for k, row in enumerate(rows):
        for name in ("loops", "varlen_found", "varlen"):
            arm = row[name]
            ops = arm["ops"]
            print(
                f"{k:>3} {row['samples']:>7} {row['patches']:>7} {name:>12} {ops['vit']:>8} {ops['lm']:>7} "
                f"{ops['other']:>6} {ops['backward']:>8} {arm['ops_total']:>7} {arm['kernels_total']:>7} "
                f"{arm['attention_calls']:>10} {arm['scalar_reads']:>12}"
            )
        ratio = row["loops"]["kernels_total"] / row["varlen"]["kernels_total"]
        row["kernels_ratio"] = ratio
        print(f"    kernels per step, loops / varlen: {ratio:.2f}x")
    if args.json:
        print(json.dumps({"rows": rows, "budget": FULL.budget}))


if __name__ == "__main__":
    main()
