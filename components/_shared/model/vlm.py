"""Qwen vision-language loading, saving, student configs and per-module parameter groups, for every family.

Every checkpoint a stage writes is a Hugging Face directory (safetensors + processor files), so
`AutoModelForImageTextToText.from_pretrained(dir)` and `AutoProcessor.from_pretrained(dir)` load it.
`trust_remote_code` is never passed: only the Qwen classes that ship with transformers are built.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from components._shared.model.attention import enable_vision_varlen
from components._shared.model.attention import register as packed_attention
from components._shared.model.families import Family, family_for
from components._shared.model.sources import read_json_file, resolve_model, validate_model_dir
from components._shared.model.train_config import MODULE_GROUPS
from components._shared.platform import disk_space

_VISION_BLOCK = re.compile(r"(?:^|\.)visual\.blocks\.(\d+)\.")
_LM_LAYER = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.")


class LoadedVlm(NamedTuple):
    """A loaded checkpoint: the model, its processor, and the dtype its weights are stored in (what
    `export_dtype: checkpoint` writes back, whatever precision training ran in)."""

    model: Any
    processor: Any
    stored_dtype: torch.dtype


def load_vlm(uri: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedVlm:
    """(model, processor, stored dtype) for a model URI (dir, s3://, builtin:NAME); safetensors only, no remote
    code. Attention runs per packed sample (`attention.PACKED_SDPA`), plain sdpa otherwise; the ViT attends over all
    its images in one call per block (`attention.enable_vision_varlen`: one kernel on CUDA, the same loop as before
    elsewhere)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = resolve_model(str(uri))
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    try:
        family = family_for(str(model_type))
    except ValueError as err:
        raise ValueError(f"{uri}: {err}") from None
    model, loading = AutoModelForImageTextToText.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=lm_attention(family),
        use_safetensors=True,
        trust_remote_code=False,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported in `loading` for check_complete's message, not raised mid-load
    )
    check_complete(uri, loading)
    check_finite_weights(model, loaded_from=uri)
    check_model_notes(path, uri)
    enable_vision_varlen(model)
    model = model.to(device)
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=False)
    return LoadedVlm(model, processor, checkpoint_dtype(path))


def lm_attention(what) -> str:
    """The attention implementation a model of this family (a Family, config, model or model_type) trains with:
    `sdpa_packed`, which splits packed rows itself, or plain sdpa with the block-causal mask where a layer reads
    the mask (Family.splits_packed_rows)."""
    family = what if isinstance(what, Family) else family_for(what)
    return packed_attention() if family.splits_packed_rows else "sdpa"


TEMPERATURE_RANGE = (0.5, 10.0)  # the range sft fits a confidence temperature over (evaluation.TEMPERATURE_GRID)


def check_model_notes(path: Path, uri: str | Path) -> None:
    """A model's `qvl_model.json`, where it has one: a JSON object whose `confidence_temperature` (sft's fitted
    temperature, which readers divide the logits by) is a finite number in TEMPERATURE_RANGE; a NaN or a zero there
    would travel on to every later stage's export and to serving unseen."""
    notes = path / "qvl_model.json"
    if not notes.is_file():
        return
    data = read_json_file(
        notes, "the model's notes", "restore it from the stage's output", shown=f"{uri}: qvl_model.json"
    )
    if not isinstance(data, dict):
        raise ValueError(f"{uri}: qvl_model.json holds {type(data).__name__}, not an object; restore it.")
    value = data.get("confidence_temperature")
    low, high = TEMPERATURE_RANGE
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and low <= value <= high
    ):
        raise ValueError(
            f"{uri}: qvl_model.json's confidence_temperature is {value!r}; sft writes a number from {low} to {high} "
            "(divide the logits by it). Restore the file sft exported, or delete the key to use no temperature."
        )


def check_complete(uri: str | Path, loading: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks weights the model needs (transformers would initialise them randomly and
    only log it) or whose tensors have other shapes than its config says."""
    missing, mismatched = sorted(loading.get("missing_keys") or ()), list(loading.get("mismatched_keys") or ())
    if missing or mismatched:
        shown = missing[:5] or [str(m) for m in mismatched[:5]]
        raise ValueError(
            f"{uri}: the checkpoint lacks {len(missing)} weight(s) and has {len(mismatched)} of another shape than "
            f"its config.json says (e.g. {shown}); it would train from random weights there. Use a complete "
            "checkpoint (all *.safetensors shards and the index) whose config matches it."
        )


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in (config.json `dtype`, or the legacy `torch_dtype`)."""
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(setting: str, stored: torch.dtype) -> torch.dtype:
    """`train.export_dtype` resolved: "checkpoint" -> the dtype the source checkpoint is stored in (a bf16 7B stays
    16.6 GB, not 33 GB of fp32 training weights); "float32" / "bfloat16" / "float16" force one."""
    return stored if setting == "checkpoint" else EXPORT_DTYPES[setting]


def save_vlm(
    model,
    processor,
    out_dir: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save model + processor in HF format (safetensors) and an optional `qvl_model.json`; returns the dir.
    The weights are written in `dtype` (`export_dtype(...)`; None: the model's own) as a cast copy: the model
    keeps its training precision."""
    check_finite_weights(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = dtype
    current = next(model.parameters()).dtype
    with disk_space.writing(out_dir, "exporting the model"):
        if target is None or target == current or not current.is_floating_point:
            model.save_pretrained(out_dir, safe_serialization=True)
        else:  # a cast copy of the weights; the model itself keeps training precision
            state = {k: v.to(target) if v.is_floating_point() else v for k, v in model.state_dict().items()}
            model.save_pretrained(out_dir, safe_serialization=True, state_dict=state)
            _set_config_dtype(out_dir / "config.json", target)
        processor.save_pretrained(out_dir)
        if metadata is not None:
            (out_dir / "qvl_model.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return validate_model_dir(out_dir)


def check_finite_weights(model, *, loaded_from: str | Path | None = None) -> None:
    """Refuse to export (or, `loaded_from`, to start from) a model any of whose floating-point tensors holds inf /
    nan: it would load and answer garbage, or stop training at step 1 as if the learning rate were to blame. The
    error names the tensors."""
    bad = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad and loaded_from is not None:
        raise ValueError(
            f"{loaded_from}: {len(bad)} weight tensor(s) of the checkpoint hold non-finite values ({bad[:3]}); "
            "training from it stops at its first step whatever the learning rate. Use a checkpoint saved before "
            "the run that wrote it diverged."
        )
    if bad:
        raise ValueError(
            f"refusing to export: {len(bad)} weight tensor(s) hold non-finite values ({bad[:3]}); the training "
            "diverged. Lower the learning rate or check the stage's loss weights."
        )


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """config.json's `dtype` (and its sub-configs') say what the weights are stored in, so `dtype="auto"` loads it."""
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for section in (config, *(v for v in config.values() if isinstance(v, dict) and "dtype" in v)):
        section["dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
    rotary width; `vision_full_attention` (Qwen2.5-VL) names the student blocks with full attention; the family
    keeps its own layer pattern (Qwen3.5: linear / full attention) and block-index lists (DeepStack).
    """
    family = family_for(teacher_config)
    config = teacher_config.__class__.from_dict(teacher_config.to_dict())
    text = config.text_config
    hidden = hidden or text.hidden_size
    heads = heads or text.num_attention_heads
    kv_heads = kv_heads or text.num_key_value_heads
    if (hidden % heads and not family.explicit_head_dim) or heads % kv_heads:
        raise ValueError(
            f"student hidden={hidden}, heads={heads}, kv_heads={kv_heads}: hidden must divide by heads and heads "
            "by kv_heads."
        )
    head_dim = int(text.head_dim) if family.explicit_head_dim else hidden // heads
    section = list(text.rope_parameters.get("mrope_section") or [])
    if section:
        half = family.rotary_half(text, head_dim)
        scaled = [max(1, round(s * half / sum(section))) for s in section]
        scaled[0] += half - sum(scaled)
        if min(scaled) < 1:
            raise ValueError(f"student head_dim={head_dim} is too small for a 3-part mrope_section; use fewer heads.")
        text.rope_parameters = {**text.rope_parameters, "mrope_section": scaled}
    text.hidden_size = hidden
    full_depth = int(text.num_hidden_layers)
    text.num_hidden_layers = layers
    text.num_attention_heads = heads
    text.num_key_value_heads = kv_heads
    if "intermediate_size" in text.to_dict():  # a dense MLP (or dense layers beside experts)
        text.intermediate_size = intermediate or text.intermediate_size
    elif intermediate:  # experts only (the Qwen4 preview): each expert and the shared one that wide
        text.moe_intermediate_size = text.shared_expert_intermediate_size = intermediate
    text.head_dim = head_dim
    text.layer_types = family.student_layer_types(text, layers)
    family.map_layer_ids(text, full_depth)
    if hasattr(text, "max_window_layers"):
        text.max_window_layers = min(text.max_window_layers, layers)
    if vision_depth is not None:
        vision = config.vision_config
        if not 1 <= vision_depth <= vision.depth:
            raise ValueError(f"student vision_depth={vision_depth} must be between 1 and the teacher's {vision.depth}.")
        family.cut_vision_depth(vision, vision_depth)
    _narrow_vision(family, config.vision_config, vision_hidden, vision_heads, vision_intermediate)
    if vision_full_attention is not None and hasattr(config.vision_config, "fullatt_block_indexes"):
        config.vision_config.fullatt_block_indexes = list(vision_full_attention)
    family.set_merger_output(config, hidden)
    return config


def _narrow_vision(family, vision, hidden: int | None, heads: int | None, intermediate: int | None) -> None:
    """Set the ViT width, heads and MLP width through the family (Qwen2-VL names them embed_dim / mlp_ratio)."""
    old_width = family.vision_width(vision)
    hidden = hidden or old_width
    heads = heads or (vision.num_heads if hidden == old_width else hidden // (old_width // vision.num_heads))
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(
            f"student vision_hidden={hidden} with {heads} heads: the width must divide into heads of an "
            "even head_dim (the ViT's 2-D RoPE splits each head in halves)."
        )
    family.set_vision_sizes(vision, hidden=hidden, heads=heads, intermediate=intermediate)


def build_student(teacher_config, **sizes):
    """A randomly initialised student model (see `student_config`), same class as the teacher's."""
    from transformers import AutoModelForImageTextToText

    student = AutoModelForImageTextToText.from_config(
        student_config(teacher_config, **sizes), attn_implementation=lm_attention(teacher_config)
    )
    enable_vision_varlen(student)
    return student


def count_parameters(model, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def module_group(name: str, *, vision_blocks: int, lm_layers: int, mergers: tuple[str, ...] = ("merger",)) -> str:
    """Which of MODULE_GROUPS the parameter `name` belongs to (lower = first half of the blocks/layers).

    `mergers` are the family's modules under `visual.` that project into the LM (Qwen3-VL: + the DeepStack
    mergers). Patch and position embedding count as vision_lower; embeddings as lm_lower; final norm and lm_head
    as lm_upper. Names of peft-wrapped models (base_model.model..., lora_A/lora_B) resolve the same way.
    """
    if any(f".visual.{merger}." in f".{name}" for merger in mergers):
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


def parameter_groups(model):
    """(group, name, parameter) for every parameter, trainable or not (the assignment `named_groups` uses)."""
    config = _qwen_config(model)
    sizes = {
        "vision_blocks": config.vision_config.depth,
        "lm_layers": config.text_config.num_hidden_layers,
        "mergers": family_for(config).merger_modules,
    }
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head.weight if head is not None and head.weight is model.get_input_embeddings().weight else None
    for name, param in model.named_parameters():
        yield ("lm_upper" if param is tied else module_group(name, **sizes)), name, param


def named_groups(model) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Trainable parameters by module group (groups with no trainable parameter are left out).

    A tied embedding (Qwen2.5-VL-3B, Qwen3-VL-2B, Qwen3.5 <= 4B) is listed once under its input name, but it is
    the output head too: it belongs to lm_upper with lm_head, so freezing the lower LM layers keeps the head
    trainable, as it is for an untied checkpoint."""
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for group, name, param in parameter_groups(model):
        if param.requires_grad:
            groups.setdefault(group, []).append((name, param))
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
    """The inner Qwen VL model (has `visual`, `language_model`, `get_rope_index`) under any wrapper."""
    for module in model.modules():
        if hasattr(module, "get_rope_index") and hasattr(module, "visual"):
            return module
    raise ValueError(f"{type(model).__name__} contains no Qwen vision-language model (no get_rope_index).")


def _qwen_config(model):
    return qwen_model(model).config
