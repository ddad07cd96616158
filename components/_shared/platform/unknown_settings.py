"""What an unknown setting was likely meant to be (thirteenth pass: "Extra inputs are not permitted" named the
setting but not that it is unknown, nor the nearest name or where a setting of that name lives)."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The settings block an annotation holds (a model, or an optional one), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((m for m in map(_model_of, typing.get_args(annotation)) if m is not None), None)
    return None


def _keyed(annotation: Any) -> type[BaseModel] | None:
    """The block a dict of blocks holds per key (kubernetes.stages: one per stage), else None."""
    if typing.get_origin(annotation) is dict:
        return _model_of(typing.get_args(annotation)[1])
    return None


def _block(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The settings block at `path` (names; list indices skipped, a dict of blocks' key taken) under `model`."""
    names = iter(path)
    for name in names:
        field = model.model_fields.get(name)
        if field is None:
            return None
        inner, keyed = _model_of(field.annotation), _keyed(field.annotation)
        if keyed is not None:
            next(names, None)  # the key (a stage's name)
            inner = keyed
        if inner is None:
            return None
        model = inner
    return model


def _all_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, field in model.model_fields.items():
        paths.append((*prefix, name))
        inner, keyed = _model_of(field.annotation), _keyed(field.annotation)
        if inner is not None and len(prefix) < 4:
            paths += _all_paths(inner, (*prefix, name))
        if keyed is not None and len(prefix) < 4:
            paths += _all_paths(keyed, (*prefix, name, f"<{name.removesuffix('s')}>"))  # stages: <stage>
    return paths


def unknown_setting_hint(model: type[BaseModel], section: str, loc: tuple) -> str:
    """ "; did you mean SECTION.X?" / "; a setting of that name is SECTION.Y" and the block's settings, for the
    unknown key at `loc` in a config of `model` ("" where the block cannot be found)."""
    names = [str(p) for p in loc if isinstance(p, str)]
    if not names:
        return ""
    key, parent = names[-1], names[:-1]
    block = _block(model, parent)
    if block is None:
        return ""
    here = sorted(block.model_fields)
    where = ".".join([section, *parent])
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {where}.{close[0]}?"
    elsewhere = [p for p in _all_paths(model) if p[-1] == key]
    if elsewhere:
        return f"; a setting of that name is {section}.{'.'.join(elsewhere[0])}"
    shown = ", ".join(here[:25]) + (", ..." if len(here) > 25 else "")
    return f"; the settings of {where} are: {shown}"
