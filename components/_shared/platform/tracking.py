"""Experiment tracking: stages log through a `Tracker`; `NullTracker` records nothing (tests, ranks > 0).

The MLflow implementation and the pipeline / stage runs are in mlflow_tracking.py; this interface imports no
MLflow, so code that only passes a tracker around stays light.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Tracker:
    """What a stage may call. Implementations: `NullTracker` (here) and `MlflowTracker`."""

    run_id: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalar metrics (buffered; flushed in batches)."""

    def log_params(self, params: dict[str, Any]) -> None:
        """Record flat parameters (nested dicts are flattened with dots)."""

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or directory to the run's artifact store."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store a text document (Markdown report, JSON) as a run artifact."""

    def set_tags(self, tags: dict[str, str]) -> None:
        """Attach tags to the run."""

    def flush(self) -> None:
        """Send buffered metrics now."""

    def register_model(
        self,
        local_dir: str | Path,
        *,
        name: str,
        artifact_path: str,
        aliases: tuple[str, ...] = (),
        tags: dict[str, str] | None = None,
        description: str = "",
        key: str = "",
    ) -> str:
        """Upload `local_dir` to this run and register it as a new version of model `name` with `aliases`;
        returns the version ("" where nothing is tracked). With `key`, a version registered earlier under the
        same key (a retried task) is reused instead of adding another."""
        return ""

    def close(self, status: str = "FINISHED") -> None:
        """Flush and end the run."""


class NullTracker(Tracker):
    """Keeps the last value of each metric in memory and sends nothing anywhere."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.history: list[tuple[int | None, dict[str, float]]] = []
        self.params: dict[str, Any] = {}
        self.texts: dict[str, str] = {}
        self.tags: dict[str, str] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)
        self.history.append((step, dict(metrics)))

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.texts[artifact_file] = text

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def flatten(values: dict[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3} (with sep=".")."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out
