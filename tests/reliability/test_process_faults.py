"""Process faults (issue 7, item 2): the reward_model stage SIGKILLed mid-run and while writing a checkpoint,
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
    config = {"min_pixels": 3136, "max_pixels": 3136, "heldout_fraction": 0.25,
              "train": {"steps": 6, "samples_per_step": 4, "max_tokens_per_micro_batch": 1024, "threads": 1,
                        "eval_every": 3, "checkpoint_every": 2}, "optim": {"lr": 0.003}}
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
