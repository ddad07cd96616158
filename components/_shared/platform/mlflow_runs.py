"""Which MLflow run a stage logs into: one parent run per pipeline run and one nested run per stage, on every path
a pipeline runs (`qvl run --local`, a KFP cluster with or without KFP's own MLflow integration, torchrun, TrainJobs).

`resolve_stage_run` decides, first match wins:

1. `$MLFLOW_RUN_ID`: a run somebody else made for this task. KFP's MLflow integration (KFP 2.17, when the server
   enables it) creates one nested run per task under its own pipeline run and injects its id; a launcher (torchrun,
   TrainJob) hands its stage run to the processes it starts. The stage logs into it and never ends it: its owner
   does (KFP sets the final status after the container exits).
2. `$QVL_MLFLOW_PARENT_RUN_ID` (`qvl run --local` opens the parent): a stage run nested under it.
3. `$QVL_KFP_RUN_ID` (a KFP task pod; pipelines/k8s.py maps the pod label `pipeline/runid` to it): the pipeline's
   parent run, found by its tag `qvl.kfp_run_id` or created by the first task that looks (preflight), and the stage
   run nested under it. The exit task (`finish_kfp_pipeline_run`) ends the parent with the run's final state.
4. Otherwise a standalone run (one stage from the command line).

Under a parent, a stage's run is looked up by (parent, stage) before one is created, so a retried task logs into the
run of its earlier attempt instead of adding another. Run-scoped ids travel in the environment, never as task
inputs: a value that changes every run would change every task's cache key.

    with stage_tracker("sft", experiment="vlm-dev", params=cfg.model_dump()) as tracker:
        tracker.log_metrics({"train/loss": 0.7}, step=10)
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components._shared.platform.credential_shapes import redact, shown
from components._shared.platform.env_numbers import env_number
from components._shared.platform.mlflow_tracking import (
    MAX_TAG_VALUE_LENGTH,
    MlflowTracker,
    _client,
    _status,
    default_tracking_uri,
)
from components._shared.platform.tracking import NullTracker, Tracker

logger = logging.getLogger(__name__)

GIVEN_RUN_ENV = "MLFLOW_RUN_ID"  # KFP's MLflow integration, or a launcher: log into this run, never end it
PARENT_RUN_ENV = "QVL_MLFLOW_PARENT_RUN_ID"
KFP_RUN_ENV = "QVL_KFP_RUN_ID"  # the KFP pipeline run's id (pod label pipeline/runid, downward API)
KFP_TASK_ENV = "QVL_KFP_TASK"  # the task's name in the pipeline (set at compile time)
SYSTEM_METRICS_ENV = "QVL_SYSTEM_METRICS_S"  # sampling interval of MLflow's system metrics; unset or 0: off

STAGE_TAG = "qvl.stage"
ROLE_TAG = "qvl.role"  # "pipeline" on a pipeline's parent run
KFP_RUN_TAG = "qvl.kfp_run_id"
KFP_TASK_TAG = "qvl.kfp_task"
CONFIG_TAG = "qvl.config"
PARENT_TAG = "mlflow.parentRunId"

_KFP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KFP_END_STATES = {"SUCCEEDED": "FINISHED", "CANCELED": "KILLED", "CANCELLED": "KILLED", "CANCELING": "KILLED"}


def _experiment_id(client, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    uri = client.tracking_uri
    # sqlite stores default their artifacts to ./mlruns in the current directory: keep them beside the db.
    location = (
        (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri() if uri.startswith("sqlite:///") else None
    )
    try:
        return client.create_experiment(experiment, artifact_location=location)
    except Exception:  # created concurrently by another stage: read it back
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def _tags(values: dict[str, Any]) -> dict[str, str]:
    return {k: str(v)[:MAX_TAG_VALUE_LENGTH] for k, v in values.items() if v not in (None, "")}


def kfp_run_id() -> str | None:
    """This task's KFP pipeline-run id from the environment (None outside KFP); refuses a malformed value, which
    would otherwise end up inside an MLflow search filter."""
    value = os.environ.get(KFP_RUN_ENV, "").strip()
    if not value:
        return None
    if not _KFP_ID.fullmatch(value):
        raise ValueError(f"${KFP_RUN_ENV}={value[:40]!r} is not a KFP run id (letters, digits, '.', '_', '-').")
    return value


def start_pipeline_run(
    experiment: str, *, run_name: str | None = None, tags: dict[str, str] | None = None, tracking_uri: str | None = None
) -> str:
    """Create the parent run of one pipeline run; returns its id (export it as QVL_MLFLOW_PARENT_RUN_ID). A tracking
    server that cannot be reached stops here, before any stage, named without its credentials."""
    uri = tracking_uri or default_tracking_uri(Path.cwd())
    try:
        client = _client(uri)
        run = client.create_run(
            _experiment_id(client, experiment), run_name=run_name, tags=_tags({ROLE_TAG: "pipeline", **(tags or {})})
        )
    except Exception as error:  # MlflowException, connection errors: each may repeat the URI with its password
        raise ValueError(
            f"the MLflow tracking server {shown(uri, 200)} (MLFLOW_TRACKING_URI) could not open this pipeline's run: "
            f"{type(error).__name__}: {shown(str(error), 300)}; start the server, fix the URI, or unset "
            "MLFLOW_TRACKING_URI to track into the run directory."
        ) from None
    return run.info.run_id


def _find_pipeline_run(client, experiment_id: str, kfp_run: str) -> str | None:
    found = client.search_runs(
        [experiment_id],
        f"tags.`{KFP_RUN_TAG}` = '{kfp_run}' and tags.`{ROLE_TAG}` = 'pipeline'",
        order_by=["attributes.start_time ASC"],
        max_results=50,
    )
    if not found:
        return None
    return min(found, key=lambda r: (r.info.start_time, r.info.run_id)).info.run_id  # the same pick on every task


def pipeline_run_for_kfp(client, experiment: str, kfp_run: str) -> str:
    """The parent run of KFP pipeline run `kfp_run`: the one tagged with it, or a new one. Two tasks creating it at
    once both keep the oldest; the other copy is deleted."""
    experiment_id = _experiment_id(client, experiment)
    existing = _find_pipeline_run(client, experiment_id, kfp_run)
    if existing:
        return existing
    created = client.create_run(
        experiment_id,
        run_name=f"kfp-{kfp_run[:8]}",
        tags=_tags({ROLE_TAG: "pipeline", KFP_RUN_TAG: kfp_run}),
    ).info.run_id
    winner = _find_pipeline_run(client, experiment_id, kfp_run) or created
    if winner != created:
        client.delete_run(created)
    return winner


def log_pipeline_artifact(run_id: str, path: str | Path, *, tracking_uri: str | None = None) -> None:
    """Attach a file (the run's report.html) to the parent run."""
    _client(tracking_uri or default_tracking_uri(Path.cwd())).log_artifact(run_id, str(path))


def finish_pipeline_run(run_id: str, status: str = "FINISHED", *, tracking_uri: str | None = None) -> None:
    """End the parent run: FINISHED, FAILED or KILLED (KFP's SUCCEEDED / CANCELLED map onto them)."""
    _client(tracking_uri or default_tracking_uri(Path.cwd())).set_terminated(run_id, _status(status))


def finish_kfp_pipeline_run(state: str, *, experiment: str, tracking_uri: str | None = None) -> str:
    """The pipeline's exit task: end this KFP run's parent run with the DAG's final state (KFP's SUCCEEDED, FAILED,
    CANCELED ...). Returns what it did, for the task's log. Parents that others own are left to them."""
    if os.environ.get(GIVEN_RUN_ENV):
        return "KFP's MLflow integration owns this pipeline's parent run; nothing to end"
    if os.environ.get(PARENT_RUN_ENV):
        return "the local runner owns this pipeline's parent run; nothing to end"
    kfp_run = kfp_run_id()
    if kfp_run is None:
        return f"no ${KFP_RUN_ENV}: not a KFP pipeline run; nothing to end"
    client = _client(tracking_uri or default_tracking_uri(Path.cwd()))
    parent = _find_pipeline_run(client, _experiment_id(client, experiment), kfp_run)
    if parent is None:
        return f"no MLflow run is tagged {KFP_RUN_TAG}={kfp_run} (no stage logged); nothing to end"
    status = _KFP_END_STATES.get(state.upper(), "FAILED")
    client.set_tag(parent, "qvl.kfp_state", state.upper())
    client.set_terminated(parent, status)
    return f"MLflow run {parent} of KFP run {kfp_run} ended {status} (KFP state {state})"


def _stage_tags(stage: str, params: dict[str, Any] | None) -> dict[str, str]:
    return _tags(
        {
            STAGE_TAG: stage,
            KFP_RUN_TAG: os.environ.get(KFP_RUN_ENV, "").strip(),
            KFP_TASK_TAG: os.environ.get(KFP_TASK_ENV, "").strip(),
            CONFIG_TAG: json.dumps(params, sort_keys=True, default=str) if params else "",
        }
    )


def resolve_stage_run(client, stage: str, experiment: str, params: dict[str, Any] | None = None) -> tuple[str, bool]:
    """(run id, owned) of `stage`'s run, by the rules in this module's docstring; `owned` runs are ours to end."""
    tags = _stage_tags(stage, params)
    given = os.environ.get(GIVEN_RUN_ENV, "").strip()
    if given:
        client.log_batch(given, tags=_run_tags(tags))
        return given, False
    kfp_run = kfp_run_id()
    parent = os.environ.get(PARENT_RUN_ENV) or (pipeline_run_for_kfp(client, experiment, kfp_run) if kfp_run else None)
    if parent is None:
        return client.create_run(_experiment_id(client, experiment), run_name=stage, tags=tags).info.run_id, True
    experiment_id = client.get_run(parent).info.experiment_id
    earlier = client.search_runs(
        [experiment_id],
        f"tags.`{PARENT_TAG}` = '{parent}' and tags.`{STAGE_TAG}` = '{stage}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if earlier:  # a retried task: the same run again, running again
        run_id = earlier[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        client.log_batch(run_id, tags=_run_tags(tags))
        return run_id, True
    return client.create_run(experiment_id, run_name=stage, tags={**tags, PARENT_TAG: parent}).info.run_id, True


def _run_tags(tags: dict[str, str]) -> list:
    from mlflow.entities import RunTag

    return [RunTag(k, v) for k, v in tags.items()]


def _rank(name: str) -> str:
    return os.environ.get(name, "0").strip() or "0"


@contextmanager
def system_metrics(run_id: str | None, *, tracking_uri: str) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network, GPUs) of this node into `run_id` while the block runs,
    when $QVL_SYSTEM_METRICS_S > 0. One monitor per node (local rank 0); on a multi-node run each is tagged with its
    node id (`system/node-1/cpu_utilization_percentage`), so the nodes' values do not overwrite each other."""
    interval = env_number(SYSTEM_METRICS_ENV, 0.0, unit="seconds")
    if not run_id or interval <= 0 or _rank("LOCAL_RANK") != "0":
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    multi_node = int(os.environ.get("GROUP_WORLD_SIZE") or 1) > 1  # torchrun: the number of nodes
    node = f"node-{_rank('GROUP_RANK')}" if multi_node else None
    try:
        monitor = SystemMetricsMonitor(
            run_id, sampling_interval=interval, node_id=node, tracking_uri=tracking_uri, resume_logging=True
        )
        monitor.start()
    except Exception as error:  # noqa: BLE001 - system metrics never stop a stage
        logger.warning("MLflow system metrics not started: %s", error)
        yield
        return
    try:
        yield
    finally:
        monitor.finish()


@contextmanager
def stage_tracker(
    stage: str,
    *,
    experiment: str,
    params: dict[str, Any] | None = None,
    tracking_uri: str | None = None,
    fallback_dir: str | Path | None = None,
    **tracker_options: Any,
) -> Iterator[Tracker]:
    """The stage's run (see the module docstring); ranks other than 0 ($RANK) get a NullTracker, and on a node's
    local rank 0 the node's system metrics go to the stage's run when it is known ($MLFLOW_RUN_ID).

    An owned run ends FAILED if the block raises, KILLED on KeyboardInterrupt, FINISHED otherwise. If MLflow is
    unreachable at the start, the run is resolved at the first successful flush (or everything lands in the
    fallback file).
    """
    uri = tracking_uri or default_tracking_uri(Path.cwd())
    if _rank("RANK") != "0":
        with system_metrics(os.environ.get(GIVEN_RUN_ENV), tracking_uri=uri):
            yield NullTracker()
        return
    client = _client(uri)
    owned = {"value": not os.environ.get(GIVEN_RUN_ENV)}

    def start_run() -> str:
        run_id, owned["value"] = resolve_stage_run(client, stage, experiment, params)
        return run_id

    try:
        run_id: str | None = start_run()
    except Exception as error:  # noqa: BLE001 - the stage runs anyway; the tracker retries creation
        logger.warning(
            "MLflow run for stage %r not resolved at %s (%s); will retry at each flush",
            stage,
            redact(uri),
            redact(str(error)),
        )
        run_id = None
    tracker = MlflowTracker(
        client, run_id, start_run=start_run, fallback_dir=fallback_dir, end_run=owned["value"], **tracker_options
    )
    if params:
        tracker.log_params(params)
    with system_metrics(run_id, tracking_uri=uri):
        try:
            yield tracker
        except KeyboardInterrupt:
            tracker.close("KILLED")
            raise
        except BaseException:
            tracker.close("FAILED")
            raise
        tracker.close("FINISHED")


@contextmanager
def launched_stage_run(stage: str, *, experiment: str, params: dict[str, Any] | None = None) -> Iterator[str | None]:
    """For a launcher (torchrun, TrainJob): resolve the stage's run before the processes start and yield its id (to
    hand them as $MLFLOW_RUN_ID: rank 0 logs into it, each node's system metrics too: one run, not one per GPU); end
    it with the launch's outcome when it is ours. None when MLflow is unreachable (the ranks then resolve it)."""
    uri = default_tracking_uri(Path.cwd())
    client = _client(uri)
    try:
        run_id, owned = resolve_stage_run(client, stage, experiment, params)
    except Exception as error:  # noqa: BLE001 - tracking never stops a stage
        logger.warning("MLflow run for stage %r not resolved before launch (%s)", stage, error)
        yield None
        return
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if owned:
            try:
                client.set_terminated(run_id, status)
            except Exception as error:  # noqa: BLE001
                logger.warning("MLflow run %s not marked %s: %s", run_id, status, error)
