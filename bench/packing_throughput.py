"""Training throughput and padding efficiency of packed micro-batches against padded batches of the same samples.

    python bench/packing_throughput.py [--model builtin:demo-qwen2_5-vl] [--samples 192]
                                       [--budget auto,1024,512] [--vision-like same|7b]
                                       [--threads 1] [--repeats 2] [--batch-size 8] [--json]

The samples are a realistic SFT mix built from the synthetic world (components.synth_world.world): images of
random size and aspect ratio between 56x56 and 448x448 (min_pixels=56*56, max_pixels=448*448, so 4..256 visual
tokens each) with text from one-word VQA answers through captions to long multi-turn conversations.

Baseline (`padded`): batches of `--batch-size` samples in a random order, as a plain DataLoader would give them,
right-padded with `packing.pad`. Candidate (`packed`): the same samples, first-fit-decreasing micro-batches
(`plan_micro_batches`) of at most `--budget` tokens, each one `packing.pack` row; `--budget auto` uses the
padded batches' mean slot count (batch x width), so both arms see about the same tensor size per step; a comma list
(default `auto,1024,512`) measures one packed arm per budget.

Reported per arm: padding efficiency (real tokens / slots, `batch_tokens`; for packed also the budget fill,
real / (micro-batches x budget), the number a fixed-shape compiled step would see), and training throughput:
real tokens per CPU-second (`time.process_time`, this process, `--threads` torch threads) of one optimizer step
per batch (forward, summed token loss / target tokens, backward, AdamW step). Also printed: the vision tower's
share of the padded step (its forward+backward timed alone on the same images; packing cannot shrink it) and the
speed-up packing could reach if the LM's cost were linear in slots. `pack` puts a micro-batch in one row; the
models load with `attention.PACKED_SDPA`, which attends within each sample (the sum of per-sample length^2, as
flash-attention's varlen kernel does on a GPU). One more arm, `packed@B sdpa-mask` (B = the first budget), runs the
same packed batches with transformers' plain `sdpa`, which builds a block-causal mask and attends over the whole
row (budget^2 per row): the kernel's own gain, measured in the same process. Each arm trains its own
copy of the model; `--vision-like 7b` swaps in a random-init ViT resized so that an image token costs what it
costs in Qwen2.5-VL-7B next to a text token (`vit_to_lm_cost`; the demo model's ViT is 12x heavier than that,
which caps what packing, an LM-side saving, can show); two untimed warm-up steps each; `--repeats` epochs over all
samples, interleaved padded/packed so machine load hits both alike; the median epoch rate counts. The goals
(efficiency >= 0.98, speed-up >= 1.5x) are printed beside the numbers, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `components` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components._shared.model.encoder import ConversationEncoder, Sample
from components._shared.model.packing import (
    batch_pixels,
    batch_tokens,
    forward_logits,
    pack,
    pad,
    plan_micro_batches,
    token_loss,
)
from components._shared.model.vlm import build_student, load_vlm, qwen_model
from components.synth_world import world

MIN_SIDE, MAX_SIDE = 56, 448
MIN_PIXELS, MAX_PIXELS = 56 * 56, 448 * 448
GOAL_EFFICIENCY, GOAL_SPEEDUP = 0.98, 1.5
# Share of each conversation kind in the mix (sums to 1).
MIX = (("vqa", 0.45), ("caption", 0.30), ("multi_turn", 0.15), ("long_caption", 0.10))
VQA_KINDS = ("color", "shape", "count", "position", "relation", "grounding", "ocr")


def _scene(rng: np.random.Generator, kind: str, width: int, height: int) -> world.Scene:
    """A scene for `kind`; tiny pictures that cannot hold 2-3 objects or a word fall back to one plain object."""
    try:
        return world.scene_for(rng, kind, width, height)
    except ValueError:
        return world.random_scene(rng, width, height, n_objects=1)


def _question(scene: world.Scene, rng: np.random.Generator) -> tuple[str, str]:
    for _ in range(20):
        qa = world.ask(scene, str(rng.choice(VQA_KINDS)), rng)
        if qa is not None:
            return qa
    return world.ask(scene, "count", rng)


def make_conversation(rng: np.random.Generator) -> tuple[list[dict], object]:
    """(turns, PIL image) of one sample of the mix."""
    width, height = (int(v) for v in np.exp(rng.uniform(np.log(MIN_SIDE), np.log(MAX_SIDE), 2)))
    mix = rng.choice(len(MIX), p=[share for _, share in MIX])
    kind = MIX[mix][0]
    scene = _scene(rng, "caption" if kind != "vqa" else str(rng.choice(VQA_KINDS)), width, height)
    image = world.render(scene)
    if kind == "vqa":
        question, answer = _question(scene, rng)
        turns = [{"role": "user", "text": f"<image>\n{question}"}, {"role": "assistant", "text": answer}]
    elif kind == "caption":
        question, answer = world.ask(scene, "caption", rng)
        turns = [{"role": "user", "text": f"<image>\n{question}"}, {"role": "assistant", "text": answer}]
    elif kind == "multi_turn":
        turns = []
        for i in range(int(rng.integers(3, 7))):
            question, answer = _question(scene, rng)
            turns += [
                {"role": "user", "text": ("<image>\n" if i == 0 else "") + question},
                {"role": "assistant", "text": answer},
            ]
    else:  # a long, detailed description: several caption sentences and every object's box
        sentences = [world.caption(scene, rng) for _ in range(int(rng.integers(3, 9)))]
        boxes = [f"The {o.name} is at {world.format_box(o.box)}." for o in scene.ordered()]
        turns = [
            {"role": "user", "text": "<image>\nDescribe the image in detail."},
            {"role": "assistant", "text": " ".join(sentences + boxes)},
        ]
    return turns, image


def vit_to_lm_cost(model) -> float:
    """Matmul parameters a visual token passes through in the ViT (each of its spatial_merge^2 patches through the
    blocks, then the merger) over those a text token passes through in the LM (layers and LM head): how much
    heavier an image token is than a text token, the share of the step that packing cannot shrink."""
    qwen = qwen_model(model)
    vision = qwen.config.vision_config
    merger = sum(p.numel() for p in qwen.visual.merger.parameters())
    vit = sum(p.numel() for p in qwen.visual.parameters()) - merger
    lm = sum(p.numel() for p in qwen.language_model.parameters())
    lm += sum(p.numel() for p in model.lm_head.parameters()) - qwen.language_model.get_input_embeddings().weight.numel()
    return (vit * vision.spatial_merge_size**2 + merger) / lm


def reference_vit_to_lm_cost(name: str) -> float:
    """`vit_to_lm_cost` of a released model's shape (built on the meta device: no weights, no download)."""
    from transformers import AutoModelForImageTextToText

    from bench.gpu.sft_workload import config_7b

    configs = {"7b": config_7b}  # Qwen2.5-VL-7B-Instruct's sizes
    with torch.device("meta"):
        return vit_to_lm_cost(AutoModelForImageTextToText.from_config(configs[name]()))


def vision_like(model, name: str):
    """A random-init model with `model`'s LM and a ViT resized so that an image token costs, relative to a text
    token, about what it costs in the released model `name`. The demo model's ViT is large next to its 0.9M-
    parameter LM (an image token costs 4.2 text tokens, against 0.36 in Qwen2.5-VL-7B), which makes the ViT,
    whose work packing cannot change, a far larger share of the step than at real scale."""
    target = reference_vit_to_lm_cost(name)
    text_layers = model.config.text_config.num_hidden_layers
    depth_max = qwen_model(model).config.vision_config.depth
    best = None
    for depth in range(1, depth_max + 1):
        for width in (16, 32, 48, 64, 96, 128):
            candidate = build_student(
                model.config,
                layers=text_layers,
                vision_depth=depth,
                vision_hidden=width,
                vision_heads=width // 16,
                vision_intermediate=2 * width,
            )
            gap = abs(np.log(vit_to_lm_cost(candidate) / target))
            if best is None or gap < best[0]:
                best = (gap, candidate)
    return best[1]


def make_samples(encoder: ConversationEncoder, count: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng([seed, 2026])
    out = []
    for i in range(count):
        turns, image = make_conversation(rng)
        out.append(encoder.encode(turns, images=[image], sample_id=f"s{i}"))
    return out


def train_step(model, optimizer, batch: dict) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss_sum, n_targets = token_loss(forward_logits(model, batch), batch)
    (loss_sum / max(n_targets, 1)).backward()
    optimizer.step()


def run_epoch(model, optimizer, batches: list[dict]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one optimizer step per batch over `batches`."""
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in batches:
        train_step(model, optimizer, batch)
    return time.process_time() - cpu, time.perf_counter() - wall


def vision_epoch(model, batches: list[dict]) -> float:
    """CPU seconds of the vision tower's forward+backward alone over the batches' images (the same in every arm)."""
    visual = qwen_model(model).visual
    cpu = time.process_time()
    for batch in batches:
        out = visual(batch_pixels(batch), grid_thw=batch["image_grid_thw"])
        out.pooler_output.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - cpu


def efficiency(batches: list[dict]) -> tuple[int, int]:
    real = slots = 0
    for batch in batches:
        r, s = batch_tokens(batch)
        real, slots = real + r, slots + s
    return real, slots


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:demo-qwen2_5-vl")
    parser.add_argument("--samples", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per padded batch (the baseline)")
    parser.add_argument(
        "--budget",
        default="auto,1024,512",
        help="packed micro-batch token budget(s), comma-separated, one packed arm each; 'auto' (or 0) "
        "= the padded batches' mean slot count",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timed epochs per arm (median counts)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vision-like",
        default="same",
        choices=("same", "7b"),
        help="'same': the model as loaded; '7b': the same LM with a random-init ViT resized so an image "
        "token costs, next to a text token, what it costs in Qwen2.5-VL-7B",
    )
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model, processor, _ = load_vlm(args.model)
    if args.vision_like != "same":
        model = vision_like(model, args.vision_like)
    model.train()
    encoder = ConversationEncoder(processor, model, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    samples = make_samples(encoder, args.samples, args.seed)
    lengths = np.array([s.num_tokens for s in samples])
    visual = np.array([int(s.image_grid_thw.prod(-1).sum()) // encoder.merge_unit for s in samples])

    order = np.random.default_rng([args.seed, 7]).permutation(len(samples))
    padded = [
        pad([samples[i] for i in order[k : k + args.batch_size]], processor.tokenizer.pad_token_id)
        for k in range(0, len(samples), args.batch_size)
    ]
    pad_real, pad_slots = efficiency(padded)
    mean_slots = round(pad_slots / len(padded))
    arms: dict[str, list[dict]] = {"padded": padded}
    budgets: dict[str, int] = {}
    for item in str(args.budget).split(","):
        budget = mean_slots if item.strip() in ("0", "auto") else int(item)
        if budget < int(lengths.max()):
            print(f"budget {budget} < longest sample ({lengths.max()} tokens): raised to {lengths.max()}")
            budget = int(lengths.max())
        name = f"packed@{budget}"
        groups = plan_micro_batches([s.num_tokens for s in samples], budget)
        arms[name], budgets[name] = [pack([samples[i] for i in group]) for group in groups], budget
    first = next(iter(budgets))
    masked = f"{first} sdpa-mask"  # the same packed batches through sdpa's block-causal mask
    arms[masked], budgets[masked] = arms[first], budgets[first]

    state = {}
    for name in arms:
        arm_model = copy.deepcopy(model)
        if name == masked:
            arm_model.set_attn_implementation("sdpa")
        optimizer = torch.optim.AdamW(arm_model.parameters(), lr=1e-4)
        for batch in (arms[name] * args.warmup)[: args.warmup]:
            train_step(arm_model, optimizer, batch)
        state[name] = (arm_model, optimizer)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    vision: list[float] = []
    for _ in range(args.repeats):
        for name, batches in arms.items():
            times[name].append(run_epoch(*state[name], batches))
        vision.append(vision_epoch(state["padded"][0], padded))

    results: dict = {
        "model": args.model,
        "vision_like": args.vision_like,
        "vit_to_lm_cost": vit_to_lm_cost(model),
        "samples": len(samples),
        "batch_size": args.batch_size,
        "padded_mean_slots": mean_slots,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}",
        "real_tokens": int(lengths.sum()),
        "sample_tokens": {"min": int(lengths.min()), "median": float(np.median(lengths)), "max": int(lengths.max())},
        "visual_tokens": {"min": int(visual.min()), "median": float(np.median(visual)), "max": int(visual.max())},
        "arms": {},
    }
    for name, batches in arms.items():
        real, slots = efficiency(batches)
        assert real == pad_real == int(lengths.sum())
        cpu = statistics.median(t[0] for t in times[name])
        wall = statistics.median(t[1] for t in times[name])
        arm = results["arms"][name] = {
            "steps": len(batches),
            "real_tokens": real,
            "slots": slots,
            "efficiency": real / slots,
            "mean_slots_per_step": slots / len(batches),
            "cpu_s": cpu,
            "wall_s": wall,
            "tokens_per_cpu_s": real / cpu,
            "tokens_per_wall_s": real / wall,
        }
        if name in budgets:
            arm["budget"] = budgets[name]
            arm["budget_fill"] = real / (len(batches) * budgets[name])
    pad_arm = results["arms"]["padded"]
    # Packing saves LM slots only: the vision tower sees the same patches in every arm. If the LM's cost were
    # linear in slots, the most packing could gain is 1 / (vision + (1 - vision) * padded efficiency).
    share = min(1.0, statistics.median(vision) / pad_arm["cpu_s"])
    results["vision_share_of_padded_step"] = share
    results["linear_ceiling_speedup"] = 1.0 / (share + (1.0 - share) * pad_arm["efficiency"])
    for arm in results["arms"].values():
        arm["speedup"] = arm["tokens_per_cpu_s"] / pad_arm["tokens_per_cpu_s"]
        arm["speedup_wall"] = arm["tokens_per_wall_s"] / pad_arm["tokens_per_wall_s"]

    vit = qwen_model(model).config.vision_config
    print(
        f"ViT depth {vit.depth}, width {vit.hidden_size}: an image token costs {results['vit_to_lm_cost']:.2f} text "
        f"tokens in matmul parameters"
        + (
            ""
            if args.vision_like == "same"
            else f" (Qwen2.5-VL-{args.vision_like}: {reference_vit_to_lm_cost(args.vision_like):.2f})"
        )
    )
    print(
        f"{args.model}: {len(samples)} samples ({results['real_tokens']} real tokens; per sample "
        f"{lengths.min()}..{lengths.max()}, median {np.median(lengths):.0f}; visual {visual.min()}..{visual.max()}, "
        f"median {np.median(visual):.0f}), padded batches of {args.batch_size} (mean {mean_slots} slots), "
        f"threads={args.threads}, median of {args.repeats} interleaved epochs after {args.warmup} warm-up steps "
        f"per arm; {results['machine']}"
    )
    print(
        f"{'arm':24s} {'steps':>6s} {'slots/step':>11s} {'efficiency':>11s} {'budget fill':>12s} "
        f"{'tok/CPU-s':>10s} {'tok/wall-s':>11s} {'vs padded':>10s}"
    )
    for name, arm in results["arms"].items():
        fill = f"{arm['budget_fill']:.3f}" if "budget_fill" in arm else "-"
        print(
            f"{name:24s} {arm['steps']:6d} {arm['mean_slots_per_step']:11.0f} {arm['efficiency']:11.3f} "
            f"{fill:>12s} {arm['tokens_per_cpu_s']:10.0f} {arm['tokens_per_wall_s']:11.0f} {arm['speedup']:9.2f}x"
        )
    print(
        f"vision tower fwd+bwd: {share:.2f} of the padded step's CPU time (the same work in every arm); if the LM's "
        f"cost were linear in slots, packing could gain at most {results['linear_ceiling_speedup']:.2f}x here"
    )

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for name in budgets:
        arm = results["arms"][name]
        print(
            f"goals {name}: efficiency {arm['efficiency']:.3f} (budget fill {arm['budget_fill']:.3f}) vs padded "
            f"{pad_arm['efficiency']:.3f}, goal >= {GOAL_EFFICIENCY} -> {met(arm['efficiency'] >= GOAL_EFFICIENCY)}; "
            f"speed-up {arm['speedup']:.2f}x per CPU-s ({arm['speedup_wall']:.2f}x wall), goal >= {GOAL_SPEEDUP}x "
            f"-> {met(arm['speedup'] >= GOAL_SPEEDUP)}"
        )
    if args.json:
        print("JSON " + json.dumps(results, sort_keys=True))
    return results


if __name__ == "__main__":
    main()
