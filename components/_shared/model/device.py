"""The torch device a stage runs on, from its `device` setting (auto / cpu / cuda)."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """auto = the GPU when one is visible, else the CPU; under torchrun each rank owns the GPU of its LOCAL_RANK."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA GPU is visible; use device: auto or cpu.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "").strip() or 0))
    return torch.device(name)
