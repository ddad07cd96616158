"""Compile the pipeline to YAML: `python -m pipelines.compile [--preset P] [--out FILE]` (same as `qvl compile`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.presets import Preset

COMPILED = Path(__file__).parent / "compiled" / "vlm_training.yaml"


def compile_pipeline(preset: Preset | str = "prod-7b", out: Path = COMPILED) -> Path:
    """Write the full DAG with `preset`'s configs as parameter defaults; returns the file written."""
    import tempfile

    from kfp import compiler

    from components._shared.platform.storage import write_bytes
    from pipelines.vlm_training import build_pipeline

    out = Path(out)
    pipeline = build_pipeline(preset)
    with tempfile.TemporaryDirectory() as work:  # compiled aside, then renamed into place: a symlink at `out` is
        compiled = Path(work) / "pipeline.yaml"  # replaced, never written through, and a failed compile leaves
        compiler.Compiler().compile(pipeline, str(compiled))  # the old file whole
        write_bytes(out, compiled.read_bytes())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="prod-7b")
    parser.add_argument("--out", type=Path, default=COMPILED)
    args = parser.parse_args()
    print(compile_pipeline(args.preset, args.out))


if __name__ == "__main__":
    main()
