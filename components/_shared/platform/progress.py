"""Live progress of a running stage, for `qvl run --local`'s progress view (pipelines/qvl/progress_view.py).

A stage calls `update("train", step, total, "steps")` as it goes (TrainLoop per step, clean_data per record,
evaluation per question ...). When QVL_PROGRESS_DIR is set (the local runner sets it; it is run-scoped, so it
travels in the environment, never in a cached task input) each process writes its latest update to
`$QVL_PROGRESS_DIR/<stage>-<pid>.json`, atomically and at most twice a second; otherwise `update` does nothing.
`execute` (launch/runner.py) names the stage with `stage_scope`; only rank 0 of a multi-process run reports.
Inside a Kubeflow Trainer TrainJob the same updates also go to the job's status (platform/trainjob_status.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components._shared.platform import trainjob_status

PROGRESS_DIR_ENV = "QVL_PROGRESS_DIR"
MIN_INTERVAL_S = 0.5

_state: dict[str, Any] = {"stage": None, "written": 0.0, "phase": None}


@contextmanager
def stage_scope(stage: str) -> Iterator[None]:
    """Updates inside the block are `stage`'s."""
    previous = _state["stage"]
    _state["stage"], _state["phase"] = stage, None  # the stage's first update is written at once
    try:
        yield
        if _rank_zero():
            trainjob_status.finish(stage)
    finally:
        _state["stage"] = previous


def _rank_zero() -> bool:
    return os.environ.get("RANK", "0").strip() in ("", "0")


def update(phase: str, done: int, total: int | None, unit: str, **extra: float) -> None:
    """`done` of `total` `unit` of `phase` (e.g. "train", 40, 200, "steps"; total None when unknown)."""
    directory, stage = os.environ.get(PROGRESS_DIR_ENV), _state["stage"]
    if not stage or not _rank_zero():
        return
    trainjob_status.update(stage, phase, done, total, extra)
    if not directory:
        return
    now = time.monotonic()
    finished = total is not None and done >= total
    if now - _state["written"] < MIN_INTERVAL_S and phase == _state["phase"] and not finished:
        return
    _state["written"], _state["phase"] = now, phase
    record = {"stage": stage, "phase": phase, "done": int(done), "total": total, "unit": unit, "time": time.time()}
    record.update({key: float(value) for key, value in extra.items()})
    path = Path(directory) / f"{stage}-{os.getpid()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:  # a progress line is never worth failing a stage for
        pass


def read_all(directory: str | Path) -> list[dict[str, Any]]:
    """Every process's latest update under `directory` (unreadable or half-written files skipped)."""
    records = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records
