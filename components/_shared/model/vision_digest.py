"""Which vision tower produced a feature cache: a digest of its weights, compared when pretrain reads the cache.

Width and DeepStack levels alone let another checkpoint's features through (two checkpoints of one family share
them: Qwen2.5-VL-3B and -7B). The digest covers the tower's weights without the merger (the cache holds pre-merger
rows, and pretrain trains the merger), each cast to bf16 first, so a tower loaded in fp32 and one loaded in bf16
from the same checkpoint agree.
"""

from __future__ import annotations

import hashlib

import torch


def vision_digest(tower: torch.nn.Module) -> str:
    """sha256 over the tower's non-merger weights (name, shape, bf16 bytes), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tower.state_dict().items()):
        if "merger" in name or not tensor.is_floating_point():  # mergers (DeepStack's too) train in pretrain
            continue
        data = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(f"{name}:{tuple(data.shape)}".encode())
        digest.update(data.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
