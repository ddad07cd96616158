"""The file names of a raw lake's WebDataset shards: here, below the data and launch layers, because both recognise
a raw lake given where a stage's output or a data directory belongs (the messages then say to clean it first)."""

from __future__ import annotations

from pathlib import Path

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def tar_shards(folder: Path) -> list[str]:
    """The names of the WebDataset tar shards directly in `folder`, sorted."""
    return sorted(p.name for p in folder.glob("*") if p.name.endswith(TAR_SUFFIXES))
