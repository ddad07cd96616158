"""MLflow behind the `Tracker` interface (tracking.py): the buffered `MlflowTracker`, the fallback file and its
replay. Which run a stage logs into (one parent per pipeline run, one nested run per stage, on every path) is
mlflow_runs.py's business.

`MlflowTracker` buffers metrics and sends them with `log_batch` from a background thread (one synchronous MLflow call
costs ~30 ms); if the tracking server is down it warns, keeps the buffer and retries, and at close writes whatever it
could not send to a JSONL file (`replay_fallback` sends such a file later).

    tracker = MlflowTracker(MlflowClient(uri), run_id)
    tracker.log_metrics({"train/loss": 0.7}, step=10)
    tracker.close()
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components._shared.platform.tracking import Tracker, flatten

logger = logging.getLogger(__name__)


FALLBACK_DIR_ENV = "QVL_MLFLOW_FALLBACK_DIR"


MAX_KEY_LENGTH, MAX_PARAM_VALUE_LENGTH, MAX_TAG_VALUE_LENGTH = 250, 6000, 8000  # MLflow 3 limits


MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH = 1000, 100


# Bounded HTTP retries (MLflow's default is 7 retries with backoff 2: minutes per call while a server is down).
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


_STATUS_ALIASES = {"SUCCEEDED": "FINISHED", "SUCCESS": "FINISHED", "CANCELLED": "KILLED", "CANCELED": "KILLED"}


def _param_value(value: Any) -> str:
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value, default=str)
        if isinstance(value, list | tuple | dict)
        else str(value)
    )
    return text[:MAX_PARAM_VALUE_LENGTH]


def _is_permanent(error: Exception) -> bool:
    """A 4xx answer (bad key, changed param value): retrying cannot help. Anything else may be an outage."""
    status = getattr(error, "get_http_status_code", lambda: 500)()
    return 400 <= status < 500 and status != 429


def _client(tracking_uri: str):
    from urllib.parse import urlparse

    from mlflow import MlflowClient

    parsed = urlparse(tracking_uri)
    problem = None
    if parsed.scheme in ("http", "https") and not parsed.hostname:
        problem = "names no host"
    elif parsed.scheme == "sqlite" and tracking_uri.startswith("sqlite:///"):
        folder = Path(tracking_uri[len("sqlite:///") :]).parent
        problem = None if folder.is_dir() else f"is a database in {folder}, which does not exist"
    if problem:
        raise ValueError(
            f"MLFLOW_TRACKING_URI={tracking_uri!r} {problem}; fix it, or leave it unset for the run's own store"
        )

    if tracking_uri.startswith(("http://", "https://")):
        for name, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
    try:
        return MlflowClient(tracking_uri=tracking_uri)
    except Exception as error:  # noqa: BLE001 - MLflow's errors for a scheme or path it does not open (no I/O yet)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ValueError(
            f"MLFLOW_TRACKING_URI={tracking_uri!r} is not a tracking store MLflow opens ({reason}); give "
            "http(s)://HOST:PORT or sqlite:////ABSOLUTE/PATH.db, or leave it unset for the run's own store"
        ) from None


class MlflowTracker(Tracker):
    """Buffers metrics, params and tags; a background thread sends them with `MlflowClient.log_batch`
    every `flush_every` metrics or `flush_interval_s` seconds, and on flush()/close().

    Never raises because the tracking server is down: it warns once per outage, keeps the buffer and
    retries. Beyond `max_buffer` metrics, new ones go straight to the fallback JSONL file; at close,
    anything still unsent goes there too (path logged, and in `fallback_path`). With `end_run=False` close()
    sends everything but leaves the run's status to its owner (KFP's MLflow integration, or a launcher).
    """

    def __init__(
        self,
        client,
        run_id: str | None,
        *,
        start_run: Callable[[], str] | None = None,
        flush_every: int = 500,
        flush_interval_s: float = 10.0,
        max_buffer: int = 100_000,
        fallback_dir: str | Path | None = None,
        end_run: bool = True,
    ) -> None:
        from mlflow.entities import Metric, Param, RunTag

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        self._client, self.run_id, self._start_run = client, run_id, start_run
        self.flush_every, self.flush_interval_s, self.max_buffer = flush_every, flush_interval_s, max_buffer
        given = fallback_dir or os.environ.get(FALLBACK_DIR_ENV)
        self._given_fallback_dir = Path(given) if given else None
        self.fallback_path: Path | None = None
        self._metrics: list = []
        self._artifacts: list[tuple[str, str | None]] = []  # (local path, artifact path) queued during an outage
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._lock, self._send_lock = threading.Lock(), threading.Lock()
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._down_since: float | None = None
        self._closed, self._end_run = False, end_run
        self._thread = threading.Thread(target=self._loop, name="mlflow-tracker", daemon=True)
        self._thread.start()

    # -- what stages call ---------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        batch = []
        for key, value in flatten(metrics, sep="/").items():
            try:
                number = float(value)
            except (TypeError, ValueError) as error:
                raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}") from error
            batch.append(self._Metric(key[:MAX_KEY_LENGTH], number, now, int(step or 0)))
        with self._lock:
            room = max(0, self.max_buffer - len(self._metrics))
            self._metrics.extend(batch[:room])
            overflow, pending = batch[room:], len(self._metrics)
        if overflow:
            logger.warning(
                "MLflow buffer full (%d metrics): writing %d to %s",
                self.max_buffer,
                len(overflow),
                self._spill(metrics=overflow),
            )
        if pending >= self.flush_every:
            self._wake.set()

    def log_params(self, params: dict[str, Any]) -> None:
        with self._lock:
            self._params.update({k[:MAX_KEY_LENGTH]: _param_value(v) for k, v in flatten(params).items()})

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self._tags.update({str(k)[:MAX_KEY_LENGTH]: str(v)[:MAX_TAG_VALUE_LENGTH] for k, v in tags.items()})

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Upload now; during an outage the file is kept in the queue and retried with the metrics (at each flush
        and at close), like them; only what is still unsent at close goes to the fallback file."""
        if not self._upload(str(local_path), artifact_path):
            with self._lock:
                self._artifacts.append((str(local_path), artifact_path))

    def _upload(self, local_path: str, artifact_path: str | None) -> bool:
        """True when uploaded (or refused for good, then spilled); False during an outage."""
        try:
            self._require_run()
            if Path(local_path).is_dir():
                self._client.log_artifacts(self.run_id, local_path, artifact_path)
            else:
                self._client.log_artifact(self.run_id, local_path, artifact_path)
        except Exception as error:  # noqa: BLE001 - tracking must never stop a stage
            if self.run_id is None or not _is_permanent(error):
                self._note_outage(error)
                return False
            where = self._spill(artifacts=[(local_path, artifact_path)])
            logger.warning("MLflow refused artifact %s (%s); recorded in %s", local_path, error, where)
        return True

    def _send_artifacts(self) -> bool:
        """Upload the artifacts queued during an outage; True when none is left."""
        while True:
            with self._lock:
                if not self._artifacts:
                    return True
                local_path, artifact_path = self._artifacts[0]
            if not self._upload(local_path, artifact_path):
                return False
            self._note_recovery()
            with self._lock:
                self._artifacts.pop(0)

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
        """Unlike logging, this raises when MLflow is unreachable: an unregistered model is not a result (KFP
        retries the task). The version's source is the run's artifact directory; loading it back is a plain
        download (`mlflow.artifacts.download_artifacts("models:/NAME@champion")`), nothing is unpickled.
        `key` (tag `qvl_registration`) makes it idempotent: a retry that registered before gets that version back,
        with the aliases set again, instead of a new one."""
        from mlflow.exceptions import MlflowException

        self._require_run()
        if key:
            if not re.fullmatch(r"[\w.:-]+", key):
                raise ValueError(f"registration key {key!r} may hold only letters, digits and . _ : -")
            earlier = self._client.search_model_versions(f"name='{name}' and tags.qvl_registration = '{key}'")
            if earlier:
                version = str(min(int(v.version) for v in earlier))
                for alias in aliases:
                    self._client.set_registered_model_alias(name, alias, version)
                return version
            tags = {**(tags or {}), "qvl_registration": key}
        self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)
        try:
            self._client.create_registered_model(name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"{self._client.get_run(self.run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
        version = self._client.create_model_version(
            name, source=source, run_id=self.run_id, tags=tags or {}, description=description
        ).version
        for alias in aliases:
            self._client.set_registered_model_alias(name, alias, version)
        return str(version)

    def log_text(self, text: str, artifact_file: str) -> None:
        try:
            self._require_run()
            self._client.log_text(self.run_id, text, artifact_file)
        except Exception as error:  # noqa: BLE001
            kept = self._fallback_root() / "artifacts" / (self.run_id or "no-run") / artifact_file
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(text)
            logger.warning("MLflow text artifact %s not logged (%s); kept at %s", artifact_file, _said(error), kept)

    def flush(self) -> None:
        if self._send():
            self._send_artifacts()

    def close(self, status: str = "FINISHED") -> None:
        if self._closed:
            return
        status = _status(status)
        self._closed = True
        self._stopping.set()
        self._wake.set()
        self._thread.join()
        if self._send() and self._send_artifacts() and self.run_id is not None and self._end_run:
            try:
                self._client.set_terminated(self.run_id, status)
            except Exception as error:  # noqa: BLE001
                logger.warning("MLflow run %s not marked %s: %s", self.run_id, status, error)
        with self._lock:
            metrics, params, tags, artifacts = self._metrics, self._params, self._tags, self._artifacts
            self._metrics, self._params, self._tags, self._artifacts = [], {}, {}, []
        if metrics or params or tags or artifacts:
            path = self._spill(metrics=metrics, params=params, tags=tags, artifacts=artifacts, status=status)
            logger.warning(
                "MLflow unreachable at close: %d metrics, %d params, %d tags, %d artifacts written to %s "
                "(send them later with components._shared.platform.tracking.replay_fallback)",
                len(metrics),
                len(params),
                len(tags),
                len(artifacts),
                path,
            )

    # -- sending ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if not self._stopping.is_set() and self._send():
                self._send_artifacts()

    def _require_run(self) -> None:
        if self.run_id is None:
            if self._start_run is None:
                raise RuntimeError("no MLflow run")
            self.run_id = self._start_run()

    def _send(self) -> bool:
        """Send everything buffered; True when the buffer is empty afterwards. Never raises."""
        with self._send_lock:
            while True:
                with self._lock:
                    params = list(self._params.items())[:MAX_PARAMS_TAGS_PER_BATCH]
                    tags = list(self._tags.items())[: MAX_PARAMS_TAGS_PER_BATCH - len(params)]
                    metrics = [] if params or tags else self._metrics[:MAX_METRICS_PER_BATCH]
                if not (params or tags or metrics):
                    return True
                try:
                    self._require_run()
                    self._client.log_batch(
                        self.run_id,
                        metrics=metrics,
                        params=[self._Param(k, v) for k, v in params],
                        tags=[self._RunTag(k, v) for k, v in tags],
                    )
                except Exception as error:  # noqa: BLE001
                    if self.run_id is None or not _is_permanent(error):
                        self._note_outage(error)
                        return False
                    logger.warning(
                        "MLflow rejected a batch (%s); written to %s",
                        error,
                        self._spill(metrics=metrics, params=dict(params), tags=dict(tags)),
                    )
                self._note_recovery()
                with self._lock:
                    for key, value in params:
                        if self._params.get(key) == value:
                            del self._params[key]
                    for key, value in tags:
                        if self._tags.get(key) == value:
                            del self._tags[key]
                    del self._metrics[: len(metrics)]  # only _send removes, and it holds _send_lock

    def _note_outage(self, error: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "MLflow tracking unavailable (%s); keeping %d metrics buffered, retrying every %.0f s",
                _said(error).splitlines()[0][:300],
                len(self._metrics),
                self.flush_interval_s,
            )

    def _note_recovery(self) -> None:
        if self._down_since is not None:
            logger.warning("MLflow tracking reachable again after %.0f s", time.monotonic() - self._down_since)
            self._down_since = None

    def _spill(self, *, metrics=(), params=None, tags=None, artifacts=(), status: str | None = None) -> Path:
        """Append records to the fallback JSONL file (one object per line, each naming its run)."""
        if self.fallback_path is None:
            root = self._fallback_root()
            self.fallback_path = root / f"mlflow-unsent-{self.run_id or 'no-run'}-{os.getpid()}.jsonl"
        run = self.run_id
        lines = [
            {"type": "metric", "run_id": run, "key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}
            for m in metrics
        ]
        lines += [{"type": "param", "run_id": run, "key": k, "value": v} for k, v in (params or {}).items()]
        lines += [{"type": "tag", "run_id": run, "key": k, "value": v} for k, v in (tags or {}).items()]
        lines += [{"type": "artifact", "run_id": run, "local_path": p, "artifact_path": a} for p, a in artifacts]
        if status is not None:
            lines.append({"type": "status", "run_id": run, "status": status})
        # appended, never through a symlink planted at the name, readable by its owner only
        descriptor = os.open(self.fallback_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "a") as handle:
            handle.writelines(json.dumps(line) + "\n" for line in lines)
        return self.fallback_path

    def _fallback_root(self) -> Path:
        """The fallback directory: the one given (fallback_dir or QVL_MLFLOW_FALLBACK_DIR), else a new private one
        under the temp directory (made at the first spill; a predictable name in a shared /tmp could be planted)."""
        if self._given_fallback_dir is None:
            self._given_fallback_dir = Path(tempfile.mkdtemp(prefix="qvl-mlflow-unsent-"))
        self._given_fallback_dir.mkdir(parents=True, exist_ok=True)
        return self._given_fallback_dir


def _said(error: BaseException) -> str:
    """An error as a warning shows it: a password in the tracking URI (http://user:pw@host) hidden."""
    from components._shared.platform.credential_shapes import redact

    return redact(str(error))


def replay_fallback(path: str | Path, *, tracking_uri: str | None = None) -> int:
    """Send the metrics, params and tags of a fallback JSONL file to their runs; returns the metric count.

    Records of a run that never got an id ("run_id": null) cannot be placed and are skipped.
    """
    from mlflow.entities import Metric, Param, RunTag

    client = _client(tracking_uri or default_tracking_uri(Path.cwd()))
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    sent = 0
    for run_id in sorted({r["run_id"] for r in records if r.get("run_id")}):
        mine = [r for r in records if r.get("run_id") == run_id]
        metrics = [Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in mine if r["type"] == "metric"]
        params = [Param(r["key"], r["value"]) for r in mine if r["type"] == "param"]
        tags = [RunTag(r["key"], r["value"]) for r in mine if r["type"] == "tag"]
        for start in range(0, len(params) + len(tags), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = (params + tags)[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            client.log_batch(
                run_id,
                params=[c for c in chunk if isinstance(c, Param)],
                tags=[c for c in chunk if isinstance(c, RunTag)],
            )
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])
        sent += len(metrics)
        statuses = [r["status"] for r in mine if r["type"] == "status"]
        if statuses:
            client.set_terminated(run_id, _status(statuses[-1]))
    return sent


def default_tracking_uri(out_dir: str | Path) -> str:
    """$MLFLOW_TRACKING_URI when set, else an embedded sqlite store `sqlite:///<out_dir>/mlflow.db`."""
    configured = os.environ.get("MLFLOW_TRACKING_URI", "").strip()  # an empty variable is unset
    if configured:
        return configured
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"


def _status(status: str) -> str:
    from mlflow.entities import RunStatus

    name = _STATUS_ALIASES.get(status.upper(), status.upper())
    if name not in ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED"):
        raise ValueError(
            f"run status {status!r} is not one of FINISHED, FAILED, KILLED, RUNNING, SCHEDULED "
            f"(KFP's SUCCEEDED/CANCELLED are accepted too)."
        )
    return RunStatus.to_string(RunStatus.from_string(name))
