"""Training settings checked against each other: contradictions are errors naming the setting and the fix;
settings that do nothing in the configuration are listed (`ignored_settings`), said by preflight and each stage."""

import pytest

from components._shared.platform.presets import validate
from components.preflight.stage import ignored_settings
from components.reward_model.config import RewardModelConfig
from components.rl.config import RlConfig
from pipelines.presets import load_preset


@pytest.mark.parametrize("config", [RlConfig, RewardModelConfig])
def test_per_group_clips_with_deepspeed_are_refused(config):
    with pytest.raises(ValueError, match=r"optim.group_max_grad_norm=\{'vision_lower': 0.1\} with train.backend: "):
        config.model_validate(
            {"train": {"backend": "deepspeed"}, "optim": {"group_max_grad_norm": {"vision_lower": 0.1}}}
        )
    assert config.model_validate({"optim": {"group_max_grad_norm": {"vision_lower": 0.1}}})  # torch clips per group


def test_deepspeed_settings_and_a_warmup_longer_than_the_run_are_listed():
    cfg = RewardModelConfig.model_validate(
        {
            "train": {"steps": 10, "offload_optimizer": True, "zero_stage": 3, "overlap_comm": False},
            "schedule": {"warmup_steps": 20},
        }
    )
    assert cfg.ignored_settings() == [
        "train.offload_optimizer: a DeepSpeed setting; train.backend is torch",
        "train.zero_stage: a DeepSpeed setting; train.backend is torch",
        "train.overlap_comm: a DeepSpeed setting; train.backend is torch",
        "schedule.warmup_steps=20 >= train.steps=10: the learning rate rises to 0.50 of optim.lr and its cosine "
        "decay never starts",
    ]
    deepspeed = {"steps": 100, "backend": "deepspeed", "offload_optimizer": True, "zero_stage": 3}
    assert RewardModelConfig.model_validate({"train": deepspeed}).ignored_settings() == []


def test_another_algorithms_settings_are_listed_for_rl():
    assert RlConfig.model_validate({"algorithm": "ppo", "ppo": {"kl_coef": 0.2}}).ignored_settings() == []
    ter = RlConfig.model_validate({"algorithm": "ter", "ppo": {"kl_coef": 0.2}, "optim": {"max_grad_norm": 0.5}})
    assert ter.ignored_settings() == [
        "ppo.kl_coef: a ppo setting; algorithm is ter",
        "optim.max_grad_norm: algorithm ter clips every group at ter.max_grad_norm instead",
    ]
    grpo = RlConfig.model_validate(
        {"algorithm": "grpo", "rollout": {"samples_per_prompt": 2}, "ter": {"baseline_decay": 0.5}}
    )
    assert grpo.ignored_settings() == ["ter.baseline_decay: a ter setting; algorithm is grpo"]


def test_preflight_lists_every_stages_settings_without_effect():
    """demo-ter extends demo, whose PPO settings (group baseline, clip 0.3) TER does not use: said, not silent."""
    assert ignored_settings(load_preset("demo-ter").stages) == [
        "rl.ppo.group_baseline: a ppo setting; algorithm is ter",
        "rl.optim.max_grad_norm: algorithm ter clips every group at ter.max_grad_norm instead",
    ]
    for name in ("demo", "prod-7b", "prod-qwen3-vl-8b", "prod-qwen3.5-9b"):
        assert ignored_settings(load_preset(name).stages) == [], name
    assert validate(RlConfig, "rl", load_preset("demo").stages["rl"]).ignored_settings() == []


def test_sft_freeze_outside_full_mode_is_refused_and_other_modes_settings_listed():
    from components.sft.config import SftConfig

    with pytest.raises(ValueError, match=r"freeze=\['lm_lower'\] applies to mode: full; with mode: lora the base"):
        SftConfig.model_validate({"mode": "lora", "freeze": ["lm_lower"]})
    assert SftConfig.model_validate({"mode": "full", "freeze": ["lm_lower"]}).ignored_settings() == []
    full = SftConfig.model_validate({"mode": "full", "lora": {"r": 8}, "qlora": {"quant_type": "fp4"}})
    assert full.ignored_settings() == [
        "lora.r: a LoRA setting; mode is full",
        "qlora.quant_type: a QLoRA setting; mode is full",
    ]


def test_distill_student_sizes_of_a_loaded_student_and_ce_without_data_answers_are_listed():
    from components.distill.config import DistillConfig

    cfg = DistillConfig.model_validate(
        {
            "student": {"init": "model", "model_uri": "builtin:tiny-qwen2_5-vl", "layers": 2},
            "on_policy": {"fraction": 1.0},
            "loss": {"kl": 1.0, "ce": 0.1},
        }
    )
    assert cfg.ignored_settings() == [
        "student.layers: a size for init prune / random; init is model",
        "loss.ce: applies to the data's answers; on_policy.fraction is 1, every answer is generated",
    ]


def test_overlap_comm_is_on_where_a_transfer_can_hide_behind_the_backward(monkeypatch):
    """null: on with CUDA and more than one rank (DeepSpeed's side stream), off on one rank or the CPU; a value given
    is kept. (The 2-process ZeRO-2 test in test_training.py trains with it on and checks the sums.)"""
    import torch

    from components._shared.model.ds_backend import ds_config
    from components._shared.model.train_config import OptimConfig, TrainConfig

    def overlap(world_size: int, cuda: bool, **train) -> bool:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        return ds_config(TrainConfig(**train), OptimConfig(), world_size)["zero_optimization"]["overlap_comm"]

    assert [overlap(8, True), overlap(1, True), overlap(8, False)] == [True, False, False]
    assert overlap(8, True, overlap_comm=False) is False and overlap(1, False, overlap_comm=True) is True
