"""The shared training loop: schedules, per-group optimizer, and exact resume after SIGKILL."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from components._shared.train_config import ScheduleConfig, WarmupSegment
from components._shared.training import lr_factor

ROOT = Path(__file__).resolve().parents[2]


def test_segmented_warmup_follows_seed_001():
    schedule = ScheduleConfig(decay="constant", warmup_segments=[
        WarmupSegment(fraction=0.05, lr_fraction=0.7), WarmupSegment(fraction=0.05, lr_fraction=0.7),
        WarmupSegment(fraction=0.10, lr_fraction=1.0)])
    f = [lr_factor(s, 1000, schedule) for s in range(1000)]
    assert f[0] == pytest.approx(0.7 / 50)
    assert f[49] == pytest.approx(0.7)
    assert f[50:100] == pytest.approx([0.7] * 50)
    assert f[149] == pytest.approx(0.85)
    assert f[199] == pytest.approx(1.0) and f[999] == pytest.approx(1.0)
    assert all(b >= a for a, b in zip(f, f[1:200]))


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


def _job(out: Path, backend: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    return subprocess.run([sys.executable, "-m", "tests.jobs.train_loop_job", str(out), backend], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=600)


def _resume_case(tmp_path: Path, backend: str) -> None:
    reference = _job(tmp_path / "straight", backend)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = _job(tmp_path / "killed", backend, QVL_TEST_KILL_AT_STEP=5)
    assert killed.returncode == -signal.SIGKILL
    in_write = _job(tmp_path / "killed", backend, QVL_TEST_KILL_IN_CHECKPOINT=6)  # resumes at 4, dies writing 6
    assert in_write.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".step-0000006.partial") for p in (tmp_path / "killed/checkpoints").iterdir())
    resumed = _job(tmp_path / "killed", backend)
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
    _resume_case(tmp_path, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed-2", "deepspeed-3"])
def test_sigkill_and_resume_is_bit_identical_deepspeed(tmp_path, backend):
    _resume_case(tmp_path, backend)
