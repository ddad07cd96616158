"""Multi-node stages as Kubeflow Trainer TrainJobs, launched and watched by their KFP task.

Why Trainer v2 (the `kubeflow` SDK) and not a v1 PyTorchJob (`kubeflow-training`): the v1 Training Operator
is in maintenance; Trainer v2 keeps the torchrun contract (PET_* variables, one pod per node), puts scheduling
and priority in a reusable TrainingRuntime (manifests/overlays/prod) and its SDK builds the TrainJob for us.
The SDK has no job failure reason and no cancellation on timeout, so those two reads/deletes are ours.

Flow: stage local inputs on S3 (`staging_uri/<job>/inputs/<name>`), create the TrainJob (same image, the
stage's command line under torchrun, secrets by reference, /dev/shm, scratch PVC, tolerations), stream node-0's
log, wait; on success fetch `staging_uri/<job>/output` into the task's output directory and return the stage's
recorded metrics; on failure raise with the job's reason; on timeout raise; always delete the job. While it waits,
each new progress report in the job's `status.trainerStatus` (Trainer's TrainJobStatus feature: step, total, loss,
time left, posted by rank 0) becomes one line of the task's log.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components._shared.launch.plan import LAUNCHED_ENV, POD_NAME_ENV, POD_UID_ENV, LaunchPlan, stage_argv
from components._shared.launch.result import read_result
from components._shared.platform import storage

TRAINER_CONTAINER = "node"  # the trainer container of the torch runtimes
# Non-secret settings the pods inherit (MLflow credentials reach them through the secret, never the job spec).
PASS_THROUGH_ENV = (
    "QVL_MLFLOW_PARENT_RUN_ID",
    "QVL_KFP_RUN_ID",
    "QVL_KFP_TASK",
    "QVL_SYSTEM_METRICS_S",
    "MLFLOW_EXPERIMENT_ID",
    "QVL_CACHE_DIR",
    "HF_HOME",
)


class TrainJobFailed(RuntimeError):
    """The TrainJob ended Failed; the message carries Kubernetes' reason."""


def job_name(stage: str) -> str:
    """A DNS-1035 name (<= 40 chars leaves room for the pod suffixes JobSet adds)."""
    return f"qvl-{stage.replace('_', '-')}-{uuid.uuid4().hex[:10]}"


KFP_S3_MOUNTS = ("/s3/", "/minio/")  # where KFP's launcher puts artifacts of s3:// and minio:// stores


def stage_inputs(inputs: dict[str, Any], staging: str, *, artifacts_on_s3: bool = False) -> dict[str, str]:
    """Inputs as URIs the job's pods can read: URIs (s3://, builtin:) and empty values as they are, KFP artifacts
    by their URI when KFP stores them on the same S3 (`artifacts_on_s3`), other local paths uploaded to `staging`."""
    remote: dict[str, str] = {}
    for name, value in inputs.items():
        value = str(value)
        if not value or "://" in value or value.startswith("builtin:"):  # URIs every pod resolves itself
            remote[name] = value
            continue
        mount = next((m for m in KFP_S3_MOUNTS if value.startswith(m)), None)
        if artifacts_on_s3 and mount:
            remote[name] = "s3://" + value[len(mount) :]
            continue
        path = Path(value)
        if not path.exists():
            raise FileNotFoundError(f"input '{name}': {value} does not exist in the launching pod.")
        target = storage.join(staging, "inputs", name)
        if path.is_dir():
            storage.publish_dir(path, target)
        else:
            target = storage.join(target, path.name)
            storage.upload_file(path, target)
        remote[name] = target
    return remote


def trainer_options(plan: LaunchPlan, name: str, argv: list[str]) -> list:
    """SDK options: name, labels, command, secrets by reference, volumes, placement, security, deadline."""
    from kubeflow.trainer.options import kubernetes as k8s_options
    from kubeflow.trainer.options.common import Name

    env = [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
        for secret, keys in plan.secrets.items()
        for key in keys
    ]
    volumes, mounts = [], []
    if plan.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if plan.scratch_pvc:
        volumes.append({"name": "scratch", "persistentVolumeClaim": {"claimName": plan.scratch_pvc}})
        mounts.append({"name": "scratch", "mountPath": plan.scratch_mount_path})
    pod = k8s_options.PodSpecPatch(
        volumes=volumes or None,
        containers=[
            k8s_options.ContainerPatch(
                name=TRAINER_CONTAINER,
                env=env or None,
                volume_mounts=mounts or None,
                security_context={"allowPrivilegeEscalation": False},
            )
        ],
        image_pull_secrets=[{"name": s} for s in plan.image_pull_secrets] or None,
        security_context={"runAsUser": plan.run_as_user, "runAsGroup": plan.run_as_user, "runAsNonRoot": True},
        node_selector=plan.node_selector or None,
        tolerations=plan.tolerations or None,
    )
    patch = k8s_options.RuntimePatch(
        training_runtime_spec=k8s_options.TrainingRuntimeSpecPatch(
            template=k8s_options.JobSetTemplatePatch(
                spec=k8s_options.JobSetSpecPatch(
                    replicated_jobs=[
                        k8s_options.ReplicatedJobPatch(
                            name=TRAINER_CONTAINER,
                            template=k8s_options.JobTemplatePatch(
                                spec=k8s_options.JobSpecPatch(
                                    template=k8s_options.PodTemplatePatch(
                                        metadata={"labels": plan.labels} if plan.labels else None, spec=pod
                                    )
                                )
                            ),
                        )
                    ]
                )
            )
        )
    )
    return [
        Name(name),
        k8s_options.Labels(plan.labels),
        k8s_options.TrainerCommand(["torchrun"]),  # nodes, ranks and rendezvous come from the runtime's PET_* env
        k8s_options.TrainerArgs(argv),
        patch,
        k8s_options.ActiveDeadlineSeconds(plan.timeout_s),
    ]


def _trainer_client(plan: LaunchPlan, client_configuration=None):
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    return TrainerClient(KubernetesBackendConfig(namespace=plan.namespace, client_configuration=client_configuration))


def _job_object(client, name: str) -> dict[str, Any]:
    backend = client.backend
    return backend.custom_api.get_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", backend.namespace, "trainjobs", name
    )


def _failure_reason(client, name: str) -> str:
    """The Failed condition's reason and message from the TrainJob object (the SDK drops them)."""
    try:
        job = _job_object(client, name)
    except Exception as err:  # noqa: BLE001 - the reason is a courtesy; the failure itself stands
        return f"(reason unavailable: {err})"
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip()
    return "(no Failed condition message)"


def _own_by_task_pod(client, name: str, log: Callable[[str], None]) -> None:
    """Make the task's pod the TrainJob's owner, so Kubernetes deletes the job if the pod goes away first (node
    loss, a KFP run terminated) and our cleanup never runs. The SDK sets no owner references; we patch them."""
    pod, uid = os.environ.get(POD_NAME_ENV), os.environ.get(POD_UID_ENV)
    if not (pod and uid):
        return
    backend = client.backend
    owner = {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid, "blockOwnerDeletion": False}
    try:
        backend.custom_api.patch_namespaced_custom_object(
            "trainer.kubeflow.org",
            "v1alpha1",
            backend.namespace,
            "trainjobs",
            name,
            {"metadata": {"ownerReferences": [owner]}},
        )
    except Exception as err:  # noqa: BLE001 - the finally-delete still covers the normal paths
        log(f"[trainjob] could not make pod {pod} the owner of {name}: {err}")


def progress_line(name: str, status: dict[str, Any]) -> str:
    """One log line of a TrainJob's `status.trainerStatus` (what its rank 0 reported: platform/trainjob_status.py)."""
    metrics = {m.get("name"): m.get("value") for m in status.get("metrics") or []}
    parts = [f"{status['progressPercentage']}%" if "progressPercentage" in status else "progress"]
    if metrics.get("total_steps"):
        parts.append(f"{metrics.get('phase', 'step')} {metrics.get('current_step', '?')}/{metrics['total_steps']}")
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']}")
    if status.get("estimatedRemainingSeconds") is not None:
        parts.append(f"~{int(status['estimatedRemainingSeconds'])} s left")
    return f"[trainjob] {name}: " + " · ".join(parts)


def _log_progress(client, name: str, last: str | None, log: Callable[[str], None]) -> str | None:
    """Log the job's reported progress when it changed since `last` (its lastUpdatedTime); returns the newest."""
    try:
        status = (_job_object(client, name).get("status") or {}).get("trainerStatus") or {}
    except Exception:  # noqa: BLE001 - progress is a courtesy; the job's state decides
        return last
    stamp = status.get("lastUpdatedTime")
    if stamp and stamp != last:
        log(progress_line(name, status))
    return stamp or last


def _raise_on_sigterm():
    """KFP stops a task with SIGTERM: turn it into an exception so the job is deleted on the way out."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise SystemExit(f"stopped by signal {signum}; deleting the TrainJob")

    return signal.signal(signal.SIGTERM, handler)


def _stream_logs(client, name: str, log: Callable[[str], None], stop: threading.Event) -> None:
    """Follow node-0's log until it ends (or the launcher stops)."""
    try:
        for line in client.get_job_logs(name, follow=True):
            log(f"[{name}/node-0] {line}")
            if stop.is_set():
                return
    except Exception as err:  # noqa: BLE001 - a broken log stream must not fail a healthy job
        log(f"[trainjob] log stream of {name} ended: {err}")


def run_trainjob(
    plan: LaunchPlan,
    config: dict[str, Any],
    *,
    inputs: dict[str, Any],
    output_dir: str,
    experiment: str,
    client_configuration=None,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
    clock: Callable[[], float] = time.monotonic,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the stage as a TrainJob and return its metrics; raises TrainJobFailed / TimeoutError, deletes the job.
    `env` is added to the pods' environment (the stage's MLflow run)."""
    if not plan.staging_uri or not storage.is_s3(plan.staging_uri):
        raise ValueError(
            f"{plan.stage}: a TrainJob needs kubernetes.trainjob.staging_uri (s3://), got {plan.staging_uri!r}."
        )
    name = job_name(plan.stage)
    staging = storage.join(plan.staging_uri, name)
    remote_output = storage.join(staging, "output")
    argv = stage_argv(
        plan.stage,
        config,
        stage_inputs(inputs, staging, artifacts_on_s3=plan.artifacts_on_s3),
        remote_output,
        experiment,
    )

    from kubeflow.trainer import CustomTrainerContainer

    env = {**{k: os.environ[k] for k in PASS_THROUGH_ENV if os.environ.get(k)}, **(env or {}), LAUNCHED_ENV: "1"}
    resources: dict[str, Any] = {"cpu": plan.cpu, "memory": plan.memory}
    if plan.gpus_per_node:
        resources[plan.accelerator_resource] = plan.gpus_per_node
    client = _trainer_client(plan, client_configuration)
    trainer = CustomTrainerContainer(image=plan.image, num_nodes=plan.nodes, resources_per_node=resources, env=env)
    previous_sigterm = _raise_on_sigterm()
    client.train(runtime=plan.runtime, trainer=trainer, options=trainer_options(plan, name, argv))
    _own_by_task_pod(client, name, log)
    log(
        f"[trainjob] created TrainJob {client.backend.namespace}/{name}: {plan.nodes} nodes x "
        f"{plan.processes_per_node} processes, runtime {plan.runtime}, image {plan.image}"
    )
    stop, logs, reported = threading.Event(), None, None
    try:
        deadline = clock() + plan.timeout_s
        while True:
            job = client.get_job(name)
            reported = _log_progress(client, name, reported, log)
            if logs is None and job.status in ("Running", "Complete", "Failed"):
                logs = threading.Thread(target=_stream_logs, args=(client, name, log, stop), daemon=True)
                logs.start()
            if job.status == "Complete":
                break
            if job.status == "Failed":
                raise TrainJobFailed(
                    f"TrainJob {client.backend.namespace}/{name} ({plan.stage}) failed: {_failure_reason(client, name)}"
                )
            if clock() >= deadline:
                raise TimeoutError(
                    f"TrainJob {client.backend.namespace}/{name} ({plan.stage}) did not finish in "
                    f"{plan.timeout_s} s (kubernetes.trainjob.timeout_s); it was deleted."
                )
            time.sleep(plan.poll_s)
        if logs is not None:
            logs.join(timeout=30)
        storage.fetch_dir(remote_output, output_dir)
        return read_result(output_dir, plan.stage)
    finally:
        stop.set()
        if previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, previous_sigterm)
        try:
            client.delete_job(name)
            log(f"[trainjob] deleted TrainJob {name}")
        except Exception as err:  # noqa: BLE001 - never mask the job's own outcome
            log(f"[trainjob] could not delete TrainJob {name}: {err}")
