"""Record ids: what an id may be, and when two ids are one to a reader.

An id is a string or an integer (anything else would be written out as its Python repr, matching nothing in the
user's other files). Two ids that differ only in white space, invisible characters, Unicode form or look-alike letters
of another script (Cyrillic "а" for Latin "a") are one id. The look-alikes are the Cyrillic and Greek letters that
Unicode's confusables table (TR39) maps to a single Latin letter; Python ships no copy of that table, so the ones that
matter for ids are written out here.
"""

from __future__ import annotations

import unicodedata

from components._shared.data.text_checks import RecordError
from components._shared.platform.names import draws_nothing, hidden_in_name

ID_FIELDS = ("id", "question_id", "questionId", "image_id")
LOOK_ALIKES = str.maketrans(
    {
        **dict(zip("аеорсухіјѕԁԛԝѵӏ", "aeopcyxijsdqwvl", strict=True)),  # Cyrillic lower case
        **dict(zip("АВЕКМНОРСТХУІЈЅ", "ABEKMHOPCTXYIJS", strict=True)),  # Cyrillic capitals
        **dict(zip("οιν", "oiv", strict=True)),  # Greek lower case
        **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧ", "ABEZHIKMNOPTYX", strict=True)),  # Greek capitals
    }
)


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
        hidden = hidden_in_name(value)
        if hidden:  # a direction override shows the id reversed in every message and report (tenth pass)
            raise RecordError(f"'{name}' {value!r} holds {hidden}, which shows it as another id; retype the id")


def id_as_seen(record_id: str) -> str:
    """An id as a reader sees it: NFKC form, no invisible format characters, no surrounding white space, look-alike
    Cyrillic and Greek letters read as the Latin ones (two ids that differ only there are one id to anyone reading
    the results)."""
    folded = unicodedata.normalize("NFKC", record_id)
    return "".join(c for c in folded if not draws_nothing(c)).strip().translate(LOOK_ALIKES)


def said_twice(record_id: str, first: str) -> str:
    """The error for an id seen before (`first`: as it was written then)."""
    if first == record_id:
        return f"id {record_id!r} appears more than once; ids must be unique"
    odd = next((c for c in record_id if ord(c) > 127 and c.translate(LOOK_ALIKES) != c), None)
    alike = f"; {odd!r} is {unicodedata.name(odd, 'a look-alike letter')}" if odd else ""
    return (
        f"id {record_id!r} appears more than once (as {first!r}: they differ only in white space, invisible / "
        f"Unicode-form characters or look-alike letters{alike}); ids must be unique"
    )
