"""Which vision tower produced a feature cache: a digest of its weights, compared when pretrain reads the cache.

Width and DeepStack levels alone let another checkpoint's features through (two checkpoints of one family share
them: Qwen2.5-VL-3B and -7B). The digest covers the tower's weights without the merger (the cache holds pre-merger
rows, and pretrain trains the merger), each cast to bf16 first, so the checkpoint's tensors as stored and a tower
loaded from them in fp32 or bf16 agree.
"""

from __future__ import annotations

import hashlib

import torch


def vision_digest(tower: torch.nn.Module) -> str:
    """sha256 over the tower's non-merger weights (name, shape, bf16 bytes), in name order."""
    return weights_digest(tower.state_dict())


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """`vision_digest` of a tower's state dict (extract_features hashes the checkpoint's tensors as stored: a
    float16 cache of a bf16 checkpoint must not hash its float16 copy)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        if "merger" in name or not tensor.is_floating_point():  # mergers (DeepStack's too) train in pretrain
            continue
        data = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(f"{name}:{tuple(data.shape)}".encode())
        digest.update(data.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
