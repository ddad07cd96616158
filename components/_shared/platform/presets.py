"""Preset files and overrides: `extends:` chains, dotted `key=value` overrides, validation with a fixable message.

A config file is either a preset (one section per stage; a stage's section is used) or a bare stage section.
`key=value` overrides use dotted paths (`optim.lr=2e-5`); values are parsed as YAML scalars.
"""

from __future__ import annotations

import difflib
import math
import re
import unicodedata
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from components._shared.platform import strict_yaml
from components._shared.platform.config import format_validation_error
from components._shared.platform.credential_shapes import shown
from components._shared.platform.names import non_ascii_letters


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": 1}, "c": "x"}`; a pair without '=', or a setting given twice (`a.b=1 a.b=2`,
    `a=1 a.b=2`), is an error that says so."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # dotted key -> the pair that set it
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"Override '{pair}' is not key=value (example: optim.lr=2e-5).")
        _check_key(key, pair)
        *parents, leaf = key.split(".")
        prefixes = [".".join(parents[: k + 1]) for k in range(len(parents))]
        earlier = given.get(key) or next((given[p] for p in prefixes if p in given), None)
        earlier = earlier or next((v for k, v in given.items() if k.startswith(f"{key}.")), None)
        if earlier is not None:
            raise ValueError(
                f"Override '{shown(pair, 200)}' sets {key!r} again after '{shown(earlier, 200)}' on the same command "
                "line; give each key=value once."
            )
        given[key] = pair
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        try:
            node[leaf] = _scalar(raw)
        except (yaml.YAMLError, ValueError, RecursionError) as error:  # an integer of over 4,300 digits; [[[...]]]
            reason = "nested too deeply" if isinstance(error, RecursionError) else str(error).splitlines()[0]
            raise ValueError(
                f"Override '{shown(pair, 200)}': the value is not valid YAML ({reason}); write key=value with a "
                "number, true/false, a word, a [list] or a quoted string (example: optim.lr=2e-5)."
            ) from None
        _check_flow_keys(node[leaf], pair)
    return out


def _check_flow_keys(value: Any, pair: str) -> None:
    """`{efficacy:1}` is one key 'efficacy:1' with no value in YAML (the space after ':' makes a pair): said as
    that, where validation would call 'efficacy:1' a setting that is not a number (thirteenth pass, R03)."""
    if not isinstance(value, dict):
        return
    for key, item in value.items():
        if item is None and isinstance(key, str) and re.fullmatch(r"[\w.-]+:\S.*", key) and "://" not in key:
            name, _, rest = key.partition(":")
            raise ValueError(
                f"Override '{shown(pair, 200)}': {{{key}}} reads in YAML as one key {key!r} with no value; put a "
                f"space after the colon: {{{name}: {rest}}}."
            )
        _check_flow_keys(item, pair)


def _check_key(key: str, pair: str) -> None:
    """A dotted key of ASCII names: an empty part (`train..steps`) or a look-alike letter (Cyrillic 'а' in `trаin`)
    is named, where validation would only call the setting unknown."""
    parts = key.split(".")
    if not all(p.strip() for p in parts):
        raise ValueError(
            f"Override '{shown(pair, 200)}': the key {key!r} has an empty part (two dots, or one at an end); write "
            "key=value with dotted setting names, e.g. train.steps=3."
        )
    if any(c.isspace() for c in key):
        raise ValueError(
            f"Override '{shown(pair, 200)}': the key {key!r} holds a space; write key=value with no spaces around "
            "'=' or inside the name (e.g. train.steps=3)."
        )
    odd = next((c for c in key if not c.isascii()), None)
    if odd is not None:
        raise ValueError(
            f"Override '{shown(pair, 200)}': the key holds {odd!r} ({unicodedata.name(odd, f'U+{ord(odd):04X}')}), "
            "not an ASCII letter; setting names are ASCII: retype the key (key=value, e.g. train.steps=3)."
        )
    index = next((p for p in parts[1:] if p.strip().isdigit()), None)
    if index is not None:
        whole = key.split(f".{index}")[0]
        raise ValueError(
            f"Override '{shown(pair, 200)}': {index!r} indexes the list {whole!r}; a list setting is given whole as "
            f"key=value (e.g. {whole}=[...], the full list in YAML flow style)."
        )


def _scalar(raw: str) -> Any:
    """A YAML scalar, with `2e-5` read as a number (YAML 1.1 wants `2.0e-5`)."""
    value = yaml.load(raw, Loader=strict_yaml.StrictLoader)  # noqa: S506 - safe: a SafeLoader subclass
    strict_yaml.refuse_loops(value, "the value", set())  # `&a {x: *a}` would recurse through every reader
    if isinstance(value, str) and "_" not in value:  # Python's float() reads 1_0 as 10
        try:
            number = float(value)
        except ValueError:
            return value
        if number == 0 and any(c in "123456789" for c in value.partition("e")[0].partition("E")[0]):
            raise ValueError(f"{value!r} is too small for a float (it reads as 0)")
        if math.isinf(number) and "inf" not in value.lower():
            raise ValueError(f"{value!r} is too large for a float (it reads as infinity)")
        return number
    return value


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `update` merged in (nested dicts merged, other values replaced)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merged_map_notes(base: dict[str, Any], pairs: list[str]) -> list[str]:
    """A note per override that gives a whole map (`rewards={efficacy: 1}`) where the config already has one with
    other keys: the map is merged, not replaced, so those keys keep their values (fourteenth pass, K04)."""
    notes = []
    for pair in pairs:
        key, _, raw = pair.partition("=")
        if not raw.lstrip().startswith("{"):
            continue
        node: Any = base
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        given = parse_overrides([pair])
        for part in key.split("."):
            given = given[part]
        if isinstance(node, dict) and isinstance(given, dict):
            kept = {k: v for k, v in node.items() if k not in given}
            if kept:
                listed = ", ".join(f"{k}={v}" for k, v in list(kept.items())[:6])
                notes.append(
                    f"{key}={shown(raw, 80)} is merged into the config's {key}, not put in its place: {listed} "
                    f"{'stay' if len(kept) > 1 else 'stays'} as given there; set {key}.NAME=... to change one."
                )
    return notes


# A preset's settings beside its stage sections (pipelines/presets reads the same set).
PRESET_TOP_LEVEL = frozenset({"description", "base_model_uri", "experiment", "lake_uri", "kubernetes"})


def read_section(config_file: Path | None, section: str, sections: Collection[str] = ()) -> dict[str, Any]:
    """The stage section of a preset file, or the whole file when it is a bare section. A file holding any of
    `sections` (the stage names) or a preset's top-level settings is a preset: a key that is neither (a misspelled
    section, a stage's setting left at the top) is an error naming it, never ignored."""
    if config_file is None:
        return {}
    data = read_preset_yaml(Path(config_file))
    known = set(sections) | PRESET_TOP_LEVEL
    if sections and set(data) & known:
        unknown = sorted(set(data) - known - {"stages"})
        if unknown:
            close = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
            hints = "; ".join(f"{k!r}: did you mean {c[0]!r}?" for k, c in close.items() if c)
            raise ValueError(
                f"{config_file}: unknown section(s) {unknown} in a preset{f' ({hints})' if hints else ''}. A preset "
                f"holds stage sections {sorted(sections)} and {sorted(PRESET_TOP_LEVEL)}; a stage's settings go "
                "inside its section."
            )
    found = data
    if section in data:
        found = data[section] or {}
    elif isinstance(data.get("stages"), dict) and section in data["stages"]:
        found = data["stages"][section] or {}
    elif sections and set(data) & PRESET_TOP_LEVEL:
        found = {}  # a preset without this stage's section: the stage's defaults, as the DAG runs it
    elif sections and set(data) & known:  # only other stages' sections: the wrong file, or a misnamed section
        raise ValueError(
            f"{config_file} has no '{section}' section (it has: {', '.join(sorted(set(data) & known))}); give a "
            f"file with a {section}: section (a preset), or the {section} settings alone."
        )
    if not isinstance(found, dict):
        raise ValueError(f"{config_file}: the '{section}' section must be a mapping of settings, got {found!r:.80}.")
    return found


# The shipped presets (pipelines/presets/, installed beside components/): found by path, not imported, since the
# platform layer imports nothing of pipelines/.
SHIPPED_PRESETS = Path(__file__).resolve().parents[3] / "pipelines" / "presets"


def not_a_file(path: Path) -> str:
    """What an existing path that is no regular file is, as an error says it after "is"."""
    return "a directory, not a file" if path.is_dir() else "not a regular file (a pipe or a device)"


def read_preset_yaml(
    path: Path, seen: tuple[Path, ...] = (), search: tuple[Path, ...] = (SHIPPED_PRESETS,)
) -> dict[str, Any]:
    """A YAML config file merged over the file its `extends: NAME` names (NAME.yaml beside it, else in a `search`
    folder, by default the shipped presets; recursive), so a preset can start from another one and change only some
    settings. A chain that comes back to a file it passed is an error naming the chain."""
    if path.resolve() in seen:
        chain = " -> ".join(p.stem for p in (*seen, path.resolve()))
        raise ValueError(
            f"presets extend each other in a cycle: {chain} ({path.resolve()}); remove one of these `extends:`."
        )
    if path.exists() and not path.is_file():  # a pipe would block the read for ever; a directory is an IsADirectory
        raise ValueError(f"{path} is {not_a_file(path)}; give the YAML file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8.") from None
    data = strict_yaml.load(text, str(path))
    if data is None:
        raise ValueError(
            f"{path} holds no settings (it is empty or only comments); give the settings, or leave the file out "
            "(the defaults)."
        )
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level.")
    if "extends" in data and data["extends"] is None:
        raise ValueError(
            f"{path}: extends: is empty (null); name the preset this one builds on (e.g. `extends: tiny`), or remove "
            "the line."
        )
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent.strip() or len(parent) > 255 or "\x00" in parent:
        shown = repr(parent) if len(repr(parent)) <= 80 else f"{repr(parent)[:60]}... ({len(str(parent))} characters)"
        raise ValueError(f"{path}: extends: {shown} is not a preset name or file name; give e.g. `extends: tiny`.")
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", parent):  # would be looked up as a file named 'https:/...'
        raise ValueError(
            f"{path}: extends: {parent!r} is a URL; presets extend a preset name or a local file only (nothing is "
            "fetched): download it beside this preset and give its file name."
        )
    names = [parent] if parent.endswith((".yaml", ".yml")) else [f"{parent}.yaml", *([parent] if "/" in parent else [])]
    candidates = list(dict.fromkeys(folder / name for folder in (path.parent, *search) for name in names))
    parent_path = next((c for c in candidates if c.exists()), None)
    if parent_path is not None and not parent_path.is_file():
        raise ValueError(f"{path}: extends '{parent}', which names {str(parent_path)!r}: {not_a_file(parent_path)}.")
    if parent_path is None:
        raise ValueError(
            f"{path}: extends '{parent}', but none of {[str(c) for c in candidates]} exists{non_ascii_letters(parent)}."
        )
    base = read_preset_yaml(parent_path, (*seen, path.resolve()), search)
    emptied = sorted(key for key, value in data.items() if value is None and isinstance(base.get(key), dict))
    if emptied:
        raise ValueError(
            f"{path}: {emptied} empty (null: its lines commented out?), which would replace the whole section of "
            f"{parent!r} with the defaults; remove the line to keep the section as it is, or give the settings to "
            "change."
        )
    return deep_merge(base, data)


def validate(config_cls, section: str, data: dict[str, Any]):
    """Build the config, turning a pydantic error into one that names the setting and how to fix it."""
    from pydantic import ValidationError

    try:
        return config_cls.model_validate(data)
    except ValidationError as err:
        raise ValueError(format_validation_error(section, err, config_cls)) from None
