"""A stage's result record and metrics: `<output_dir>/_stage_result.json`, the run-summary copy, KFP Metrics.

Every run of a stage writes its record (status, metrics, artifacts, seconds) into its output directory and,
when QVL_RUN_SUMMARY_DIR is set, `$QVL_RUN_SUMMARY_DIR/<stage>.json` (the local runner collects those into
run_summary.json). The variable is run-scoped, so it travels in the environment and never in a cached task
input. Launchers read the record back (`read_result`) to return the metrics of a stage run elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from components._shared.platform.disk_space import write_text_atomic

RESULT_FILE = "_stage_result.json"
MODEL_DIR = "model"  # a model stage's HF checkpoint inside its output artifact


def model_dir(artifact: str | Path) -> str:
    """The HF checkpoint directory inside a model stage's output artifact: `<artifact>/model`."""
    return f"{str(artifact).rstrip('/')}/{MODEL_DIR}"


SUMMARY_DIR_ENV = "QVL_RUN_SUMMARY_DIR"
SUMMARY_FILE = "run_summary.json"  # the local runner's collection of them (pipelines/qvl/local_run.py)


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
    the task, and a Metrics artifact otherwise has no file. A value that is not finite (NaN, inf) is left out of the
    artifact, with a warning naming it: KFP's metadata (protobuf JSON) refuses it and fails the task after its work
    was done; it stays in the stage's record and MLflow.
    """
    flat = {name: value for name, value in flatten_metrics(metrics).items() if math.isfinite(value)}
    dropped = sorted(set(flatten_metrics(metrics)) - set(flat))
    if dropped:
        print(f"warning: not finite, left out of the KFP metrics: {', '.join(dropped)}", file=sys.stderr, flush=True)
    for name, value in flat.items():
        artifact.log_metric(name, value)
    Path(artifact.path).parent.mkdir(parents=True, exist_ok=True)
    Path(artifact.path).write_text(json.dumps(flat, indent=2, sort_keys=True))


def _record(stage: str, result: dict[str, Any], output_dir: Path | None) -> None:
    text = json.dumps({"stage": stage, **result}, indent=2, sort_keys=True, default=str)
    if output_dir is not None and output_dir.is_dir():
        write_text_atomic(output_dir / RESULT_FILE, text)  # whole or not at all: never a 0-byte result
    summary_dir = os.environ.get(SUMMARY_DIR_ENV)
    if summary_dir:
        Path(summary_dir).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(summary_dir) / f"{stage}.json", text)


def read_result(output_dir: str | Path, stage: str) -> dict[str, Any]:
    """The metrics the launched stage recorded in its output directory (launch.RESULT_FILE)."""
    path = Path(output_dir) / RESULT_FILE
    if not path.exists():
        raise RuntimeError(f"{stage}: the launched processes finished without writing {path}.")
    result = json.loads(path.read_text())
    if result.get("status") != "succeeded":
        raise RuntimeError(
            f"{stage}: the launched stage recorded status {result.get('status')}: "
            f"{result.get('error', 'no error recorded')}"
        )
    return result["metrics"]
