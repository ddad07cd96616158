"""components._shared.platform.tracking against an embedded sqlite store and a real `mlflow server`."""

import json
import re
import time

import pytest
from mlflow import MlflowClient

from components._shared.platform import mlflow_runs as runs
from components._shared.platform import mlflow_tracking as tracking
from components._shared.platform.mlflow_runs import (
    PARENT_RUN_ENV,
    finish_pipeline_run,
    stage_tracker,
    start_pipeline_run,
)
from components._shared.platform.mlflow_tracking import MlflowTracker, replay_fallback
from components._shared.platform.tracking import NullTracker
from tests.services import free_port


@pytest.fixture(autouse=True)
def _fast_http(monkeypatch):
    """No long MLflow HTTP retries while a server is down (and restore whatever tracking sets)."""
    for name, value in {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }.items():
        monkeypatch.setenv(name, value)


def _wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _two_stage_flow(uri: str, monkeypatch) -> tuple[str, MlflowClient]:
    """A parent run with two stage runs; returns the parent id."""
    parent = start_pipeline_run("vlm-test", run_name="pipeline-1", tags={"qvl.preset": "tiny"}, tracking_uri=uri)
    monkeypatch.setenv(PARENT_RUN_ENV, parent)
    params = {"optim": {"lr": 0.003, "betas": [0.9, 0.95]}, "note": "x" * 7000}
    with stage_tracker("clean_data", experiment="vlm-test", params=params, tracking_uri=uri) as tracker:
        tracker.log_metrics({"records_kept": 90, "rejected_by_reason": {"corrupt": 4, "tiny": 6}})
        tracker.log_text("# report\n", "report.md")
    with stage_tracker("sft", experiment="vlm-test", tracking_uri=uri) as tracker:
        for step in range(5):
            tracker.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    finish_pipeline_run(parent, "SUCCEEDED", tracking_uri=uri)
    return parent, MlflowClient(uri)


def _check_two_stage_flow(parent: str, client: MlflowClient) -> None:
    parent_run = client.get_run(parent)
    assert parent_run.info.status == "FINISHED" and parent_run.data.tags["qvl.preset"] == "tiny"
    children = client.search_runs([parent_run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    by_stage = {run.data.tags[runs.STAGE_TAG]: run for run in children}
    assert sorted(by_stage) == ["clean_data", "sft"]
    clean, sft = by_stage["clean_data"], by_stage["sft"]
    assert clean.info.status == sft.info.status == "FINISHED"
    assert clean.data.metrics == {
        "records_kept": 90.0,
        "rejected_by_reason/corrupt": 4.0,
        "rejected_by_reason/tiny": 6.0,
    }
    assert clean.data.params["optim.lr"] == "0.003" and clean.data.params["optim.betas"] == "[0.9, 0.95]"
    assert clean.data.params["note"] == "x" * tracking.MAX_PARAM_VALUE_LENGTH
    assert [a.path for a in client.list_artifacts(clean.info.run_id)] == ["report.md"]
    history = client.get_metric_history(sft.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 4)) for m in sorted(history, key=lambda m: m.step)] == [
        (0, 1.0),
        (1, 0.5),
        (2, 0.3333),
        (3, 0.25),
        (4, 0.2),
    ]


def test_parent_and_nested_stage_runs_in_sqlite(tracking_env, monkeypatch):
    parent, client = _two_stage_flow(tracking_env, monkeypatch)
    _check_two_stage_flow(parent, client)


def test_default_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.default_tracking_uri(tmp_path / "out") == f"sqlite:///{tmp_path}/out/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert tracking.default_tracking_uri(tmp_path) == "http://mlflow.example:5000"


def test_standalone_stage_run_without_parent(tracking_env):
    with stage_tracker("distill", experiment="solo") as tracker:
        tracker.log_metrics({"kd/loss": 2.5}, step=3)
    run = MlflowClient(tracking_env).get_run(tracker.run_id)
    assert "mlflow.parentRunId" not in run.data.tags and run.data.tags[runs.STAGE_TAG] == "distill"
    assert run.data.metrics == {"kd/loss": 2.5} and run.info.run_name == "distill"


def test_many_metrics_go_in_few_log_batch_calls(tracking_env, monkeypatch):
    client = MlflowClient(tracking_env)
    run_id = client.create_run(client.create_experiment("batching")).info.run_id
    calls: list[int] = []
    real_log_batch = client.log_batch
    monkeypatch.setattr(
        client,
        "log_batch",
        lambda run_id, metrics=(), **kw: (calls.append(len(metrics)), real_log_batch(run_id, metrics=metrics, **kw))[1],
    )
    tracker = MlflowTracker(client, run_id, flush_every=10**9, flush_interval_s=3600)
    for step in range(250):
        tracker.log_metrics({f"m{i}": step * 10 + i for i in range(10)}, step=step)
    assert calls == []  # nothing sent synchronously
    tracker.close()
    assert calls == [1000, 1000, 500]
    history = client.get_metric_history(run_id, "m7")
    assert len(history) == 250 and max(m.value for m in history) == 2497.0


def test_background_thread_flushes_by_count_and_by_time(tracking_env, monkeypatch):
    client = MlflowClient(tracking_env)
    run_id = client.create_run(client.create_experiment("background")).info.run_id
    calls: list[int] = []
    real_log_batch = client.log_batch
    monkeypatch.setattr(
        client,
        "log_batch",
        lambda run_id, metrics=(), **kw: (calls.append(len(metrics)), real_log_batch(run_id, metrics=metrics, **kw))[1],
    )
    by_count = MlflowTracker(client, run_id, flush_every=100, flush_interval_s=3600)
    by_count.log_metrics({f"a{i}": i for i in range(100)})
    assert _wait_until(lambda: len(client.get_metric_history(run_id, "a99")) == 1), calls
    assert calls == [100]
    by_count.close()
    by_time = MlflowTracker(client, run_id, flush_every=10**9, flush_interval_s=0.2)
    by_time.log_metrics({"b": 1.5}, step=2)
    assert _wait_until(lambda: client.get_metric_history(run_id, "b")), "not flushed after 10 s"
    assert calls == [100, 1] and client.get_metric_history(run_id, "b")[0].value == 1.5
    by_time.close()


def test_rank_other_than_zero_logs_nothing(tracking_env, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with stage_tracker("sft", experiment="ranked", params={"a": 1}) as tracker:
        tracker.log_metrics({"loss": 1.0}, step=0)
    assert isinstance(tracker, NullTracker)
    assert MlflowClient(tracking_env).get_experiment_by_name("ranked") is None


def test_failed_block_marks_run_failed_and_keeps_metrics(tracking_env):
    with pytest.raises(RuntimeError, match="boom"), stage_tracker("rl", experiment="failing") as tracker:
        tracker.log_metrics({"reward": 0.25}, step=7)
        raise RuntimeError("boom")
    run = MlflowClient(tracking_env).get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.metrics == {"reward": 0.25}


def test_bad_metric_value_and_status_are_rejected(tracking_env):
    with stage_tracker("sft", experiment="bad") as tracker, pytest.raises(TypeError, match="must be a number, got str"):
        tracker.log_metrics({"loss": "low"})
    with pytest.raises(ValueError, match="run status 'DONE' is not one of"):
        finish_pipeline_run(tracker.run_id, "DONE")


def test_dead_server_never_raises_and_writes_fallback(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with stage_tracker(
        "sft", experiment="offline", params={"lr": 0.1}, tracking_uri=dead, fallback_dir=tmp_path, flush_interval_s=3600
    ) as tracker:
        for step in range(10):
            tracker.log_metrics({"loss": float(step)}, step=step)
        tracker.flush()
        tracker.set_tags({"phase": "2"})
        tracker.log_text("report", "report.md")
    assert time.monotonic() - started < 30
    lines = [json.loads(line) for line in tracker.fallback_path.read_text().splitlines()]
    assert [(r["step"], r["value"]) for r in lines if r["type"] == "metric"] == [(s, float(s)) for s in range(10)]
    assert {(r["type"], r["key"], r["value"]) for r in lines if r["type"] in ("param", "tag")} == {
        ("param", "lr", "0.1"),
        ("tag", "phase", "2"),
    }
    assert lines[-1] == {"type": "status", "run_id": None, "status": "FINISHED"}
    assert (tmp_path / "artifacts" / "no-run" / "report.md").read_text() == "report"


def test_bounded_buffer_spills_overflow_to_fallback(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    client = tracking._client(dead)
    tracker = MlflowTracker(
        client, "run-x", flush_every=10**9, flush_interval_s=3600, max_buffer=5, fallback_dir=tmp_path
    )
    tracker.log_metrics({f"m{i}": i for i in range(8)})
    spilled = [json.loads(line)["key"] for line in tracker.fallback_path.read_text().splitlines()]
    assert spilled == ["m5", "m6", "m7"]
    tracker.close()
    keys = [json.loads(line).get("key") for line in tracker.fallback_path.read_text().splitlines()]
    assert sorted(k for k in keys if k) == [f"m{i}" for i in range(8)]


# --- a real tracking server ------------------------------------------------------------------------


def test_parent_and_nested_stage_runs_on_server(mlflow_server, monkeypatch):
    parent, client = _two_stage_flow(mlflow_server.uri, monkeypatch)
    _check_two_stage_flow(parent, client)


def test_server_outage_keeps_buffer_and_recovers(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.delenv(PARENT_RUN_ENV, raising=False)
    uri = mlflow_server.uri
    client = MlflowClient(uri)
    experiment = client.create_experiment(f"outage-{time.time_ns()}")
    resilient = MlflowTracker(client, client.create_run(experiment).info.run_id, flush_interval_s=3600)
    spilling = MlflowTracker(
        client, client.create_run(experiment).info.run_id, flush_interval_s=3600, fallback_dir=tmp_path
    )
    resilient.log_metrics({"loss": 0.0}, step=0)
    resilient.flush()
    mlflow_server.stop()
    try:
        for step in range(1, 4):
            resilient.log_metrics({"loss": float(step)}, step=step)
            spilling.log_metrics({"acc": step / 10}, step=step)
        (tmp_path / "figure.png").write_bytes(b"not really a png")
        resilient.log_artifact(tmp_path / "figure.png", "figures")  # queued, like the metrics (it was spilled)
        spilling.log_artifact(tmp_path / "figure.png", "figures")
        resilient.flush()  # server down: warns, keeps the buffer, does not raise
        spilling.close()  # server down at close: everything goes to the fallback file
    finally:
        mlflow_server.start()
    assert spilling.fallback_path.exists()
    spilled = [json.loads(line) for line in spilling.fallback_path.read_text().splitlines()]
    assert [r["local_path"] for r in spilled if r["type"] == "artifact"] == [str(tmp_path / "figure.png")]
    assert resilient.fallback_path is None  # nothing of the outage was spilled
    resilient.close()
    assert [a.path for a in client.list_artifacts(resilient.run_id, "figures")] == ["figures/figure.png"]
    history = client.get_metric_history(resilient.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert client.get_run(resilient.run_id).info.status == "FINISHED"
    assert client.get_run(spilling.run_id).info.status == "RUNNING"
    assert replay_fallback(spilling.fallback_path, tracking_uri=uri) == 3
    replayed = client.get_run(spilling.run_id)
    assert replayed.info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(spilling.run_id, "acc")) == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]


@pytest.mark.parametrize("uri", ["mlflow://", "s3://bucket/mlruns"])
def test_a_tracking_uri_mlflow_cannot_open_is_named_not_a_traceback(uri):
    from components._shared.platform.mlflow_tracking import _client

    with pytest.raises(ValueError, match=rf"MLFLOW_TRACKING_URI='{uri}' is not a tracking store MLflow opens"):
        _client(uri)


@pytest.mark.parametrize(
    ("uri", "says"),
    [("sqlite:////nonexistent/dir/x.db", "is a database in /nonexistent/dir, which does not exist"),
     ("http://", "names no host")],
)  # fmt: skip
def test_a_tracking_uri_that_cannot_work_is_named_before_any_run(uri, says):
    """A sqlite store in a missing folder ran the stage with every metric in the fallback file ("relative path can't
    be expressed as a file URI"); `http://` warned about a host 'api'."""
    from components._shared.platform.mlflow_tracking import _client

    with pytest.raises(ValueError, match=re.escape(f"MLFLOW_TRACKING_URI={uri!r} {says}")):
        _client(uri)
