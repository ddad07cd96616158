"""Container images of the components, tagged with the package version (never `:latest`).

Two images, built from docker/ by `make images` (docs/images.md):

- train (docker/Dockerfile.train): CUDA, torch, DeepSpeed with prebuilt ops, DALI; the GPU stages.
- data (docker/Dockerfile.data): CPU, OCR/NSFW models; the data and control stages.

A tag is `<registry>/<kind>:<components.__version__>`; the Makefile derives its tags from the same two values,
so what `make images` builds is what the compiled pipeline asks for. Override the registry with
QVL_IMAGE_REGISTRY at compile time (e.g. your own mirror) and build with the same value.
"""

import os

from components import __version__

DEFAULT_REGISTRY = "ghcr.io/qwen-vl-pipeline"
REGISTRY = (os.environ.get("QVL_IMAGE_REGISTRY") or DEFAULT_REGISTRY).rstrip("/")
KINDS = ("train", "data")


def image_for(kind: str, registry: str | None = None) -> str:
    """The image of one kind ("train" or "data") in `registry` (default: REGISTRY), tagged with the version."""
    if kind not in KINDS:
        raise ValueError(f"unknown image kind {kind!r}; use one of {', '.join(KINDS)}")
    return f"{(registry or REGISTRY).rstrip('/')}/{kind}:{__version__}"


TRAIN_IMAGE = image_for("train")  # CUDA, torch, deepspeed, DALI: GPU stages
DATA_IMAGE = image_for("data")  # CPU, OCR/NSFW models: data and control stages
