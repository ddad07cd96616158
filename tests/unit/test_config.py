"""The config base: strictness, KFP float coercion, errors that name the setting, CLI overrides."""

import re
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


def test_a_key_given_twice_on_one_command_line_is_refused_naming_it():
    for pairs in (["train.steps=1", "train.steps=2"], ["train=1", "train.steps=2"], ["train.steps=1", "train=1"]):
        with pytest.raises(ValueError, match=rf"Override '{pairs[1]}' sets '{pairs[1].split('=')[0]}' again after "):
            parse_overrides(pairs)
    assert parse_overrides(["train.steps=1", "train.threads=2"]) == {"train": {"steps": 1, "threads": 2}}


def _number_settings(model, prefix: str = ""):
    """Dotted paths of every int field of a config, nested blocks walked."""
    from pydantic import BaseModel

    from components._shared.platform.config import _member_types

    for name, field in model.model_fields.items():
        kinds = _member_types(field.annotation)
        block = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if block is not None:
            yield from _number_settings(block, f"{prefix}{name}.")
        elif int in kinds and bool not in kinds:
            yield f"{prefix}{name}"


def _nested(path: str, value) -> dict:
    *parents, leaf = path.split(".")
    out = {leaf: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def test_a_boolean_is_refused_for_every_int_setting_of_every_stage():
    """`train.steps: true` used to run one step (pydantic reads true as 1)."""
    from components.stages import STAGES, load_config_class

    checked = 0
    for stage in STAGES:
        config_cls = load_config_class(stage)
        for path in _number_settings(config_cls):
            with pytest.raises(ValueError, match=rf"{stage}\.{re.escape(path)}: .*true is a boolean where a number"):
                validate(config_cls, stage, _nested(path, True))
            checked += 1
    assert checked > 100  # steps, seeds, sizes, bounds ... of every stage
    for bad in ({"ratio": False}, {"sizes": [1, True]}, {"keep": True}, {"optim": {"warmup_steps": True}}):
        with pytest.raises(ValueError, match="is a boolean where a number belongs"):
            validate(Example, "example", bad)
    with pytest.raises(ValueError, match=r"rl\.rewards: .*true is a boolean where a number belongs"):
        validate(load_config_class("rl"), "rl", {"rewards": {"efficacy": True}})


def test_thread_counts_and_samples_per_step_are_bounded():
    from components.sft.config import SftConfig

    for bad in ({"train": {"threads": 1025}}, {"train": {"samples_per_step": 1_000_001}}):
        with pytest.raises(ValueError, match=r"sft\.train\.\w+: Input should be less than or equal to"):
            validate(SftConfig, "sft", bad)
    assert validate(SftConfig, "sft", {"train": {"threads": 1024, "samples_per_step": 1_000_000}}).train.threads == 1024


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


def test_an_extends_cycle_is_named_and_shipped_presets_are_found_from_anywhere(tmp_path):
    from components._shared.platform import presets
    from components._shared.platform.presets import read_preset_yaml, read_section
    from pipelines.presets import PRESET_DIR

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.yaml").write_text("extends: ../p/b\n")  # the path grows each turn unless resolved
    (tmp_path / "p" / "b.yaml").write_text("extends: ../p/a.yaml\nsft: {seed: 1}\n")
    with pytest.raises(ValueError, match=r"presets extend each other in a cycle: a -> b -> a \(.*a.yaml\); remove"):
        read_section(tmp_path / "p" / "a.yaml", "sft")
    (tmp_path / "self.yaml").write_text("extends: self\n")
    with pytest.raises(ValueError, match="cycle: self -> self"):
        read_preset_yaml(tmp_path / "self.yaml")
    assert presets.SHIPPED_PRESETS == PRESET_DIR.resolve()
    (tmp_path / "mine.yaml").write_text("extends: demo\nsft: {seed: 7}\n")  # a preset of one's own, outside presets/
    demo = read_section(PRESET_DIR / "demo.yaml", "sft")
    assert read_section(tmp_path / "mine.yaml", "sft") == {**demo, "seed": 7}


def test_extends_naming_a_directory_says_so(tmp_path):
    """Was `[Errno 21] Is a directory`."""
    from components._shared.platform.presets import read_preset_yaml

    (tmp_path / "sub.yaml").mkdir()
    (tmp_path / "mine.yaml").write_text("extends: sub\nsft: {}\n")
    with pytest.raises(ValueError, match=r"mine.yaml: extends 'sub', which names .*sub.yaml': a directory, not a file"):
        read_preset_yaml(tmp_path / "mine.yaml")


def test_an_empty_config_a_section_emptied_under_extends_and_a_list_index_are_named(tmp_path):
    """An empty --config ran on the stage defaults, and `sft:` with its lines commented out under `extends: tiny`
    replaced tiny's whole sft section with the defaults (LoRA r=16, not tiny's 8), both exit 0; `curriculum.0.steps=1`
    was "Input should be a valid list"."""
    from components._shared.platform.presets import read_preset_yaml, read_section

    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match=r"empty\.yaml holds no settings \(it is empty or only comments\)"):
        read_section(tmp_path / "empty.yaml", "sft")
    (tmp_path / "mine.yaml").write_text("extends: tiny\nsft:\n#  train: {steps: 3}\nrl: {seed: 3}\n")
    emptied = r"\['sft'\] empty \(null: its lines commented out\?\).*whole section of 'tiny'"
    with pytest.raises(ValueError, match=emptied):
        read_preset_yaml(tmp_path / "mine.yaml")
    (tmp_path / "mine.yaml").write_text("extends: tiny\nrl: {seed: 3}\n")
    assert read_preset_yaml(tmp_path / "mine.yaml")["sft"]["lora"]["r"] == 8
    with pytest.raises(ValueError, match=r"'0' indexes the list 'curriculum'; a list setting is given whole as key="):
        parse_overrides(["curriculum.0.steps=1"])
