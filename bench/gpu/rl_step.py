"""RL step time split (generation / scoring / update) and rollout tokens/s, with the KV cache against without it.

    python bench/gpu/rl_step.py [--algorithm ppo] [--steps 4] [--prompts 32] [--samples 2] [--max-new-tokens 128]
                                [--json-out PATH]            # one GPU: a Qwen2.5-VL-3B-shaped LM, bf16 autocast
    python bench/gpu/rl_step.py --tiny [--steps 3]           # CPU: builtin:tiny-qwen2_5-vl, fp32
    python bench/gpu/rl_step.py --model builtin:demo-qwen2_5-vl --steps 5    # CPU: the demo preset's model

The rl stage's own RlTrainer runs `--steps` timed steps (after `--warmup` untimed ones) on prompts of the synthetic
world (efficacy + format rewards, no reward model), without checkpoints. Baseline, in the same process: the
same prompts sampled with `use_cache=False` (every new token re-runs the whole prefix), so the ratio shows what
the rollout engine's batched KV-cache generation buys.

GPU shape: the builtin tiny model's config with the LM widened to Qwen2.5-VL-3B's sizes (hidden 2048, 36 layers,
16 heads / 2 KV heads, intermediate 11008), random init, built on the GPU; the vocabulary stays the synthetic
world's tokenizer's (~0.6k tokens, so the LM head is far cheaper than with Qwen's 152k) and the ViT the tiny
one's. Random weights sample to max_new_tokens every time, which makes the generation phase a fixed-length,
worst-case measurement. Sized to finish in well under 5 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `components` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from components._shared.data import datasets
from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.vlm import build_student, load_vlm
from components._shared.platform.tracking import NullTracker
from components.rl import algorithms
from components.rl.config import RlConfig
from components.rl.rewards import build_rewards
from components.rl.rollout import Policy, RolloutEngine
from components.rl.stage import load_prompts
from components.rl.trainer import RlTrainer
from components.synth_world.splits import write_splits

GPU_LM = {"layers": 36, "hidden": 2048, "heads": 16, "kv_heads": 2, "intermediate": 11008}


def build_models(args, device: torch.device):
    """(policy model, frozen reference copy, processor); on a GPU the tiny model's LM is widened to GPU_LM."""
    model, processor, _ = load_vlm(args.model)
    if device.type == "cuda" and args.model == "builtin:tiny-qwen2_5-vl":
        torch.manual_seed(0)
        model = build_student(model.config, **GPU_LM)
    reference = type(model)(model.config)
    reference.load_state_dict(model.state_dict())
    if device.type == "cuda":
        reference = reference.to(torch.bfloat16)
    return model.to(device), reference.requires_grad_(False), processor


def build_trainer(
    args,
    device: torch.device,
    data: Path,
    checkpoints: Path,
    *,
    steps: int,
    data_workers: int = 0,
    image_size: tuple[int, int] = (112, 112),
    min_pixels: int | None = None,
    max_pixels: int | None = None,
):
    """(the rl stage's RlTrainer, its prompts, its policy) on a synthetic world written to `data`: efficacy + format
    rewards, no reward model, no evaluations; `args` carries model / algorithm / prompts / samples / max_new_tokens /
    pixels / threads (bench/input_pipeline.py builds its RL arm with it too)."""
    low, high = min_pixels or args.pixels, max_pixels or args.pixels
    write_splits(
        data,
        seed=11,
        eval_per_type=1,
        sft_records=max(64, args.prompts * (steps + 1)),
        preference_pairs=2,
        image_size=image_size,
    )
    cfg = RlConfig.model_validate(
        {
            "algorithm": args.algorithm,
            "min_pixels": low,
            "max_pixels": high,
            "rewards": {"efficacy": 1.0, "format": 0.2},
            "rollout": {
                "samples_per_prompt": max(args.samples, 2 if args.algorithm in ("grpo", "dapo", "gspo") else 1),
                "max_new_tokens": args.max_new_tokens,
                "batch_size": 64,
            },
            "update": {"epochs": 2, "minibatches": 2},
            "ppo": {"kl_stop": 1e9},
            "gates": {"kl_max": 0, "length_ratio_min": 0, "length_ratio_max": 0},
            "train": {
                "steps": steps,
                "samples_per_step": args.prompts,
                "eval_every": 0,
                "max_tokens_per_micro_batch": 16384 if device.type == "cuda" else 4096,
                "device": device.type,
                "threads": args.threads,
                "data_workers": data_workers,
                "log_every": steps,
            },
            "optim": {"lr": 1e-6},
        }
    )
    model, reference, processor = build_models(args, device)
    policy = Policy(model, value_head=algorithms.ALGORITHMS[args.algorithm].critic)
    encoder = ConversationEncoder(processor, model, min_pixels=low, max_pixels=high)
    prompts = load_prompts(data, cfg)
    engine = RolloutEngine(
        encoder,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        batch_size=64,
        max_tokens=cfg.train.max_tokens_per_micro_batch,
        chunk_rows=cfg.train.loss_chunk_tokens,
    )
    rewards = build_rewards(dict(cfg.rewards), reward_model_uri=None, min_pixels=low, max_pixels=high, device=device)
    trainer = RlTrainer(
        policy,
        reference,
        cfg=cfg,
        prompts=prompts,
        image=lambda ref: datasets.load_image(data, ref),
        engine=engine,
        rewards=rewards,
        checkpoints=CheckpointStore(checkpoints),
        tracker=NullTracker(),
    )
    return trainer, prompts, policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on builtin:tiny-qwen2_5-vl.")
    parser.add_argument("--model", default="builtin:tiny-qwen2_5-vl")
    parser.add_argument("--algorithm", default="ppo", choices=list(algorithms.ALGORITHMS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--pixels", type=int, default=12544, help="min = max pixels per image.")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.prompts, args.max_new_tokens, args.pixels = (
            min(args.steps, 3),
            min(args.prompts, 8),
            min(args.max_new_tokens, 16),
            3136,
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")

    with tempfile.TemporaryDirectory(prefix="qvl-rl-bench-") as tmp:
        data = Path(tmp) / "world"
        trainer, prompts, policy = build_trainer(
            args, device, data, Path(tmp) / "ckpt", steps=args.steps + args.warmup + 1
        )
        model, engine, cfg = policy.model, trainer.engine, trainer.cfg
        params = sum(p.numel() for p in model.parameters())
        steps = []
        for i in range(args.warmup + args.steps):
            indices, _ = trainer.loop.next_indices()
            records = [{**prompts[j], "pil": datasets.load_image(data, prompts[j]["image"])} for j in indices]
            metrics = trainer.rl_step(records)
            trainer.loop.step += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                steps.append({**metrics, "tokens": metrics["rollout_tokens_per_second"] * metrics["time/generation"]})

        # baseline: the same kind of batch sampled without the KV cache
        indices, _ = trainer.loop.next_indices()
        records = [{**prompts[j], "pil": datasets.load_image(data, prompts[j]["image"])} for j in indices]
        arms = {}
        for name, cache in (("kv_cache", True), ("no_cache", False)):
            engine.use_cache = cache
            torch.manual_seed(0)
            started = time.perf_counter()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                rollouts = engine.sample(policy.model.eval(), records, cfg.rollout.samples_per_prompt)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            tokens = sum(r.length for r in rollouts)
            arms[name] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}
        engine.use_cache = True

    split = {k: statistics.median(s[f"time/{k}"] for s in steps) for k in ("generation", "scoring", "update")}
    total = sum(split.values())
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
        "model": args.model if args.tiny or device.type == "cpu" else f"{args.model} widened to {GPU_LM}",
        "parameters": params,
        "algorithm": args.algorithm,
        "prompts_per_step": args.prompts,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "timed_steps": len(steps),
        "step_seconds_median": round(total, 3),
        "split_seconds": {k: round(v, 3) for k, v in split.items()},
        "split_fraction": {k: round(v / total, 3) for k, v in split.items()},
        "rollout_tokens_per_s": round(statistics.median(s["rollout_tokens_per_second"] for s in steps), 1),
        "generation_arms": arms,
        "kv_cache_speedup": round(arms["kv_cache"]["tokens_per_s"] / arms["no_cache"]["tokens_per_s"], 2),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }
    print(
        f"RL step ({args.algorithm}, {report['device']}): {report['step_seconds_median']} s = generation "
        f"{report['split_fraction']['generation']:.0%} / scoring {report['split_fraction']['scoring']:.0%} / update "
        f"{report['split_fraction']['update']:.0%}; rollout {report['rollout_tokens_per_s']} tokens/s; KV cache "
        f"{report['kv_cache_speedup']}x vs no cache"
    )
    print(json.dumps(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
