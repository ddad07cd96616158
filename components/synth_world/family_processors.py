"""The world tokenizer and image processor dressed as each family's processor (offline, no downloads).

Qwen2-VL and Qwen2.5-VL keep `tokenizer.build_processor` (patch 14, Qwen2-VL's template). Qwen3-VL and Qwen3.5
use `Qwen3VLProcessor` (what their checkpoints load) with patch 16 and each family's own chat template
(`chat_templates.py`); Qwen3.5's tokenizer gains its `<think>` / `</think>` tokens, as in the real vocabulary.
"""

from __future__ import annotations

from components._shared.model.families import FAMILIES
from components.synth_world import chat_templates
from components.synth_world import tokenizer as world_tokenizer

# Tokens a family's real vocabulary has beyond Qwen2-VL's specials (added as ordinary added tokens, like Qwen3's).
EXTRA_TOKENS: dict[str, tuple[str, ...]] = {"qwen3_5": ("<think>", "</think>")}


def family_tokenizer(tokenizer, family: str):
    """`tokenizer` with the family's extra tokens added (returned for chaining)."""
    extra = EXTRA_TOKENS.get(family, ())
    if extra:
        tokenizer.add_tokens(list(extra))
    return tokenizer


def build_processor(tokenizer, *, family: str, min_pixels: int, max_pixels: int):
    """The family's processor over `tokenizer`, resizing images within [min_pixels, max_pixels]."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown processor family {family!r}; use one of {sorted(FAMILIES)}.")
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return world_tokenizer.build_processor(tokenizer, family=family, min_pixels=min_pixels, max_pixels=max_pixels)
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    patch = FAMILIES[family].patch_size
    unit = (patch * world_tokenizer.MERGE_SIZE) ** 2
    if min_pixels < unit or max_pixels < min_pixels:
        raise ValueError(
            f"min_pixels={min_pixels}, max_pixels={max_pixels}: need {unit} <= min_pixels <= max_pixels "
            f"(one merged {patch * 2}x{patch * 2} patch at least)."
        )
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    common = {"size": size, "patch_size": patch, "merge_size": world_tokenizer.MERGE_SIZE, "temporal_patch_size": 2}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common, image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**common),
        chat_template=chat_templates.TEMPLATES[family],
    )


def visual_tokens(processor, height: int, width: int, *, min_pixels: int, max_pixels: int) -> int:
    """How many <|image_pad|> tokens an image of this size becomes with `processor`'s patch and merge sizes."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    image_processor = processor.image_processor
    patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch) * (w // patch) // (merge**2)
