"""Container images of the components, tagged with the package version (never `:latest`).

Two images, built from docker/ by `make images` (docs/images.md):

- train (docker/Dockerfile.train): CUDA, torch, DeepSpeed with prebuilt ops, DALI; the GPU stages.
- data (docker/Dockerfile.data): CPU, OCR/NSFW models; the data and control stages.

A tag is `<registry>/<kind>:<components.__version__>`; the Makefile derives its tags from the same two values,
so what `make images` builds is what the compiled pipeline asks for. Override the registry with
QVL_IMAGE_REGISTRY at compile time (e.g. your own mirror) and build with the same value.
"""

import os
import re

from components import __version__
from components._shared.platform.credential_shapes import shown

DEFAULT_REGISTRY = "ghcr.io/qwen-vl-pipeline"
KINDS = ("train", "data")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # one DNS label: 1-63 characters, no '-' at an end
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*(?::(?P<port>[0-9]{{1,5}}))?")  # registry host[:port]
MAX_REFERENCE = 255  # a reference name's length limit (distribution's reference grammar)
_PATH = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")  # a repository path component (lowercase)


def check_registry(value: str, setting: str = "QVL_IMAGE_REGISTRY") -> str:
    """`value` without a trailing slash if it is a registry / repository prefix Kubernetes can pull from
    (host[:port]/path, lowercase path, no scheme); a ValueError naming `setting` otherwise. A `user:password@`
    is refused without being shown: it would be written into every task of the compiled YAML."""
    text = value.strip().rstrip("/")
    if "@" in text:
        raise ValueError(
            f"{setting} holds an '@' (a user:password@ or a digest); the registry is written into every task of the "
            "compiled YAML, so credentials go into an image pull secret, never the image name: give host/path only."
        )
    if "://" in text:
        raise ValueError(f"{setting}={text!r}: an image registry takes no scheme; write host/path (ghcr.io/org).")
    host, _, path = text.partition("/")
    parts = path.split("/") if path else []
    matched = _HOST.fullmatch(host)
    port = int(matched["port"]) if matched and matched["port"] else None
    # A first component without '.' or ':' (and not localhost) is a Docker Hub namespace: lowercase like a path.
    hub = "." not in host and ":" not in host and host != "localhost"
    if (
        not matched
        or (port is not None and not 1 <= port <= 65535)
        or (hub and not _PATH.fullmatch(host))
        or not all(_PATH.fullmatch(part) for part in parts)
        or len(text) + len("/train:") + 32 > MAX_REFERENCE
    ):
        raise ValueError(
            f"{setting}={shown(text, 120)!r} is not a registry prefix Kubernetes can pull from: host[:port]/path (DNS "
            "labels of at most 63 characters, a port 1-65535; a Docker Hub namespace and every path part in lowercase "
            "letters, digits and . _ -; no spaces; at most ~200 characters), e.g. ghcr.io/my-org."
        )
    return text


REGISTRY = check_registry(os.environ.get("QVL_IMAGE_REGISTRY") or DEFAULT_REGISTRY)


def image_for(kind: str, registry: str | None = None) -> str:
    """The image of one kind ("train" or "data") in `registry` (default: REGISTRY), tagged with the version."""
    if kind not in KINDS:
        raise ValueError(f"unknown image kind {kind!r}; use one of {', '.join(KINDS)}")
    return f"{check_registry(registry, 'registry') if registry else REGISTRY}/{kind}:{__version__}"


TRAIN_IMAGE = image_for("train")  # CUDA, torch, deepspeed, DALI: GPU stages
DATA_IMAGE = image_for("data")  # CPU, OCR/NSFW models: data and control stages
