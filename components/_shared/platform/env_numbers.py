"""Numbers read from QVL_* environment variables: a value that is not a number is refused naming the variable."""

from __future__ import annotations

import math
import os


def env_number(name: str, default: float, *, minimum: float = 0.0, unit: str = "") -> float:
    """$`name` as a finite number >= `minimum`, `default` when unset or empty; a ValueError naming the variable,
    its value and the default otherwise (read when used, not at import, so the CLI reports it in one line)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum:
        raise ValueError(
            f"environment variable {name}={raw!r} is not a number{f' of {unit}' if unit else ''} >= {minimum:g}; "
            f"give one, or unset it for the default {default:g}"
        )
    return value
