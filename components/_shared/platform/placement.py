"""Where an output may go: never inside a stage's committed output, a lake or a data directory.

A file written there joins what the next reader lists: an added file in a committed output fails its
verification (or, unlisted, is read), a folder of Parquet parts in a lake is read as shards, a pipeline file in a
data directory is read as its dataset.yaml (ninth hostile pass). Checked on the path's ancestors, before any work.
"""

from __future__ import annotations

import re
from pathlib import Path

from components._shared.platform.storage import COMMIT_MARKER

DATA_FILES = ("dataset.yaml", "eval.jsonl", "sft.jsonl")  # what makes a folder a data directory (docs/data.md)
STAGE_RESULT = "_stage_result.json"  # launch.result.RESULT_FILE: every stage run writes it, committed or not
SHARD_NAME = re.compile(r"^\d{5,}\.(tar|tar\.gz|tgz)$")  # img2dataset's shard names


def enclosing_input(path: Path) -> tuple[Path, str] | None:
    """The nearest ancestor of `path` (not `path` itself) that readers list as a whole, and what it is."""
    for parent in path.resolve().parents:  # a link is judged by where it leads
        if (parent / COMMIT_MARKER).is_file():
            return parent, f"a stage's committed output (it holds {COMMIT_MARKER})"
        if (parent / STAGE_RESULT).is_file():
            return parent, f"a stage's output, not committed (it holds {STAGE_RESULT}; a rerun of the stage clears it)"
        try:
            names = [p.name for p in parent.iterdir()] if parent.is_dir() else []
        except OSError:  # unreadable: nothing a reader lists from there either
            names = []
        shard = next((n for n in names if SHARD_NAME.match(n)), None)
        if shard is not None:
            return parent, f"a lake (it holds the shard {shard})"
        data = next((n for n in DATA_FILES if n in names), None)
        if data is not None:
            return parent, f"a data directory (it holds {data})"
    return None


def check_outside_inputs(path: Path, flag: str) -> None:
    """Refuse an output path inside a committed output, a lake or a data directory, naming the option and it."""
    found = enclosing_input(path)
    if found is not None:
        where, what = found
        raise ValueError(
            f"{flag} {path} lies inside {where}, {what}; what is written there would be read with it by the next "
            "stage. Give a path outside it (e.g. runs/NAME)."
        )
