"""Run the DAG on this machine with kfp.local and write run_summary.json.

Every task runs as a subprocess of this Python (no containers); the stages record their results through
`components._shared.launch.result` into a per-run directory named by QVL_RUN_SUMMARY_DIR, and the MLflow parent
run id travels in QVL_MLFLOW_PARENT_RUN_ID (environment only, never a cached task input).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components._shared.launch.result import RESULT_FILE, SUMMARY_DIR_ENV
from components.stages import DAG_ORDER

SUMMARY_FILE = "run_summary.json"


@contextmanager
def _recording_cache_hits() -> Iterator[list[dict[str, Any]]]:
    """Yield a list that collects the outputs of every kfp.local cache hit during the block.

    kfp.local logs its hits at INFO on a logger it leaves at WARNING, so the lookup itself is wrapped.
    """
    from kfp.local import cache as kfp_cache

    hits: list[dict[str, Any]] = []
    original = kfp_cache.LocalCache.get

    def get(self, key):
        outputs = original(self, key)
        if outputs is not None:
            hits.append(outputs)
        return outputs

    kfp_cache.LocalCache.get = get
    try:
        yield hits
    finally:
        kfp_cache.LocalCache.get = original


def _cached_results(hits: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Stage results of cached tasks: the `_stage_result.json` inside the artifacts they reused."""
    results: dict[str, dict[str, Any]] = {}
    for outputs in hits:
        for value in outputs.values():
            uri = getattr(value, "uri", None)
            result_file = Path(uri or "") / RESULT_FILE
            if uri and result_file.is_file():
                result = json.loads(result_file.read_text())
                if result.get("stage"):
                    results[result["stage"]] = {**result, "status": "cached"}
    return results


def _collect(results_dir: Path, expected: list[str], cached: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stages: dict[str, Any] = {}
    for stage in expected:
        path = results_dir / f"{stage}.json"
        if path.exists():
            result = json.loads(path.read_text())
        elif stage in cached:
            result = cached[stage]
        else:
            continue
        stages[stage] = {key: result.get(key) for key in ("status", "metrics", "artifacts", "seconds", "error")}
        if not stages[stage]["error"]:
            stages[stage].pop("error")
    return stages


def run_local(
    *,
    lake_uri: str,
    out_dir: Path,
    data_uri: str = "",
    preset: str = "tiny",
    until: str | None = None,
    enable_caching: bool = False,
) -> dict[str, Any]:
    """Run the DAG (up to `until`) on `lake_uri` with held-out / SFT data at `data_uri`; returns the run summary,
    also written to out_dir/run_summary.json."""
    from kfp import local

    from components._shared.platform.mlflow_tracking import (
        default_tracking_uri,
        finish_pipeline_run,
        start_pipeline_run,
    )
    from pipelines.presets import load_preset
    from pipelines.vlm_training import build_pipeline

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    p = load_preset(preset)
    pipeline = build_pipeline(preset, until, for_cluster=False)  # validates `until` before anything starts
    if lake_uri and "://" not in lake_uri:
        lake_uri = str(Path(lake_uri).resolve())
    if data_uri and "://" not in data_uri:
        data_uri = str(Path(data_uri).resolve())
    results_dir = out_dir / "stage_results"
    shutil.rmtree(results_dir, ignore_errors=True)
    results_dir.mkdir()

    os.environ.setdefault("MLFLOW_TRACKING_URI", default_tracking_uri(out_dir))
    parent_run_id = start_pipeline_run(p.experiment, run_name=f"local-{p.name}", tags={"preset": p.name})
    os.environ["QVL_MLFLOW_PARENT_RUN_ID"] = parent_run_id
    os.environ[SUMMARY_DIR_ENV] = str(results_dir)

    cache_root = out_dir / "kfp_cache"
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(out_dir / "pipeline_root"),
        raise_on_error=False,
        enable_caching=enable_caching,
        cache_root=str(cache_root) if enable_caching else None,
    )
    started = time.time()
    with _recording_cache_hits() as hits:
        pipeline(
            lake_uri=lake_uri,
            eval_data_uri=data_uri,
            sft_data_uri=data_uri,
            preference_data_uri=data_uri,
            rl_data_uri=data_uri,
            **p.pipeline_args(),
        )

    expected = ["preflight", *DAG_ORDER[: DAG_ORDER.index(until) + 1 if until else len(DAG_ORDER)]]
    stages = _collect(results_dir, expected, _cached_results(hits))
    ok = all(stages.get(s, {}).get("status") in ("succeeded", "cached") for s in expected)
    finish_pipeline_run(parent_run_id, "FINISHED" if ok else "FAILED")
    summary = {
        "mlflow_run_id": parent_run_id,
        "mlflow_tracking_uri": os.environ["MLFLOW_TRACKING_URI"],
        "preset": p.name,
        "lake_uri": lake_uri,
        "data_uri": data_uri,
        "status": "succeeded" if ok else "failed",
        "seconds": round(time.time() - started, 1),
        "stages": stages,
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return summary
