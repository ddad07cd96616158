"""The config base: strictness, KFP float coercion, errors that name the setting, CLI overrides."""

from typing import Annotated

import pytest
from pydantic import Field, ValidationError

from components._shared.platform.config import StageConfig, SubConfig
from components._shared.platform.presets import deep_merge, parse_overrides, validate


class Optim(SubConfig):
    lr: float = 1e-3
    warmup_steps: Annotated[int, Field(ge=0)] = 10


class Example(StageConfig):
    max_steps: Annotated[int, Field(ge=1)] = 5
    keep: int | None = None
    sizes: list[int] = [1, 2]
    ratio: float = 0.5
    optim: Optim = Optim()


def test_kfp_floats_become_ints_only_where_the_field_is_int():
    cfg = Example.model_validate(
        {"max_steps": 2.0, "keep": 3.0, "sizes": [4.0, 5.0], "ratio": 1.0, "optim": {"warmup_steps": 7.0, "lr": 2.0}}
    )
    assert cfg.max_steps == 2 and isinstance(cfg.max_steps, int)
    assert cfg.keep == 3 and isinstance(cfg.keep, int)
    assert cfg.sizes == [4, 5] and all(isinstance(v, int) for v in cfg.sizes)
    assert isinstance(cfg.ratio, float) and cfg.ratio == 1.0
    assert cfg.optim.warmup_steps == 7 and isinstance(cfg.optim.warmup_steps, int)
    assert isinstance(cfg.optim.lr, float)


def test_fractional_float_for_int_field_is_still_an_error():
    with pytest.raises(ValueError, match="max_steps"):
        validate(Example, "example", {"max_steps": 2.5})


def test_unknown_key_is_rejected_and_named():
    with pytest.raises(ValueError) as err:
        validate(Example, "example", {"max_stpes": 3})
    assert "example.max_stpes" in str(err.value)


def test_bounds_error_names_the_nested_setting():
    with pytest.raises(ValueError) as err:
        validate(Example, "example", {"optim": {"warmup_steps": -1}})
    assert "example.optim.warmup_steps" in str(err.value)


def test_configs_are_frozen():
    cfg = Example()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.max_steps = 3  # type: ignore[misc]


def test_round_trip_through_json_dump_keeps_values():
    cfg = Example(max_steps=3, sizes=[7])
    assert Example.model_validate(cfg.model_dump(mode="json")) == cfg


def test_overrides_parse_dotted_paths_and_yaml_scalars():
    assert parse_overrides(["optim.lr=2e-5", "max_steps=3", "name=abc", "flag=true"]) == {
        "optim": {"lr": 2e-5},
        "max_steps": 3,
        "name": "abc",
        "flag": True,
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["optim.lr"])
    with pytest.raises(ValueError, match=r"Override 'optim.lr=\[1': the value is not valid YAML"):
        parse_overrides(["optim.lr=[1"])
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_overrides(["name=a\x1fb"])  # a control character (found by the fuzz test)


def test_deep_merge_merges_nested_and_replaces_leaves():
    assert deep_merge({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 5}, "d": [1]}) == {"a": {"b": 5, "c": 2}, "d": [1]}


def test_non_finite_numbers_are_refused_everywhere():
    """inf / nan validate nowhere (a LoRA alpha of inf trained NaN losses to a 'succeeded' run before)."""
    for bad in ({"ratio": float("inf")}, {"optim": {"lr": float("nan")}}, {"ratio": "-inf"}):
        with pytest.raises(ValueError, match="finite number"):
            validate(Example, "example", bad)
    from components.sft.config import SftConfig

    with pytest.raises(ValueError, match=r"sft.lora.alpha.*finite"):
        validate(SftConfig, "sft", {"lora": {"alpha": float("inf")}})
    with pytest.raises(ValueError, match=r"sft.optim.eps.*finite"):
        validate(SftConfig, "sft", {"optim": {"eps": float("inf")}})


def test_duplicate_keys_and_alias_bombs_are_refused(tmp_path):
    from components._shared.platform.presets import read_preset_yaml

    twice = tmp_path / "twice.yaml"
    twice.write_text("sft:\n  mode: lora\nrl: {}\nsft:\n  mode: full\n")
    with pytest.raises(ValueError, match=r"twice.yaml: not a valid config \(the key 'sft' is given twice.*line 4"):
        read_preset_yaml(twice)
    bomb = tmp_path / "bomb.yaml"  # the 449-byte kind: each level holds the one before nine times
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(levels) + "\n")
    with pytest.raises(ValueError, match="aliases expand it past 100,000 nodes") as caught:
        read_preset_yaml(bomb)
    assert len(str(caught.value)) < 3000
    shared = tmp_path / "shared.yaml"  # what presets do with aliases: share a block
    shared.write_text("base: &gpu {gpus: 8, nodes: 1}\nsft: {kubernetes: *gpu}\nrl: {kubernetes: *gpu}\n")
    assert read_preset_yaml(shared)["rl"] == {"kubernetes": {"gpus": 8, "nodes": 1}}
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_overrides(["sft.lora.r=[1, 2"])
