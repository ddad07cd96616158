"""Builtin models that ship with the package, so a fresh machine trains no helper model and gets the same bytes.

A builtin whose build is slow (tiny-clip: ~20 minutes of contrastive training on 2 cores) and not bit-identical
across machines (float reductions differ with the CPU and its thread count) is built once by its recipe, then
committed under `components/synth_world/shipped_models/<name>/` with `SHIPPED.json`: the recipe key it was built for
(builtin_models.recipe_version) and the sha256 of every file. `materialize` copies it into the cache, checking
every checksum; a shipped copy built for another recipe key is never used (the builtin is then built by its
recipe, and tests/unit/test_builtin_models.py fails until the copy is refreshed with
`qvl models ship NAME`). The fast builtins (the tiny Qwen models: a seeded init, seconds) are built, not shipped.

The key hashes the code of world.py, lake.py and tokenizer.py, so an edit there that leaves every builtin's inputs as
they were (2026-12-06: the lake's JSON gained `noun_chunks`) changes the key and not what a build would make. Then
the shipped copy is re-keyed (SHIPPED.json's `recipe_key`) once the inputs are shown unchanged: the CLIP's train,
calibration and test pairs (pixels and captions) and the world tokenizer's vocabulary hashed the same under the old
and the new code (sha256 f1a68286...).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

SHIPPED_DIR = Path(__file__).parent / "shipped_models"
SHIPPED_FILE = "SHIPPED.json"
SHIPPED_NAMES: tuple[str, ...] = ("tiny-clip",)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_key(name: str) -> str | None:
    """The recipe key the shipped copy of `name` was built for, or None when none ships."""
    record = SHIPPED_DIR / name / SHIPPED_FILE
    return json.loads(record.read_text())["recipe_key"] if record.is_file() else None


def materialize(name: str, key: str, dest_dir: Path) -> bool:
    """Copy the shipped `name` into the empty `dest_dir` when it was built for `key`; False when it was not.

    A file whose checksum differs from SHIPPED.json is an error (a damaged install), never used.
    """
    source = SHIPPED_DIR / name
    if shipped_key(name) != key:
        return False
    record = json.loads((source / SHIPPED_FILE).read_text())
    for file_name, digest in record["files"].items():
        if _sha256(source / file_name) != digest:
            raise ValueError(
                f"Shipped builtin {name}: {source / file_name} does not match its sha256 in {SHIPPED_FILE}; "
                "reinstall the package (or `qvl models ship` it anew)."
            )
        shutil.copyfile(source / file_name, Path(dest_dir) / file_name)
    return True


def ship(name: str, built_dir: Path, key: str) -> Path:
    """Replace the shipped copy of `name` with the model built at `built_dir` for recipe key `key`."""
    target = SHIPPED_DIR / name
    files = sorted(p for p in Path(built_dir).iterdir() if p.is_file() and p.name != SHIPPED_FILE)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in files:
        shutil.copyfile(path, target / path.name)
    record = {"name": name, "recipe_key": key, "files": {p.name: _sha256(target / p.name) for p in files}}
    (target / SHIPPED_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return target
