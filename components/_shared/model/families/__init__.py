"""The model-family layer: one module per Qwen vision-language generation, everything that differs between them.

    family = family_for(config)          # a config, a model, or a model_type string
    family.visual_tokens(visual, features), family.cached_levels(vision_config), family.patch_size, ...

Stage code asks the family and never compares `model_type` itself.
"""

from __future__ import annotations

from components._shared.model.families.base import Family, VisualTokens
from components._shared.model.families.qwen2_5_vl import Qwen2_5_VL
from components._shared.model.families.qwen2_vl import Qwen2_VL
from components._shared.model.families.qwen3_5 import Qwen3_5
from components._shared.model.families.qwen3_vl import Qwen3_VL
from components._shared.model.families.qwen4_exp import Qwen4Exp

FAMILIES: dict[str, Family] = {f.name: f for f in (Qwen2_VL(), Qwen2_5_VL(), Qwen3_VL(), Qwen3_5(), Qwen4Exp())}
_BY_MODEL_TYPE = {model_type: f for f in FAMILIES.values() for model_type in f.model_types}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_BY_MODEL_TYPE)

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "VisualTokens", "family_for"]


def family_for(what) -> Family:
    """The family of a model_type string, a config (the top-level one), or a model (any wrapper)."""
    model_type = what if isinstance(what, str) else _model_type(what)
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"model_type {model_type!r} is not supported; this pipeline trains {', '.join(SUPPORTED_MODEL_TYPES)} "
            "checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE variants, the Qwen4 preview)."
        )
    return _BY_MODEL_TYPE[model_type]


def _model_type(what) -> str | None:
    config = getattr(what, "config", what)
    model_type = getattr(config, "model_type", None)
    if model_type in _BY_MODEL_TYPE or not hasattr(what, "modules"):
        return model_type
    for module in what.modules():  # a wrapper (peft, a reward head): the inner Qwen model's config
        inner = getattr(getattr(module, "config", None), "model_type", None)
        if inner in _BY_MODEL_TYPE:
            return inner
    return model_type
