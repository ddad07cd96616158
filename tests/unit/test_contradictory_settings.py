"""Settings that cannot mean what they say are refused when the config is read, naming the setting and the fix:
pixel ranges that cannot be met in every stage that has one, reward weights that train the policy to fail, gates
that every step trips, names left empty by an unset shell variable."""

import pytest

from components._shared.platform.presets import validate
from components.stages import STAGES, load_config_class


def test_every_stage_with_a_pixel_range_refuses_one_that_cannot_be_met():
    checked = []
    for stage in STAGES:
        config_cls = load_config_class(stage)
        if {"min_pixels", "max_pixels"} <= set(config_cls.model_fields):
            with pytest.raises(
                ValueError,
                match=r"min_pixels=200704 (>|is larger than) max_pixels=3136; (swap or fix them|lower min_pixels)",
            ):
                validate(config_cls, stage, {"min_pixels": 200704, "max_pixels": 3136})
            checked.append(stage)
    assert {"rl", "reward_model", "sft", "distill", "pretrain", "extract_features", "clean_data"} <= set(checked)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"rewards": {"efficacy": 1.0, "format": -0.5}}, r"rl\.rewards: .*\{'format': -0\.5\} are negative"),
        ({"gates": {"length_ratio_min": 3.0, "length_ratio_max": 2.0}}, r"length_ratio_min=3\.0 > .*swap them"),
        ({"prompts_file": ""}, r"rl\.prompts_file: .*empty \(an unset shell variable\?\)"),
        ({"prompts_file": "  "}, r"rl\.prompts_file: .*empty"),
        ({"eval": {"files": [""]}}, r"rl\.eval\.files: .*holds an empty name"),
        ({"ppo": {"clip_start": 0.05, "clip_end": 0.3}}, r"rl\.ppo: .*clip_end=0\.3 > ppo\.clip_start=0\.05"),
        ({"ppo": {"kl_target": 0.5, "kl_stop": 0.1}}, r"rl\.ppo: .*kl_stop=0\.1 <= ppo\.kl_target=0\.5"),
    ],
)
def test_rl_settings_that_cannot_mean_what_they_say_are_refused(settings, says):
    with pytest.raises(ValueError, match=says):
        validate(load_config_class("rl"), "rl", settings)


def test_a_gate_turned_off_is_not_a_contradiction():
    cfg = validate(load_config_class("rl"), "rl", {"gates": {"length_ratio_min": 3.0, "length_ratio_max": 0}})
    assert cfg.gates.length_ratio_max == 0 and cfg.rewards == {"efficacy": 1.0}


def test_select_gates_no_candidate_could_pass_are_refused():
    cls = load_config_class("select_checkpoint")
    with pytest.raises(ValueError, match=r"ask vqa_exact_match >= 0\.8 and <= 0\.5: no candidate can pass"):
        validate(
            cls, "select_checkpoint", {"min_gates": {"vqa_exact_match": 0.8}, "max_gates": {"vqa_exact_match": 0.5}}
        )
    both = {"min_gates": {"vqa_exact_match": 0.5}, "max_gates": {"vqa_exact_match": 0.5, "latency_ms": 3}}
    assert validate(cls, "select_checkpoint", both).max_gates == {"vqa_exact_match": 0.5, "latency_ms": 3.0}


def test_ptx_settings_without_a_ptx_weight_are_said_to_have_no_effect():
    cfg = validate(load_config_class("rl"), "rl", {"ptx": {"types": ["color"], "loss": "kl"}})
    assert cfg.ignored_settings() == [
        "ptx.types: ptx.coef is 0 (no SFT loss is mixed in)",
        "ptx.loss: ptx.coef is 0 (no SFT loss is mixed in)",
    ]
    assert validate(load_config_class("rl"), "rl", {"ptx": {"types": ["color"], "coef": 0.1}}).ignored_settings() == []


def test_evaluation_and_checkpoint_intervals_past_the_last_step_are_said():
    cfg = validate(load_config_class("sft"), "sft", {"train": {"steps": 2, "eval_every": 50, "checkpoint_every": 10}})
    notes = [n for n in cfg.ignored_settings() if not n.startswith("schedule.")]
    assert notes == [
        "train.eval_every=50 > train.steps=2: never reached (as eval_every: 0, held-out evaluation at the start and at "
        "the end only)",
        "train.checkpoint_every=10 > train.steps=2: never reached (as checkpoint_every: 0, a checkpoint at the end "
        "only)",
    ]
    assert (
        validate(load_config_class("sft"), "sft", {"train": {"steps": 100, "eval_every": 50}}).ignored_settings() == []
    )


def test_selective_checkpointing_without_checkpointing_is_said():
    sft = load_config_class("sft")
    off = validate(sft, "sft", {"train": {"steps": 100, "checkpoint_every_n_layers": 2}})
    assert off.ignored_settings() == ["train.checkpoint_every_n_layers=2: train.gradient_checkpointing is off"]
    on = {"train": {"steps": 100, "checkpoint_every_n_layers": 2, "gradient_checkpointing": True}}
    assert validate(sft, "sft", on).ignored_settings() == []
