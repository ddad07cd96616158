"""A small training run on the tiny model for the exact-resume tests (run as a subprocess, killed on purpose).

    python -m tests.jobs.train_loop_job OUT [torch|deepspeed-2|deepspeed-3|deepspeed-2-offload] \
        [CHECKPOINT_ROOT (dir or s3://)]
    torchrun --nproc-per-node 2 -m tests.jobs.train_loop_job OUT deepspeed-2      (data parallel, gloo)

Trains 8 steps on world captions with a checkpoint every 2 steps into OUT/checkpoints and writes the final
trainable weights to OUT/final.safetensors. Env QVL_TEST_KILL_AT_STEP / QVL_TEST_KILL_IN_CHECKPOINT kill it;
QVL_TEST_LOSS_CHUNK sets train.loss_chunk_tokens (0 = the plain full-logits loss), QVL_TEST_DATA_WORKERS
train.data_workers (0 = inputs built in the training process), QVL_TEST_OVERLAP_COMM train.overlap_comm (0/1),
QVL_TEST_STEPS the steps (8).
"""

import os
import sys
from pathlib import Path

import torch

from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop
from components._shared.model.vlm import load_vlm
from components.synth_world.world import sample_clean_pairs

STEPS = 8


def main(out: str, backend: str = "torch", checkpoint_root: str = "") -> None:
    torch.manual_seed(0)
    model, processor, _ = load_vlm("builtin:tiny-qwen2_5-vl")
    encoder = ConversationEncoder(processor, model, min_pixels=56 * 56, max_pixels=112 * 112)
    samples = [
        encoder.encode(
            [{"role": "user", "text": "<image>\nDescribe the image."}, {"role": "assistant", "text": c}],
            images=[img],
            sample_id=str(i),
        )
        for i, (img, c) in enumerate(sample_clean_pairs(24, seed=1))
    ]
    engine, zero, offload = (backend.split("-") + ["", ""])[:3]
    steps = int(os.environ.get("QVL_TEST_STEPS", STEPS))
    train = TrainConfig(
        steps=steps,
        samples_per_step=6,
        max_tokens_per_micro_batch=160,
        checkpoint_every=2,
        keep_checkpoints=2,
        threads=1,
        backend=engine,
        zero_stage=int(zero or 2),
        log_every=1,
        offload_optimizer=offload == "offload",
        loss_chunk_tokens=int(os.environ.get("QVL_TEST_LOSS_CHUNK", TrainConfig().loss_chunk_tokens)),
        data_workers=int(os.environ["QVL_TEST_DATA_WORKERS"]) if "QVL_TEST_DATA_WORKERS" in os.environ else None,
        overlap_comm=bool(int(os.environ["QVL_TEST_OVERLAP_COMM"])) if "QVL_TEST_OVERLAP_COMM" in os.environ else None,
    )
    loop = TrainLoop(
        model,
        LoopSettings(train, OptimConfig(lr=3e-3, group_lr={"merger": 1e-3}), ScheduleConfig(warmup_steps=2), seed=3),
        LoopData(
            phases=[Phase("a", steps // 2, range(0, 12)), Phase("b", steps - steps // 2, range(24), lr_scale=0.5)],
            sample=samples.__getitem__,
        ),
        CheckpointStore(checkpoint_root or Path(out) / "checkpoints", keep=2, scratch=Path(out) / "scratch"),
    )
    result = loop.run()
    from safetensors.torch import save_file

    from components._shared.model.training import is_main_process

    with loop.backend.gathered():
        weights = {n: p.detach().float().cpu().contiguous() for n, p in loop.backend.module.named_parameters()}
    if not is_main_process():
        return
    save_file(weights, str(Path(out) / "final.safetensors"))
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    print(f"resumed_from={result.resumed_from} steps={result.steps} first_loss={first:.6f} last_loss={last:.6f}")
    print("losses=" + ",".join(f"{h['loss']:.9g}" for h in result.history))


if __name__ == "__main__":
    main(*sys.argv[1:])
