"""`qvl run --local --runner docker`: every kfp.local task in the image its component names, as a pod runs it.

kfp.local's DockerRunner starts each task's command in its component's `base_image` (the data image: preflight and
the shard tasks; the train image: the model stages) with the pipeline root mounted. A pod reaches its data, models
and tracking server through volumes, secrets and the network; a task here gets the same paths as mounts: the run
directory (MLflow's sqlite store and artifacts, the stage results, progress), the lake and the data read-only, and
a model cache of the run's own. Its environment is the run's (tracking URI, parent run, result and progress
directories, the CPU numerics pins) and then the task's own. It runs as uid 1000, the images' user, with no network.
The images must be on this machine (`make local-base images-cpu`, docs/images.md): nothing is pulled.

Written around kfp.local rather than through its options: its DockerTaskHandler replaces a runner's environment
with the task's own variables (every task sets one) and takes no mounts beyond the pipeline root, so its module's
`run_docker_container` is replaced for the run, as local_run.py replaces the subprocess runner's task stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.qvl.task_logs import TaskLogs

USER = "1000:1000"  # the images' numeric non-root user (docker/Dockerfile.*)


def check_images(images: Iterable[str]) -> None:
    """Each image is on this machine, or a ValueError naming what to build; no docker daemon is one too."""
    import docker  # docker-py; mypy takes the repo's docker/ folder (Dockerfiles) for it, hence the ignores

    try:
        client = docker.from_env()  # type: ignore[attr-defined]
        missing = sorted(image for image in set(images) if not client.images.list(name=image))
    except docker.errors.DockerException as error:  # type: ignore[attr-defined]
        raise ValueError(f"--runner docker: no docker daemon answers ({error}); start one (dockerd).") from None
    if missing:
        raise ValueError(
            f"--runner docker: the image(s) {missing} are not on this machine and are never pulled; build them with "
            "`make local-base images-cpu` (docs/images.md)."
        )


def open_to_containers(*paths: Path) -> None:
    """Directories and files the host made that the containers' uid 1000 writes to (a run directory, MLflow's
    sqlite database): opened to every user, as a pod's volume is to its user."""
    for path in paths:
        if path.exists():
            path.chmod(0o777 if path.is_dir() else 0o666)


@contextmanager
def in_containers(
    logs: TaskLogs, mounts: dict[str, str], env: tuple[str, ...], extra_env: dict[str, str]
) -> Iterator[None]:
    """kfp.local's DockerRunner tasks run with `mounts` (host path -> "ro" | "rw", at the same path inside), the
    host's variables named in `env` (as they are when a task starts) and `extra_env` under the task's own, no
    network and uid 1000; each task's output goes where `logs` says. Files the host creates while the block runs are
    open to the containers' user (umask 0)."""
    from kfp.local import docker_task_handler

    original = docker_task_handler.run_docker_container

    def run_docker_container(client, image: str, command: list[str], volumes: dict, **run_args) -> int:
        task, log = logs.started(command)
        given = {name: os.environ[name] for name in env if name in os.environ}
        environment = {**given, **extra_env, **(run_args.pop("environment", None) or {})}
        binds = {path: {"bind": path, "mode": mode} for path, mode in mounts.items()} | volumes
        container = client.containers.run(
            image=image,
            command=command,
            detach=True,
            volumes=binds,
            environment=environment,
            network_mode="none",
            user=USER,
            **run_args,
        )
        try:
            with log.open("w") as sink:
                for chunk in container.logs(stream=True, follow=True):
                    logs.write(sink, task, chunk.decode(errors="replace"))
            returncode = int(container.wait()["StatusCode"])
        finally:
            container.remove(force=True)
        logs.finished(task, returncode, log)
        return returncode

    docker_task_handler.run_docker_container = run_docker_container
    umask = os.umask(0)
    try:
        yield
    finally:
        os.umask(umask)
        docker_task_handler.run_docker_container = original
