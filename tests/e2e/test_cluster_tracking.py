"""The pipeline compiled for a cluster, executed under kfp.local with the environment a KFP task pod gets, tracked by
a real `mlflow server`: one parent run per pipeline run and one nested run per stage, ended by the exit task; and
the same with KFP's MLflow integration emulated (a parent per pipeline run, a task run per task injected as
MLFLOW_RUN_ID and ended by "KFP" after the task), where the stages log into KFP's runs and create none."""

import os
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from components._shared.platform import mlflow_runs as runs

pytestmark = pytest.mark.e2e

UNTIL = "extract_features"  # preflight, clean_data (fan-out + merge), extract_features: every kind of task, quickly
TRACKED = ["clean_data", "extract_features", "preflight"]  # shards log nothing; their merge reports for them


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from components.synth_world.lake import write_world

    out = tmp_path_factory.mktemp("world")
    write_world(out, records=200, seed=5)
    return out


@pytest.fixture
def cluster_preset(tmp_path) -> Path:
    """tiny, with a cluster profile that runs on this machine: no scratch PVC paths (/scratch) in the tasks' env."""
    path = tmp_path / "tiny-cluster.yaml"
    stages = "".join(
        f"    {s}: {{scratch: false}}\n" for s in ("extract_features", "pretrain", "sft", "reward_model", "rl")
    )
    path.write_text(f"extends: tiny\nexperiment: {{experiment}}\nkubernetes:\n  stages:\n{stages}")
    return path


def _run_cluster_build(preset: Path, world: Path, root: Path, experiment: str) -> None:
    from kfp import local

    from pipelines.vlm_training import build_pipeline

    preset.write_text(preset.read_text().replace("{experiment}", experiment))
    pipeline = build_pipeline(str(preset), until=UNTIL, for_cluster=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    pipeline(lake_uri=str(world / "lake"), eval_data_uri=str(world / "heldout"))


@pytest.fixture
def kfp_env(mlflow_server, monkeypatch, tmp_path):
    """What a KFP task pod of one pipeline run sees: the tracking URI (from the secret), the run id (from the pod
    label, downward API); no local parent run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv(runs.KFP_RUN_ENV, str(uuid.uuid4()))
    monkeypatch.setenv("QVL_RUN_SUMMARY_DIR", str(tmp_path / "results"))
    for name in (runs.PARENT_RUN_ENV, runs.GIVEN_RUN_ENV, "QVL_PROGRESS_DIR"):
        monkeypatch.delenv(name, raising=False)
    return MlflowClient(mlflow_server.uri)


def test_one_parent_per_pipeline_run_with_one_nested_run_per_stage(world, cluster_preset, kfp_env, tmp_path):
    experiment = f"cluster-{uuid.uuid4().hex[:8]}"
    _run_cluster_build(cluster_preset, world, tmp_path / "root", experiment)

    client = kfp_env
    everything = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in everything if r.data.tags.get(runs.ROLE_TAG) == "pipeline"]
    assert parent.data.tags[runs.KFP_RUN_TAG] == os.environ[runs.KFP_RUN_ENV]
    assert parent.info.status == "FINISHED" and parent.data.tags["qvl.kfp_state"] == "SUCCEEDED"  # the exit task
    children = [r for r in everything if r is not parent]
    assert all(r.data.tags.get("mlflow.parentRunId") == parent.info.run_id for r in children)
    assert sorted(r.data.tags[runs.STAGE_TAG] for r in children) == TRACKED
    by_stage = {r.data.tags[runs.STAGE_TAG]: r for r in children}
    assert by_stage["clean_data"].data.tags[runs.KFP_TASK_TAG] == "merge-shards-op"
    assert by_stage["extract_features"].data.metrics["images"] > 0
    assert all(r.info.status == "FINISHED" for r in children)


def test_with_kfps_mlflow_integration_the_stages_log_into_kfps_runs(
    world, cluster_preset, kfp_env, tmp_path, monkeypatch
):
    """KFP's driver is emulated around each kfp.local task: a nested run per task under KFP's pipeline run, its id
    injected as MLFLOW_RUN_ID, ended by "KFP" once the task exits (what KFP 2.17's plugin does)."""
    from kfp.local import subprocess_task_handler

    experiment = f"kfp-mlflow-{uuid.uuid4().hex[:8]}"
    client = kfp_env
    experiment_id = client.create_experiment(experiment)
    kfp_parent = client.create_run(experiment_id, run_name="vlm-training", tags={"kfp.pipeline_run_id": "r"}).info
    real = subprocess_task_handler.run_local_subprocess
    task_runs: list[str] = []

    def with_kfp_task_run(full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
        task = full_command[full_command.index("--function_to_execute") + 1]
        run_id = client.create_run(
            experiment_id, run_name=task, tags={"mlflow.parentRunId": kfp_parent.run_id}
        ).info.run_id
        task_runs.append(run_id)
        os.environ[runs.GIVEN_RUN_ENV] = run_id
        try:
            code = real(full_command, env_vars)
        finally:
            del os.environ[runs.GIVEN_RUN_ENV]
        client.set_terminated(run_id, "FINISHED" if code == 0 else "FAILED")
        return code

    monkeypatch.setattr(subprocess_task_handler, "run_local_subprocess", with_kfp_task_run)
    _run_cluster_build(cluster_preset, world, tmp_path / "root", experiment)

    everything = client.search_runs([experiment_id])
    assert sorted(r.info.run_id for r in everything) == sorted([kfp_parent.run_id, *task_runs])  # ours: none
    staged = [r for r in everything if runs.STAGE_TAG in r.data.tags]
    assert sorted(r.data.tags[runs.STAGE_TAG] for r in staged) == TRACKED
    assert all(r.info.status == "FINISHED" for r in everything if r.info.run_id != kfp_parent.run_id)
    assert client.get_run(kfp_parent.run_id).info.status == "RUNNING"  # KFP's to end, not the exit task's
    assert {r.info.run_name for r in everything} >= {"preflight_op", "merge_shards_op", "finish_pipeline_run_op"}
