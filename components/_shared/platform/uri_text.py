"""How a location reads in an error, and what resolving a local one can trip on (storage.check_location uses both)."""

from __future__ import annotations

import errno
import re
from pathlib import Path


def shown(uri: str | Path) -> str:
    """`uri` as an error may print it: a URL's query and any `user:password@` hidden (they can hold credentials)."""
    text = re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@", r"\1<credentials hidden>@", str(uri))
    base, query_mark, _ = text.partition("?")
    return base + ("?<query hidden>" if query_mark else "")


def symlink_loop(path: str) -> str | None:
    """Why the local `path` cannot be resolved (a symbolic link that leads back to itself), else None. Python 3.11's
    `Path.resolve()` raises RuntimeError for it (3.13: OSError ELOOP), which no reader downstream expects."""
    try:
        Path(path).resolve()
    except RuntimeError as err:
        cause = str(err)
    except OSError as err:
        if err.errno != errno.ELOOP:
            return None
        cause = str(err.strerror)
    else:
        return None
    return f"a symbolic link loop ({cause}): a link there leads back to itself; point it at a real file or folder."
