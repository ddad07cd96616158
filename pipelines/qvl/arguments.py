"""What `qvl` does with its command line before a command runs: an option given twice is refused, and the text of
click's own usage errors passes through the credential redaction (it quotes the arguments it refuses)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from components._shared.platform.credential_shapes import redact

# click's base error, of whichever click typer parses with (typer 0.2x carries its own copy, not the `click` package)
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class RedactingGroup(TyperGroup):
    """The root command group: a usage error of it or of any command under it ("Got unexpected extra argument(s)
    (sft.hf_...=1)", "Invalid value for '--records': 'ghp_...'") names a credential-shaped argument as a credential
    (tenth hostile pass, K02, K08c): a token typed in the wrong place is never printed back."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _redacted():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _redacted():
            return super().invoke(ctx)


@contextlib.contextmanager
def _redacted() -> Iterator[None]:
    """Re-raise a click usage error with its message redacted."""
    try:
        yield
    except CLICK_ERROR as error:
        error.message = redact(error.message)
        raise


def refuse_repeated_options(argv: list[str]) -> None:
    """An option given twice is refused: click keeps the last one without a word (`--out a ... --out b`). `qvl stage`
    hands its arguments to the stage's own command line, which checks them itself."""
    if argv[:1] == ["stage"]:
        return
    seen: set[str] = set()
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2:
            if name in seen:
                raise ValueError(f"{name} is given twice; give it once (the last one would win without a word).")
            seen.add(name)
