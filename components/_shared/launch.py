"""How a stage runs inside a KFP task (or from the CLI): validate, track, run, record the result.

`run_stage` is the one call a component body makes. It re-validates the config (KFP hands dicts back with
floats for ints), opens the stage's nested MLflow run, calls the stage function and records a result file:
`<output_dir>/_stage_result.json`, plus `$QVL_RUN_SUMMARY_DIR/<stage>.json` when that variable is set
(the local runner collects those into run_summary.json). Inputs that are committed directories are verified
against their `_COMMITTED.json` first; the output directory gets its own marker last, on success only. The variable is run-scoped, so it travels in the
environment and never in a cached task input.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from components._shared import storage

RESULT_FILE = "_stage_result.json"
SUMMARY_DIR_ENV = "QVL_RUN_SUMMARY_DIR"


def flatten_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric metrics only, nested dicts flattened with '.', for KFP's Metrics artifact and MLflow."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_metrics(value, prefix=f"{name}."))
        elif isinstance(value, bool):
            flat[name] = float(value)
        elif isinstance(value, (int, float)):
            flat[name] = float(value)
    return flat


def report_metrics(artifact, metrics: dict[str, Any]) -> None:
    """Mirror a stage's metrics to a KFP Metrics artifact: logged for the UI and written as JSON at its path.

    The file matters: KFP's local cache treats an output whose path does not exist as missing and re-runs
    the task, and a Metrics artifact otherwise has no file.
    """
    flat = flatten_metrics(metrics)
    for name, value in flat.items():
        artifact.log_metric(name, value)
    Path(artifact.path).parent.mkdir(parents=True, exist_ok=True)
    Path(artifact.path).write_text(json.dumps(flat, indent=2, sort_keys=True))


def _record(stage: str, result: dict[str, Any], output_dir: Path | None) -> None:
    text = json.dumps({"stage": stage, **result}, indent=2, sort_keys=True, default=str)
    if output_dir is not None and output_dir.is_dir():
        (output_dir / RESULT_FILE).write_text(text)
    summary_dir = os.environ.get(SUMMARY_DIR_ENV)
    if summary_dir:
        Path(summary_dir).mkdir(parents=True, exist_ok=True)
        (Path(summary_dir) / f"{stage}.json").write_text(text)


def execute(
    stage: str,
    cfg,
    run: Callable[..., dict[str, Any]],
    *,
    inputs: dict[str, Any],
    output_dir: str | Path,
    experiment: str,
    artifacts: dict[str, str] | None = None,
    record_as: str | None = None,
) -> dict[str, Any]:
    """Run `run(cfg, **inputs, output_dir=..., tracker=...)` inside the stage's tracker and record the result.

    `record_as` names the entry in the run summary and the MLflow stage run; None records and tracks nothing
    (one shard of a fan-out: its merge task reports for it).
    """
    from contextlib import nullcontext

    from components._shared.tracking import NullTracker, stage_tracker

    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        # torchrun: every rank trains; only rank 0 writes the record and the commit marker (and logs).
        record_as = None
    verify_inputs(inputs)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    artifacts = {"output": str(output_dir), **(artifacts or {})}
    started = time.time()
    params = cfg.model_dump(mode="json")
    try:
        tracking = (
            stage_tracker(record_as, experiment=experiment, params=params) if record_as else nullcontext(NullTracker())
        )
        with tracking as tracker:
            metrics = run(cfg, **inputs, output_dir=output_dir, tracker=tracker)
            tracker.log_metrics(flatten_metrics(metrics))
    except BaseException as err:
        if record_as:
            _record(
                record_as,
                {
                    "status": "failed",
                    "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc(limit=8),
                    "metrics": {},
                    "artifacts": artifacts,
                    "seconds": round(time.time() - started, 3),
                },
                output_dir,
            )
        raise
    if record_as:
        _record(
            record_as,
            {
                "status": "succeeded",
                "metrics": metrics,
                "artifacts": artifacts,
                "seconds": round(time.time() - started, 3),
            },
            output_dir,
        )
    if os.environ.get("RANK", "0").strip() in ("", "0"):
        storage.commit_dir(output_dir)  # last: readers treat a directory without the marker as unfinished
    return metrics


def verify_inputs(inputs: dict[str, Any]) -> int:
    """Verify every input that is a committed local directory (or a list of them) against its marker."""
    verified = 0
    for value in inputs.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, (str, Path)) and not storage.is_s3(item):
                path = Path(item)
                if path.is_dir() and storage.is_committed(path):
                    storage.verify_dir(path)
                    verified += 1
    return verified


def run_stage(
    stage: str,
    config: dict[str, Any],
    *,
    experiment: str,
    inputs: dict[str, Any],
    output_dir: str,
    function: str = "run",
    artifacts: dict[str, str] | None = None,
    record_as: str | None = None,
) -> dict[str, Any]:
    """Validate `config` for `stage` and run `components.<stage>.stage.<function>` (the component body's one call).

    With a launch plan in QVL_LAUNCH_PLAN (a cluster profile asking for several GPUs or nodes) the stage runs
    on several processes instead (components/_shared/scale_out.py) and this returns the metrics they recorded.
    """
    from components._shared.cli import validate
    from components.stages import load_config_class, load_stage

    from components._shared import scale_out

    cfg = validate(load_config_class(stage), stage, config)
    plan = scale_out.plan_from_env() if function == "run" else None
    if plan is not None:  # several processes (torchrun here) or nodes (a TrainJob): they run and record the stage
        return scale_out.run_launched(plan, cfg.model_dump(mode="json"), inputs=inputs, output_dir=output_dir,
                                      experiment=experiment)
    fn = getattr(load_stage(stage), function)
    return execute(
        stage,
        cfg,
        fn,
        inputs=inputs,
        output_dir=output_dir,
        experiment=experiment,
        artifacts=artifacts,
        record_as=record_as,
    )
