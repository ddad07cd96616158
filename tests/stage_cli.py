"""Run a stage's command line (`python -m components.<stage>`) in a subprocess, as a pod would: the resume
tests kill it with the QVL_TEST_KILL_* variables and run it again on the same output directory.

    done = run_stage_cli("sft", config, out, {"base_model": BASE, "data": data_dir}, QVL_TEST_KILL_AT_STEP=3)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml


def run_stage_cli(
    stage: str, config: dict, out: Path, inputs: dict[str, object], *, beside: Path | None = None, **env: object
) -> subprocess.CompletedProcess:
    """`config` is the stage's section (written beside `out`, or in `beside`); `inputs` become --flag values;
    one torch thread; MLflow in a sqlite file there too."""
    beside = beside or out.parent
    cfg_file = beside / f"{out.name}.yaml"
    cfg_file.write_text(yaml.safe_dump({stage: config}))
    cmd = [sys.executable, "-m", f"components.{stage}", "--config", str(cfg_file), "--output-dir", str(out)]
    for name, value in inputs.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    leaked = {"QVL_MLFLOW_PARENT_RUN_ID", "MLFLOW_RUN_ID", "QVL_KFP_RUN_ID"}  # another test's run: set them via `env`
    environ = {
        **{k: v for k, v in os.environ.items() if k not in leaked},
        "OMP_NUM_THREADS": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{beside}/mlflow.db",
        **{k: str(v) for k, v in env.items()},
    }
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=900, check=False)
