"""The launcher's variables (torchrun, a PyTorchJob, a TrainJob) checked once, before a stage reads them.

RANK, WORLD_SIZE and the like are read in several places as whole numbers; a value such as `WORLD_SIZE=abc` left
in a shell or a pod spec would otherwise end a stage deep inside with Python's "invalid literal for int()".
"""

from __future__ import annotations

import os

COUNTS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")  # at least 1
INDICES = ("RANK", "LOCAL_RANK", "GROUP_RANK")  # from 0


def _whole(name: str, environ) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit():
        raise ValueError(
            f"environment variable {name}={environ[name]!r} is not a whole number: the launcher (torchrun, the "
            f"PyTorchJob or TrainJob) sets it; unset it for a single-process run, or set a number (e.g. {name}="
            f"{1 if name in COUNTS else 0})"
        )
    return int(raw)


def check(environ=None) -> None:
    """Raise ValueError naming the variable when a launcher variable is not a whole number, a count is 0, or a
    rank is not below its count."""
    environ = os.environ if environ is None else environ
    values = {name: _whole(name, environ) for name in (*COUNTS, *INDICES)}
    for name in COUNTS:
        if values[name] == 0:
            raise ValueError(f"environment variable {name}=0: a run has at least one process; unset it or set >= 1")
    for index, count in (
        ("RANK", "WORLD_SIZE"),
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        ("GROUP_RANK", "GROUP_WORLD_SIZE"),
    ):
        rank, size = values[index], values[count]
        if rank is not None and size is not None and rank >= size:
            raise ValueError(
                f"environment variable {index}={rank} is not below {count}={size}: ranks count from 0, so the "
                f"launcher's variables disagree; unset both for a single-process run"
            )
