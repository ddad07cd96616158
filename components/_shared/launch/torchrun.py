"""One node, several processes: the stage's command line under torchrun in the task's own pod."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from components._shared.launch.plan import LAUNCHED_ENV, LaunchPlan, stage_argv
from components._shared.launch.result import read_result


def run_local_torchrun(
    plan: LaunchPlan,
    config: dict[str, Any],
    *,
    inputs: dict[str, Any],
    output_dir: str,
    experiment: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One node, G processes (one per GPU) in this pod; rank 0 writes `output_dir` and the result record. `env`
    is added to the processes' environment (the stage's MLflow run)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={plan.processes_per_node}",
        *stage_argv(plan.stage, config, inputs, output_dir, experiment),
    ]
    print(f"[torchrun] {plan.stage}: torchrun with {plan.processes_per_node} processes", flush=True)
    rc = subprocess.run(cmd, env={**os.environ, **(env or {}), LAUNCHED_ENV: "1"}).returncode
    if rc != 0:
        raise RuntimeError(
            f"{plan.stage}: torchrun with {plan.processes_per_node} processes exited with code {rc} "
            "(the failing rank's traceback is in the log above)."
        )
    return read_result(output_dir, plan.stage)
