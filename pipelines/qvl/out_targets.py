"""What `qvl lake synth --out` and `qvl compile --out` may write over: their own earlier output, never a user's files.

lake synth writes DIR/lake/, DIR/heldout/ and DIR/ground_truth.jsonl over whatever is there, and compile replaces
its target file; so a directory or file that is not one they made before is refused, naming it, before anything
is written (seventh hostile pass: a data directory, a lake and a preset file were written over).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

from components._shared.platform.placement import check_outside_inputs

WORLD_GENERATOR = "components.synth_world"  # world.json's "generator"
COMPILED_KEYS = ("pipelineInfo:", "deploymentSpec:", "schemaVersion:")  # top-level keys of a compiled KFP spec


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_world_dir(directory: Path) -> None:
    """A new or empty directory, or an earlier synthetic world's (its world.json names the generator), outside any
    lake, data directory or committed output."""
    check_outside_inputs(directory, "--out")
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"--out {directory} is a file; give a new or empty directory (e.g. runs/world).")
    entries = sorted(p.name for p in directory.iterdir())
    if not entries:
        return
    marker = directory / "world.json"
    try:
        earlier = marker.is_file() and json.loads(marker.read_text()).get("generator") == WORLD_GENERATOR
    except (ValueError, AttributeError, OSError, RecursionError):
        earlier = False
    if not earlier:
        raise ValueError(
            f"--out {directory} holds files that are not a synthetic world's ({_listed(entries)}); lake synth writes "
            "lake/, heldout/ and ground_truth.jsonl there over what is there. Give a new or empty directory (e.g. "
            "runs/world)."
        )


def check_compile_target(target: Path, preset_file: Path | None) -> None:
    """A new file, or an earlier compiled pipeline; never the preset being compiled."""
    check_outside_inputs(target, "--out")
    if preset_file is not None and target.exists() and target.resolve() == preset_file.resolve():
        raise ValueError(f"--out {target} is the preset being compiled; give another file (e.g. vlm_training.yaml).")
    if not target.exists() or target.is_symlink():  # a link is replaced, not written through (what it names stays)
        return
    if not target.is_file():
        raise ValueError(f"--out {target} is not a file; give a path ending in .yaml.")
    with target.open("r", encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 20)
    if not all(f"\n{key}" in f"\n{head}" for key in COMPILED_KEYS):
        raise ValueError(
            f"--out {target} exists and is not a compiled pipeline (no top-level {', '.join(COMPILED_KEYS)}); compile "
            "replaces its target, so give a new file or an earlier compiled one."
        )


def check_writable(path: Path, flag: str, kind: str = "dir") -> None:
    """Before any work: `path` can be made as a `kind` ("dir" or "file") and written, or a ValueError naming `flag`
    and what to give instead (the OS's own words came late and named no option: seventh hostile pass)."""
    if path.exists() and kind == "dir" and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a new or empty directory (e.g. runs/NAME).")
    if path.exists() and kind == "file" and path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path ending in .yaml.")
    ancestor = path if path.is_dir() else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(
            f"{flag} {path}: {ancestor} is a file, so nothing can be made under it; give a path in a directory."
        )
    try:  # the only sure test of writability (permissions, read-only mounts, immutable files, /proc)
        handle, probe = tempfile.mkstemp(prefix=".qvl-write-check-", dir=ancestor)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        hint = " (read-only file system)" if err.errno == errno.EROFS else ""
        raise ValueError(
            f"{flag} {path}: cannot write in {ancestor}: {reason}{hint}; give a directory you can write to."
        ) from None
