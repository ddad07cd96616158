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
    from kfp import compiler

    from pipelines.vlm_training import build_pipeline

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(preset), str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="prod-7b")
    parser.add_argument("--out", type=Path, default=COMPILED)
    args = parser.parse_args()
    print(compile_pipeline(args.preset, args.out))


if __name__ == "__main__":
    main()
