"""User mistakes end a command with one message, not a traceback.

    with reported(debug=args.debug, log_file=OUT / "_stage_result.json"):
        ...the command...

A bad setting, record, path or model is raised as ValueError (pydantic's ValidationError, RecordError,
IntegrityError, NonFiniteTraining are ValueErrors), OSError (missing or unwritable files, S3 refused or
unreachable) or a lock error; those print `error: <message>` and exit 2. Anything else is a defect of this
project and keeps its traceback. `--debug` (or QVL_DEBUG=1) shows the traceback for every error.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from components._shared.platform.credential_shapes import shown
from components._shared.platform.locks import LockHeld, OutputUnusable

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, LockHeld, OutputUnusable)
MAX_MESSAGE = 4000  # characters: an error about a huge input must not flood the terminal
EXIT_USER_ERROR = 2


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get("QVL_DEBUG", "").strip().lower() in ("1", "true", "yes")


def message(err: BaseException) -> str:
    """The error's text, capped at MAX_MESSAGE characters."""
    text = str(err) or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{text} ({err.filename})"
    return shown(text, MAX_MESSAGE)  # a token typed where a setting or path belongs is never printed back


@contextlib.contextmanager
def reported(*, debug: bool = False, log_file: Path | None = None) -> Iterator[None]:
    """Turn a user error raised inside into `error: ...` on stderr and exit code 2 (unless debugging); names
    `log_file` as the place of the traceback when it exists by then."""
    started = time.time()
    try:
        yield
    except USER_ERRORS as err:
        if debug_enabled(debug):
            raise
        written = log_file is not None and log_file.is_file() and log_file.stat().st_mtime >= started - 1
        hint = f" The traceback is in {log_file}." if written else ""
        print(f"error: {message(err)}\n(rerun with --debug or QVL_DEBUG=1 for the traceback.{hint})", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    except KeyboardInterrupt:
        if debug_enabled(debug):
            raise
        print("interrupted.", file=sys.stderr)
        raise SystemExit(130) from None
