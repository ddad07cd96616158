"""A fake Kubeflow Pipelines API server (v2beta1) on loopback, for submission tests.

It serves exactly what kfp.Client and the `kfp` CLI call to submit and watch a run (kfp 2.17):

    GET  /apis/v2beta1/healthz                  Client() asks whether the deployment is multi-user
    GET  /apis/v2beta1/experiments?filter=...   create_experiment looks the name up first
    POST /apis/v2beta1/experiments              ... and creates it when missing
    GET  /apis/v2beta1/experiments/{id}
    POST /apis/v2beta1/runs                     run_pipeline: the spec inline, runtime_config.parameters
    GET  /apis/v2beta1/runs/{id}                get_run / waits: each GET moves the run one state on

Every request is recorded (method, path, query, headers, JSON body). Anything else is answered 404 and a body
the real server would refuse is answered 400, so a test notices when the client starts calling something new.
With `token` set, a request without `Authorization: Bearer <token>` is answered 401.

    with FakeKfpApi(states=["PENDING", "RUNNING", "FAILED"]) as api:
        ... kfp.Client(host=api.url) ...
        api.requests_to("POST", "/apis/v2beta1/runs")[0].body
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

PREFIX = "/apis/v2beta1"
CREATED_AT = "2025-01-01T00:00:00Z"
# Fields of the v2beta1 resources (kfp_server_api 2.17 models); a body with another field is refused.
RUN_FIELDS = {
    "experiment_id",
    "run_id",
    "display_name",
    "storage_state",
    "description",
    "pipeline_version_id",
    "pipeline_spec",
    "pipeline_version_reference",
    "runtime_config",
    "service_account",
    "created_at",
    "scheduled_at",
    "finished_at",
    "state",
    "error",
    "run_details",
    "recurring_run_id",
    "state_history",
    "plugins_input",
    "plugins_output",
}
EXPERIMENT_FIELDS = {
    "experiment_id",
    "display_name",
    "description",
    "created_at",
    "namespace",
    "storage_state",
    "last_run_created_at",
}
RUNTIME_CONFIG_FIELDS = {"parameters", "pipeline_root"}
STATES = {
    "RUNTIME_STATE_UNSPECIFIED",
    "PENDING",
    "RUNNING",
    "SUCCEEDED",
    "SKIPPED",
    "FAILED",
    "CANCELING",
    "CANCELED",
    "PAUSED",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any = None
    raw: bytes = b""
    status: int = 0  # what the fake answered


@dataclass
class _Run:
    resource: dict[str, Any]
    states: list[str]
    step: int = 0


@dataclass
class FakeKfpApi:
    """The server; `states` is the script every new run follows, one step per GET of the run."""

    states: list[str] = field(default_factory=lambda: ["PENDING", "RUNNING", "SUCCEEDED"])
    token: str | None = None
    multi_user: bool = False
    failure_message: str = "task 'sft-op' failed: exit code 1"

    def __post_init__(self):
        unknown = set(self.states) - STATES
        if unknown or not self.states:
            raise ValueError(f"states must be non-empty and among {sorted(STATES)}; got {self.states}")
        self.requests: list[Request] = []
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, _Run] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._url: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> Self:
        api = self

        class Handler(_Handler):
            fake = api

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-kfp-api").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (kept after stop(), for assertions on what was printed)."""
        assert self._url is not None, "start() the fake first"
        return self._url

    def add_experiment(self, name: str, namespace: str = "") -> str:
        """An experiment that exists before the test submits; returns its id."""
        with self._lock:
            return self._create_experiment({"display_name": name, "namespace": namespace})["experiment_id"]

    # -- what tests read ---------------------------------------------------------------------------------
    def requests_to(self, method: str, path: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == method and r.path == path]

    def unexpected(self) -> list[Request]:
        """Requests answered 4xx/5xx (other than a deliberate 401)."""
        with self._lock:
            return [r for r in self.requests if r.status >= 400 and r.status != 401]

    # -- the API -----------------------------------------------------------------------------------------
    def handle(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        if not path.startswith(PREFIX + "/"):
            raise ApiError(404, f"no route for {method} {path}")
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            raise ApiError(401, "missing or wrong bearer token")
        route = path[len(PREFIX) :]
        with self._lock:
            if method == "GET" and route == "/healthz":
                return 200, {"multi_user": self.multi_user, "pipeline_store": "database"}
            if method == "GET" and route == "/experiments":
                return 200, self._list_experiments(query)
            if method == "POST" and route == "/experiments":
                return 200, self._create_experiment(body)
            if method == "POST" and route == "/runs":
                return 200, self._create_run(body, query)
            if method == "GET" and (m := re.fullmatch(r"/experiments/([\w-]+)", route)):
                if m.group(1) not in self.experiments:
                    raise ApiError(404, f"experiment {m.group(1)} not found")
                return 200, self.experiments[m.group(1)]
            if method == "GET" and (m := re.fullmatch(r"/runs/([\w-]+)", route)):
                return 200, self._get_run(m.group(1))
        raise ApiError(404, f"no route for {method} {path}")

    def _list_experiments(self, query: dict[str, list[str]]) -> dict[str, Any]:
        allowed = {"page_token", "page_size", "sort_by", "filter", "namespace"}
        if set(query) - allowed:
            raise ApiError(400, f"unknown query parameters {sorted(set(query) - allowed)}")
        found = list(self.experiments.values())
        if "filter" in query:
            found = [e for e in found if _matches(e, _parse_filter(query["filter"][0]))]
        namespace = query.get("namespace", [""])[0]
        if namespace:
            found = [e for e in found if e.get("namespace") == namespace]
        return {"experiments": found, "total_size": len(found)} if found else {}

    def _create_experiment(self, body: Any) -> dict[str, Any]:
        _check_fields(body, EXPERIMENT_FIELDS, "experiment")
        name = body.get("display_name")
        if not isinstance(name, str) or not name.strip():
            raise ApiError(400, "experiment.display_name is required")
        if any(
            e["display_name"] == name and e.get("namespace", "") == (body.get("namespace") or "")
            for e in self.experiments.values()
        ):
            raise ApiError(409, f"experiment '{name}' already exists")
        exp_id = f"exp-{next(self._ids)}"
        self.experiments[exp_id] = {
            "experiment_id": exp_id,
            "display_name": name,
            "created_at": CREATED_AT,
            "namespace": body.get("namespace") or "",
            "storage_state": "AVAILABLE",
        }
        return self.experiments[exp_id]

    def _create_run(self, body: Any, query: dict[str, list[str]]) -> dict[str, Any]:
        if set(query) - {"experiment_id"}:
            raise ApiError(400, f"unknown query parameters {sorted(query)}")
        _check_fields(body, RUN_FIELDS, "run")
        if not isinstance(body.get("display_name"), str) or not body["display_name"].strip():
            raise ApiError(400, "run.display_name is required")
        if body.get("experiment_id") not in self.experiments:
            raise ApiError(404, f"experiment '{body.get('experiment_id')}' not found")
        if ("pipeline_spec" in body) == ("pipeline_version_reference" in body):
            raise ApiError(400, "a run needs exactly one of pipeline_spec and pipeline_version_reference")
        if "pipeline_version_reference" in body:
            raise ApiError(404, "this fake holds no uploaded pipelines")
        spec = pipeline_spec_of(body)
        declared = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
        runtime = body.get("runtime_config") or {}
        _check_fields(runtime, RUNTIME_CONFIG_FIELDS, "runtime_config")
        params = runtime.get("parameters") or {}
        unknown = sorted(set(params) - set(declared))
        if unknown:
            raise ApiError(400, f"unknown pipeline parameters {unknown}; the spec declares {sorted(declared)}")
        missing = sorted(
            name
            for name, p in declared.items()
            if "defaultValue" not in p and not p.get("isOptional") and name not in params
        )
        if missing:
            raise ApiError(400, f"required pipeline parameters missing: {missing}")
        run_id = f"run-{next(self._ids)}"
        resource = {
            **body,
            "run_id": run_id,
            "created_at": CREATED_AT,
            "storage_state": "AVAILABLE",
            "state": self.states[0],
        }
        self.runs[run_id] = _Run(resource=resource, states=list(self.states))
        return resource

    def _get_run(self, run_id: str) -> dict[str, Any]:
        if run_id not in self.runs:
            raise ApiError(404, f"run {run_id} not found")
        run = self.runs[run_id]
        run.step = min(run.step + 1, len(run.states) - 1)
        state = run.states[run.step]
        run.resource["state"] = state
        if state in ("FAILED", "CANCELED"):
            run.resource["finished_at"] = CREATED_AT
            run.resource["error"] = {"code": 2 if state == "FAILED" else 1, "message": self.failure_message}
        elif state in ("SUCCEEDED", "SKIPPED"):
            run.resource["finished_at"] = CREATED_AT
        return run.resource


def pipeline_spec_of(run_body: dict[str, Any]) -> dict[str, Any]:
    """The PipelineSpec of a run body: kfp sends {pipeline_spec, platform_spec} when there is a platform spec."""
    spec = run_body.get("pipeline_spec")
    if not isinstance(spec, dict):
        raise ApiError(400, "run.pipeline_spec must be an object")
    if "pipelineInfo" not in spec and isinstance(spec.get("pipeline_spec"), dict):
        spec = spec["pipeline_spec"]
    if not spec.get("pipelineInfo", {}).get("name") or "root" not in spec:
        raise ApiError(400, "run.pipeline_spec is not a PipelineSpec (pipelineInfo.name and root are required)")
    return spec


def _check_fields(body: Any, allowed: set[str], what: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"{what} must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise ApiError(400, f"{what}: unknown fields {sorted(unknown)}")


_OPERATIONS = {"EQUALS": 1, 1: 1}


def _parse_filter(text: str) -> list[dict[str, Any]]:
    try:
        predicates = json.loads(text)["predicates"]
    except (ValueError, KeyError, TypeError):
        raise ApiError(400, f"filter is not a JSON Filter: {text!r}") from None
    for p in predicates:
        if _OPERATIONS.get(p.get("operation")) != 1 or p.get("key") != "display_name" or "stringValue" not in p:
            raise ApiError(400, f"this fake filters on display_name EQUALS only; got {p}")
    return predicates


def _matches(resource: dict[str, Any], predicates: list[dict[str, Any]]) -> bool:
    return all(resource.get(p["key"]) == p["stringValue"] for p in predicates)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKfpApi
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _serve(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k.lower(): v for k, v in self.headers.items()}
        request = Request(self.command, url.path, parse_qs(url.query), headers, raw=raw)
        with self.fake._lock:
            self.fake.requests.append(request)
        try:
            if raw:
                try:
                    request.body = json.loads(raw)
                except ValueError:
                    raise ApiError(400, "body is not JSON") from None
            elif self.command == "POST":
                raise ApiError(400, "POST without a body")
            status, payload = self.fake.handle(self.command, url.path, request.query, headers, request.body)
        except ApiError as err:
            status, payload = err.status, {"code": err.status, "message": str(err)}
        request.status = status
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve
