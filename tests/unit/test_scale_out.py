"""Several processes in the task's pod: a stage whose profile asks for G GPUs on one node runs under torchrun
with G processes (gloo on the CPU here), rank 0 records, and run_stage returns what it recorded."""

import json

import pytest

from components._shared.launch.plan import LAUNCH_PLAN_ENV, LaunchPlan, check_config, stage_argv


def test_several_processes_need_deepspeed_in_every_train_section():
    check_config("sft", {"train": {"backend": "deepspeed"}})
    with pytest.raises(
        ValueError,
        match=r"pretrain.stage2.train.backend: pretrain on several GPUs or nodes needs "
        r"backend: deepspeed \(got torch\)",
    ):
        check_config("pretrain", {"stage1": {"train": {"backend": "deepspeed"}}, "stage2": {"train": {}}})


def test_the_stage_command_line_carries_config_inputs_and_output():
    argv = stage_argv("reward_model", {"b": 1, "a": {"c": 2}}, {"base_model": "s3://m", "data": ""}, "s3://o", "exp")
    assert argv == [
        "-m",
        "components.reward_model",
        "--config-json",
        '{"a": {"c": 2}, "b": 1}',
        "--output-dir",
        "s3://o",
        "--experiment",
        "exp",
        "--base-model",
        "s3://m",
        "--data",
        "",
    ]
    with pytest.raises(ValueError, match="input 'shards' must be a path or URI"):
        stage_argv("sft", {}, {"shards": ["a", "b"]}, "o", "exp")


@pytest.mark.slow
def test_a_two_gpu_profile_runs_the_stage_under_torchrun_and_returns_rank0s_metrics(
    tmp_path, monkeypatch, tracking_env
):
    from components._shared.launch.runner import run_stage
    from components._shared.platform import storage
    from components.synth_world.lake import write_splits

    data = tmp_path / "data"
    write_splits(data, seed=5, eval_per_type=2, sft_records=16, preference_pairs=2)
    config = {
        "mode": "full",
        "min_pixels": 3136,
        "max_pixels": 12544,
        "max_records": 16,
        "train": {
            "steps": 2,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 256,
            "threads": 1,
            "backend": "deepspeed",
            "zero_stage": 2,
            "checkpoint_every": 2,
        },
        "optim": {"lr": 0.01},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
        "calibration": {"enabled": False},
    }
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(LAUNCH_PLAN_ENV, LaunchPlan(stage="sft", gpus_per_node=2, image="img:1").model_dump_json())
    metrics = run_stage(
        "sft",
        config,
        experiment="vlm",
        inputs={"base_model": "builtin:tiny-qwen2_5-vl", "data": str(data)},
        output_dir=str(tmp_path / "out"),
        record_as="sft",
    )
    result = json.loads((tmp_path / "out/_stage_result.json").read_text())
    assert result["status"] == "succeeded" and result["metrics"] == metrics
    assert metrics["steps"] == 2 and metrics["train_loss_final"] > 0
    assert storage.is_committed(tmp_path / "out") and (tmp_path / "out/model/model.safetensors").exists()
    # both ranks took part: each wrote its RNG state into the step-2 checkpoint
    assert len(list((tmp_path / "out").rglob("state-rank1.json"))) == 1, sorted(
        p.name for p in (tmp_path / "out").rglob("*")
    )
