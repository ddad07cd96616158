"""Model FLOPs utilisation (MFU) of full SFT of a 7B-shaped Qwen2.5-VL on one GPU, with packed micro-batches.

    python bench/gpu/sft_mfu.py [--steps 10] [--warmup 3] [--budget 4096] [--grad-ckpt] [--freeze-vision]
                                [--optim adamw|adamw-fused|adamw8bit] [--attn sdpa_packed] [--peak-tflops 989]
                                [--json-out PATH]
    python bench/gpu/sft_mfu.py --tiny [--steps 3]          # CPU smoke run: builtin:tiny-qwen2_5-vl, fp32

The model is built from a config with Qwen2.5-VL-7B-Instruct's sizes (random init, nothing is downloaded): LM
hidden 3584, 28 layers, 28 heads / 4 KV heads, intermediate 18944, vocab 152064, mrope_section [16, 24, 24]; ViT
depth 32, hidden 1280, 16 heads, intermediate 3420, out_hidden 3584, full attention in blocks 7/15/23/31, window
112 px, patch 14, spatial merge 2, temporal patch 2. Weights, gradients and the AdamW state are bf16 (pure bf16,
no fp32 master copy: ~66 GB for 8.3B parameters with torch AdamW), built directly on the GPU.

Data: synthetic SFT samples built without a tokenizer (`packing.Sample`: random text ids below the special tokens,
<|vision_start|> + image pads + <|vision_end|>, labels on the answer only, M-RoPE positions from the model's own
`get_rope_index`, random pixel values of a random image size), packed first-fit-decreasing
(`plan_micro_batches`, at most `--budget` tokens) into one row per optimizer step; each step's row is packed
(`pack`) by the stages' input pipeline (`step_inputs`: `--data-workers` processes ahead of the step, pinned memory
on CUDA, a non-blocking copy), and the step's time includes waiting for it (`data_wait_share` in the JSON). Loss =
the stages' `sequence_loss` (the LM head in `--loss-chunk` rows, never the whole logits) / target tokens.
`--warmup` steps are untimed; each timed step is synchronised and the median step time counts.

MFU = model FLOPs per step / median step time / peak FLOP/s (`--peak-tflops`; default 989 = H200 bf16 dense).
Model FLOPs per step (PaLM convention: attention counted non-causal, recomputation by --grad-ckpt not counted):

    6 * P_lm * T                                   LM matmuls; P_lm = LM parameters without the input embedding
                                                   (lm_head included); T = tokens in the packed row (text + visual)
  + 12 * L * d * sum_i n_i^2                       LM attention; L layers, d = hidden, n_i = length of sample i
                                                   (= "12 * layers * hidden * seq_len_per_sample * tokens")
  + k * ((P_vit - P_merger) * p + P_merger * p/4)  ViT matmuls over p patches; the merger runs on p/4 merged rows
  + (2k) * d_vit * (F * sum_img p_img^2 + W * sum_win p_win^2)
                                                   ViT attention: F full-attention blocks over each image's
                                                   patches, W windowed blocks over each window's patches

with k = 6 when the ViT trains, 2 with --freeze-vision (forward only). The JSON on stdout (one line starting
`{`, also written to --json-out) holds tokens/s, step time, FLOPs split, MFU and peak memory.

With --tiny it runs on the CPU in fp32 (builtin:tiny-qwen2_5-vl, small images, 3 steps by default) to exercise
the code without a GPU; its MFU is against --peak-tflops or a nominal 0.1 TFLOP/s per CPU thread and is flagged
`"mfu_meaningful": false`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `components` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from components._shared.model.head_loss import sequence_loss
from components._shared.model.packing import (
    IGNORE_INDEX,
    Sample,
    pack,
    plan_micro_batches,
)
from components._shared.model.pixels import PixelNorm
from components._shared.model.step_inputs import step_inputs
from components._shared.model.vlm import qwen_model

H200_BF16_DENSE_TFLOPS = 989.0
CPU_NOMINAL_TFLOPS_PER_THREAD = 0.1
# The synthetic rows are uint8 like the stages' (components/_shared/model/pixels.py), normalised on the device.
PIXEL_NORM = PixelNorm(
    mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711), rescale_factor=1 / 255
)


@dataclass(frozen=True)
class Profile:
    """Synthetic sample shapes: image sides in patches (even), text lengths in tokens."""

    side_patches: tuple[int, int]
    prompt_tokens: tuple[int, int]
    answer_short: tuple[int, int]
    answer_medium: tuple[int, int]
    answer_long: tuple[int, int]
    budget: int


# 7B: 224..896 px sides (64..1024 visual tokens), answers from one word to ~500 tokens.
FULL = Profile((16, 64), (8, 64), (1, 8), (16, 96), (128, 512), 4096)
TINY = Profile((4, 16), (4, 24), (1, 4), (8, 32), (48, 128), 1024)


def config_7b():
    """Qwen2_5_VLConfig with the sizes of Qwen2.5-VL-7B-Instruct."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "pad_token_id": 151643,
        },
        vision_config={
            "depth": 32,
            "hidden_size": 1280,
            "num_heads": 16,
            "intermediate_size": 3420,
            "out_hidden_size": 3584,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "window_size": 112,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
            "in_channels": 3,
            "hidden_act": "silu",
        },
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    )


def build_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForImageTextToText

    if args.tiny:
        from components._shared.model.vlm import load_vlm

        model, _ = load_vlm("builtin:tiny-qwen2_5-vl", dtype=dtype, device=device)
        return model
    from components._shared.model.attention import enable_vision_varlen, register, use_varlen

    register()  # makes "sdpa_packed" (the default --attn) a valid attn_implementation
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config_7b(), dtype=dtype, attn_implementation=args.attn)
    use_varlen(args.varlen == "on")
    if args.varlen == "on":
        enable_vision_varlen(model)
    return model


def varlen_agreement(model, batch: dict, chunk: int) -> dict:
    """Loss and per-tensor gradient norms of one step with the varlen kernel off (per-sample / per-window SDPA
    loops) and on, same weights and batch: their relative differences (bf16 rounding is expected, not more)."""
    from components._shared.model.attention import enable_vision_varlen, use_varlen

    enable_vision_varlen(model)
    arms = {}
    for enabled in (False, True):
        use_varlen(enabled)
        model.zero_grad(set_to_none=True)
        loss_sum, n_targets = sequence_loss(model, batch, chunk_rows=chunk)
        (loss_sum / max(n_targets, 1)).backward()
        norms = torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
        arms[enabled] = (float(loss_sum / max(n_targets, 1)), norms)
    model.zero_grad(set_to_none=True)
    (loss_off, norms_off), (loss_on, norms_on) = arms[False], arms[True]
    return {
        "loss_off": loss_off,
        "loss_on": loss_on,
        "loss_rel_diff": abs(loss_on - loss_off) / abs(loss_off),
        "grad_norms_rel_diff": float((norms_on - norms_off).norm() / norms_off.norm()),
        "grad_norms_max_rel_diff": float(((norms_on - norms_off).abs() / norms_off.clamp_min(1e-12)).max()),
    }


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def synthetic_sample(model, rng: np.random.Generator, profile: Profile, index: int) -> Sample:
    """One user turn (prompt, image, question) and an answer (labelled), as token ids; random pixels."""
    config = qwen_model(model).config
    text = config.text_config
    specials = [
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
        text.eos_token_id,
        text.pad_token_id,
        text.bos_token_id,
    ]
    low_special = min(int(t) for t in specials if t is not None)
    vision = config.vision_config
    merge = vision.spatial_merge_size
    h, w = (merge * (_uniform(rng, profile.side_patches) // merge) for _ in range(2))
    grid = torch.tensor([[1, h, w]], dtype=torch.int64)
    n_visual = h * w // merge**2
    kind = rng.choice(3, p=[0.5, 0.3, 0.2])
    answer = _uniform(rng, (profile.answer_short, profile.answer_medium, profile.answer_long)[kind])

    def words(n: int) -> list[int]:
        return rng.integers(0, low_special, n).tolist()

    prompt, question = words(_uniform(rng, profile.prompt_tokens)), words(_uniform(rng, profile.prompt_tokens))
    ids = prompt + [config.vision_start_token_id] + [config.image_token_id] * n_visual
    ids += [config.vision_end_token_id] + question
    labels = [IGNORE_INDEX] * len(ids) + (reply := words(answer) + [text.eos_token_id])
    ids += reply
    input_ids = torch.tensor(ids, dtype=torch.int64)
    token_types = (input_ids == config.image_token_id).to(torch.int32)
    positions, _ = qwen_model(model).get_rope_index(input_ids[None], token_types[None], image_grid_thw=grid)
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    # uint8 like the encoder's rows, from their own stream: the shapes drawn above stay those of earlier runs
    pixels = torch.from_numpy(np.random.default_rng([index, 256]).integers(0, 256, (h * w, patch_dim), dtype=np.uint8))
    return Sample(
        input_ids=input_ids,
        labels=torch.tensor(labels, dtype=torch.int64),
        position_ids=positions[:, 0],
        image_grid_thw=grid,
        pixel_values=pixels,
        pixel_norm=PIXEL_NORM,
        sample_id=f"syn{index}",
    )


def step_groups(model, profile: Profile, budget: int, steps: int, seed: int) -> list[list[Sample]]:
    """The samples of `steps` packed micro-batches, fullest first: FFD over a sample pool grown until `steps` bins
    are >= 90% full."""
    rng = np.random.default_rng([seed, 31])
    samples: list[Sample] = []
    while True:
        samples += [synthetic_sample(model, rng, profile, len(samples) + i) for i in range(16)]
        groups = plan_micro_batches([s.num_tokens for s in samples], budget)
        groups.sort(key=lambda g: -sum(samples[i].num_tokens for i in g))
        full = [g for g in groups if sum(samples[i].num_tokens for i in g) >= 0.9 * budget]
        if len(full) >= steps or (len(groups) >= steps and len(samples) > 64 * steps):
            return [[samples[i] for i in g] for g in groups[:steps]]


@dataclass
class PackedStep:
    """One step's packed row, as a data worker hands it over (pinned on CUDA by the DataLoader's pin thread)."""

    batch: dict

    def pin_memory(self) -> PackedStep:
        self.batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in self.batch.items()}
        return self


def flops_per_step(model, samples: list[Sample], *, vision_trains: bool) -> dict[str, float]:
    """Model FLOPs of one optimizer step on the packed `samples` (formula in the module docstring)."""
    from transformers.vision_utils import get_vision_window_index

    qwen = qwen_model(model)
    text, vision = qwen.config.text_config, qwen.config.vision_config
    lm_params = sum(p.numel() for p in qwen.language_model.parameters())
    lm_params -= qwen.language_model.get_input_embeddings().weight.numel()
    lm_params += sum(p.numel() for p in model.lm_head.parameters())
    vit_params = sum(p.numel() for p in qwen.visual.parameters())
    merger_params = sum(p.numel() for p in qwen.visual.merger.parameters())
    tokens = sum(s.num_tokens for s in samples)
    grids = torch.cat([s.image_grid_thw for s in samples])
    per_image = grids.prod(-1)
    patches = int(per_image.sum())
    _, cu_windows = get_vision_window_index(
        grids,
        spatial_merge_size=vision.spatial_merge_size,
        window_size=vision.window_size,
        patch_size=vision.patch_size,
    )
    windows = torch.diff(cu_windows.to(torch.int64))
    full_blocks = len(vision.fullatt_block_indexes)
    k = 6 if vision_trains else 2
    parts = {
        "lm_matmul": 6.0 * lm_params * tokens,
        "lm_attention": 12.0 * text.num_hidden_layers * text.hidden_size * sum(s.num_tokens**2 for s in samples),
        "vit_matmul": float(k * ((vit_params - merger_params) * patches + merger_params * patches / 4)),
        "vit_attention": 2.0
        * k
        * vision.hidden_size
        * (
            full_blocks * float((per_image.double() ** 2).sum())
            + (vision.depth - full_blocks) * float((windows.double() ** 2).sum())
        ),
    }
    parts["total"] = sum(parts.values())
    parts.update(lm_params=float(lm_params), vit_params=float(vit_params), tokens=float(tokens), patches=float(patches))
    return parts


def make_optimizer(name: str, params, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr)
    raise ValueError(f"--optim {name!r}: choose adamw, adamw-fused or adamw8bit.")


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device, non_blocking=True)
            if value.is_floating_point():
                value = value.to(dtype)
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: builtin tiny model, fp32")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 3 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    parser.add_argument(
        "--budget", type=int, default=None, help="tokens per packed micro-batch (default 4096; 1024 with --tiny)"
    )
    parser.add_argument(
        "--loss-chunk",
        type=int,
        default=1024,
        help="target rows per LM-head chunk in the loss (train.loss_chunk_tokens); 0 = the whole logits at once",
    )
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (recompute not counted)")
    parser.add_argument(
        "--varlen",
        choices=("on", "off"),
        default="on",
        help="on: torch's flash varlen kernel for packed LM rows and the ViT (one call per layer, what the stages "
        "run on CUDA); off: per-sample / per-window SDPA loops",
    )
    parser.add_argument(
        "--check-varlen", action="store_true", help="first compare one step's loss and gradients, varlen off vs on"
    )
    parser.add_argument(
        "--profile", default=None, help="write torch.profiler's top ops of the last warm-up step (untimed) here"
    )
    parser.add_argument("--freeze-vision", action="store_true", help="train the LM (and nothing of the ViT)")
    parser.add_argument("--optim", default="adamw", choices=("adamw", "adamw-fused", "adamw8bit"))
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--attn",
        default="sdpa_packed",
        help=(
            "attn_implementation of the 7B model: sdpa_packed (per-sample SDPA on packed rows, what the stages use), "
            "flash_attention_2 (needs flash-attn), or sdpa (block-causal mask over the whole row)"
        ),
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"peak dense FLOP/s of the device in TFLOP/s (default {H200_BF16_DENSE_TFLOPS:g}, H200 "
        "bf16; with --tiny a nominal CPU figure)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (--tiny)")
    parser.add_argument(
        "--data-workers",
        type=int,
        default=None,
        help="processes packing the next steps' rows (train.data_workers; default 1 on a GPU, 0 with --tiny)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.tiny:
        device, dtype, profile = torch.device("cpu"), torch.float32, TINY
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU visible; run with --tiny for the CPU smoke run")
        device, dtype, profile = torch.device("cuda"), torch.bfloat16, FULL
    steps = args.steps or (3 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    budget = args.budget or profile.budget

    model = build_model(args, device, dtype)
    model.config.use_cache = False
    if args.grad_ckpt:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.freeze_vision:
        qwen_model(model).visual.requires_grad_(False)
    model.train()
    build_s = time.perf_counter() - started
    groups = step_groups(model, profile, budget, warmup + steps, args.seed)
    workers = args.data_workers if args.data_workers is not None else (0 if args.tiny else 1)
    optimizer = make_optimizer(args.optim, [p for p in model.parameters() if p.requires_grad], args.lr)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    agreement = None
    if args.check_varlen:
        from components._shared.model.attention import use_varlen

        agreement = varlen_agreement(model, to_device(pack(groups[0]), device, dtype), args.loss_chunk)
        use_varlen(args.varlen == "on")
        print(json.dumps({"varlen_agreement": agreement}))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, waits, losses = [], [], []
    profiler = None
    # The stages' input pipeline (step_inputs): each step's row packed by data workers ahead of the step, pinned
    # on CUDA, copied without blocking; the step's time includes waiting for it.
    inputs = step_inputs(
        list(range(len(groups))),
        lambda k: PackedStep(pack(groups[k])),
        workers=workers,
        depth=2,
        pin=device.type == "cuda",
    )
    sync()
    for i in range(len(groups)):
        if args.profile and i == max(warmup - 1, 0):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        t0 = time.perf_counter()
        batch = to_device(next(inputs).batch, device, dtype)
        waited = time.perf_counter() - t0
        try:
            optimizer.zero_grad(set_to_none=True)
            loss_sum, n_targets = sequence_loss(model, batch, chunk_rows=args.loss_chunk)
            loss = loss_sum / max(n_targets, 1)
            loss.backward()
            optimizer.step()
            sync()
        except torch.OutOfMemoryError as err:
            report = {
                "error": "out of memory",
                "step": i,
                "budget": budget,
                "grad_ckpt": args.grad_ckpt,
                "optim": args.optim,
                "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "hint": "rerun with --grad-ckpt, a smaller --budget or --optim adamw8bit",
                "message": str(err).splitlines()[0],
            }
            print(json.dumps(report, sort_keys=True))
            raise SystemExit(3) from None
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            waits.append(waited)
            losses.append(float(loss.detach()))
        if profiler is not None and i == max(warmup - 1, 0):
            profiler.__exit__(None, None, None)
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            averages = profiler.key_averages()
            table = averages.table(sort_by=key, row_limit=25, max_name_column_width=60)
            cpu_table = averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
            Path(args.profile).write_text(f"{table}\n\nby CPU time:\n{cpu_table}\n")
            profiler = None

    inputs.close()
    timed = groups[warmup:]
    flops = [flops_per_step(model, s, vision_trains=not args.freeze_vision) for s in timed]
    step_s = statistics.median(times)
    mean_flops = statistics.mean(f["total"] for f in flops)
    mean_tokens = statistics.mean(f["tokens"] for f in flops)
    if args.peak_tflops is not None:
        peak = args.peak_tflops
    else:
        peak = CPU_NOMINAL_TFLOPS_PER_THREAD * torch.get_num_threads() if args.tiny else H200_BF16_DENSE_TFLOPS
    achieved = sum(f["total"] for f in flops) / sum(times)
    if device.type == "cuda":
        memory = {
            "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "device_total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        }
        device_name = torch.cuda.get_device_name(0)
    else:
        memory = {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        device_name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} thread(s)"
    result = {
        "model": "builtin:tiny-qwen2_5-vl" if args.tiny else "qwen2_5_vl-7B-shaped (random init)",
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "attn": args.attn if not args.tiny else "sdpa_packed",
        "varlen": args.varlen if not args.tiny else "off (CPU)",
        "varlen_agreement": agreement,
        "optim": args.optim,
        "grad_ckpt": args.grad_ckpt,
        "loss_chunk": args.loss_chunk,
        "freeze_vision": args.freeze_vision,
        "params": sum(p.numel() for p in model.parameters()),
        "lm_params_no_embed": int(flops[0]["lm_params"]),
        "vit_params": int(flops[0]["vit_params"]),
        "budget": budget,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "samples_per_step": statistics.mean(len(s) for s in timed),
        "tokens_per_step": mean_tokens,
        "patches_per_step": statistics.mean(f["patches"] for f in flops),
        "step_time_s": step_s,
        "step_time_s_all": times,
        "data_workers": workers,
        "data_wait_s_median": statistics.median(waits),
        "data_wait_share": sum(waits) / sum(times),
        "tokens_per_s": sum(f["tokens"] for f in flops) / sum(times),
        "model_flops_per_step": mean_flops,
        "flops_split": {
            k: statistics.mean(f[k] for f in flops) / mean_flops
            for k in ("lm_matmul", "lm_attention", "vit_matmul", "vit_attention")
        },
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": peak,
        "mfu": achieved / (peak * 1e12),
        "mfu_meaningful": not args.tiny or args.peak_tflops is not None,
        "memory": memory,
        "loss_first_last": [losses[0], losses[-1]],
        "build_s": build_s,
        "total_s": time.perf_counter() - started,
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
    }
    if args.tiny and args.peak_tflops is None:
        result["note"] = (
            f"CPU smoke run: peak is a nominal {CPU_NOMINAL_TFLOPS_PER_THREAD} TFLOP/s per thread, MFU not meaningful"
        )
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
