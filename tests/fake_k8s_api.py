"""A fake Kubernetes API server on loopback for the TrainJob launcher: just the calls the Kubeflow Trainer SDK
and our launcher make (runtimes, trainjobs, their pods and logs, events, the trainer's version ConfigMap).

It records every request and plays a scripted life for each TrainJob: one state per GET of the job
("Created", "Running", "Complete", or ("Failed", reason, message)); the last state repeats. `on_create`
runs when a TrainJob is posted (a test uses it to do the pods' work). Unknown paths answer 404, so drift
in the client's calls fails the test. `FakeTrainerStatusServer` plays Kubeflow Trainer's status endpoint (HTTPS,
bearer token): what the job's pods post lands in the fake job's `status.trainerStatus`.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

GROUP = "/apis/trainer.kubeflow.org/v1alpha1"
CREATED = "2026-11-30T00:00:00Z"


def torch_runtime(name: str) -> dict[str, Any]:
    """A torch TrainingRuntime like the stock `torch-distributed` one."""
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "replicas": 1,
                            "template": {
                                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                "spec": {
                                    "template": {
                                        "spec": {
                                            "containers": [
                                                {
                                                    "name": "node",
                                                    "image": "pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime",
                                                    "command": ["torchrun"],
                                                }
                                            ]
                                        }
                                    }
                                },
                            },
                        }
                    ]
                }
            },
        },
    }


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class FakeKubernetesApi:
    states: list[Any] = field(default_factory=lambda: ["Created", "Running", "Complete"])
    cluster_runtimes: dict[str, dict] = field(
        default_factory=lambda: {"torch-distributed": torch_runtime("torch-distributed")}
    )
    logs: str = "rank 0: step 1 loss 2.0\nrank 0: done\n"
    on_create: Callable[[dict], None] | None = None
    state_of: Callable[[str], Any] | None = None  # instead of `states`: the job's state, asked at every GET
    requests: list[Request] = field(default_factory=list)
    jobs: dict[str, dict] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    polls: dict[str, int] = field(default_factory=dict)
    trainer_status: dict[str, dict] = field(default_factory=dict)  # by job name: what its pods reported

    def __enter__(self) -> FakeKubernetesApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _handle(self, method: str):
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                api.requests.append(Request(method, url.path, parse_qs(url.query), body))
                status, payload = api.route(method, url.path, parse_qs(url.query), body)
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

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

    def configuration(self):
        from kubernetes.client import Configuration

        config = Configuration(host=self.url)
        config.verify_ssl = False
        return config

    # --- routing -------------------------------------------------------------------------------------------

    def _state(self, name: str) -> Any:
        if self.state_of is not None:
            return self.state_of(name)
        return self.states[min(self.polls.get(name, 0), len(self.states) - 1)]

    def route(self, method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        if path == "/api/v1/namespaces/kubeflow-system/configmaps/kubeflow-trainer-public" and method == "GET":
            return 200, {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "kubeflow-trainer-public"},
                "data": {"kubeflow_trainer_version": "v2.1.0"},
            }
        if m := re.fullmatch(rf"{GROUP}/namespaces/([^/]+)/trainingruntimes/([^/]+)", path):
            return 404, _status(404, f'trainingruntimes "{m[2]}" not found')
        if m := re.fullmatch(rf"{GROUP}/clustertrainingruntimes/([^/]+)", path):
            runtime = self.cluster_runtimes.get(m[1])
            return (200, runtime) if runtime else (404, _status(404, f'clustertrainingruntimes "{m[1]}" not found'))
        if (m := re.fullmatch(rf"{GROUP}/namespaces/([^/]+)/trainjobs", path)) and method == "POST":
            job = dict(body)
            job["metadata"] = {**job["metadata"], "namespace": m[1], "creationTimestamp": CREATED}
            self.jobs[job["metadata"]["name"]] = job
            if self.on_create:
                self.on_create(job)
            return 201, job
        if m := re.fullmatch(rf"{GROUP}/namespaces/([^/]+)/trainjobs/([^/]+)", path):
            name = m[2]
            if name not in self.jobs:
                return 404, _status(404, f'trainjobs "{name}" not found')
            if method == "DELETE":
                self.deleted.append(name)
                return 200, _status(200, "deleted")
            if method == "PATCH":  # a merge patch of metadata (owner references)
                self.jobs[name]["metadata"] = {**self.jobs[name]["metadata"], **body.get("metadata", {})}
                return 200, self.jobs[name]
            self.polls[name] = self.polls.get(name, 0) + 1
            return 200, self._job_with_status(name)
        if (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)) and method == "GET":
            selector = query.get("labelSelector", [""])[0]
            name = re.search(r"jobset-name=([^,]+)", selector)
            return 200, {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {},
                "items": self._pods(name[1]) if name and name[1] in self.jobs else [],
            }
        if re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", path):
            return 200, self.logs
        if re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path):
            return 200, {"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": []}
        return 404, _status(404, f"fake API: no route for {method} {path}")

    def _job_with_status(self, name: str) -> dict:
        job = dict(self.jobs[name])
        state = self._state(name)
        conditions = []
        if state == "Complete":
            conditions = [
                {
                    "type": "Complete",
                    "status": "True",
                    "reason": "JobSetCompleted",
                    "message": "jobset completed",
                    "lastTransitionTime": CREATED,
                }
            ]
        elif isinstance(state, tuple):
            _, reason, message = state
            conditions = [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": CREATED,
                }
            ]
        job["status"] = {"conditions": conditions} if conditions else {}
        if name in self.trainer_status:
            job["status"]["trainerStatus"] = self.trainer_status[name]
        return job

    def _pods(self, name: str) -> list[dict]:
        state = self._state(name)
        phase = {"Created": "Pending", "Running": "Running", "Complete": "Succeeded"}.get(
            state if isinstance(state, str) else "", "Failed"
        )
        nodes = self.jobs[name]["spec"].get("trainer", {}).get("numNodes", 1)
        resources = self.jobs[name]["spec"].get("trainer", {}).get("resourcesPerNode", {})
        return [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{name}-node-0-{i}-abcde",
                    "namespace": "qvl",
                    "creationTimestamp": CREATED,
                    "labels": {
                        "jobset.sigs.k8s.io/jobset-name": name,
                        "jobset.sigs.k8s.io/replicatedjob-name": "node",
                        "batch.kubernetes.io/job-completion-index": str(i),
                        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer",
                    },
                },
                "spec": {
                    "containers": [
                        {
                            "name": "node",
                            "image": self.jobs[name]["spec"]["trainer"].get("image", ""),
                            "resources": resources,
                        }
                    ]
                },
                "status": {"phase": phase},
            }
            for i in range(nodes)
        ]


def _status(code: int, message: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "code": code,
    }


class FakeTrainerStatusServer:
    """Kubeflow Trainer's status server on loopback: HTTPS with a self-signed certificate (written to `ca_file`), a
    bearer token (written to `token_file`), POST .../namespaces/NS/trainjobs/NAME/status with {"trainerStatus": ...}
    checked like the controller does (progress 0-100, remaining >= 0, metric names/values strings, lastUpdatedTime
    required); an accepted status is stored on the fake API's job. `env` is what the controller injects into pods."""

    TOKEN = "projected-sa-token-7f3a"

    def __init__(self, api: FakeKubernetesApi, directory) -> None:
        from pathlib import Path

        self.api, self.dir, self.posts = api, Path(directory), []
        self.ca_file, self.token_file = self.dir / "ca.crt", self.dir / "token"
        self.token_file.write_text(self.TOKEN)

    def __enter__(self) -> FakeTrainerStatusServer:
        import ssl

        key_file = self.dir / "tls.key"
        _self_signed(self.ca_file, key_file)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                code = server.accept(self.path, self.headers.get("Authorization", ""), body)
                data = json.dumps(body if code == 200 else _status(code, "rejected")).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca_file, key_file)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def env(self, namespace: str, job: str) -> dict[str, str]:
        port = self._server.server_address[1]
        return {
            "KUBEFLOW_TRAINER_SERVER_URL": f"https://127.0.0.1:{port}{GROUP}/namespaces/{namespace}/trainjobs/{job}/status",
            "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca_file),
            "KUBEFLOW_TRAINER_SERVER_TOKEN": str(self.token_file),
        }

    def accept(self, path: str, auth: str, body: dict) -> int:
        match = re.fullmatch(rf"{GROUP}/namespaces/([^/]+)/trainjobs/([^/]+)/status", path)
        if not match or match[2] not in self.api.jobs:
            return 404
        if auth != f"Bearer {self.TOKEN}":
            return 403
        status = body.get("trainerStatus")
        if status is None:
            return 200
        valid = (
            "lastUpdatedTime" in status
            and 0 <= status.get("progressPercentage", 0) <= 100
            and status.get("estimatedRemainingSeconds", 0) >= 0
            and all(isinstance(m["name"], str) and isinstance(m["value"], str) for m in status.get("metrics", []))
        )
        if not valid:
            return 422
        self.posts.append(status)
        self.api.trainer_status[match[2]] = status
        return 200


def _self_signed(cert_file, key_file) -> None:
    """A self-signed CA certificate for 127.0.0.1 (its own trust anchor) and its key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-status")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
