"""Process faults: the reward_model stage SIGKILLed mid-run and while writing a checkpoint,
then rerun, ends bit-identical to an uninterrupted run. (pretrain, sft and rl have the same test next to their
stage tests: tests/unit/test_{pretrain,sft,rl_stage}.py; the shared loop's in tests/unit/test_training.py.)"""

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from components.synth_world.splits import write_splits
from tests.stage_cli import run_stage_cli

BASE = "builtin:tiny-qwen2_5-vl"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefs")
    write_splits(out, seed=8, eval_per_type=1, sft_records=4, preference_pairs=48)
    return out


def _stage(config: dict, data_dir, out, **env):
    return run_stage_cli("reward_model", config, out, {"base_model": BASE, "data": data_dir}, **env)


def test_reward_model_killed_mid_run_and_mid_checkpoint_resumes_to_bit_identical_weights(data_dir, tmp_path):
    config = {
        "min_pixels": 3136,
        "max_pixels": 3136,
        "heldout_fraction": 0.25,
        "train": {
            "steps": 6,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 1024,
            "threads": 1,
            "eval_every": 3,
            "checkpoint_every": 2,
        },
        "optim": {"lr": 0.003},
    }
    straight = _stage(config, data_dir, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _stage(config, data_dir, tmp_path / "killed", QVL_TEST_KILL_AT_STEP=3)
    assert killed.returncode == -signal.SIGKILL
    in_write = _stage(config, data_dir, tmp_path / "killed", QVL_TEST_KILL_IN_CHECKPOINT=4)
    assert in_write.returncode == -signal.SIGKILL
    resumed = _stage(config, data_dir, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    compared = 0
    for name in ("model/model.safetensors", "model/reward_head.safetensors"):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "killed" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        compared += len(a)
    first = json.loads((tmp_path / "straight/_stage_result.json").read_text())["metrics"]
    second = json.loads((tmp_path / "killed/_stage_result.json").read_text())["metrics"]
    assert first["pair_accuracy"] == second["pair_accuracy"] and first["reward_mean"] == second["reward_mean"]
    print(f"reward_model: 2 kills (at step 3, inside the step-4 checkpoint); {compared} tensors bit-identical")


@pytest.mark.slow
def test_a_kfp_task_killed_mid_stage_is_retried_under_kfp_local_and_resumes_bit_identically(data_dir, tmp_path):
    """The KFP retry path: the sft component (the real one) SIGKILLed at step 3 inside a kfp.local pipeline task
    with set_retry; KFP's retry resumes from the step-2 checkpoint and ends with the uninterrupted run's weights."""
    import shutil

    from kfp import dsl, local

    from components._shared.model.sources import resolve_model
    from components.sft.component import sft_op

    pretrained = tmp_path / "pretrained"
    shutil.copytree(resolve_model(BASE), pretrained / "model")
    config = {
        "mode": "full",
        "min_pixels": 3136,
        "max_pixels": 12544,
        "max_records": 4,
        "train": {
            "steps": 4,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 512,
            "threads": 1,
            "checkpoint_every": 2,
            "checkpoint_uri": str(tmp_path / "checkpoints"),
        },
        "optim": {"lr": 0.01},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
        "calibration": {"enabled": False},
    }
    straight = run_stage_cli(
        "sft",
        {**config, "train": {**config["train"], "checkpoint_uri": str(tmp_path / "straight-checkpoints")}},
        tmp_path / "straight",
        {"base_model": pretrained / "model", "data": data_dir},
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    marker = tmp_path / "killed-once"
    local.init(
        runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"), raise_on_error=True
    )  # a task that fails for good raises here

    @dsl.pipeline
    def retried(sft_config: dict):
        model = dsl.importer(artifact_uri=str(pretrained), artifact_class=dsl.Model, reimport=False)
        task = sft_op(base_model=model.output, sft_data_uri=str(data_dir), config=sft_config)
        task.set_retry(num_retries=1).set_caching_options(False)
        task.set_env_variable("QVL_TEST_KILL_AT_STEP", "3")
        task.set_env_variable("QVL_TEST_KILL_ONCE", str(marker))
        task.set_env_variable("OMP_NUM_THREADS", "1")
        task.set_env_variable("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")

    retried(sft_config=config)
    assert marker.read_text() == "QVL_TEST_KILL_AT_STEP=3\n"  # the first attempt was killed at step 3
    outputs = sorted((tmp_path / "root").rglob("_stage_result.json"))
    assert len(outputs) == 1, outputs
    metrics = json.loads(outputs[0].read_text())["metrics"]
    assert metrics["resumed_from_step"] == 2 and metrics["steps"] == 4
    a = load_file(str(tmp_path / "straight/model/model.safetensors"))
    b = load_file(str(outputs[0].parent / "model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"kfp.local retry: attempt 1 SIGKILLed at step 3, attempt 2 resumed from step 2; {len(a)} tensors "
        "bit-identical to the uninterrupted run"
    )
