"""What a name (an MLflow experiment, a KFP run, a file named in dataset.yaml) must not hold: characters that make
it read as another name, or as two lines."""

from __future__ import annotations

import unicodedata

# Letters and marks that draw nothing: a name holding one reads as another name (ninth and tenth hostile passes):
# the grapheme joiner, Hangul fillers, the Braille blank, Khmer's inherent vowels, Mongolian free variation selectors.
_BLANK_LOOKING = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u2800\u3164\uffa0")


def draws_nothing(c: str) -> bool:
    """Whether a character shows nothing by itself: invisible formatting (Cf: zero-width, direction marks, tags),
    variation selectors (they only pick the look of the character before them) and the blank-drawing letters."""
    code = ord(c)
    return (
        unicodedata.category(c) == "Cf" or 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF or c in _BLANK_LOOKING
    )


def hidden_in_name(text: str) -> str:
    """The first character a name (an experiment, a run, a file in dataset.yaml) must not hold, described, or "":
    control characters (C0, C1), invisible formatting (Unicode Cf: zero-width, direction marks), line and paragraph
    separators, spaces other than U+0020, variation selectors and letters that draw nothing (Hangul fillers, the
    grapheme joiner)."""
    for c in text:
        category = unicodedata.category(c)
        if category in ("Cc", "Zl", "Zp") or (category == "Zs" and c != " ") or draws_nothing(c):
            kind = {"Cc": "a control character", "Cf": "an invisible formatting character"}.get(
                category, "a character that draws nothing"
            )
            return f"{kind} ({unicodedata.name(c, f'U+{ord(c):04X}')})"
    return ""
