"""The shared training loop: schedules, per-group optimizer, and exact resume after SIGKILL."""

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components._shared.model.train_config import ScheduleConfig, WarmupSegment, lr_factor

ROOT = Path(__file__).resolve().parents[2]


def test_segmented_warmup_follows_seed_001():
    schedule = ScheduleConfig(
        decay="constant",
        warmup_segments=[
            WarmupSegment(fraction=0.05, lr_fraction=0.7),
            WarmupSegment(fraction=0.05, lr_fraction=0.7),
            WarmupSegment(fraction=0.10, lr_fraction=1.0),
        ],
    )
    f = [lr_factor(s, 1000, schedule) for s in range(1000)]
    assert f[0] == pytest.approx(0.7 / 50)
    assert f[49] == pytest.approx(0.7)
    assert f[50:100] == pytest.approx([0.7] * 50)
    assert f[149] == pytest.approx(0.85)
    assert f[199] == pytest.approx(1.0) and f[999] == pytest.approx(1.0)
    assert all(b >= a for a, b in itertools.pairwise(f[:200]))


def test_cosine_decay_reaches_floor():
    schedule = ScheduleConfig(decay="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, 110, schedule) == pytest.approx(0.1)
    assert lr_factor(10, 110, schedule) == pytest.approx(1.0)
    assert lr_factor(60, 110, schedule) == pytest.approx(0.55)
    assert lr_factor(110, 110, schedule) == pytest.approx(0.1)


def test_schedule_config_rejects_overlapping_settings():
    with pytest.raises(ValueError, match="warmup_steps or warmup_segments"):
        ScheduleConfig(warmup_steps=5, warmup_segments=[WarmupSegment(fraction=0.1, lr_fraction=1.0)])
    with pytest.raises(ValueError, match="sum to <= 1"):
        ScheduleConfig(warmup_segments=[WarmupSegment(fraction=0.8, lr_fraction=1.0)] * 2)


def _job(out: Path, backend: str, checkpoint_root: str = "", **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    cmd = [sys.executable, "-m", "tests.jobs.train_loop_job", str(out), backend, checkpoint_root]
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600, check=False)


def _resume_case(tmp_path: Path, backend: str, **env) -> None:
    reference = _job(tmp_path / "straight", backend, QVL_TEST_DATA_WORKERS=0)  # inputs built in-process
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = _job(tmp_path / "killed", backend, QVL_TEST_KILL_AT_STEP=5, **env)
    assert killed.returncode == -signal.SIGKILL
    in_write = _job(tmp_path / "killed", backend, QVL_TEST_KILL_IN_CHECKPOINT=6, **env)  # resumes at 4, dies at 6
    assert in_write.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".step-0000006.partial") for p in (tmp_path / "killed/checkpoints").iterdir())
    resumed = _job(tmp_path / "killed", backend, **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed_from=4 " in resumed.stdout  # step 6 was never committed, so it was never loaded
    losses = dict(kv.split("=") for kv in resumed.stdout.split() if "_loss=" in kv)
    assert float(losses["last_loss"]) < 0.9 * float(losses["first_loss"])  # it really trains
    a = (tmp_path / "straight/final.safetensors").read_bytes()
    b = (tmp_path / "killed/final.safetensors").read_bytes()
    print(f"{backend}: final weights {len(a)} bytes, identical={a == b}")
    assert a == b
    committed = sorted(p.name for p in (tmp_path / "killed/checkpoints").iterdir() if not p.name.startswith("."))
    assert committed == ["step-0000006", "step-0000008"]  # keep_checkpoints=2


def test_sigkill_and_resume_is_bit_identical_torch(tmp_path):
    """Killed and resumed with two data workers prefetching, against a straight run without workers."""
    _resume_case(tmp_path, "torch", QVL_TEST_DATA_WORKERS=2)


def test_every_backend_sums_the_gradients_of_a_steps_micro_batches(tmp_path):
    """A step of 3 micro-batches: the second step's loss (after one update) is the same under torch, ZeRO-2 and
    ZeRO-3. The loop calls the module, not DeepSpeed's engine, so the backend closes each backward before the next
    forward as the engine would; without that ZeRO-3 kept only the last micro-batch's gradients (step 1's gradient
    norm 0.71 instead of 2.14, the second loss 6.187 instead of 6.055)."""
    losses = {}
    for backend in ("torch", "deepspeed-2", "deepspeed-3"):
        done = _job(tmp_path / backend, backend, QVL_TEST_STEPS=2)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[backend] = [float(x) for x in done.stdout.split("losses=")[1].split()[0].split(",")]
    print(losses)
    assert losses["torch"][1] < 0.97 * losses["torch"][0]  # one update moved it
    for backend in ("deepspeed-2", "deepspeed-3"):
        assert losses[backend] == pytest.approx(losses["torch"], rel=1e-5), backend


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed-2", "deepspeed-3", "deepspeed-2-offload"])
def test_sigkill_and_resume_is_bit_identical_deepspeed(tmp_path, backend):
    _resume_case(tmp_path, backend, QVL_TEST_DATA_WORKERS=1)  # inputs prefetched by a worker


def _torchrun(out: Path, backend: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.jobs.train_loop_job",
        str(out),
        backend,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.slow
def test_two_process_zero2_matches_one_process_and_resumes_exactly(tmp_path):
    """Data parallel over 2 processes (gloo): the same steps as 1 process up to summation order; a SIGKILL of the
    job and a restart ends bit-identical to the uninterrupted 2-process run, which reduced its gradients with
    train.overlap_comm on (the CPU's side stream is the main one: same sums, same order)."""
    from safetensors.torch import load_file

    single = _job(tmp_path / "single", "deepspeed-2")
    assert single.returncode == 0, single.stderr[-3000:]
    double = _torchrun(tmp_path / "double", "deepspeed-2", QVL_TEST_OVERLAP_COMM=1)
    assert double.returncode == 0, double.stderr[-3000:]
    a, b = load_file(str(tmp_path / "single/final.safetensors")), load_file(str(tmp_path / "double/final.safetensors"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"2 processes vs 1: max abs weight difference {diff:.2e}")
    assert diff < 1e-4
    killed = _torchrun(tmp_path / "killed", "deepspeed-2", QVL_TEST_KILL_AT_STEP=5, QVL_TEST_OVERLAP_COMM=0)
    assert killed.returncode != 0
    resumed = _torchrun(tmp_path / "killed", "deepspeed-2", QVL_TEST_OVERLAP_COMM=0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    c = load_file(str(tmp_path / "killed/final.safetensors"))
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_checkpoints_on_s3_resume_bit_identical(tmp_path, s3_env):
    """Checkpoints published to S3 (SeaweedFS): a killed run resumes from the bucket and ends bit-identical."""
    from components._shared.platform import storage

    root = f"{s3_env.uri}/ckpt"
    reference = _job(tmp_path / "straight", "torch")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert _job(tmp_path / "killed", "torch", root, QVL_TEST_KILL_AT_STEP=5).returncode == -signal.SIGKILL
    assert [u.rsplit("/", 1)[1] for u in storage.list_committed(root)] == ["step-0000002", "step-0000004"]
    resumed = _job(tmp_path / "resumed", "torch", root)  # a fresh machine: nothing local, only the bucket
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed_from=4 " in resumed.stdout
    assert (tmp_path / "straight/final.safetensors").read_bytes() == (
        tmp_path / "resumed/final.safetensors"
    ).read_bytes()
    assert [u.rsplit("/", 1)[1] for u in storage.list_committed(root)] == ["step-0000006", "step-0000008"]


def test_gradient_checkpointing_of_every_block_or_every_second_gives_the_same_gradients():
    import numpy as np
    from PIL import Image
    from transformers.modeling_layers import GradientCheckpointingLayer

    from components._shared.model.encoder import ConversationEncoder
    from components._shared.model.packing import forward_logits, pack, token_loss
    from components._shared.model.vlm import load_vlm

    grads, checkpointed = [], []
    for every in (0, 1, 2):  # off, every block, every second block (train.checkpoint_every_n_layers)
        torch.manual_seed(0)
        model, processor, _ = load_vlm("builtin:tiny-qwen2_5-vl")
        model.train()
        if every:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every
            )
        blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        checkpointed.append(sum(m.gradient_checkpointing for m in blocks))
        encoder = ConversationEncoder(processor, model, min_pixels=3136, max_pixels=12544)
        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (84, 112, 3), dtype=np.uint8))
        batch = pack(
            [
                encoder.encode(
                    [{"role": "user", "text": "<image>\nColor?"}, {"role": "assistant", "text": "red"}], images=[image]
                )
                for _ in range(2)
            ]
        )
        loss, _ = token_loss(forward_logits(model, batch), batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert checkpointed == [0, len(blocks), (len(blocks) + 1) // 2] and len(blocks) >= 4
    for other in grads[1:]:
        assert all(torch.allclose(grads[0][n], other[n], atol=1e-6) for n in grads[0])


def test_a_non_finite_loss_or_gradient_norm_stops_the_run():
    from components._shared.model.training import NonFiniteTraining, check_finite

    check_finite({"loss": 1.0, "grad_norm/lm_upper": 3.0, "kl": float("nan")}, 1)  # only losses and norms count
    with pytest.raises(NonFiniteTraining, match=r"step 4: \{'loss': nan\} is not finite; nothing of this step"):
        check_finite({"loss": float("nan"), "lr": 0.1}, 4)
    with pytest.raises(NonFiniteTraining, match="grad_norm/merger"):
        check_finite({"loss": 1.0, "grad_norm/merger": float("inf")}, 2)


def test_the_data_order_says_how_often_it_repeats_its_records(caplog):
    from components._shared.model.data_order import DataOrder, Phase

    with caplog.at_level("INFO", logger="components._shared.model.data_order"):
        DataOrder([Phase("all", 30, range(10))], seed=0, samples_per_step=16, steps=30)
        DataOrder([Phase("basic", 10, range(400)), Phase("all", 20, range(800))], seed=0, samples_per_step=16, steps=30)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(warned) == 1 and "over 10 records = 48.0 passes" in warned[0]
    assert "fewer than train.samples_per_step=16" in warned[0]
    assert said == [
        "phase 'basic': 10 steps x 16 samples over 400 records = 0.4 passes over its data",
        "phase 'all': 20 steps x 16 samples over 800 records = 0.4 passes over its data",
    ]


def test_fused_adamw_where_asked_and_equal_to_the_foreach_update():
    """auto fuses only where every parameter is on a GPU (never on this CPU, nor offloaded); `on` fuses on the CPU
    too, and its update equals the multi-tensor one to float rounding."""
    from components._shared.model.backends import adamw
    from components._shared.model.train_config import OptimConfig

    def trained(setting: str):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
        optimizer = adamw([{"params": params, "lr": 1e-2}], OptimConfig(fused=setting, weight_decay=0.1))
        for step in range(4):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            optimizer.step()
        return optimizer, torch.cat([p.detach().flatten() for p in params])

    (auto, a), (on, b), (off, c) = trained("auto"), trained("on"), trained("off")
    assert not auto.defaults["fused"] and on.defaults["fused"] is True and not off.defaults["fused"]
    assert torch.equal(a, c) and torch.allclose(a, b, atol=1e-6) and not torch.equal(a, torch.zeros_like(a))
