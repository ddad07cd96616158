"""Model FLOPs utilisation (MFU) of full SFT of a 7B-shaped Qwen2.5-VL on one GPU, with packed micro-batches.

    python bench/gpu/sft_mfu.py [--steps 10] [--warmup 3] [--budget 4096] [--grad-ckpt] [--freeze-vision] [--compile]
                                [--optim adamw|adamw-fused|adamw8bit] [--attn sdpa_packed] [--peak-tflops 989]
                                [--json-out PATH]
    python bench/gpu/sft_mfu.py --tiny [--steps 3]          # CPU smoke run: builtin:tiny-qwen2_5-vl, fp32

The model is built from a config with Qwen2.5-VL-7B-Instruct's sizes (random init, nothing is downloaded): LM
hidden 3584, 28 layers, 28 heads / 4 KV heads, intermediate 18944, vocab 152064, mrope_section [16, 24, 24]; ViT
depth 32, hidden 1280, 16 heads, intermediate 3420, out_hidden 3584, full attention in blocks 7/15/23/31, window
112 px, patch 14, spatial merge 2, temporal patch 2. Weights, gradients and the AdamW state are bf16 (pure bf16,
no fp32 master copy: ~66 GB for 8.3B parameters with torch AdamW), built directly on the GPU.

Workload (bench/gpu/sft_workload.py): synthetic SFT samples packed into one row of at most `--budget` tokens per
optimizer step. Each step's row is packed (`pack`) by the stages' input pipeline (`step_inputs`: `--data-workers`
processes ahead of the step, pinned memory on CUDA, a non-blocking copy), and the step's time includes waiting
for it (`data_wait_share` in the JSON). Loss = the stages' `sequence_loss` (the LM head in `--loss-chunk` rows,
never the whole logits) / target tokens. `--warmup` steps are untimed (`warmup_step_s` in the JSON); each timed
step is synchronised and the median step time counts. `--compile` compiles each LM layer and ViT block in place
(`torch.compile`, dynamic shapes; fewer, fused kernels for the eager ops around the attention); it compiles before
the timed steps (in --check-varlen's step, else the warm-up steps); not with --grad-ckpt (transformers'
checkpointed layers bypass the compiled call). On the CPU (tiny model, 2 cores) the first compile takes about 3
minutes; the loss equals the eager one, the gradients to ~2e-7 relative.

MFU = model FLOPs per step (sft_workload.flops_per_step: PaLM convention, recomputation by --grad-ckpt not
counted) / median step time / peak FLOP/s (`--peak-tflops`; default 989 = H200 bf16 dense). The JSON on stdout
(one line starting `{`, also written to --json-out) holds tokens/s, step time, FLOPs split, MFU and peak memory.

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

import torch

if __package__ in (None, ""):  # run as a script: make `components` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.sft_workload import FULL, TINY, config_7b, flops_per_step, step_groups  # noqa: E402
from components._shared.model.head_loss import sequence_loss  # noqa: E402
from components._shared.model.packing import pack  # noqa: E402
from components._shared.model.step_inputs import step_inputs
from components._shared.model.vlm import qwen_model

H200_BF16_DENSE_TFLOPS = 989.0
CPU_NOMINAL_TFLOPS_PER_THREAD = 0.1


def build_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForImageTextToText

    if args.tiny:
        from components._shared.model.vlm import load_vlm

        model = load_vlm("builtin:tiny-qwen2_5-vl", dtype=dtype, device=device).model
        return model
    from components._shared.model.attention import enable_vision_varlen, register, use_varlen

    register()  # makes "sdpa_packed" (the default --attn) a valid attn_implementation
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config_7b(), dtype=dtype, attn_implementation=args.attn)
    use_varlen(args.varlen == "on")
    if args.varlen == "on":
        enable_vision_varlen(model)
    return model


def compile_blocks(model) -> int:
    """torch.compile each LM decoder layer and ViT block in place (regional compilation: the blocks of one kind share
    their compiled code; dynamic shapes, since every packed row has its own length); returns how many. Attention's
    data-dependent bounds break each block's graph around the attention call, the rest (norms, rotary, MLP) fuses."""
    qwen = qwen_model(model)
    blocks = [*qwen.language_model.layers, *qwen.visual.blocks]
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def compiled_frames() -> int:
    """Frames torch.compile compiled in this process (0 without --compile: nothing was compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


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


@dataclass
class PackedStep:
    """One step's packed row, as a data worker hands it over (pinned on CUDA by the DataLoader's pin thread)."""

    batch: dict

    def pin_memory(self) -> PackedStep:
        self.batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in self.batch.items()}
        return self


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
        "--ckpt-every",
        type=int,
        default=1,
        help="with --grad-ckpt: recompute only every n-th block (train.checkpoint_every_n_layers; 1 = every block)",
    )
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
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each LM layer and ViT block (compile time falls in the warm-up steps, which must be >= 1)",
    )
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
    if args.compile and args.grad_ckpt:
        # transformers' checkpointed layers call Module.__call__ around the compiled one: 3 of 30 frames compiled
        parser.error("--compile with --grad-ckpt: the checkpointed layers bypass their compiled code; use one of them")
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
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=args.ckpt_every
        )
    if args.freeze_vision:
        qwen_model(model).visual.requires_grad_(False)
    if args.compile:
        compile_blocks(model)
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
    times, waits, losses, warmup_times = [], [], [], []
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
        if i < warmup:
            warmup_times.append(time.perf_counter() - t0)  # with --compile: the compile happens here
        else:
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
        "ckpt_every": args.ckpt_every if args.grad_ckpt else None,
        "compile": args.compile,
        "compiled_frames": compiled_frames(),
        "warmup_step_s": warmup_times,
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
