"""Checks on a data directory's files as wholes (a record's own problems are formats.py's): a training file listed
twice or also held out, and a file a reader cannot read at all (not UTF-8, a damaged Parquet file), named."""

from __future__ import annotations

import os
from pathlib import Path

TRAINING_ROLES = ("sft", "rl", "preferences")


def same_file(path: str) -> str:
    """A data file's path as one string however it is spelled (`./a.jsonl`, `x/../a.jsonl`: `a.jsonl`)."""
    return os.path.normpath(path)


def check_training_files(role: str, files: list[str], held_out: list[str]) -> None:
    """A training role's file listed twice (its records would train twice) or also held out is refused."""
    seen: dict[str, str] = {}
    for path in files:
        if same_file(path) in seen:
            raise ValueError(
                f"dataset.yaml's {role} files name {path!r} twice (also as {seen[same_file(path)]!r}): its records "
                "would train twice. List each file once."
            )
        seen[same_file(path)] = path
    both = sorted(path for path in seen if path in {same_file(p) for p in held_out})
    if both:
        raise ValueError(
            f"{both} are both {role} and held-out (eval) files: the model would train on the questions it is scored "
            "on. Give training and held-out data different files in dataset.yaml (or the stage's file settings)."
        )


def naming_the_file(items, path: Path, shown: str):
    """A reader's failure on the file as a whole (not on one record: those are the records' errors) as one error
    naming the file: invalid UTF-8 in a benchmark's JSON or TSV, a damaged or cut Parquet file."""
    from pyarrow import ArrowException

    try:
        yield from items
    except UnicodeDecodeError as error:
        whole = path.is_file() and len(error.object) == path.stat().st_size
        number = bytes(error.object[: error.start]).count(b"\n") + 1
        line = f":{number}" if whole else ""
        bad = bytes(error.object[error.start : error.start + 1])
        raise ValueError(f"{shown}{line}: not UTF-8 text (byte {bad!r}); re-encode the file as UTF-8.") from None
    except (OSError, ArrowException) as error:
        said = " ".join(str(error).split())
        raise ValueError(f"{shown}: unreadable ({said}); the file is damaged or cut short: fetch it again.") from None
