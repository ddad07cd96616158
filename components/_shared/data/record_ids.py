"""Record ids: what an id may be, and when two ids are one to a reader.

An id is a string or an integer (anything else would be written out as its Python repr, matching nothing in the
user's other files). Two ids that differ only in white space, invisible characters or Unicode form are one id; an id
that mixes Latin, Cyrillic or Greek letters is refused, since a look-alike letter (Cyrillic "а" for Latin "a") makes two
ids that read the same and no confusables table (Unicode TR39) ships with Python to merge them.
"""

from __future__ import annotations

import unicodedata

from components._shared.data.text_checks import RecordError

CONFUSABLE_SCRIPTS = ("LATIN", "CYRILLIC", "GREEK")  # scripts whose letters stand in for each other
ID_FIELDS = ("id", "question_id", "questionId", "image_id")


def check_ids(raw: dict) -> None:
    """A record's id fields are strings or integers: an object, list, float or boolean id would be written out
    as its Python repr, never matching what the user's other files call the record."""
    for name in ID_FIELDS:
        value = raw.get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            continue
        if not isinstance(value, str):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise RecordError(f"'{name}' must be a string or an integer, got {type(value).__name__} {shown}")
        if not value.strip():
            raise RecordError(f"'{name}' is empty; give each record an id (a string or an integer)")
        _check_one_script(name, value)


def _check_one_script(name: str, value: str) -> None:
    scripts: dict[str, str] = {}  # script -> its first letter in the id
    for char in value:
        if char.isalpha():
            script = unicodedata.name(char, "").split(" ")[0]
            if script in CONFUSABLE_SCRIPTS:
                scripts.setdefault(script, char)
    if len(scripts) > 1:
        letters = ", ".join(f"{c!r} ({s.title()}, U+{ord(c):04X})" for s, c in scripts.items())
        raise RecordError(
            f"'{name}' {value!r} mixes letters of {' and '.join(s.title() for s in scripts)} ({letters}): a look-alike "
            "letter makes two ids that read the same; write the id in one script"
        )


def id_as_seen(record_id: str) -> str:
    """An id as a reader sees it: NFKC form, no invisible format characters, no surrounding white space (two ids
    that differ only there are one id to anyone reading the results)."""
    folded = unicodedata.normalize("NFKC", record_id)
    return "".join(c for c in folded if unicodedata.category(c) != "Cf").strip()


def said_twice(record_id: str, first: str) -> str:
    """The error for an id seen before (`first`: as it was written then)."""
    if first == record_id:
        return f"id {record_id!r} appears more than once; ids must be unique"
    return (
        f"id {record_id!r} appears more than once (as {first!r}: they differ only in white space or invisible / "
        "Unicode-form characters); ids must be unique"
    )
