"""What a name (an MLflow experiment, a KFP run, a file named in dataset.yaml, a path) must not hold: characters that
make it read as another name, or as two lines; and the name a missing one was likely meant to be."""

from __future__ import annotations

import unicodedata
from pathlib import Path

# Letters and marks that draw nothing: a name holding one reads as another name (ninth and tenth hostile passes):
# the grapheme joiner, Hangul fillers, the Braille blank, Khmer's inherent vowels, Mongolian free variation selectors.
_BLANK_LOOKING = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u2800\u3164\uffa0")
# Characters drawn as '/' that are letters of one name, not folder separators (tenth hostile pass, CL23): the full-width
# solidus, division and fraction slashes, the big solidus, a box-drawing and a rising diagonal, the Philippine single
# punctuation, the Kangxi radical slash, the combining long solidus overlay.
SLASH_LOOKALIKES = frozenset("\uff0f\u2215\u2044\u29f8\u2571\u27cb\u1735\u2f03\u0338")


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


def non_ascii_letters(text: str) -> str:
    """The letters of `text` outside ASCII, named, as a clause an error adds after a value that should be ASCII (a
    setting's choice, a preset name): "; 'с' is CYRILLIC SMALL LETTER ES (U+0441), not an ASCII letter"; else ""."""
    odd = list(dict.fromkeys(c for c in text if not c.isascii()))[:3]
    if not odd:
        return ""
    named = ", ".join(f"{c!r} is {unicodedata.name(c, 'unnamed')} (U+{ord(c):04X})" for c in odd)
    return f"; {named}, not an ASCII letter: retype it"


def misread_in_path(text: str) -> str:
    """How a path or URI would be read as another one, with the fix, or "": a character a listing does not show
    (hidden_in_name), white space at an edge, a character drawn as '/' that is part of a name."""
    hidden = hidden_in_name(text)
    if hidden or text != text.strip():
        what = f"holds {hidden}" if hidden else "begins or ends with white space"
        return f"{what}, which a listing does not show; retype the path."
    slash = next((c for c in text if c in SLASH_LOOKALIKES), "")
    if slash:
        return (
            f"holds {unicodedata.name(slash)} (U+{ord(slash):04X}), drawn as '/' but a letter of a name, not a folder "
            "separator; write '/' itself (or another character)."
        )
    return ""


def twin_of(path: Path) -> tuple[Path, str] | None:
    """An entry beside a missing `path` whose name is the same letters in another Unicode form (a macOS NFD name) or
    another case (`SFT.jsonl` for `sft.jsonl`: Linux names are case-sensitive), and which of the two; else None."""
    wanted = unicodedata.normalize("NFC", path.name)
    try:
        entries = [e for e in path.parent.iterdir() if e.name != path.name] if path.parent.is_dir() else []
    except OSError:  # an unreadable folder: nothing to suggest
        return None
    forms = [e for e in entries if unicodedata.normalize("NFC", e.name) == wanted]
    if forms:
        return forms[0], "another Unicode form"
    cased = sorted(e for e in entries if unicodedata.normalize("NFC", e.name).casefold() == wanted.casefold())
    return (cased[0], "another case") if cased else None
