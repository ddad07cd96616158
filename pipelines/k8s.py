"""Cluster profiles: the Kubernetes settings of every pipeline task, one section per stage in the presets.

A preset's `kubernetes:` section is merged over `DEFAULT_STAGES` below and validated here; `apply_profile`
writes it onto a task at compile time, so the compiled YAML carries it (kfp-kubernetes platform spec). Local
runs (kfp.local) skip it: GPU and pod settings mean nothing there, and its environment variables would.

KFP's limits, and how this works within them:
- accelerator type and count are compile-time constants here (one value per stage and preset);
- secret *names* are compile-time constants (settable per preset); their values never enter the YAML;
- the platform spec has no priorityClassName for task pods: multi-node stages get their priority class from
  the TrainJob's TrainingRuntime (manifests/overlays/prod), single-pod tasks run at the namespace default;
- a task pod is one pod: a stage asking for `nodes > 1` runs as a Kubeflow Trainer TrainJob launched and
  watched by its task (components/_shared/launch/trainjob.py), a stage asking for several GPUs on one node runs
  under torchrun inside its pod (components/_shared/launch/torchrun.py). Both read the plan from QVL_LAUNCH_PLAN.
"""

import json
from typing import Any, Literal

from kfp import dsl, kubernetes
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from components._shared.launch.plan import LAUNCH_PLAN_ENV, MULTI_PROCESS_STAGES, POD_NAME_ENV, POD_UID_ENV, LaunchPlan
from components._shared.platform.config import refuse_bool_for_number
from components._shared.platform.mlflow_runs import KFP_RUN_ENV, KFP_TASK_ENV, SYSTEM_METRICS_ENV
from pipelines import k8s_names as names

PART_OF = "qwen-vl-pipeline"
KFP_RUN_LABEL = "pipeline/runid"  # KFP's API server puts the run id on every pod of a run (Argo podMetadata)
CPU_STAGES = ("preflight", "clean_data", "promote")  # run on the CPU image: no CUDA inside
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:  # `gpus: true` is not one GPU
        return refuse_bool_for_number(value, cls.model_fields[str(info.field_name)].annotation)


class Toleration(_Strict):
    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class StageProfile(_Strict):
    """The pod(s) of one stage."""

    gpus: int = Field(0, ge=0, le=16, description="GPUs per node (the accelerator limit of the pod).")
    nodes: int = Field(1, ge=1, le=256, description="Nodes; > 1 runs the stage as a TrainJob (training stages).")
    accelerator_resource: str = Field("nvidia.com/gpu", description="Extended resource name of the accelerator.")
    accelerator_type: str | None = Field(None, description="Node label value picking the GPU model.")
    accelerator_label: str = Field("nvidia.com/gpu.product", description="Node label that accelerator_type matches.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    cpu: str = "2"
    cpu_limit: str | None = Field(None, description="Default: equal to cpu (Guaranteed QoS when memory is too).")
    memory: str = "8Gi"
    memory_limit: str | None = Field(None, description="Default: equal to memory.")
    shm_size: str | None = Field(None, description="Size of the memory-backed /dev/shm (NCCL, data loaders).")
    scratch: bool = Field(False, description="Mount the cluster's scratch PVC (caches) at scratch_mount_path.")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    retries: int = Field(0, ge=0, le=10, description="KFP retries (preemption, node loss); resumes from checkpoints.")
    backoff: str = "60s"
    backoff_factor: float = Field(2.0, ge=1.0)
    backoff_max: str = "3600s"
    caching: bool = True
    timeout_s: int = Field(0, ge=0, description="activeDeadlineSeconds of the pod; 0 = none.")

    @field_validator("cpu", "cpu_limit")
    @classmethod
    def _cpu(cls, value: str | None) -> str | None:
        return None if value is None else names.cpu(value)

    @field_validator("memory", "memory_limit", "shm_size")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        return None if value is None else names.memory(value)

    @field_validator("backoff", "backoff_max")
    @classmethod
    def _duration(cls, value: str) -> str:
        return names.duration(value)

    @field_validator("accelerator_label")
    @classmethod
    def _label_key(cls, value: str) -> str:
        return names.label_key(value)

    @field_validator("accelerator_type")
    @classmethod
    def _label_value(cls, value: str | None) -> str | None:
        return None if value is None else names.label_value(value)

    @field_validator("labels", "node_selector", "annotations")
    @classmethod
    def _labels(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        for key, item in value.items():
            names.label_key(key)
            if info.field_name != "annotations":
                names.label_value(item)
        return value

    @model_validator(mode="after")
    def _limits_cover_requests(self) -> "StageProfile":
        if self.cpu_limit is not None and names.cpu_cores(self.cpu_limit) < names.cpu_cores(self.cpu):
            raise ValueError(f"cpu_limit {self.cpu_limit} is below the request cpu {self.cpu}; Kubernetes refuses it")
        if self.memory_limit is not None and names.memory_bytes(self.memory_limit) < names.memory_bytes(self.memory):
            raise ValueError(
                f"memory_limit {self.memory_limit} is below the request memory {self.memory}; Kubernetes refuses it"
            )
        return self

    def node_selectors(self) -> dict[str, str]:
        selectors = dict(self.node_selector)
        if self.accelerator_type:
            selectors[self.accelerator_label] = self.accelerator_type
        return selectors


class TrainJobSettings(_Strict):
    """How multi-node stages run on Kubeflow Trainer."""

    runtime: str = Field("torch-distributed", description="(Cluster)TrainingRuntime the TrainJobs reference.")
    staging_uri: str | None = Field(None, description="s3:// prefix for the job's inputs and outputs.")
    timeout_s: int = Field(7 * 24 * 3600, ge=60, description="Fail the task (and delete the job) after this long.")
    poll_s: float = Field(15.0, gt=0)
    artifacts_on_s3: bool = Field(
        False,
        description="KFP's artifact store is the S3 the s3 secret reaches: pass input artifacts to the job "
        "by URI (/s3/B/K -> s3://B/K) instead of copying them to staging_uri.",
    )

    @field_validator("runtime")
    @classmethod
    def _runtime_name(cls, value: str) -> str:
        return names.object_name(value)


class PipelineSettings(_Strict):
    """Run-level settings of KFP 2.17's PipelineConfig (Argo's ttlStrategy and activeDeadlineSeconds)."""

    ttl_seconds_after_success: int | None = Field(
        86_400, ge=0, description="Delete a succeeded run's workflow and pods after this long (None: keep)."
    )
    ttl_seconds_after_failure: int | None = Field(
        7 * 86_400, ge=0, description="Keep a failed run's pods (and their logs) this long for debugging."
    )
    active_deadline_seconds: int | None = Field(
        None, ge=60, description="Stop the whole run after this long (None: no limit; per-stage timeout_s still apply)."
    )


class ClusterProfile(_Strict):
    """Cluster-wide names plus one StageProfile per stage (list_shards and the exit task run with preflight's)."""

    s3_secret: str = Field("qvl-s3-credentials", description="Secret with AWS_ACCESS_KEY_ID/SECRET/ENDPOINT_URL.")
    mlflow_secret: str = Field(
        "qvl-mlflow",
        description="Secret with MLFLOW_TRACKING_URI (optionally MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD).",
    )
    image_pull_secrets: list[str] = Field(default_factory=list)
    scratch_pvc: str = "qvl-scratch"
    scratch_mount_path: str = "/scratch"
    run_as_user: int = Field(1000, ge=1, description="Non-root uid of the images (docker/).")
    trainjob: TrainJobSettings = Field(default_factory=TrainJobSettings)
    pipeline: PipelineSettings = Field(default_factory=PipelineSettings)
    system_metrics_s: float = Field(
        10.0, ge=0, le=3600, description="MLflow system metrics (CPU, memory, GPU) every N s per node; 0: off."
    )
    stages: dict[str, StageProfile]

    def gpu_profiles(self, stages) -> dict[str, dict]:
        """The pods of the given stages that hold GPUs (gpus, nodes, accelerator_type): what preflight plans on."""
        return {  # KFP parameters cannot hold null: no accelerator_type, no key
            name: {
                "gpus": s.gpus,
                "nodes": s.nodes,
                **({"accelerator_type": s.accelerator_type} if s.accelerator_type else {}),
            }
            for name, s in self.stages.items()
            if name in stages and s.gpus
        }

    def pipeline_config(self):
        """The KFP PipelineConfig of these settings."""
        return dsl.PipelineConfig(**self.pipeline.model_dump())

    @field_validator("s3_secret", "mlflow_secret", "scratch_pvc")
    @classmethod
    def _object_name(cls, value: str) -> str:
        return names.object_name(value)

    @field_validator("image_pull_secrets")
    @classmethod
    def _object_names(cls, value: list[str]) -> list[str]:
        return [names.object_name(v) for v in value]

    @field_validator("scratch_mount_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or ":" in value:
            raise ValueError(f"{value!r} is not a mount path: give an absolute path without ':' (e.g. /scratch)")
        return value

    @model_validator(mode="after")
    def _check_stages(self) -> "ClusterProfile":
        from components.stages import STAGES, STEPS

        tasks = [*STAGES, *STEPS]  # a step (sft_data) has its own pod
        unknown = set(self.stages) - set(tasks)
        if unknown:
            raise ValueError(f"kubernetes.stages: unknown stage(s) {sorted(unknown)}; stages: {', '.join(tasks)}.")
        missing = set(tasks) - set(self.stages)
        if missing:
            raise ValueError(f"kubernetes.stages: no profile for {sorted(missing)} (pipelines/k8s.py DEFAULT_STAGES).")
        on_gpus = sorted(name for name, stage in self.stages.items() if stage.gpus and name not in CPU_STAGES)
        for name, stage in self.stages.items():
            where = f"kubernetes.stages.{name}"
            if on_gpus and not stage.gpus and name not in CPU_STAGES:  # one model stage left on the CPU by mistake
                raise ValueError(
                    f"{where}.gpus: 0 while {', '.join(on_gpus[:3])}{' ...' if len(on_gpus) > 3 else ''} run on GPUs: "
                    f"{name} runs the model too and would run it on the CPU for hours; give it gpus: 1 (or every "
                    "model stage gpus: 0 for a CPU-only cluster)."
                )
            if name in CPU_STAGES and stage.gpus:
                raise ValueError(f"{where}.gpus: {name} runs on the CPU image (no CUDA); set gpus: 0.")
            if stage.gpus * stage.nodes > 1 and name not in MULTI_PROCESS_STAGES:
                raise ValueError(
                    f"{where}: {name} runs in one process, so {stage.gpus * stage.nodes} GPUs would sit idle; use "
                    f"gpus: 1, nodes: 1 (several processes: {', '.join(MULTI_PROCESS_STAGES)})."
                )
            if stage.nodes > 1 and not (self.trainjob.staging_uri or "").startswith("s3://"):
                raise ValueError(
                    f"{where}.nodes: {stage.nodes} nodes run as a TrainJob, which exchanges inputs and outputs through "
                    "S3: set kubernetes.trainjob.staging_uri to an s3:// prefix."
                )
        return self


_GPU_STAGE = {"gpus": 1, "cpu": "8", "memory": "64Gi", "shm_size": "16Gi", "scratch": True, "retries": 2}
DEFAULT_STAGES: dict[str, dict[str, Any]] = {
    "preflight": {"cpu": "1", "memory": "4Gi", "caching": False, "timeout_s": 3600},
    "clean_data": {"cpu": "4", "memory": "16Gi", "retries": 2, "backoff": "30s"},
    "extract_features": dict(_GPU_STAGE),
    "pretrain": dict(_GPU_STAGE),
    "sft_data": dict(_GPU_STAGE),  # scores the built candidates with the pretrained model: one process
    "sft": dict(_GPU_STAGE),
    "reward_model": dict(_GPU_STAGE),
    "rl": dict(_GPU_STAGE),
    "distill": dict(_GPU_STAGE),
    "select_checkpoint": dict(_GPU_STAGE),
    "promote": {"cpu": "4", "memory": "32Gi", "retries": 2},  # casts one safetensors shard at a time
}


LAUNCHER_POD = {"cpu": "2", "memory": "16Gi"}  # the task pod of a multi-node stage: staging and watching only


def load_cluster_profile(section: dict[str, Any] | None) -> ClusterProfile:
    """A preset's `kubernetes:` section over the defaults; errors name the setting (kubernetes.stages.sft.gpus)."""
    from pydantic import ValidationError

    from components._shared.platform.presets import deep_merge

    section = dict(section or {})
    stages = deep_merge(DEFAULT_STAGES, section.pop("stages", None) or {})
    try:
        return ClusterProfile(stages=stages, **section)
    except ValidationError as err:
        from components._shared.platform.unknown_settings import unknown_setting_hint

        problems = "; ".join(
            f"kubernetes.{'.'.join(str(p) for p in e['loc'])}: "
            + (
                f"unknown setting{unknown_setting_hint(ClusterProfile, 'kubernetes', e['loc'])}"
                if e["type"] == "extra_forbidden"
                else e["msg"]
            )  # fmt: skip
            for e in err.errors()
        )
        raise ValueError(f"Invalid kubernetes profile: {problems}") from None


def launch_plan(cluster: ClusterProfile, stage: str, image: str) -> LaunchPlan:
    """What scale_out needs to run `stage` on several processes or nodes (same image, secrets, volumes)."""
    p = cluster.stages[stage]
    return LaunchPlan(
        stage=stage,
        nodes=p.nodes,
        gpus_per_node=p.gpus,
        image=image,
        cpu=p.cpu,
        memory=p.memory,
        accelerator_resource=p.accelerator_resource,
        node_selector=p.node_selectors(),
        tolerations=[t.model_dump(exclude_none=True) for t in _tolerations(p)],
        shm_size=p.shm_size,
        scratch_pvc=cluster.scratch_pvc if p.scratch else None,
        scratch_mount_path=cluster.scratch_mount_path,
        secrets={cluster.s3_secret: list(_S3_KEYS), cluster.mlflow_secret: list(_MLFLOW_KEYS)},
        image_pull_secrets=cluster.image_pull_secrets,
        run_as_user=cluster.run_as_user,
        labels=_labels(stage, p),
        runtime=cluster.trainjob.runtime,
        staging_uri=cluster.trainjob.staging_uri,
        timeout_s=cluster.trainjob.timeout_s,
        poll_s=cluster.trainjob.poll_s,
        artifacts_on_s3=cluster.trainjob.artifacts_on_s3,
    )


_S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")
_MLFLOW_KEYS = (  # the URI, and the login a server with auth wants (each key optional in the Secret)
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
)


def _tolerations(p: StageProfile) -> list[Toleration]:
    tolerations = list(p.tolerations)
    if p.gpus and not any(t.key == GPU_TOLERATION["key"] for t in tolerations):
        tolerations.append(Toleration(**GPU_TOLERATION))
    return tolerations


def _labels(stage: str, p: StageProfile) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": PART_OF, "qvl.stage": stage, **p.labels}


def apply_task_policy(
    task: dsl.PipelineTask, stage: str, cluster: ClusterProfile, *, retries: bool = True
) -> dsl.PipelineTask:
    """Retries (unless `retries` is false), caching and the task's name in its environment (its MLflow run's tag):
    what kfp.local honours too. `qvl run --local` runs without retries: on one machine a failure is this run's
    (a user error fails the same way again, after minutes of back-off), and a rerun resumes from checkpoints."""
    p = cluster.stages[stage]
    task.set_env_variable(KFP_TASK_ENV, task.name)
    if p.retries and retries:
        task.set_retry(
            num_retries=p.retries,
            backoff_duration=p.backoff,
            backoff_factor=p.backoff_factor,
            backoff_max_duration=p.backoff_max,
        )
    return task.set_caching_options(p.caching)


def apply_local_launch(task: dsl.PipelineTask, stage: str, processes: int | None) -> dsl.PipelineTask:
    """kfp.local: the stage under torchrun with `processes` CPU processes (the launch plan a pod with that many GPUs
    gets); nothing for None or 1."""
    if processes and processes > 1:
        plan = LaunchPlan(stage=stage, gpus_per_node=processes, image=task.container_spec.image)
        task.set_env_variable(LAUNCH_PLAN_ENV, json.dumps(plan.model_dump(mode="json"), sort_keys=True))
    return task


def apply_profile(task: dsl.PipelineTask, stage: str, cluster: ClusterProfile) -> dsl.PipelineTask:
    """Resources, placement, volumes, secrets, security, retries and caching of `stage` onto `task`.

    A stage on several nodes keeps a small CPU pod for its task (it stages data and watches the TrainJob);
    the TrainJob's pods get the stage's GPUs, placement and volumes from the launch plan.
    """
    p = cluster.stages[stage]
    plan = launch_plan(cluster, stage, task.container_spec.image) if p.gpus * p.nodes > 1 else None
    if p.nodes > 1:
        p = StageProfile(
            **LAUNCHER_POD,
            labels=p.labels,
            annotations=p.annotations,
            retries=p.retries,
            backoff=p.backoff,
            backoff_factor=p.backoff_factor,
            backoff_max=p.backoff_max,
            caching=p.caching,
        )
    task.set_cpu_request(p.cpu).set_cpu_limit(p.cpu_limit or p.cpu)
    task.set_memory_request(p.memory).set_memory_limit(p.memory_limit or p.memory)
    if p.gpus:
        task.set_accelerator_type(p.accelerator_resource).set_accelerator_limit(p.gpus)
    for key, value in p.node_selectors().items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for t in _tolerations(p):
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    if p.shm_size:
        kubernetes.empty_dir_mount(
            task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=p.shm_size
        )
    if p.scratch:
        kubernetes.mount_pvc(task, pvc_name=cluster.scratch_pvc, mount_path=cluster.scratch_mount_path)
        task.set_env_variable("QVL_CACHE_DIR", f"{cluster.scratch_mount_path}/qvl-cache")
        task.set_env_variable("HF_HOME", f"{cluster.scratch_mount_path}/hf")
    kubernetes.use_secret_as_env(
        task, secret_name=cluster.s3_secret, secret_key_to_env={k: k for k in _S3_KEYS}, optional=True
    )
    kubernetes.use_secret_as_env(
        task, secret_name=cluster.mlflow_secret, secret_key_to_env={k: k for k in _MLFLOW_KEYS}, optional=True
    )
    # The run id from the pod's label, not a task input: a per-run value among the inputs would miss every cache.
    kubernetes.use_field_path_as_env(task, env_name=KFP_RUN_ENV, field_path=f"metadata.labels['{KFP_RUN_LABEL}']")
    if cluster.system_metrics_s:
        task.set_env_variable(SYSTEM_METRICS_ENV, f"{cluster.system_metrics_s:g}")
    if cluster.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, cluster.image_pull_secrets)
    kubernetes.set_security_context(
        task, run_as_user=cluster.run_as_user, run_as_group=cluster.run_as_user, run_as_non_root=True
    )
    for key, value in _labels(stage, p).items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    for key, value in p.annotations.items():
        kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    if p.timeout_s:
        kubernetes.set_timeout(task, p.timeout_s)
    apply_task_policy(task, stage, cluster)
    if plan is not None:
        task.set_env_variable(LAUNCH_PLAN_ENV, json.dumps(plan.model_dump(mode="json"), sort_keys=True))
    if plan is not None and plan.nodes > 1:  # the TrainJob is owned by this pod: deleting the pod deletes the job
        kubernetes.use_field_path_as_env(task, env_name=POD_NAME_ENV, field_path="metadata.name")
        kubernetes.use_field_path_as_env(task, env_name=POD_UID_ENV, field_path="metadata.uid")
    return task
