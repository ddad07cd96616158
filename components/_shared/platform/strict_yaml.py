"""YAML as configs need it: PyYAML's safe loader without the two ways a file can say something else than it looks
like. A key given twice is an error (safe_load keeps the last one silently), and aliases (`*name`, which presets
use to share a Kubernetes profile) may not expand the document past MAX_EXPANDED_NODES (a 449-byte file of nested
aliases expands to hundreds of millions of characters). Errors are capped in length.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

MAX_ERROR_CHARS = 2000
MAX_EXPANDED_NODES = 100_000


def _expanded_size(node, memo: dict[int, int]) -> int:
    """Nodes of the document with every alias expanded (each distinct node measured once)."""
    key = id(node)
    if key not in memo:
        memo[key] = 1  # a node inside itself (a recursive alias) counts once
        if isinstance(node, yaml.SequenceNode):
            memo[key] = 1 + sum(_expanded_size(child, memo) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            memo[key] = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    return memo[key]


class StrictLoader(yaml.SafeLoader):
    def get_single_node(self):
        node = super().get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_EXPANDED_NODES:
            raise yaml.constructor.ConstructorError(
                None, None, f"its aliases expand it past {MAX_EXPANDED_NODES:,} nodes; write it out", node.start_mark
            )
        return node

    def construct_yaml_int(self, node):
        """YAML 1.1's readings of numbers that do not look like them are refused: `010` (octal 8) and `1:30`
        (base 60, 90); decimal, `0x` hex and `0b` binary read as they do."""
        if "_" in str(node.value):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{node.value!r} reads as {super().construct_yaml_int(node)} in YAML 1.1 (its '_' are dropped); write "
                "the number without '_', or quote it as text",
                node.start_mark,
            )
        text = str(node.value).lstrip("+-")
        if ":" in text or (len(text) > 1 and text.startswith("0") and text.isdigit()):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{node.value!r} reads as {super().construct_yaml_int(node)} in YAML 1.1 (octal or base 60); write the "
                "number without a leading zero or colon, or quote it as text",
                node.start_mark,
            )
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        """Refused: base 60 (`1:30.5`), '_' (dropped: `0.000_1` is 0.0001), and a number too small or too large
        for a float (`1.0e-400` would read as 0, `1.0e400` as infinity; `.inf` is written as such)."""
        text = str(node.value)
        why = None
        if ":" in text:
            why = "reads as a base-60 number in YAML 1.1; write it in decimal"
        elif "_" in text:
            why = "has '_', which YAML 1.1 drops; write the number without '_', or quote it as text"
        value = super().construct_yaml_float(node) if why is None else 0.0
        mantissa = text.lower().partition("e")[0]
        if why is None and value == 0 and any(c in "123456789" for c in mantissa):
            why = "is too small for a float (it reads as 0); write 0, or a number a float holds (>= 1e-308)"
        elif why is None and math.isinf(value) and "inf" not in text.lower():
            why = "is too large for a float (it reads as infinity); write a number a float holds (< 1.8e308)"
        if why is not None:
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} {why}", node.start_mark)
        return value

    def construct_merge(self, node):
        raise yaml.constructor.ConstructorError(
            None,
            None,
            "YAML merge keys (<<) are not read here; write the settings out (or use extends:)",
            node.start_mark,
        )

    def construct_yaml_bool(self, node):
        """Only true/false are booleans: YAML 1.1's yes/no/on/off stay the words typed (`mode=yes` was read as true
        and refused as a boolean where the user wrote a word)."""
        if str(node.value).lower() in ("true", "false"):
            return super().construct_yaml_bool(node)
        return self.construct_scalar(node)

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict):
                continue  # unhashable: the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
StrictLoader.add_constructor("tag:yaml.org,2002:bool", StrictLoader.construct_yaml_bool)
StrictLoader.add_constructor("tag:yaml.org,2002:merge", StrictLoader.construct_merge)


def load(text: str, where: str) -> Any:
    """The YAML (or JSON) document in `text`; a ValueError naming `where` and the line for anything wrong."""
    try:
        value = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
        refuse_loops(value, where, set())
        return value
    except yaml.YAMLError as error:
        message = " ".join(str(error).split())
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + f"... ({len(message) - MAX_ERROR_CHARS} more characters)"
        raise ValueError(f"{where}: not a valid config ({message})") from None
    except RecursionError:  # the parser and composer recurse once per level of nesting
        raise ValueError(f"{where}: nested too deeply to be a config (thousands of levels); flatten it") from None


def refuse_loops(value: Any, where: str, holding: set[int]) -> None:
    """A ValueError when an alias refers to a mapping or list that holds it (`a: &x {b: *x}`): an endless value no
    setting takes, which every reader walking it would recurse into without end."""
    if not isinstance(value, dict | list):
        return
    if id(value) in holding:
        raise ValueError(f"{where}: an alias refers to the mapping or list that holds it (a loop); write the value out")
    holding.add(id(value))
    for item in value.values() if isinstance(value, dict) else value:
        refuse_loops(item, where, holding)
    holding.discard(id(value))


class KeyGivenTwice(ValueError):
    """A JSON object names a key twice (json keeps the last silently; other readers the first)."""


def json_object(pairs: list[tuple[str, Any]]) -> dict:
    """`object_pairs_hook` for json.loads that refuses a key given twice, as `load` does for YAML."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise KeyGivenTwice(f"the key {key!r} is given twice in one object")
            seen.add(key)
    return record
