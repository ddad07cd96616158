"""`qvl run --local --runner docker` without a docker daemon: what each task's container gets (a fake client records
it), and what is refused before any task starts. The real run is tests/pipeline/test_images.py (-m images)."""

from __future__ import annotations

import os

import pytest

from pipelines.qvl.docker_tasks import USER, in_containers, open_to_containers
from pipelines.qvl.task_logs import TaskLogs


class _Container:
    def __init__(self, lines: list[bytes], code: int) -> None:
        self.lines, self.code, self.removed = lines, code, False

    def logs(self, stream: bool, follow: bool):
        return iter(self.lines)

    def wait(self) -> dict:
        return {"StatusCode": self.code}

    def remove(self, force: bool) -> None:
        self.removed = True


class _Client:
    def __init__(self, container: _Container) -> None:
        self.container, self.runs = container, []

    @property
    def containers(self):
        return self

    def run(self, **kwargs):
        self.runs.append(kwargs)
        return self.container


def test_a_task_runs_as_uid_1000_without_network_with_the_runs_mounts_and_environment(tmp_path, monkeypatch):
    from kfp.local import docker_task_handler

    monkeypatch.setenv("QVL_MLFLOW_PARENT_RUN_ID", "parent-1")
    container = _Container([b"step 1\n", b"done\n"], 3)
    client = _Client(container)
    logs = TaskLogs(tmp_path, None, None)
    mounts = {"/runs/out": "rw", "/data/lake": "ro"}
    original = docker_task_handler.run_docker_container
    with in_containers(logs, mounts, ("QVL_MLFLOW_PARENT_RUN_ID", "UNSET_NAME"), {"QVL_CACHE_DIR": "/runs/out/c"}):
        code = docker_task_handler.run_docker_container(
            client=client,
            image="reg/train:1",
            command=["python", "-m", "x", "--function_to_execute", "sft_op"],
            volumes={"/runs/out/pipeline_root": {"bind": "/runs/out/pipeline_root", "mode": "rw"}},
            environment={"QVL_KFP_TASK": "sft-op", "QVL_CACHE_DIR": "task's own wins"},
        )
        assert os.umask(0) == 0  # files the host makes meanwhile are open to the containers' user
    assert docker_task_handler.run_docker_container is original and code == 3 and container.removed
    (run,) = client.runs
    assert run["user"] == USER == "1000:1000" and run["network_mode"] == "none" and run["image"] == "reg/train:1"
    assert run["environment"] == {
        "QVL_MLFLOW_PARENT_RUN_ID": "parent-1",
        "QVL_CACHE_DIR": "task's own wins",
        "QVL_KFP_TASK": "sft-op",
    }
    assert run["volumes"]["/data/lake"] == {"bind": "/data/lake", "mode": "ro"}
    assert set(run["volumes"]) == {"/runs/out", "/data/lake", "/runs/out/pipeline_root"}
    assert (tmp_path / "sft_op.log").read_text() == "step 1\ndone\n"


def test_the_docker_runner_refuses_what_its_tasks_could_not_reach(tmp_path, monkeypatch):
    from pipelines.qvl.local_run import run_local

    with pytest.raises(ValueError, match="runner 'podman': choose subprocess or docker"):
        run_local(lake_uri=str(tmp_path / "lake"), out_dir=tmp_path / "o", runner="podman")
    monkeypatch.setattr("pipelines.qvl.docker_tasks.check_images", lambda images: None)
    with pytest.raises(ValueError, match=r"runs each task without network: \['s3://bucket/lake'\]"):
        run_local(lake_uri="s3://bucket/lake", out_dir=tmp_path / "o", runner="docker")


def test_missing_images_or_no_daemon_are_named_with_what_to_do():
    from pipelines.qvl.docker_tasks import check_images

    with pytest.raises(ValueError, match=r"make local-base images-cpu|no docker daemon answers"):
        check_images(["localhost/qvl-never-built/train:0"])


def test_what_the_host_made_is_opened_to_the_containers_user(tmp_path):
    (tmp_path / "db").write_text("x")
    (tmp_path / "d").mkdir(mode=0o755)
    open_to_containers(tmp_path / "db", tmp_path / "d", tmp_path / "absent")
    assert (tmp_path / "db").stat().st_mode & 0o777 == 0o666 and (tmp_path / "d").stat().st_mode & 0o777 == 0o777
