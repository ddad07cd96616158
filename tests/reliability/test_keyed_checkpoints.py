"""Checkpoints are keyed and every output / checkpoint root has one writer (issue 21, item 1).

A checkpoint carries the key of what produced it (stage config, data and input models by content, package
version); a run resumes only its own key's checkpoints, keeps any other set aside and says so. A second run into
an output directory (or checkpoint root) in use fails at once, naming the holder.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from components._shared.model import checkpoint as ckpt
from components._shared.platform import locks
from components._shared.platform.tracking import NullTracker
from components.synth_world.splits import write_splits
from tests.stage_cli import run_stage_cli

BASE = "builtin:tiny-qwen2_5-vl"


def _sft_config(**train) -> dict:
    return {
        "mode": "full",
        "min_pixels": 3136,
        "max_pixels": 3136,
        "calibration": {"enabled": False},
        "train": {"steps": 2, "samples_per_step": 4, "max_tokens_per_micro_batch": 512, "threads": 1, **train},
        "optim": {"lr": 0.01},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
    }


def _sft(config: dict, data, out):
    from components.sft.config import SftConfig
    from components.sft.stage import run

    return run(SftConfig.model_validate(config), base_model=BASE, data=str(data), output_dir=out, tracker=NullTracker())


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("worlds")
    for seed in (1, 2):
        write_splits(root / f"w{seed}", seed=seed, eval_per_type=1, sft_records=12, preference_pairs=4)
    return root


def test_rerun_into_a_finished_output_with_other_data_and_settings_trains_afresh(worlds, tmp_path):
    out = tmp_path / "sft"
    first = _sft(_sft_config(), worlds / "w1", out)
    assert first["resumed_from_step"] == -1
    before = _weights(out)

    again = _sft(_sft_config(), worlds / "w1", out)  # the same run retried: resumes its final checkpoint
    assert again["resumed_from_step"] == 2
    assert all(torch.equal(before[k], v) for k, v in _weights(out).items())

    config = _sft_config()
    config["optim"]["lr"] = 0.5
    other = _sft(config, worlds / "w2", out)
    assert other["resumed_from_step"] == -1, "a run with other data and settings resumed a finished run"
    after = _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the old model was exported again"
    stale = sorted(tmp_path.glob("sft/checkpoints.stale-*"))
    assert len(stale) == 1 and sorted(p.name for p in stale[0].glob("step-*")) == ["step-0000002"]
    assert "set aside" in (out / "report.md").read_text()
    key = json.loads((out / "checkpoints" / "step-0000002" / ckpt.KEY_FILE).read_text())["key"]
    assert key != json.loads((stale[0] / "step-0000002" / ckpt.KEY_FILE).read_text())["key"]


def test_checkpoint_uri_with_data_edited_in_place_starts_fresh_but_moved_data_resumes(worlds, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(worlds / "w1", data)
    config = _sft_config(checkpoint_uri=str(tmp_path / "ckpt"))
    assert _sft(config, data, tmp_path / "a")["resumed_from_step"] == -1

    moved = tmp_path / "moved"
    shutil.copytree(data, moved)  # same content at another path: the same run
    assert _sft(config, moved, tmp_path / "b")["resumed_from_step"] == 2

    lines = (data / "sft.jsonl").read_text().splitlines()
    (data / "sft.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # edited in place, same path
    assert _sft(config, data, tmp_path / "c")["resumed_from_step"] == -1


def test_fingerprint_is_content_not_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jsonl").write_text('{"id": 1}\n')
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    key = ckpt.fingerprint({"lr": 1}, {"data": str(tmp_path / "a")})
    assert ckpt.fingerprint({"lr": 1}, {"data": str(tmp_path / "b")}) == key
    assert ckpt.fingerprint({"lr": 2}, {"data": str(tmp_path / "a")}) != key
    (tmp_path / "b" / "x.jsonl").write_text('{"id": 2}\n')
    assert ckpt.fingerprint({"lr": 1}, {"data": str(tmp_path / "b")}) != key
    assert ckpt.fingerprint({"lr": 1}, {"data": "builtin:tiny"}) != ckpt.fingerprint({"lr": 1}, {"data": "builtin:x"})


def test_a_second_run_into_an_output_in_use_fails_at_once_naming_the_holder(worlds, tmp_path):
    out = tmp_path / "sft"
    config = _sft_config(steps=6)
    cfg_file = tmp_path / "a.yaml"
    import yaml

    cfg_file.write_text(yaml.safe_dump({"sft": config}))
    cmd = [sys.executable, "-m", "components.sft", "--config", str(cfg_file), "--output-dir", str(out)]
    cmd += ["--base-model", BASE, "--data", str(worlds / "w1")]
    env = {"OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    first = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    holder = out / locks.HOLDER_FILE
    deadline = time.time() + 120
    while not holder.is_file() and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert holder.is_file(), "the first run never took the output's lock"

    config["optim"]["lr"] = 0.5
    started = time.time()
    second = run_stage_cli("sft", config, out, {"base_model": BASE, "data": worlds / "w1"})
    assert second.returncode != 0
    assert f"pid {first.pid}" in second.stderr and "in use" in second.stderr
    assert "Traceback" not in second.stderr
    assert time.time() - started < 60  # refused before any model is built (the CLI's imports take most of it)

    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert not holder.exists()  # released
    metrics = json.loads((out / "_stage_result.json").read_text())
    assert metrics["status"] == "succeeded"


def test_local_lock_is_exclusive_reentrant_and_released(tmp_path):
    with locks.scope():
        locks.hold(tmp_path / "out", purpose="test")
        locks.hold(tmp_path / "out" / "checkpoints", purpose="test")  # inside a held folder: no second lock
        holder = json.loads((tmp_path / "out" / locks.HOLDER_FILE).read_text())
        assert holder["pid"] == os.getpid()
        probe = subprocess.run(
            [sys.executable, "-c", _HOLD_SNIPPET, str(tmp_path / "out")], capture_output=True, text=True, check=False
        )
        assert probe.returncode == 3 and "in use" in probe.stdout, probe.stdout + probe.stderr
    assert not (tmp_path / "out" / locks.HOLDER_FILE).exists()
    probe = subprocess.run([sys.executable, "-c", _HOLD_SNIPPET, str(tmp_path / "out")], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stdout + probe.stderr


_HOLD_SNIPPET = """
import sys
from components._shared.platform import locks
try:
    with locks.scope():
        locks.hold(sys.argv[1], purpose="probe")
except locks.LockHeld as err:
    print(err); sys.exit(3)
"""


def test_unwritable_output_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(locks.OutputUnusable, match="not writable"), locks.scope():
        locks.hold(tmp_path / "file" / "out", purpose="sft output")  # a path under a file
    with pytest.raises(locks.OutputUnusable, match="not writable"), locks.scope():
        locks.hold("/sys/qvl-out", purpose="sft output")  # read-only for every user, root included


def test_unwritable_output_stage_cli_says_so_without_traceback(worlds, tmp_path):
    started = time.time()
    done = run_stage_cli("sft", _sft_config(), tmp_path / "sft", {"base_model": BASE, "data": worlds / "w1"})
    assert done.returncode == 0, done.stderr[-2000:]
    quick = time.time() - started
    (tmp_path / "blocker").write_text("x")
    out = tmp_path / "blocker" / "sft"
    started = time.time()
    done = run_stage_cli("sft", _sft_config(), out, {"base_model": BASE, "data": worlds / "w1"}, beside=tmp_path)
    said = "which is a file, not a directory" in done.stderr
    assert done.returncode == 2 and said and "Traceback" not in done.stderr
    assert time.time() - started < quick  # found before the work, not after it


def test_s3_lease_is_exclusive_taken_over_when_expired_and_released(s3_env):
    root = f"{s3_env.uri}/ckpt/sft-abc"
    with locks.scope():
        locks.hold(root, purpose="checkpoints")
        lease = s3_env.client().get_object(Bucket=s3_env.bucket, Key="ckpt/sft-abc.qvl-lock.json")
        body = json.loads(lease["Body"].read())
        assert body["pid"] == os.getpid() and body["expires"] > time.time()
    listing = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="ckpt/")
    assert listing.get("KeyCount", 0) == 0  # released

    alive = locks.S3Lease(root, holder=locks.holder("first"), lease_s=2.0)  # renews every 0.4 s
    started = time.time()
    with pytest.raises(locks.LockHeld, match=r"in use by pid \d+ .*\(first, .*renews its lease"):
        locks.S3Lease(root, holder=locks.holder("second"))
    assert time.time() - started < 2.0  # refused on seeing a renewal, before the lease could run out
    alive.release()

    stale = locks.S3Lease(root, holder=locks.holder("crashed"), lease_s=0.5, renew=False)
    time.sleep(1.0)  # its holder stopped renewing: the lease ran out
    taken = locks.S3Lease(root, holder=locks.holder("retry"))
    assert json.loads(taken.read()[0])["purpose"] == "retry"
    taken.release()
    del stale


def test_s3_lease_of_a_killed_process_is_taken_over_at_once(s3_env):
    root = f"{s3_env.uri}/out/sft"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    who = {**locks.holder("killed run"), "pid": int(gone.stdout)}
    locks.S3Lease(root, holder=who, lease_s=3600, renew=False)  # an hour left, but its process is dead
    started = time.time()
    retry = locks.S3Lease(root, holder=locks.holder("retry"))
    assert time.time() - started < 5 and json.loads(retry.read()[0])["purpose"] == "retry"
    retry.release()
