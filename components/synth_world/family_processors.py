"""The world tokenizer and image processor dressed as each family's processor (offline, no downloads).

Each family builds its checkpoints' processor (`Family.build_processor`: processor classes, patch, normalisation)
with its chat template: Qwen2-VL's for Qwen2-VL and Qwen2.5-VL, each later family's own (`chat_templates.py`);
the tokenizer gains the family's extra tokens (Qwen3.5's `<think>` / `</think>`), as in the real vocabulary.
"""

from __future__ import annotations

from components._shared.model.families import FAMILIES
from components.synth_world import chat_templates
from components.synth_world import tokenizer as world_tokenizer


def family_tokenizer(tokenizer, family: str):
    """`tokenizer` with the family's extra tokens added (returned for chaining)."""
    extra = FAMILIES[family].extra_tokens
    if extra:
        tokenizer.add_tokens(list(extra))
    return tokenizer


def chat_template(family: str) -> str:
    """The family's chat template (Qwen2-VL's where the family has none of its own)."""
    return chat_templates.TEMPLATES.get(family, world_tokenizer.CHAT_TEMPLATE)


def build_processor(tokenizer, *, family: str, min_pixels: int, max_pixels: int):
    """The family's processor over `tokenizer`, resizing images within [min_pixels, max_pixels]."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown processor family {family!r}; use one of {sorted(FAMILIES)}.")
    return FAMILIES[family].build_processor(
        tokenizer, min_pixels=min_pixels, max_pixels=max_pixels, chat_template=chat_template(family)
    )


def visual_tokens(processor, height: int, width: int, *, min_pixels: int, max_pixels: int) -> int:
    """How many <|image_pad|> tokens an image of this size becomes with `processor`'s patch and merge sizes."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    image_processor = processor.image_processor
    patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch) * (w // patch) // (merge**2)
