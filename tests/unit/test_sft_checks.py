"""sft settings that would otherwise be dropped silently fail with the setting's name and the fix: LoRA target
patterns that match no layer LoRA can adapt, curriculum difficulty names the data does not have."""

import re

import pytest

from components._shared.model.families import family_for
from components._shared.model.vlm import load_vlm
from components.sft.config import SftConfig
from components.sft.stage import build_model, check_lora_targets, phases_for

BUILTINS = {
    "qwen2_vl": "builtin:tiny-qwen2-vl",
    "qwen2_5_vl": "builtin:tiny-qwen2_5-vl",
    "qwen3_vl": "builtin:tiny-qwen3-vl",
    "qwen3_5": "builtin:tiny-qwen3_5",
}


def test_lora_target_patterns_that_match_no_linear_layer_are_named_with_the_real_layers():
    from components._shared.model.families.base import Family

    targets = [*Family.lora_targets, "typo_proj", r"visual\..*nonexistent"]
    cfg = SftConfig.model_validate({"mode": "lora", "lora": {"target_modules": targets}})
    with pytest.raises(ValueError) as err:
        build_model(cfg, BUILTINS["qwen2_5_vl"])
    message = str(err.value)
    assert message.startswith(
        r"sft.lora.target_modules: ['typo_proj', 'visual\\..*nonexistent'] match no Linear, Embedding or Conv layer "
        "of this qwen2_5_vl model"
    )
    assert "fix or remove them" in message
    assert "'model.language_model.layers.N.self_attn.q_proj'" in message  # real names, layer index folded
    assert "'model.visual.merger.mlp.0'" in message
    # a pattern that matches only a container module (the ViT's patch embedding wraps its Conv3d `proj`) is named too
    with pytest.raises(
        ValueError, match=re.escape("sft.lora.target_modules: ['patch_embed'] match no Linear, Embedding or Conv layer")
    ):
        build_model(
            SftConfig.model_validate({"mode": "lora", "lora": {"target_modules": ["patch_embed", "q_proj"]}}),
            BUILTINS["qwen2_5_vl"],
        )


@pytest.mark.parametrize("name", list(BUILTINS))
def test_every_family_default_lora_target_matches_a_linear_layer(name):
    """Written out as sft.lora.target_modules, each family's defaults pass the check (no false alarm)."""
    model = load_vlm(BUILTINS[name]).model
    family = family_for(model)
    assert family.name == name
    check_lora_targets(model, family.lora_targets, family.name)
    with pytest.raises(
        ValueError, match=re.escape(f"['nope'] match no Linear, Embedding or Conv layer of this {name} model")
    ):
        check_lora_targets(model, [*family.lora_targets, "nope"], family.name)


def _curriculum(*phases):
    return SftConfig.model_validate(
        {
            "train": {"steps": 2 * len(phases)},
            "curriculum": [{"name": f"p{i}", "steps": 2, "difficulties": d} for i, d in enumerate(phases)],
        }
    )


RECORDS = [{"difficulty": d, "type": "color"} for d in ["basic"] * 3 + ["advanced"] * 2]


@pytest.mark.parametrize(
    ("difficulties", "missing"),
    [(["basic", "hard"], ["hard"]), (["Advanced", "advanced"], ["Advanced"]), (["hard", "x"], ["hard", "x"])],
)
def test_curriculum_difficulty_names_the_data_lacks_are_named_even_when_another_matches(difficulties, missing):
    with pytest.raises(ValueError) as err:
        phases_for(_curriculum(["basic"], difficulties), RECORDS)
    assert str(err.value) == (
        f"sft.curriculum[1] (phase 'p1').difficulties: {missing} match no training record; the data's difficulties "
        "are ['advanced', 'basic'] (records without one are 'all'). Use names from that list, or leave "
        "difficulties empty for every record."
    )


def test_curriculum_phases_that_name_only_known_difficulties_select_their_records():
    phases = phases_for(_curriculum(["basic"], ["advanced", "basic"], []), RECORDS)
    assert [p.pool for p in phases] == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_records_no_phase_trains_on_are_named_not_left_out():
    """With phases `basic` then `advanced`, records of `Basic`, `expert` or none ('all') were in no phase: never
    trained and never counted."""
    records = RECORDS + [{"difficulty": d, "type": "color"} for d in ("Basic", "expert", "expert", "all")]
    with pytest.raises(ValueError) as err:
        phases_for(_curriculum(["basic"], ["advanced"]), records)
    assert str(err.value).startswith(
        "4 training record(s) have a difficulty no sft.curriculum phase trains on ({'Basic': 1, 'all': 1, 'expert': 2};"
    )
    assert [p.pool for p in phases_for(_curriculum(["basic"], []), records)] == [[0, 1, 2], list(range(9))]


def test_the_synthetic_world_and_the_presets_curricula_agree(tmp_path):
    """Every difficulty a preset's curriculum names is one the shapes world writes, so its sft data passes
    phases_for for each preset (prod-7b's basic / advanced are the world's names too)."""
    from pathlib import Path

    from components._shared.platform import presets as P
    from components.sft.stage import load_sft_records
    from components.synth_world.splits import write_splits

    write_splits(tmp_path, seed=5, eval_per_type=1, sft_records=48, preference_pairs=2)
    records = load_sft_records(tmp_path)
    checked = 0
    for preset in sorted((Path(__file__).parents[2] / "pipelines/presets").glob("*.yaml")):
        sft = P.read_preset_yaml(preset).get("sft") or {}
        cfg = P.validate(SftConfig, "sft", sft)
        if any(p.difficulties for p in cfg.curriculum):
            assert len(phases_for(cfg, records)) == len(cfg.curriculum), preset.name
            checked += 1
    assert checked >= 3  # tiny, demo, prod-7b
