"""Multiple-choice options: read from a record (a dict, a list lettered A, B, ... or MMBench's A..E columns), and
shown after the question in MMBench / LLaVA's form unless the question lists them already."""

from __future__ import annotations

import re

from components._shared.data.text_checks import RecordError, check_text

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def choices_of(raw: dict) -> dict[str, str] | None:
    """Multiple-choice options as {letter: text}: a dict, a list (lettered A, B, ...) or MMBench's A..E columns."""
    value = raw.get("choices", raw.get("options"))
    if value is None and all(isinstance(raw.get(c), str) for c in "AB"):
        value = {c: raw[c] for c in _LETTERS[:8] if isinstance(raw.get(c), str) and raw[c].strip()}
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) > len(_LETTERS):
            raise RecordError(f"{len(value)} choices; at most {len(_LETTERS)} options (A to Z) are lettered")
        value = dict(zip(_LETTERS, value, strict=False))
    if not isinstance(value, dict) or len(value) < 2 or not all(isinstance(v, str) for v in value.values()):
        raise RecordError(
            f"choices must be two or more option strings (a list or {{letter: text}}), got {repr(value)[:200]}"
        )
    letters = [str(k).strip().upper() for k in value]
    if not all(letters) or any(not v.strip() for v in value.values()):
        raise RecordError(f"choices {list(value)[:8]} hold a blank option letter or text; give each option both")
    if len(set(letters)) != len(letters):
        raise RecordError(f"choices {list(value)} name an option twice once upper-cased (letters are A, B, ...)")
    return {letter: check_text(v, f"'choices' {k}") for letter, (k, v) in zip(letters, value.items(), strict=True)}


def with_options(question: str, choices: dict[str, str]) -> str:
    """A multiple-choice prompt in MMBench / LLaVA's form, unless the question already lists its options (every one,
    as in `choices`: a question listing other options, or some of them, is a RecordError)."""
    listed = {m.group(1).upper(): _loose(m.group(2)) for m in _LISTED_OPTION.finditer(question)}
    shown = [key for key in choices if key in listed]
    if shown and shown == list(choices) and all(listed[key] == _loose(choices[key]) for key in choices):
        return question
    if shown:
        raise RecordError(
            f"the question lists option(s) {[f'{key}. {listed[key]}' for key in shown][:4]} that are not its "
            f"'choices' {list(choices.items())[:4]}: list every option as in 'choices', or leave them out of the "
            "question (they are added after it)"
        )
    options = "\n".join(f"{key}. {text}" for key, text in choices.items())
    return f"{question}\n{options}\nAnswer with the option's {_key_kind(choices)} from the given choices directly."


_LISTED_OPTION = re.compile(r"(?m)^[ \t]*\(?([A-Za-z0-9]{1,2})[.)]\)?[ \t]+(\S.*)$")  # "A. dog", "(B) cat", "3) red"


def _loose(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".;,")


def _key_kind(choices: dict[str, str]) -> str:
    """What the option keys are, for the prompt: letters (A, B, ...), numbers (1, 2, ...) or labels."""
    if all(len(key) == 1 and key in _LETTERS for key in choices):
        return "letter"
    return "number" if all(key.isascii() and key.isdigit() for key in choices) else "label"
