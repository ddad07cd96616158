"""Kubernetes settings of pipeline tasks, applied at compile time so the compiled YAML carries them.

Kept here so pipelines/vlm_training.py reads like the stage list. Locally (kfp.local) these are ignored.
"""

from __future__ import annotations

from kfp import dsl, kubernetes

# Secret *names* (not values): created by manifests/ on the cluster; values never enter parameters or YAML.
S3_SECRET = "qvl-s3-credentials"
MLFLOW_SECRET = "qvl-mlflow"


def with_runtime_env(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """S3 and MLflow credentials from Kubernetes secrets, as environment variables."""
    kubernetes.use_secret_as_env(
        task,
        secret_name=S3_SECRET,
        secret_key_to_env={
            "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
        },
        optional=True,
    )
    kubernetes.use_secret_as_env(
        task,
        secret_name=MLFLOW_SECRET,
        secret_key_to_env={"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"},
        optional=True,
    )
    return task


def on_cpu(task: dsl.PipelineTask, *, cpu: str = "2", memory: str = "8Gi") -> dsl.PipelineTask:
    """A CPU pod with requests equal to limits."""
    task.set_cpu_request(cpu).set_cpu_limit(cpu).set_memory_request(memory).set_memory_limit(memory)
    return task


def on_gpus(
    task: dsl.PipelineTask,
    *,
    gpus: int = 1,
    accelerator: str = "nvidia.com/gpu",
    cpu: str = "8",
    memory: str = "64Gi",
    shm: str = "16Gi",
) -> dsl.PipelineTask:
    """A GPU pod: accelerator limit, CPU/memory, a memory-backed /dev/shm, and the GPU taint tolerated."""
    task.set_accelerator_type(accelerator).set_accelerator_limit(gpus)
    on_cpu(task, cpu=cpu, memory=memory)
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=shm)
    kubernetes.add_toleration(task, key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
    return task
