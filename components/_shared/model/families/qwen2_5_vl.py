"""Qwen2.5-VL (3B/7B/32B/72B): window attention in the ViT with full attention in `fullatt_block_indexes`,
RMSNorm + SwiGLU ViT blocks, patch 14, absolute-pixel grounding. The defaults of `Family` are this family's."""

from __future__ import annotations

from components._shared.model.families.base import Family


class Qwen2_5_VL(Family):
    pass
