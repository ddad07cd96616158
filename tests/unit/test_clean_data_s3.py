"""clean_data on S3: a lake on a real S3 server (SeaweedFS), outputs published atomically to S3."""

import json

import pytest

from components._shared.platform import storage
from components.clean_data.stage import main as clean_main

MODEL_FREE = ["clip_enabled=false", "nsfw_enabled=false", "ocr_enabled=false", "outlier_enabled=false"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from components.synth_world.lake import write_world

    out = tmp_path_factory.mktemp("world")
    write_world(out, records=120, seed=5, records_per_shard=60, eval_per_type=1, sft_records=1, preference_pairs=1)
    return out


def test_lake_on_s3_cleans_like_the_local_lake_and_publishes_atomically(world, s3_env, tracking_env, tmp_path):
    for shard in sorted((world / "lake").glob("*.tar")):
        storage.upload_file(shard, f"{s3_env.uri}/lake/{shard.name}")

    clean_main(["--lake-uri", f"{s3_env.uri}/lake", "--output-dir", f"{s3_env.uri}/clean", *MODEL_FREE])
    clean_main(["--lake-uri", str(world / "lake"), "--output-dir", str(tmp_path / "local"), *MODEL_FREE])

    assert storage.is_committed(f"{s3_env.uri}/clean")
    fetched = storage.fetch_dir(f"{s3_env.uri}/clean", tmp_path / "fetched")  # verifies every sha256
    remote = json.loads((fetched / "manifest.json").read_text())
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert remote["records_in"] == local["records_in"] == 120
    assert remote["rejected_by_reason"] == local["rejected_by_reason"]
    assert remote["records_kept"] == local["records_kept"] > 0
    marker = storage.read_marker(f"{s3_env.uri}/clean")
    assert "manifest.json" in marker["files"] and any(f.startswith("kept/") for f in marker["files"])


def test_uncommitted_s3_output_is_not_readable(s3_env, tmp_path):
    storage.write_bytes(f"{s3_env.uri}/half/kept/part-00000.parquet", b"partial")
    assert not storage.is_committed(f"{s3_env.uri}/half")
    with pytest.raises(storage.IntegrityError, match="not committed"):
        storage.fetch_dir(f"{s3_env.uri}/half", tmp_path / "x")
