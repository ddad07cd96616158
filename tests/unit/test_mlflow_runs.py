"""Which MLflow run a stage logs into, against a real `mlflow server`: one parent per KFP pipeline run with one nested
run per stage (found again by a retried task), KFP's injected task run used and left to KFP, the exit task ending
the parent, and a multi-node launch logging once with each node's system metrics under its own node id."""

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from components._shared.platform import mlflow_runs as runs
from components._shared.platform.mlflow_runs import (
    finish_kfp_pipeline_run,
    launched_stage_run,
    pipeline_run_for_kfp,
    stage_tracker,
)
from tests.services import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server_env(mlflow_server, monkeypatch) -> str:
    """The real server as the tracking URI, no run ids in the environment; returns a fresh experiment name."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    for name in (runs.GIVEN_RUN_ENV, runs.PARENT_RUN_ENV, runs.KFP_RUN_ENV, runs.KFP_TASK_ENV, "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    return f"runs-{uuid.uuid4().hex[:8]}"


def _runs(client: MlflowClient, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def _stage(experiment: str, stage: str, monkeypatch, task: str, metrics: dict, fail: bool = False) -> str:
    monkeypatch.setenv(runs.KFP_TASK_ENV, task)
    params = {"optim": {"lr": 0.001}, "stage": stage}
    try:
        with stage_tracker(stage, experiment=experiment, params=params) as tracker:
            tracker.log_metrics(metrics, step=0)
            if fail:
                raise RuntimeError("preempted")
    except RuntimeError:
        pass
    return tracker.run_id


def test_a_kfp_run_gets_one_parent_and_one_run_per_stage_and_a_retry_reuses_its_run(
    server_env, mlflow_server, monkeypatch
):
    experiment, client = server_env, MlflowClient(mlflow_server.uri)
    kfp_run = str(uuid.uuid4())
    monkeypatch.setenv(runs.KFP_RUN_ENV, kfp_run)
    first = _stage(experiment, "preflight", monkeypatch, "preflight-op", {"checked": 1.0})
    attempt_1 = _stage(experiment, "sft", monkeypatch, "sft-op", {"train/loss": 2.0}, fail=True)
    assert client.get_run(attempt_1).info.status == "FAILED"
    attempt_2 = _stage(experiment, "sft", monkeypatch, "sft-op", {"train/loss": 1.0})
    _stage(experiment, "rl", monkeypatch, "rl-op", {"rl/reward": 0.5})
    monkeypatch.setenv(runs.KFP_RUN_ENV, str(uuid.uuid4()))  # a second pipeline run: its own parent
    _stage(experiment, "preflight", monkeypatch, "preflight-op", {"checked": 1.0})

    everything = _runs(client, experiment)
    parents = [r for r in everything if r.data.tags.get(runs.ROLE_TAG) == "pipeline"]
    assert len(parents) == 2 and len(everything) == 2 + 3 + 1
    parent = next(r for r in parents if r.data.tags[runs.KFP_RUN_TAG] == kfp_run)
    children = [r for r in everything if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags[runs.STAGE_TAG] for r in children) == ["preflight", "rl", "sft"]
    assert attempt_2 == attempt_1  # the retried task logged into its earlier attempt's run
    sft = client.get_run(attempt_2)
    assert sft.info.status == "FINISHED"
    assert sorted(m.value for m in client.get_metric_history(attempt_2, "train/loss")) == [1.0, 2.0]
    assert sft.data.tags[runs.KFP_RUN_TAG] == kfp_run and sft.data.tags[runs.KFP_TASK_TAG] == "sft-op"
    assert json.loads(sft.data.tags[runs.CONFIG_TAG]) == {"optim": {"lr": 0.001}, "stage": "sft"}
    assert sft.data.params["optim.lr"] == "0.001"
    assert client.get_run(first).data.tags["mlflow.parentRunId"] == parent.info.run_id

    # the exit task ends this run's parent with the DAG's state, and only this run's
    monkeypatch.setenv(runs.KFP_RUN_ENV, kfp_run)
    assert "ended KILLED" in finish_kfp_pipeline_run("CANCELED", experiment=experiment)
    ended = client.get_run(parent.info.run_id)
    assert ended.info.status == "KILLED" and ended.data.tags["qvl.kfp_state"] == "CANCELED"
    other = next(r for r in parents if r.data.tags[runs.KFP_RUN_TAG] != kfp_run)
    assert client.get_run(other.info.run_id).info.status == "RUNNING"


def test_kfps_injected_task_run_is_used_and_left_for_kfp_to_end(server_env, mlflow_server, monkeypatch):
    """KFP's MLflow integration: a parent per pipeline run and a nested run per task, made by KFP, whose id the
    task gets as MLFLOW_RUN_ID; KFP ends them after the container exits."""
    experiment, client = server_env, MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment(experiment)
    kfp_parent = client.create_run(experiment_id, run_name="vlm-training-run", tags={"kfp.pipeline_run_id": "r-1"})
    task_run = client.create_run(
        experiment_id, run_name="sft-op", tags={"mlflow.parentRunId": kfp_parent.info.run_id}
    ).info.run_id
    monkeypatch.setenv(runs.GIVEN_RUN_ENV, task_run)
    monkeypatch.setenv(runs.KFP_RUN_ENV, "r-1")  # also present: it must not create a parent of ours
    _stage(experiment, "sft", monkeypatch, "sft-op", {"train/loss": 0.75})
    assert "KFP's MLflow integration owns" in finish_kfp_pipeline_run("SUCCEEDED", experiment=experiment)

    assert sorted(r.info.run_id for r in _runs(client, experiment)) == sorted([kfp_parent.info.run_id, task_run])
    run = client.get_run(task_run)
    assert run.info.status == "RUNNING"  # KFP's to end
    assert run.data.metrics == {"train/loss": 0.75} and run.data.tags[runs.STAGE_TAG] == "sft"
    assert run.data.tags[runs.KFP_TASK_TAG] == "sft-op" and run.data.params["optim.lr"] == "0.001"
    assert client.get_run(kfp_parent.info.run_id).info.status == "RUNNING"


def test_racing_parent_creations_settle_on_the_oldest(server_env, mlflow_server):
    experiment, client = server_env, MlflowClient(mlflow_server.uri)
    kfp_run = "race-1"
    experiment_id = client.create_experiment(experiment)
    tags = {runs.ROLE_TAG: "pipeline", runs.KFP_RUN_TAG: kfp_run}
    older = client.create_run(experiment_id, tags=tags, start_time=1_000).info.run_id
    client.create_run(experiment_id, tags=tags, start_time=2_000)  # a second task's copy, created a moment later
    assert pipeline_run_for_kfp(client, experiment, kfp_run) == older
    assert pipeline_run_for_kfp(client, experiment, "race-2") == pipeline_run_for_kfp(client, experiment, "race-2")


def test_a_malformed_kfp_run_id_is_refused(server_env, monkeypatch):
    monkeypatch.setenv(runs.KFP_RUN_ENV, "x' or tags.a = 'b")
    with pytest.raises(ValueError, match="is not a KFP run id"):
        runs.kfp_run_id()


NODE_SCRIPT = textwrap.dedent(
    """
    import os, time
    from components._shared.platform.mlflow_runs import stage_tracker

    with stage_tracker("sft", experiment=os.environ["EXPERIMENT"], params={"lr": 0.1}) as tracker:
        tracker.log_metrics({"loss": float(os.environ["RANK"])}, step=0)
        time.sleep(3.0)
    """
)


def test_a_two_node_launch_logs_once_with_each_nodes_system_metrics(server_env, mlflow_server, tmp_path, monkeypatch):
    """Two torchrun agents (two "nodes", two processes each) under one launched run: metrics from rank 0 only, system
    metrics from each node's local rank 0 under its node id, one run in all, ended by the launcher."""
    experiment, client = server_env, MlflowClient(mlflow_server.uri)
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    monkeypatch.setenv(runs.SYSTEM_METRICS_ENV, "0.5")
    with launched_stage_run("sft", experiment=experiment, params={"lr": 0.1}) as run_id:
        assert run_id
        env = {
            **os.environ,
            runs.GIVEN_RUN_ENV: run_id,
            "EXPERIMENT": experiment,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        }
        port = free_port()
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2"]
                + [f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
        assert [agent.returncode for agent in agents] == [0, 0], outputs

    assert [r.info.run_id for r in _runs(client, experiment)] == [run_id]  # no run per GPU, none per node
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [0.0]  # rank 0 only
    system = {key for key in run.data.metrics if key.startswith("system/")}
    for node in ("node-0", "node-1"):
        assert f"system/{node}/cpu_utilization_percentage" in system, sorted(system)
    assert not any(key.count("/") == 1 for key in system), sorted(system)  # no untagged node's values
