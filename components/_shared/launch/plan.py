"""Launch plans: how a training stage runs on several processes (torchrun in its pod, or a TrainJob of N nodes).

The compiled pipeline puts a `LaunchPlan` (JSON, no secrets) in QVL_LAUNCH_PLAN of every task whose cluster
profile asks for more than one GPU (pipelines/k8s.py). `run_stage` (launch/runner.py) sees it and, instead
of running the stage in its own process, starts the stage's command line (`python -m components.<stage>
--config-json ...`)
- on one node: under `torch.distributed.run --standalone --nproc-per-node G` in the same pod (launch/torchrun.py);
- on N nodes: as a Kubeflow Trainer TrainJob with the same image (launch/trainjob.py).
The started processes carry QVL_LAUNCHED=1, so they run the stage themselves. Either way the task's output
directory ends up as if the stage had run in the task, and its recorded metrics are returned.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

LAUNCH_PLAN_ENV = "QVL_LAUNCH_PLAN"


LAUNCHED_ENV = "QVL_LAUNCHED"  # set on the processes a launcher starts: they run the stage themselves


POD_NAME_ENV, POD_UID_ENV = "QVL_POD_NAME", "QVL_POD_UID"  # a multi-node task's pod (downward API): owns its job


# Stages whose loop shards micro-batches over ranks (TrainLoop + DeepSpeed; rl also its rollouts, rl/shard.py).
MULTI_PROCESS_STAGES = ("pretrain", "sft", "reward_model", "rl", "distill")


class LaunchPlan(BaseModel):
    """How one stage runs on several processes; written at compile time from its cluster profile."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    image: str
    cpu: str = "8"
    memory: str = "64Gi"
    accelerator_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    shm_size: str | None = None
    scratch_pvc: str | None = None
    scratch_mount_path: str = "/scratch"
    secrets: dict[str, list[str]] = Field(default_factory=dict, description="secret name -> keys set as env vars")
    image_pull_secrets: list[str] = Field(default_factory=list)
    run_as_user: int = 1000
    labels: dict[str, str] = Field(default_factory=dict)
    runtime: str = "torch-distributed"
    staging_uri: str | None = None
    namespace: str | None = Field(None, description="Default: the namespace of the task's pod.")
    timeout_s: int = 7 * 24 * 3600
    poll_s: float = 15.0
    artifacts_on_s3: bool = False

    @property
    def processes_per_node(self) -> int:
        return max(self.gpus_per_node, 1)


def plan_from_env(environ: Mapping[str, str] | None = None) -> LaunchPlan | None:
    """The plan of this task, or None when it runs the stage itself (no plan, or already launched)."""
    if environ is None:
        environ = os.environ
    raw = environ.get(LAUNCH_PLAN_ENV, "").strip()
    if not raw or environ.get(LAUNCHED_ENV):
        return None
    try:
        plan = LaunchPlan.model_validate_json(raw)
    except ValidationError as err:
        raise ValueError(f"{LAUNCH_PLAN_ENV} is not a valid launch plan (recompile the pipeline): {err}") from None
    if plan.nodes * plan.processes_per_node <= 1:
        return None
    if plan.stage not in MULTI_PROCESS_STAGES:
        raise ValueError(
            f"{LAUNCH_PLAN_ENV}: stage '{plan.stage}' runs in one process; "
            f"several processes: {', '.join(MULTI_PROCESS_STAGES)}."
        )
    return plan


def check_config(stage: str, config: dict[str, Any]) -> None:
    """Several processes need DeepSpeed: the torch backend trains in one process. Every `train` section counts."""

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{where}.{key}"
                if key == "train" and isinstance(value, dict) and value.get("backend", "torch") != "deepspeed":
                    raise ValueError(
                        f"{path}.backend: {stage} on several GPUs or nodes needs backend: deepspeed "
                        f"(got {value.get('backend', 'torch')}); or give the stage gpus: 1, nodes: 1."
                    )
                walk(value, path)

    walk(config, stage)


def stage_argv(
    stage: str, config: dict[str, Any], inputs: dict[str, Any], output_dir: str, experiment: str
) -> list[str]:
    """`-m components.<stage> ...`: the stage's own command line (launch/cli.py:stage_main)."""
    argv = [
        "-m",
        f"components.{stage}",
        "--config-json",
        json.dumps(config, sort_keys=True),
        "--output-dir",
        str(output_dir),
        "--experiment",
        experiment,
    ]
    for name, value in inputs.items():
        if not isinstance(value, (str, Path)):
            raise ValueError(
                f"{stage}: input '{name}' must be a path or URI to run on several processes, "
                f"got {type(value).__name__}."
            )
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
