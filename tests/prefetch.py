"""Stage outputs with the prefetching input pipeline on and off (issue 24): the same model bytes."""

from pathlib import Path


def model_bytes(out: Path) -> dict[str, bytes]:
    """Every safetensors file of a stage's exported model/, by name."""
    files = sorted((Path(out) / "model").glob("*.safetensors"))
    assert files, f"no model/*.safetensors under {out}"
    return {f.name: f.read_bytes() for f in files}


def assert_same_with_and_without_workers(run_with, tmp_path: Path) -> None:
    """`run_with(data_workers, out)` runs a stage; its model must be byte-identical with 0 and 2 data workers."""
    run_with(0, tmp_path / "in_process")
    run_with(2, tmp_path / "workers")
    assert model_bytes(tmp_path / "workers") == model_bytes(tmp_path / "in_process")
