"""What a name (an MLflow experiment, a KFP run, a file named in dataset.yaml) must not hold: characters that make
it read as another name, or as two lines."""

from __future__ import annotations

import unicodedata

# Letters and marks that draw nothing: a name holding one reads as another name (ninth hostile pass).
_BLANK_LOOKING = frozenset("\u034f\u115f\u1160\u2800\u3164\uffa0")


def hidden_in_name(text: str) -> str:
    """The first character a name (an experiment, a run, a file in dataset.yaml) must not hold, described, or "":
    control characters (C0, C1), invisible formatting (Unicode Cf: zero-width, direction marks), line and paragraph
    separators, spaces other than U+0020 and letters that draw nothing (Hangul fillers, the grapheme joiner)."""
    for c in text:
        category = unicodedata.category(c)
        if category in ("Cc", "Cf", "Zl", "Zp") or (category == "Zs" and c != " ") or c in _BLANK_LOOKING:
            kind = {"Cc": "a control character", "Cf": "an invisible formatting character"}.get(
                category, "a character that draws nothing"
            )
            return f"{kind} ({unicodedata.name(c, f'U+{ord(c):04X}')})"
    return ""
