"""Checks on a data directory's files as wholes (a record's own problems are formats.py's): a training file listed
twice or also held out, and a file a reader cannot read at all (not UTF-8, a damaged Parquet file), named."""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
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
                f"would {'be scored' if role == 'eval' else 'train'} twice. List each file once."
            )
        seen[same_file(path)] = path
    both = sorted(path for path in seen if path in {same_file(p) for p in held_out})
    if both:
        raise ValueError(
            f"{both} are both {role} and held-out (eval) files: the model would train on the questions it is scored "
            "on. Give training and held-out data different files in dataset.yaml (or the stage's file settings)."
        )


def check_distinct_contents(root: Path, role: str, files: list[str], held_out: list[str]) -> None:
    """No two of a training role's files, nor one of them and a held-out file, hold the same bytes under other
    names (a symlink, a hard link, a copy): the records would train twice, or be scored on what trained. Only files
    of equal size are hashed."""
    named = [(path, True) for path in files] + [(path, False) for path in held_out if path not in files]
    by_size: dict[int, list[tuple[str, bool]]] = defaultdict(list)
    for path, training in named:
        full = root / path
        if full.is_file():
            by_size[full.stat().st_size].append((path, training))
    for group in (g for g in by_size.values() if len(g) > 1):
        first: dict[str, tuple[str, bool]] = {}
        for path, training in group:
            digest = _sha256(root / path)
            if digest not in first:
                first[digest] = (path, training)
                continue
            other, other_training = first[digest]
            if training or other_training:
                kind = "the same training records twice" if training and other_training else "held-out records"
                raise ValueError(
                    f"{path!r} and {other!r} ({role} / {'training' if other_training else 'held-out'} files in "
                    f"dataset.yaml or the stage's file settings) hold the same bytes (a link or a copy): {role} "
                    f"would train on {kind}. Name each file once, and hold out a file of its own."
                )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
