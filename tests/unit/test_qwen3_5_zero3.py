"""Qwen3.5 under ZeRO-3: its Gated DeltaNet layers pass `conv1d.weight` to a convolution function and never call
`conv1d`, so ZeRO-3 (which gathers a parameter around its owner's forward) left the weight partitioned there:
`IndexError: Dimension out of range` in every forward. The family names the weight and DeepSpeed gathers it with the
layer that reads it (`register_external_parameter`), in training engines and the rl stage's frozen reference alike.
Found by `qvl rehearse --preset prod-qwen3.5-9b` (pretrain stage 2, SFT, reward model, rl, distill are ZeRO-3)."""

import json
import math

import pytest

from components.rl.config import RlConfig
from components.sft.config import SftConfig
from components.synth_world.splits import write_splits
from tests.stage_cli import run_stage_cli

pytestmark = pytest.mark.slow
BASE = "builtin:tiny-qwen3_5"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5-zero3")
    write_splits(out, seed=5, eval_per_type=2, sft_records=24, preference_pairs=2)
    return out


def test_lora_with_gradient_checkpointing_trains_under_zero3(data_dir, tmp_path):
    train = {"steps": 2, "samples_per_step": 8, "max_tokens_per_micro_batch": 256, "threads": 1, "eval_every": 2}
    config = SftConfig.model_validate(
        {
            "mode": "lora",
            "min_pixels": 3136,
            "max_pixels": 12544,
            "calibration": {"enabled": False},
            "train": {**train, "backend": "deepspeed", "zero_stage": 3, "gradient_checkpointing": True},
            "eval": {"per_type": 2, "batch_size": 16, "max_new_tokens": 8},
        }
    ).model_dump(mode="json", exclude_none=True)
    done = run_stage_cli("sft", config, tmp_path / "sft", {"base_model": BASE, "data": data_dir})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "sft/_stage_result.json").read_text())["metrics"]
    assert math.isfinite(metrics["train_loss_final"]) and metrics["merge_max_abs_logit_diff"] < 1e-3


def test_rl_policy_and_frozen_reference_under_zero3(data_dir, tmp_path):
    config = RlConfig.model_validate(
        {
            "algorithm": "ppo",
            "min_pixels": 3136,
            "max_pixels": 3136,
            "rewards": {"efficacy": 1.0, "format": 0.2},
            "rollout": {"samples_per_prompt": 2, "max_new_tokens": 4, "batch_size": 2},
            "train": {
                "steps": 1,
                "samples_per_step": 2,
                "max_tokens_per_micro_batch": 512,
                "threads": 1,
                "eval_every": 0,
                "backend": "deepspeed",
                "zero_stage": 3,
            },
            "frozen_sharding": "zero3",
            "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
            "gates": {"kl_max": 0, "length_ratio_min": 0, "length_ratio_max": 0, "heldout_drop_max": 0},
        }  # fmt: skip
    ).model_dump(mode="json")
    inputs = {"base_model": BASE, "reward_model": "", "data": data_dir}
    done = run_stage_cli("rl", config, tmp_path / "rl", inputs)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "rl/_stage_result.json").read_text())["metrics"]
    assert metrics["steps"] == 1 and math.isfinite(metrics["efficacy_after"])
