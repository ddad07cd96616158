"""Tracking faults: the MLflow server is stopped for 60 s while an sft stage trains. The stage
completes, no exception escapes, every metric logged during the outage reaches the server after it returns (no
fallback file needed), and the model is written."""

import json
import threading
import time

import pytest
from mlflow import MlflowClient

from components.synth_world.splits import write_splits
from tests.stage_cli import run_stage_cli

pytestmark = pytest.mark.slow
OUTAGE_S = 60.0


def _sft_run(client):
    for experiment in client.search_experiments():
        runs = client.search_runs([experiment.experiment_id], filter_string="tags.`qvl.stage` = 'sft'")
        if runs:
            return runs[0]
    return None


def test_a_60_s_tracking_outage_during_training_loses_nothing(mlflow_server, tmp_path):
    data = tmp_path / "data"
    write_splits(data, seed=4, eval_per_type=1, sft_records=64, preference_pairs=4)
    # ~2.5 minutes at one thread on an idle 2-core machine (4,000 steps ended within a second of the outage's end:
    # the artifacts logged then had to wait for the server): the 60 s outage falls well inside it
    steps = 8000
    config = {
        "mode": "full",
        "min_pixels": 3136,
        "max_pixels": 3136,
        "calibration": {"enabled": False},
        "train": {
            "steps": steps,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 512,
            "threads": 1,
            "log_every": 1,
        },
        "optim": {"lr": 0.003},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
    }
    out, fallback = tmp_path / "out", tmp_path / "fallback"
    result: dict = {}

    def stage():
        result["proc"] = run_stage_cli(
            "sft",
            config,
            out,
            {"base_model": "builtin:tiny-qwen2_5-vl", "data": data},
            MLFLOW_TRACKING_URI=mlflow_server.uri,
            QVL_MLFLOW_FALLBACK_DIR=fallback,
        )

    worker = threading.Thread(target=stage)
    worker.start()
    client = MlflowClient(mlflow_server.uri)
    deadline = time.time() + 300
    run = None
    while time.time() < deadline:  # wait until the stage's run exists and its first metrics have arrived
        run = _sft_run(client)
        if run is not None and client.get_metric_history(run.info.run_id, "train/loss"):
            break
        time.sleep(2)
    assert run is not None, "the sft stage never created its MLflow run"
    seen_before = len(client.get_metric_history(run.info.run_id, "train/loss"))
    mlflow_server.stop()
    stopped_at = time.time()
    time.sleep(OUTAGE_S)
    mlflow_server.start()
    outage = time.time() - stopped_at
    worker.join(timeout=900)
    proc = result["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    stage_result = json.loads((out / "_stage_result.json").read_text())
    assert stage_result["status"] == "succeeded" and stage_result["metrics"]["steps"] == steps
    assert stage_result["seconds"] > outage, "the stage ended before the outage did; make it longer"
    assert (out / "model" / "model.safetensors").is_file()

    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # every step, outage included
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert not fallback.exists() or not any(fallback.rglob("*.jsonl"))
    print(
        f"outage {outage:.0f} s; train/loss points before it {seen_before}, on the server after: {len(history)} "
        f"of {steps}"
    )
