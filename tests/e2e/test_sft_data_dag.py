"""The sft_data step in the local DAG (sft.build_data.enabled): built from clean_data's output and the pretrained
model between pretrain and sft, with its accounting; sft trains on what it built, not on the given conversations."""

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.e2e

BUILT_RECORDS = 48

PRESET = f"""\
extends: tiny
description: tiny with the sft_data step
sft:
  build_data:
    enabled: true
    max_records: {BUILT_RECORDS}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path, Path]:
    from components.synth_world.lake import write_world

    world = tmp_path_factory.mktemp("world")
    write_world(world, records=160, seed=5)
    given = world / "heldout"
    (given / "sft.jsonl").unlink()  # built only: the data directory holds the held-out questions alone
    preset = world / "built.yaml"
    preset.write_text(PRESET)
    out = tmp_path_factory.mktemp("run")
    cmd = [sys.executable, "-m", "pipelines.qvl.app", "run", "--local", "--preset", str(preset), "--until", "sft"]
    cmd += ["--lake", str(world / "lake"), "--data", str(given), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "run_summary.json").read_text()), out, given


def test_the_step_runs_between_pretrain_and_sft_and_accounts_for_every_candidate(run):
    summary, _, _ = run
    assert summary["status"] == "succeeded"
    assert set(summary["stages"]) == {"preflight", "clean_data", "extract_features", "pretrain", "sft_data", "sft"}
    step = summary["stages"]["sft_data"]
    built = Path(step["artifacts"]["output"])
    accounting = json.loads((built / "build_accounting.json").read_text())
    assert accounting["kept"] == step["metrics"]["kept"] == BUILT_RECORDS
    assert accounting["candidates"] == accounting["kept"] + sum(accounting["dropped"].values())
    dropped = (built / "built_dropped.jsonl").read_text().splitlines()
    assert len(dropped) == sum(accounting["dropped"].values())
    rows = [json.loads(line) for line in (built / "sft.jsonl").read_text().splitlines()]
    assert len(rows) == BUILT_RECORDS and all((built / r["image"]).is_file() for r in rows)
    assert (built / "eval.jsonl").is_file() and (built / "_COMMITTED.json").is_file()


def test_sft_trains_on_the_built_conversations(run):
    summary, out, given = run
    assert not (given / "sft.jsonl").exists()  # the built conversations are the only ones
    assert summary["stages"]["sft"]["status"] == "succeeded"
    mlflow.set_tracking_uri(summary["mlflow_tracking_uri"])
    client = MlflowClient()
    children = client.search_runs(
        [client.get_run(summary["mlflow_run_id"]).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'",
    )
    by_stage = {r.data.tags.get("qvl.stage"): r for r in children}
    assert int(by_stage["sft"].data.params["records"]) == BUILT_RECORDS
    assert by_stage["sft_data"].data.metrics["kept"] == BUILT_RECORDS
    log = (Path(summary["logs"]) / "sft_op.log").read_text()
    assert str(summary["stages"]["sft_data"]["artifacts"]["output"]) in log  # the step's output is sft's --data
