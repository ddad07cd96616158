"""Storage faults: S3 behind a proxy that answers 500 / 503 SlowDown, resets connections,
truncates bodies and delays, at 20% of requests. Publishing, fetching, single reads, a checkpoint commit and
resume, and a clean_data run on an S3 lake all complete, every object verified by its checksum, and nothing is
ever visible as committed before it is complete."""

import hashlib
import os

import pytest

from components._shared.platform import storage
from tests.reliability.fault_proxy import FaultProxy

RATE = 0.2


@pytest.fixture
def faulty_s3(s3_env, monkeypatch):
    with FaultProxy(s3_env.server.endpoint, rate=RATE, seed=7) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        yield s3_env, proxy
    print(f"proxy: {proxy.requests} requests, faults injected {dict(proxy.injected)}")


def _tree(root, sizes):
    root.mkdir(parents=True)
    digests = {}
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        (root / f"part-{i:02d}.bin").write_bytes(data)
        digests[f"part-{i:02d}.bin"] = hashlib.sha256(data).hexdigest()
    return digests


def test_publish_fetch_and_reads_complete_and_verify_under_faults(faulty_s3, tmp_path):
    s3, proxy = faulty_s3
    digests = _tree(tmp_path / "src", [0, 1, 1000, 70_000, 300_000] + [5_000] * 15 + [12 * 1024**2])
    uri = f"{s3.uri}/export/model"
    storage.publish_dir(tmp_path / "src", uri, multipart_threshold=5 * 1024**2)
    assert storage.is_committed(uri)
    fetched = storage.fetch_dir(uri, tmp_path / "dst")
    for name, digest in digests.items():
        assert hashlib.sha256((fetched / name).read_bytes()).hexdigest() == digest
        assert hashlib.sha256(storage.read_bytes(f"{uri}/{name}")).hexdigest() == digest
    assert sum(proxy.injected.values()) >= 5, proxy.injected


def test_checkpoints_commit_prune_and_resume_verified_under_faults(faulty_s3, tmp_path):
    from components._shared.model.checkpoint import CheckpointStore

    s3, proxy = faulty_s3
    store = CheckpointStore(f"{s3.uri}/ckpt/sft-abc", keep=2, scratch=tmp_path / "scratch")
    written = {}
    for step in (2, 4, 6):
        staging = store.staging_dir(step)
        written[step] = _tree(staging / "weights", [50_000, 2_000, 7])
        store.commit(staging, step)
    # an interrupted publication (files but no marker) is never offered for resume
    storage.write_bytes(f"{s3.uri}/ckpt/sft-abc/step-0000008/weights/part-00.bin", b"half")
    assert [u.rsplit("/", 1)[1] for u in store.committed()] == ["step-0000004", "step-0000006"]
    local = store.local_copy(store.latest())
    for name, digest in written[6].items():
        assert hashlib.sha256((local / "weights" / name).read_bytes()).hexdigest() == digest
    assert sum(proxy.injected.values()) >= 3, proxy.injected


def test_clean_data_on_an_s3_lake_accounts_every_record_under_faults(faulty_s3, tracking_env, tmp_path):
    import json

    from components.clean_data.stage import main as clean_main
    from components.synth_world.lake import write_world

    s3, proxy = faulty_s3
    world = tmp_path / "world"
    write_world(world, records=120, seed=5, records_per_shard=60, eval_per_type=1, sft_records=1, preference_pairs=1)
    for shard in sorted((world / "lake").glob("*.tar")):
        storage.upload_file(shard, f"{s3.uri}/lake/{shard.name}")
    model_free = ["clip_enabled=false", "nsfw_enabled=false", "ocr_enabled=false", "outlier_enabled=false"]
    clean_main(["--lake-uri", f"{s3.uri}/lake", "--output-dir", f"{s3.uri}/clean", *model_free])
    clean_main(["--lake-uri", str(world / "lake"), "--output-dir", str(tmp_path / "local"), *model_free])
    fetched = storage.fetch_dir(f"{s3.uri}/clean", tmp_path / "fetched")  # verifies every sha256
    remote = json.loads((fetched / "manifest.json").read_text())
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert remote["records_in"] == local["records_in"] == 120
    assert remote["rejected_by_reason"] == local["rejected_by_reason"] and not remote["shard_errors"]
    assert remote["records_kept"] == local["records_kept"] > 0
    assert sum(proxy.injected.values()) >= 5, proxy.injected
    print(
        f"clean_data on S3 under faults: {remote['records_in']} records, {remote['records_kept']} kept, "
        f"identical accounting to the local run"
    )


def test_a_stream_broken_mid_body_resumes_where_it_broke(s3_env, monkeypatch):
    data = os.urandom(3 * 1024**2)
    storage.write_bytes(f"{s3_env.uri}/big.bin", data)
    with FaultProxy(s3_env.server.endpoint, rate=0.5, seed=3, faults=("truncate",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        with storage.open_read(f"{s3_env.uri}/big.bin") as stream:  # read in pieces, as tarfile does
            pieces = iter(lambda: stream.read(256 * 1024), b"")
            received = b"".join(pieces)
    assert received == data
    assert proxy.injected["truncate"] >= 1 and proxy.ranged >= 1
    print(
        f"3 MiB read in 256 KiB pieces: {proxy.injected['truncate']} truncated answers, "
        f"{proxy.ranged} resumed with a Range GET"
    )


@pytest.mark.slow
def test_a_training_stage_with_checkpoints_and_export_on_faulty_s3_is_killed_resumes_and_matches(faulty_s3, tmp_path):
    """A whole sft run against S3 at a 20% fault rate: checkpoints on S3, SIGKILLed at step 3, rerun; the model
    it exports to S3 (verified on fetch) is bit-identical to a run with local checkpoints and no kill."""
    import json
    import signal
    import subprocess
    import sys

    import torch
    import yaml
    from safetensors.torch import load_file

    from components.synth_world.splits import write_splits

    s3, proxy = faulty_s3
    data = tmp_path / "data"
    write_splits(data, seed=6, eval_per_type=1, sft_records=8, preference_pairs=1)
    config = {
        "mode": "full",
        "min_pixels": 3136,
        "max_pixels": 12544,
        "max_records": 8,
        "train": {
            "steps": 6,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 512,
            "threads": 1,
            "checkpoint_every": 2,
        },
        "optim": {"lr": 0.01},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
        "calibration": {"enabled": False},
    }

    def sft(output: str, checkpoint_uri: str, **env):
        cfg = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
        cfg.write_text(
            yaml.safe_dump({"sft": {**config, "train": {**config["train"], "checkpoint_uri": checkpoint_uri}}})
        )
        cmd = [
            sys.executable,
            "-m",
            "components.sft",
            "--config",
            str(cfg),
            "--output-dir",
            output,
            "--base-model",
            "builtin:tiny-qwen2_5-vl",
            "--data",
            str(data),
        ]
        environ = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
            **{k: str(v) for k, v in env.items()},
        }
        return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=900, check=False)

    straight = sft(str(tmp_path / "straight"), str(tmp_path / "straight-ckpt"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = sft(f"{s3.uri}/export/sft", f"{s3.uri}/ckpt", QVL_TEST_KILL_AT_STEP=3)
    assert killed.returncode == -signal.SIGKILL
    assert not storage.is_committed(f"{s3.uri}/export/sft")  # nothing published by the killed run
    resumed = sft(f"{s3.uri}/export/sft", f"{s3.uri}/ckpt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fetched = storage.fetch_dir(f"{s3.uri}/export/sft", tmp_path / "fetched")  # every sha256 verified
    assert json.loads((fetched / "_stage_result.json").read_text())["metrics"]["resumed_from_step"] == 2
    a = load_file(str(tmp_path / "straight/model/model.safetensors"))
    b = load_file(str(fetched / "model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(proxy.injected.values()) >= 10, proxy.injected
    print(
        f"sft on faulty S3: killed at step 3, resumed from step 2, {len(a)} tensors bit-identical; "
        f"{proxy.requests} requests, faults {dict(proxy.injected)}"
    )
