"""A write that fails on a full volume is one error naming the place and the space left.

torch.save on a full disk says `[enforce fail at inline_container.cc:672] . unexpected pos 791893376 vs 791893264`
(DeepSpeed's checkpoints go through it), safetensors and json writes say `No space left on device` without the
path: neither tells a user which volume to grow. `writing(directory, what)` wraps a stage's checkpoint and export
writes and re-raises such a failure as `DiskFull` (an OSError: the command line prints it as one `error:` line).
`write_text_atomic` writes a small file whole or not at all: a result file cut at 0 bytes read as a crash.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

NEARLY_FULL_BYTES = 64 << 20  # a failed write with less than this left on its volume is blamed on the space
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class DiskFull(OSError):
    """A write failed because the volume (or the quota) holding it is full."""


def free_bytes(path: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the volume holding `path` (its nearest existing parent), or None if unknown."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    return usage.free, usage.total


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _caused_by_space(error: BaseException, space: tuple[int, int] | None) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    return space is not None and space[0] < NEARLY_FULL_BYTES


def explain(error: BaseException, path: Path, what: str) -> DiskFull | None:
    """A DiskFull naming `path` when `error` came from a full volume, else None."""
    if not isinstance(error, OSError | RuntimeError) or isinstance(error, DiskFull):
        return None
    space = free_bytes(path)
    if not _caused_by_space(error, space):
        return None
    left = f" ({_gb(space[0])} free of {_gb(space[1])})" if space else ""
    full = DiskFull(
        f"{what}: writing {path} failed: the volume holding it is full{left}. Free space there or point the "
        f"stage's output / checkpoint location at a larger volume; nothing of this write was committed. "
        f"(the writer said: {str(error)[:200]})"
    )
    full.errno = errno.ENOSPC
    return full


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """Inside the block, a write failure caused by a full volume becomes `DiskFull` naming `path` and `what`."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        full = explain(error, Path(path), what)
        if full is None:
            raise
        raise full from error


def write_text_atomic(path: str | Path, text: str) -> None:
    """`path` holds `text` whole or keeps what it held: written beside it, then renamed over it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with writing(path.parent, f"writing {path.name}"):
            with open(partial, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
