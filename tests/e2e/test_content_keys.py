"""KFP's cache sees the content behind a URI: preflight hands each stage a digest of what its URIs hold and
list_shards one per shard, so a shard rewritten under the same path is cleaned again (and only that shard) instead
of the old result being served; unchanged data stays cached."""

import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def _run(world: Path, out: Path) -> dict:
    from pipelines.qvl.local_run import run_local

    return run_local(
        lake_uri=str(world / "lake"),
        data_uri=str(world / "heldout"),
        out_dir=out,
        preset="tiny",
        until="clean_data",
        enable_caching=True,
    )


def test_a_shard_rewritten_under_the_same_path_is_recleaned_and_the_others_stay_cached(tmp_path, monkeypatch):
    from components.synth_world.lake import write_world

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    world, out = tmp_path / "world", tmp_path / "run"
    write_world(world, records=160, seed=5, records_per_shard=80)  # two shards
    first = _run(world, out)
    assert first["status"] == "succeeded" and first["stages"]["clean_data"]["status"] == "succeeded"
    assert len(list((out / "logs").glob("clean_shard_op*.log"))) == 2
    leaked = {"MLFLOW_TRACKING_URI", "QVL_MLFLOW_PARENT_RUN_ID", "QVL_RUN_SUMMARY_DIR", "QVL_PROGRESS_DIR"} & set(
        os.environ
    )
    assert not leaked, f"run_local left {leaked} set for whatever runs next in this process"
    again = _run(world, out)
    assert again["stages"]["clean_data"]["status"] == "cached"  # same content: KFP's cache serves it

    write_world(tmp_path / "other", records=160, seed=6, records_per_shard=80)  # a refreshed shard, same name
    shutil.copyfile(tmp_path / "other" / "lake" / "00001.tar", world / "lake" / "00001.tar")
    refreshed = _run(world, out)
    clean = refreshed["stages"]["clean_data"]
    assert clean["status"] == "succeeded", clean  # not the cached result of the old lake
    assert [p.name for p in (out / "logs").glob("clean_shard_op*.log")] == ["clean_shard_op.log"]  # that shard only
    old = first["stages"]["clean_data"]["metrics"]
    assert clean["metrics"]["records_in"] == 160 and clean["metrics"]["records_kept"] != old["records_kept"]
    keys = json.loads((Path(refreshed["stages"]["preflight"]["artifacts"]["output"]) / "preflight.json").read_text())
    assert set(keys["content_keys"]) >= {"clean_data", "sft", "select_checkpoint"}
