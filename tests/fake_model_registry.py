"""A stand-in for the Kubeflow Model Registry REST API (v1) on loopback: exactly the calls the real `model-registry`
0.3.18 client makes when it connects, registers a model and looks a version up again. Everything else answers 404,
so drift in the client's calls fails the test.

    GET  /api/model_registry/v1/registered_models?pageSize=1...     the client's connection check
    GET  /api/model_registry/v1/registered_model?name=N              find (404 when absent)
    POST /api/model_registry/v1/registered_models                    create
    GET  /api/model_registry/v1/model_version?name=V&parentResourceId=RM
    POST /api/model_registry/v1/model_versions
    POST /api/model_registry/v1/model_versions/{id}/artifacts        upsert a version's model artifact
    GET  /api/model_registry/v1/model_artifact?name=N&parentResourceId=MV

Objects are kept in memory as the server returns them: string ids, registered models and versions from one sequence
(both are contexts in the server's store), artifacts from another; names unique per parent (409 otherwise); unknown
fields in a request are a 400, as the server's strict JSON decoding gives. `token`, when set, is required as a bearer
token (401 otherwise); `fail_artifact_posts` answers that many artifact posts with 503 (an interrupted registration).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

API = "/api/model_registry/v1"
COMMON = {"name", "description", "externalId", "customProperties", "state"}
CREATE_FIELDS = {
    "registered_model": COMMON
    | {"owner", "readme", "maturity", "language", "tasks", "provider", "logo", "license", "licenseLink", "libraryName"},
    "model_version": COMMON | {"author", "registeredModelId"},
    "model_artifact": COMMON
    | {
        "artifactType",
        "uri",
        "modelFormatName",
        "modelFormatVersion",
        "storageKey",
        "storagePath",
        "serviceAccountName",
        "modelSourceKind",
        "modelSourceClass",
        "modelSourceGroup",
        "modelSourceId",
        "modelSourceName",
        "experimentId",
        "experimentRunId",
        "id",
        "createTimeSinceEpoch",
        "lastUpdateTimeSinceEpoch",
    },
}
METADATA_TYPES = {"MetadataStringValue", "MetadataIntValue", "MetadataDoubleValue", "MetadataBoolValue"}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    authorization: str | None


@dataclass
class FakeModelRegistry:
    token: str | None = None
    fail_artifact_posts: int = 0
    requests: list[Request] = field(default_factory=list)
    registered_models: dict[str, dict] = field(default_factory=dict)
    versions: dict[str, dict] = field(default_factory=dict)
    artifacts: dict[str, dict] = field(default_factory=dict)
    artifact_of_version: dict[str, list[str]] = field(default_factory=dict)
    _context_ids: int = 0
    _artifact_ids: int = 0

    def __enter__(self) -> FakeModelRegistry:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                request = Request(method, url.path, parse_qs(url.query), body, self.headers.get("Authorization"))
                registry.requests.append(request)
                status, payload = registry.handle(request)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PATCH(self):
                self._handle("PATCH")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- routing -------------------------------------------------------------------------------------------

    def handle(self, request: Request) -> tuple[int, Any]:
        if self.token is not None and request.authorization != f"Bearer {self.token}":
            return 401, _error(401, "unauthorized: missing or wrong bearer token")
        try:
            return self.route(request.method, request.path, {k: v[0] for k, v in request.query.items()}, request.body)
        except _Refused as refused:
            return refused.status, _error(refused.status, refused.message)

    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if path == f"{API}/registered_models" and method == "GET":
            return 200, self._page(list(self.registered_models.values()), query)
        if path == f"{API}/registered_models" and method == "POST":
            return 201, self._create_registered_model(body)
        if path == f"{API}/registered_model" and method == "GET":
            found = [m for m in self.registered_models.values() if m["name"] == query.get("name")]
            return (200, found[0]) if found else (404, _error(404, f"no registered model named {query.get('name')}"))
        if path == f"{API}/model_version" and method == "GET":
            parent, name = query.get("parentResourceId"), query.get("name")
            found = [v for v in self.versions.values() if v["registeredModelId"] == parent and v["name"] == name]
            return (200, found[0]) if found else (404, _error(404, f"no version {name} of model {parent}"))
        if path == f"{API}/model_versions" and method == "POST":
            return 201, self._create_version(body)
        if (m := re.fullmatch(rf"{API}/model_versions/([^/]+)/artifacts", path)) and method == "POST":
            return 201, self._upsert_artifact(m[1], body)
        if path == f"{API}/model_artifact" and method == "GET":
            parent, name = query.get("parentResourceId"), query.get("name")
            found = [self.artifacts[a] for a in self.artifact_of_version.get(parent or "", [])]
            found = [a for a in found if a["name"] == name]
            return (200, found[0]) if found else (404, _error(404, f"no artifact {name} of version {parent}"))
        return 404, _error(404, f"fake model registry: no route for {method} {path}")

    # --- objects -------------------------------------------------------------------------------------------

    def _check(self, kind: str, body: Any, required: tuple[str, ...]) -> dict:
        if not isinstance(body, dict):
            raise _Refused(400, f"{kind}: the body must be a JSON object")
        unknown = sorted(set(body) - CREATE_FIELDS[kind])
        if unknown:
            raise _Refused(400, f"{kind}: unknown field(s) {unknown}")
        missing = [k for k in required if not body.get(k)]
        if missing:
            raise _Refused(400, f"{kind}: missing {missing}")
        for key, value in (body.get("customProperties") or {}).items():
            if not isinstance(value, dict) or value.get("metadataType") not in METADATA_TYPES:
                raise _Refused(400, f"{kind}: customProperties[{key}] is not a typed metadata value: {value}")
        return body

    def _stamp(self, obj: dict, *, artifact: bool = False) -> dict:
        if artifact:
            self._artifact_ids += 1
            obj["id"] = str(self._artifact_ids)
        else:
            self._context_ids += 1
            obj["id"] = str(self._context_ids)
        now = str(int(time.time() * 1000))
        obj.update(createTimeSinceEpoch=now, lastUpdateTimeSinceEpoch=now)
        obj.setdefault("customProperties", {})
        return obj

    def _create_registered_model(self, body: Any) -> dict:
        body = self._check("registered_model", body, ("name",))
        if any(m["name"] == body["name"] for m in self.registered_models.values()):
            raise _Refused(409, f"registered model {body['name']} already exists")
        model = self._stamp({**body, "state": body.get("state") or "LIVE"})
        self.registered_models[model["id"]] = model
        return model

    def _create_version(self, body: Any) -> dict:
        body = self._check("model_version", body, ("name", "registeredModelId"))
        if body["registeredModelId"] not in self.registered_models:
            raise _Refused(404, f"registered model {body['registeredModelId']} not found")
        if any(
            v["registeredModelId"] == body["registeredModelId"] and v["name"] == body["name"]
            for v in self.versions.values()
        ):
            raise _Refused(409, f"version {body['name']} already exists")
        version = self._stamp({**body, "state": body.get("state") or "LIVE"})
        self.versions[version["id"]] = version
        return version

    def _upsert_artifact(self, version_id: str, body: Any) -> dict:
        if self.fail_artifact_posts > 0:
            self.fail_artifact_posts -= 1
            raise _Refused(503, "unavailable (the fake was told to fail this artifact post)")
        if version_id not in self.versions:
            raise _Refused(404, f"model version {version_id} not found")
        body = self._check("model_artifact", body, ("artifactType", "name", "uri"))
        if body["artifactType"] != "model-artifact":
            raise _Refused(400, f"artifactType {body['artifactType']} is not model-artifact")
        if body.get("id"):
            raise _Refused(400, "this fake only creates artifacts (no update by id)")
        artifact = self._stamp({**body, "state": body.get("state") or "UNKNOWN"}, artifact=True)
        self.artifacts[artifact["id"]] = artifact
        self.artifact_of_version.setdefault(version_id, []).append(artifact["id"])
        return artifact

    def _page(self, items: list[dict], query: dict[str, str]) -> dict:
        size = int(query.get("pageSize") or 100)
        return {"items": items[:size], "nextPageToken": "", "pageSize": size, "size": len(items[:size])}


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str) -> dict:
    return {"code": str(status), "message": message}
