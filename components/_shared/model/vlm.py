"""Qwen2-VL / Qwen2.5-VL loading, saving, student configs and per-module parameter groups.

Every checkpoint a stage writes is a Hugging Face directory (safetensors + processor files), so
`AutoModelForImageTextToText.from_pretrained(dir)` and `AutoProcessor.from_pretrained(dir)` load it.
`trust_remote_code` is never passed: only the Qwen classes that ship with transformers are built.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from components._shared.model.attention import register as packed_attention
from components._shared.model.sources import resolve_model, validate_model_dir
from components._shared.model.train_config import MODULE_GROUPS

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
_VISION_BLOCK = re.compile(r"(?:^|\.)visual\.blocks\.(\d+)\.")
_LM_LAYER = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.")


def load_vlm(uri: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, processor) for a model URI (dir, s3://, builtin:NAME); safetensors only, no remote code. Attention
    runs per packed sample (`attention.PACKED_SDPA`), plain sdpa otherwise."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = resolve_model(str(uri))
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{uri}: model_type {model_type!r} is not supported; this pipeline trains {SUPPORTED_MODEL_TYPES} "
            "checkpoints (Qwen2-VL / Qwen2.5-VL)."
        )
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, attn_implementation=packed_attention(), use_safetensors=True, trust_remote_code=False
    ).to(device)
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=False)
    return model, processor


def save_vlm(model, processor, out_dir: str | Path, *, metadata: dict[str, Any] | None = None) -> Path:
    """Save model + processor in HF format (safetensors) and an optional `qvl_model.json`; returns the dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    if metadata is not None:
        (out_dir / "qvl_model.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return validate_model_dir(out_dir)


def set_pixel_bounds(processor, min_pixels: int, max_pixels: int) -> None:
    """Make the processor resize images within [min_pixels, max_pixels] (saved with the model, so a checkpoint's
    AutoProcessor sees images at the resolution the model was trained on)."""
    image_processor = processor.image_processor
    image_processor.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if hasattr(image_processor, name):
            setattr(image_processor, name, value)


def student_config(
    teacher_config,
    *,
    layers: int,
    hidden: int | None = None,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    vision_depth: int | None = None,
    vision_hidden: int | None = None,
    vision_heads: int | None = None,
    vision_intermediate: int | None = None,
    vision_full_attention: list[int] | None = None,
):
    """A smaller config of the same family: fewer / narrower LM layers, optionally fewer / narrower ViT blocks,
    the same vocabulary. The merger's output width follows the LM width; `mrope_section` is rescaled to the new
    head_dim; `vision_full_attention` (Qwen2.5-VL) names the student blocks with full attention.
    """
    config = teacher_config.__class__.from_dict(teacher_config.to_dict())
    text = config.text_config
    hidden = hidden or text.hidden_size
    heads = heads or text.num_attention_heads
    kv_heads = kv_heads or text.num_key_value_heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"student hidden={hidden}, heads={heads}, kv_heads={kv_heads}: hidden must divide by heads and heads "
            "by kv_heads."
        )
    head_dim = hidden // heads
    section = list(text.rope_parameters["mrope_section"])
    scaled = [max(1, round(s * (head_dim // 2) / sum(section))) for s in section]
    scaled[0] += head_dim // 2 - sum(scaled)
    if min(scaled) < 1:
        raise ValueError(f"student head_dim={head_dim} is too small for a 3-part mrope_section; use fewer heads.")
    text.hidden_size = hidden
    text.num_hidden_layers = layers
    text.num_attention_heads = heads
    text.num_key_value_heads = kv_heads
    text.intermediate_size = intermediate or text.intermediate_size
    text.head_dim = head_dim
    text.layer_types = ["full_attention"] * layers
    text.max_window_layers = min(getattr(text, "max_window_layers", layers), layers)
    text.rope_parameters = {**text.rope_parameters, "mrope_section": scaled}
    if vision_depth is not None:
        vision = config.vision_config
        if not 1 <= vision_depth <= vision.depth:
            raise ValueError(f"student vision_depth={vision_depth} must be between 1 and the teacher's {vision.depth}.")
        vision.depth = vision_depth
        if hasattr(vision, "fullatt_block_indexes"):  # Qwen2.5-VL: keep full attention in the last block at least
            vision.fullatt_block_indexes = [i for i in vision.fullatt_block_indexes if i < vision_depth] or [
                vision_depth - 1
            ]
    _narrow_vision(config, vision_hidden, vision_heads, vision_intermediate)
    if vision_full_attention is not None and hasattr(config.vision_config, "fullatt_block_indexes"):
        config.vision_config.fullatt_block_indexes = list(vision_full_attention)
    if config.model_type == "qwen2_vl":  # Qwen2-VL's merger projects to vision_config.hidden_size
        config.vision_config.hidden_size = hidden
    else:
        config.vision_config.out_hidden_size = hidden
    return config


def _narrow_vision(config, hidden: int | None, heads: int | None, intermediate: int | None) -> None:
    """Set the ViT width, heads and MLP width (Qwen2-VL names them embed_dim / mlp_ratio)."""
    vision = config.vision_config
    width_name = "embed_dim" if config.model_type == "qwen2_vl" else "hidden_size"
    old_width = getattr(vision, width_name)
    hidden = hidden or old_width
    heads = heads or (vision.num_heads if hidden == old_width else hidden // (old_width // vision.num_heads))
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(
            f"student vision_hidden={hidden} with {heads} heads: the width must divide into heads of an "
            "even head_dim (the ViT's 2-D RoPE splits each head in halves)."
        )
    setattr(vision, width_name, hidden)
    vision.num_heads = heads
    if config.model_type == "qwen2_vl":
        if intermediate:
            if intermediate % hidden:
                raise ValueError(
                    f"student vision_intermediate={intermediate}: Qwen2-VL sets the ViT MLP width as an "
                    f"integer multiple (mlp_ratio) of vision_hidden={hidden}; use a multiple of it."
                )
            vision.mlp_ratio = intermediate // hidden
    else:
        vision.intermediate_size = intermediate or vision.intermediate_size


def build_student(teacher_config, **sizes):
    """A randomly initialised student model (see `student_config`), same class as the teacher's."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(
        student_config(teacher_config, **sizes), attn_implementation=packed_attention()
    )


def count_parameters(model, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def module_group(name: str, *, vision_blocks: int, lm_layers: int) -> str:
    """Which of MODULE_GROUPS the parameter `name` belongs to (lower = first half of the blocks/layers).

    Patch embedding counts as vision_lower; embeddings as lm_lower; final norm and lm_head as lm_upper.
    Names of peft-wrapped models (base_model.model..., lora_A/lora_B) resolve the same way.
    """
    if ".merger." in f".{name}":
        return "merger"
    if match := _VISION_BLOCK.search(name):
        return "vision_lower" if int(match.group(1)) < vision_blocks // 2 else "vision_upper"
    if ".visual." in f".{name}":
        return "vision_lower"
    if match := _LM_LAYER.search(name):
        return "lm_lower" if int(match.group(1)) < lm_layers // 2 else "lm_upper"
    if "embed_tokens" in name:
        return "lm_lower"
    return "lm_upper"


def named_groups(model) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Trainable parameters by module group (groups with no trainable parameter are left out)."""
    config = _qwen_config(model)
    sizes = {"vision_blocks": config.vision_config.depth, "lm_layers": config.text_config.num_hidden_layers}
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(module_group(name, **sizes), []).append((name, param))
    return {g: groups[g] for g in MODULE_GROUPS if g in groups}


def freeze(model, groups: tuple[str, ...]) -> int:
    """Set requires_grad=False on every parameter of the named groups; returns how many tensors were frozen."""
    unknown = set(groups) - set(MODULE_GROUPS)
    if unknown:
        raise ValueError(f"freeze: unknown module group(s) {sorted(unknown)}; choose from {MODULE_GROUPS}.")
    frozen = 0
    for group, params in named_groups(model).items():
        if group in groups:
            for _, param in params:
                param.requires_grad_(False)
                frozen += 1
    return frozen


def qwen_model(model):
    """The inner Qwen2(.5)-VL model (has `visual`, `language_model`, `get_rope_index`) under any wrapper."""
    for module in model.modules():
        if hasattr(module, "get_rope_index") and hasattr(module, "visual"):
            return module
    raise ValueError(f"{type(model).__name__} contains no Qwen2-VL / Qwen2.5-VL model (no get_rope_index).")


def _qwen_config(model):
    return qwen_model(model).config
