"""Training progress into the status of the Kubeflow Trainer TrainJob a stage runs in (Trainer >= 2.2 with its
`TrainJobStatus` feature gate: `kubectl get trainjob` and the launching KFP task's log show it).

The controller injects KUBEFLOW_TRAINER_SERVER_URL (and its CA certificate and a projected token) into the trainer
pods; outside such a pod nothing is sent. `progress.update` (platform/progress.py) hands every update here on rank 0;
a background thread posts the latest one with the Kubeflow SDK's `update_trainjob_status` at most every 5 s (the
SDK's own limit), so a slow or unreachable status server never stalls a training step. `finish()` sends 100% once
the stage succeeded. What is sent: progress of the current phase (capped at 99% until the stage ends), its
estimated remaining seconds, and the metrics stage, phase, current_step, total_steps and loss.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

SERVER_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
MIN_INTERVAL_S = 5.0  # the SDK drops calls closer together than this


def enabled() -> bool:
    return bool(os.environ.get(SERVER_URL_ENV))


def _send(progress: int, remaining: int | None, metrics: dict[str, Any]) -> bool:
    from kubeflow.trainer import update_trainjob_status

    return update_trainjob_status(progress_percent=progress, estimated_remaining_seconds=remaining, metrics=metrics)


class _Reporter:
    """Keeps the newest status and posts it from a daemon thread, never more often than MIN_INTERVAL_S."""

    def __init__(self) -> None:
        self._latest: tuple[int, int | None, dict[str, Any]] | None = None
        self._sent_at = -MIN_INTERVAL_S
        self._wake = threading.Condition()
        self._phase: tuple[str | None, str | None, float] = (None, None, 0.0)  # stage, phase, its start
        self._thread = threading.Thread(target=self._loop, name="trainjob-status", daemon=True)
        self._thread.start()

    def update(self, stage: str, phase: str, done: int, total: int | None, extra: dict[str, float]) -> None:
        now = time.monotonic()
        if self._phase[:2] != (stage, phase):
            self._phase = (stage, phase, now)
        if not total:
            return
        fraction = min(1.0, max(0.0, done / total))
        elapsed = now - self._phase[2]
        remaining = int(elapsed / fraction * (1 - fraction)) if fraction > 0 else None
        metrics: dict[str, Any] = {"stage": stage, "phase": phase, "current_step": int(done), "total_steps": total}
        if "loss" in extra and extra["loss"] == extra["loss"]:  # not NaN
            metrics["loss"] = round(float(extra["loss"]), 6)
        self._post((min(99, int(fraction * 100)), remaining, metrics))

    def finish(self, stage: str, timeout: float = MIN_INTERVAL_S + 5.0) -> bool:
        """Post 100% for `stage` now (waiting out the interval) and return whether it was sent."""
        with self._wake:
            self._latest = None
        wait = self._sent_at + MIN_INTERVAL_S - time.monotonic()
        if wait > timeout:
            return False
        time.sleep(max(0.0, wait))
        sent = _send(100, 0, {"stage": stage, "phase": "done"})
        self._sent_at = time.monotonic()
        return sent

    def _post(self, status: tuple[int, int | None, dict[str, Any]]) -> None:
        with self._wake:
            self._latest = status
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._latest is None:
                    self._wake.wait()
                wait = self._sent_at + MIN_INTERVAL_S - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)  # newer updates may replace the one waiting
                    continue
                status, self._latest = self._latest, None
            try:
                _send(*status)
            except Exception:  # noqa: BLE001, S110 - progress is a courtesy; training goes on
                pass
            self._sent_at = time.monotonic()


_reporter: _Reporter | None = None


def update(stage: str, phase: str, done: int, total: int | None, extra: dict[str, float]) -> None:
    """Hand one progress update over (no-op outside a TrainJob's pods)."""
    global _reporter
    if not enabled():
        return
    if _reporter is None:
        _reporter = _Reporter()
    _reporter.update(stage, phase, done, total, extra)


def finish(stage: str) -> bool:
    """The stage succeeded: report 100% (no-op outside a TrainJob's pods, or when nothing was reported)."""
    return _reporter.finish(stage) if enabled() and _reporter is not None else False
