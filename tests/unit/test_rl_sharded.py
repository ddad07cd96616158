"""The rl stage sharded over two processes (torchrun, DeepSpeed, gloo on the CPU): each rank generates and scores its
share of a step, every rank gets all of it (rl/shard.py). Two processes sample exactly the rollouts one process
samples, end within float rounding of its weights, and a SIGKILLed two-process run resumes bit-identically; with
the policy and the frozen reference under ZeRO-3 the ranks run their forwards in lockstep."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from components.rl.config import RlConfig
from components.synth_world.splits import write_splits
from tests.codebase import ROOT
from tests.tiny_sft import train_tiny_sft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rl-sharded")
    write_splits(root / "data", seed=7, eval_per_type=3, sft_records=64, preference_pairs=96)
    return {"data": str(root / "data"), "base_model": str(train_tiny_sft(root / "data", root / "sft", steps=40))}


def _config(algorithm: str, *, zero_stage: int = 2, frozen: str = "replicated") -> dict:
    data = {
        "algorithm": algorithm,
        "min_pixels": 3136,
        "max_pixels": 3136,
        "rewards": {"efficacy": 1.0, "format": 0.2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 6, "batch_size": 2},  # 4 chunks a step
        "train": {"steps": 4, "samples_per_step": 4, "max_tokens_per_micro_batch": 512, "threads": 1, "eval_every": 0,
                  "backend": "deepspeed", "zero_stage": zero_stage, "checkpoint_every": 2},
        "frozen_sharding": frozen,
        "update": {"epochs": 2, "minibatches": 2},
        "optim": {"lr": 0.001},
        "ppo": {"kl_stop": 10.0},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 6},
        "gates": {"kl_max": 0, "length_ratio_min": 0, "length_ratio_max": 0, "heldout_drop_max": 0},
    }  # fmt: skip
    return RlConfig.model_validate(data).model_dump(mode="json")


def _run(config: dict, world: dict, out: Path, processes: int, **env) -> subprocess.CompletedProcess:
    cfg = out.with_suffix(".yaml")
    cfg.write_text(yaml.safe_dump({"rl": config}))
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    cmd = [sys.executable, *launcher, "-m", "components.rl", "--config", str(cfg), "--output-dir", str(out)]
    cmd += ["--base-model", world["base_model"], "--reward-model", "", "--data", world["data"]]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{out}.db"}
    environ.update({k: str(v) for k, v in env.items()})
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900, check=False)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.mark.parametrize("algorithm", ["ppo", "ter", "grpo", "dapo", "gspo"])
def test_two_processes_sample_what_one_does_and_resume_bit_identically(algorithm, world, tmp_path):
    config = _config(algorithm)
    for name, processes in (("one", 1), ("two", 2)):
        done = _run(config, world, tmp_path / name, processes)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = tmp_path / "one", tmp_path / "two"
    assert (one / "rollouts.jsonl").read_text() == (two / "rollouts.jsonl").read_text()  # the last step's samples
    a, b = _weights(one), _weights(two)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert diff < 1e-4, f"2 processes vs 1: max abs weight difference {diff:.2e}"
    first, second = (json.loads((d / "_stage_result.json").read_text())["metrics"] for d in (one, two))
    assert first["efficacy_before"] == second["efficacy_before"] and second["steps"] == 4
    killed = _run(config, world, tmp_path / "killed", 2, QVL_TEST_KILL_AT_STEP=3)
    assert killed.returncode != 0
    resumed = _run(config, world, tmp_path / "killed", 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "killed/_stage_result.json").read_text())["metrics"]["resumed_from_step"] == 2
    c = _weights(tmp_path / "killed")
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_zero3_policy_and_reference_run_in_lockstep_and_sample_what_one_process_does(world, tmp_path):
    one = _run(_config("ppo", zero_stage=3), world, tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(_config("ppo", zero_stage=3, frozen="zero3"), world, tmp_path / "two", 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / "one/rollouts.jsonl").read_text() == (tmp_path / "two/rollouts.jsonl").read_text()
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-4
