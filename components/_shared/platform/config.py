"""Base class of every stage config. Imports pydantic only, so the pipeline compiles without torch.

KFP hands dict parameters back with whole numbers turned into floats (``{"max_steps": 2.0}``); the
base class turns such floats back into ints where the field is an int, and nowhere else. A boolean where a number
belongs (``train.steps: true``, which pydantic would read as 1) is refused.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from components._shared.platform.credential_shapes import shown
from components._shared.platform.names import non_ascii_letters


def _accepts_int_not_float(annotation: Any) -> bool:
    """True when a field's type admits int but not float (``int``, ``int | None``, ``Annotated[int, ...]``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _accepts_int_not_float(typing.get_args(annotation)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        members = typing.get_args(annotation)
        return int in members and float not in members
    return annotation is int


def _member_types(annotation: Any) -> set:
    """The types a field's annotation admits (Annotated and unions unwrapped, a Literal's values' types)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _member_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_member_types(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return {type(v) for v in typing.get_args(annotation)}
    return {annotation}


def _is_number_not_bool(annotation: Any) -> bool:
    """True when a field takes numbers (int / float) and not booleans."""
    kinds = _member_types(annotation)
    return bool(kinds & {int, float}) and not kinds & {bool, Any}


def refuse_bool_for_number(value: Any, annotation: Any) -> Any:
    """`value`, or a ValueError when it is a boolean (or a list or mapping holding one) where the field takes
    numbers."""
    origin = typing.get_origin(annotation)
    if origin is list and isinstance(value, list):
        (item_type,) = typing.get_args(annotation) or (Any,)
        for item in value:
            refuse_bool_for_number(item, item_type)
    elif origin is dict and isinstance(value, dict):
        item_type = (typing.get_args(annotation) or (Any, Any))[1]
        for item in value.values():
            refuse_bool_for_number(item, item_type)
    elif isinstance(value, bool) and _is_number_not_bool(annotation):
        raise ValueError(f"{str(value).lower()} is a boolean where a number belongs; write the number itself")
    return value


def coerce_whole_floats(model_cls: type[BaseModel], data: Any) -> Any:
    """Turn ``2.0`` into ``2`` for int fields of ``model_cls`` (recursing into nested configs and lists)."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model_cls.model_fields.items():
        key = field.alias or name
        if key not in out:
            continue
        value = out[key]
        if isinstance(value, float) and value.is_integer() and _accepts_int_not_float(field.annotation):
            out[key] = int(value)
        elif isinstance(value, list) and typing.get_origin(field.annotation) is list:
            (item_type,) = typing.get_args(field.annotation) or (Any,)
            if item_type is int:
                out[key] = [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
    return out


class _Settings(BaseModel):
    """What every block of settings shares: unknown keys are errors, numbers are finite (no inf / nan anywhere) and
    never booleans, KFP's whole floats are ints again, values are immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _coerce_kfp_floats(cls, data: Any) -> Any:
        return coerce_whole_floats(cls, data)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool_for_number(value, cls.model_fields[str(info.field_name)].annotation)


class StageConfig(_Settings):
    """Stage settings (a stage's section of a preset): the shared strictness plus the seed and the bad-record
    policy."""

    seed: int = Field(0, ge=0, lt=2**32, description="Seed for every random choice the stage makes (0 to 2**32-1).")
    on_bad_record: Literal["fail", "skip"] = Field(
        "fail",
        description=(
            "A bad record in the stage's data files (sft / eval / rl / preference records: unparsable, missing fields, "
            "missing or undecodable image, empty answer, repeated id): fail = stop before training with every one "
            "listed; skip = train without them, counted per reason in the metrics (data/skipped/<reason>) and listed "
            "in the report. clean_data accounts for lake records itself."
        ),
    )

    @model_validator(mode="after")
    def _pixel_range_can_be_met(self):
        """Every stage that resizes images by a pixel range (min_pixels, max_pixels) needs min <= max."""
        low, high = getattr(self, "min_pixels", None), getattr(self, "max_pixels", None)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            raise ValueError(f"min_pixels={low} > max_pixels={high}; swap or fix them.")
        return self

    def ignored_settings(self) -> list[str]:
        """Settings whose values have no effect in this configuration, each "setting: why" (the runner and preflight
        print them and record them with the run). Contradictions are validation errors instead; stages extend this."""
        return []


class SubConfig(_Settings):
    """A nested block of a stage config (same strictness, same float coercion, no boolean for a number)."""


CHOICE_ERRORS = ("literal_error", "enum")  # a value refused for not being one of the listed words
PATTERN_WORDS: dict[str, str] = {}  # a field's pattern -> what a value must look like, in words (configs add theirs)
SHOWN_VALUE = 200  # characters of a refused value an error repeats


def format_validation_error(section: str, error: Exception, model: type[BaseModel] | None = None) -> str:
    """A pydantic ValidationError rewritten as 'section.field: message' lines a person can act on; with the config's
    `model`, an unknown setting is called one, with the nearest name or where a setting of that name is."""
    from components._shared.platform.unknown_settings import unknown_setting_hint

    errors = getattr(error, "errors", None)
    if not callable(errors):
        return f"{section}: {error}"
    lines = []
    for item in errors():
        where = ".".join(str(p) for p in item.get("loc", ())) or "(config)"
        got = item.get("input")
        if item.get("type") == "extra_forbidden":
            hint = unknown_setting_hint(model, section, tuple(item.get("loc", ()))) if model is not None else ""
            lines.append(f"  {section}.{where}: unknown setting (got {shown(repr(got), SHOWN_VALUE)}){hint}")
            continue
        odd = non_ascii_letters(got) if isinstance(got, str) and item.get("type") in CHOICE_ERRORS else ""
        said = PATTERN_WORDS.get((item.get("ctx") or {}).get("pattern", ""), "")
        message = f"should be {said}" if item.get("type") == "string_pattern_mismatch" and said else item.get("msg")
        lines.append(f"  {section}.{where}: {message} (got {shown(repr(got), SHOWN_VALUE)}{odd})")
    return f"Invalid config for stage '{section}':\n" + "\n".join(lines)
