"""What a bad record in a stage's data files does: `on_bad_record: fail` (default) or `skip`.

    with bad_records.policy(cfg.on_bad_record) as ledger:   # runner.execute, around the stage
        ...data/datasets.py reads files: under `fail` it raises with every bad record listed; under `skip` it
           drops them and calls ledger.skip(...)...
    metrics.update(ledger.metrics())    # data/skipped_records, data/skipped/<reason>

Skipped records are never silent: counted per reason in the metrics, listed (first MAX_LISTED) in the report
(model/stage_steps.finish_report). A record read twice (preflight, then the stage) is counted once.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

MAX_LISTED = 20

# reason -> the pattern that identifies it in a reader's message (first match wins; else "invalid_fields")
_REASONS = (
    ("not_utf8", r"UTF-8"),
    ("invalid_json", r"not valid JSON"),
    ("not_an_object", r"not a record object"),
    ("duplicate_id", r"more than once"),
    ("identical_pair", r"chosen and rejected are the same text"),
    ("too_long", r"tokens \(text \+ visual\), more than"),
    ("box", r"^box "),
    ("image", r"image"),
    ("empty", r"(?<!non-)\bempty\b"),  # "is empty", not "must be a non-empty string" (a wrong type)
)


def reason_of(message: str) -> str:
    for reason, pattern in _REASONS:
        if re.search(pattern, message):
            return reason
    return "invalid_fields"


@dataclass
class Ledger:
    policy: str = "fail"
    skipped: dict[str, tuple[str, str]] = field(default_factory=dict)  # "file:line" -> (reason, message)

    @property
    def skipping(self) -> bool:
        return self.policy == "skip"

    def skip(self, source: str, message: str) -> None:
        self.skipped.setdefault(source, (reason_of(message), message))

    def metrics(self) -> dict[str, int]:
        if not self.skipping:
            return {}
        counts = Counter(reason for reason, _ in self.skipped.values())
        return {
            "data/skipped_records": len(self.skipped),
            **{f"data/skipped/{k}": v for k, v in sorted(counts.items())},
        }

    def report(self) -> str:
        """A report section listing the skipped records ('' when none were)."""
        if not self.skipped:
            return ""
        counts = Counter(reason for reason, _ in self.skipped.values())
        lines = [
            f"\n**Records skipped** (on_bad_record: skip): {len(self.skipped)} — "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            "",
        ]
        for source, (_, message) in list(self.skipped.items())[:MAX_LISTED]:
            lines.append(f"- `{source}`: {_one_line(message)}")
        if len(self.skipped) > MAX_LISTED:
            lines.append(f"- ... and {len(self.skipped) - MAX_LISTED} more")
        return "\n".join(lines) + "\n"


_CURRENT: ContextVar[Ledger | None] = ContextVar("qvl_bad_records", default=None)


@contextlib.contextmanager
def policy(name: str) -> Iterator[Ledger]:
    """Apply `name` ("fail" | "skip") to the files read inside; yields the ledger of what was skipped."""
    if name not in ("fail", "skip"):
        raise ValueError(f"on_bad_record={name!r}: choose fail or skip.")
    ledger = Ledger(name)
    token = _CURRENT.set(ledger)
    try:
        yield ledger
    finally:
        _CURRENT.reset(token)


def current() -> Ledger | None:
    """The ledger of the open `policy` (None outside one: readers fail on any bad record)."""
    return _CURRENT.get()


def settle(path: str, bad: list[tuple[str, str]], *, kept: int, what: str, state: str = "bad") -> None:
    """Apply the open policy to the bad records of the data file `path` (its path in the data directory), each
    (source "name:line ...", reason): under `skip`, count them (an error if none is `kept`); else one ValueError
    listing them (the first MAX_LISTED). `what` names them ("bad conversation record(s)"), `state` says what
    they are ("bad", "too long to train on")."""
    if not bad:
        return
    ledger = current()
    if ledger is not None and ledger.skipping:
        name = Path(path).name
        for source, reason in bad:  # keyed by the file's path in the data dir: same-named files never collide
            ledger.skip(path + source[len(name) :] if source.startswith(name) else source, reason)
        if not kept:
            raise ValueError(
                f"every record of {path} is {state} ({len(bad)} skipped under on_bad_record: skip), e.g. "
                f"{bad[0][0]}: {bad[0][1]}; fix the file."
            )
        return
    listed = "\n  ".join(f"{source}: {reason}" for source, reason in bad[:MAX_LISTED])
    more = f"\n  ... and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    raise ValueError(
        f"{len(bad)} {what} in {path}; fix or drop them (or set on_bad_record: skip to train without "
        f"them, counted in the metrics):\n  {listed}{more}"
    )


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()[:300]
