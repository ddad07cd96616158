"""Qwen3.5 (0.8B-27B dense, MoE as `qwen3_5_moe`; Qwen3.6 / 3.8 reuse the classes): natively multimodal, a hybrid
LM of Gated DeltaNet linear-attention layers and gated full-attention layers (every 4th), head_dim 256 with
partial rotary, vocabulary 248,320; the ViT is Qwen3-VL's without DeepStack (patch 16, learned position table).

Packing: the full-attention layers split at the text-position restarts like every family, but a linear-attention
layer's causal convolution and recurrent state would run on from one packed sample into the next. The layers
are given the packed row's sample lengths (`packed_sample_lengths`) and run each sample from a zero state, the
way the varlen kernels do with `cu_seqlens`; without them the samples leak into each other (tests show it). The
decoder layers take the lengths as an argument, so gradient checkpointing, which recomputes a layer during
backward after the forward's context has ended, recomputes it per sample too (tested: the same gradients).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from components._shared.model.families.base import Family

FULL_ATTENTION_INTERVAL = 4
_SAMPLE_LENGTHS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("packed_lengths", default=None)


@contextlib.contextmanager
def packed_sample_lengths(lengths: list[int] | None):
    """Within the block, linear-attention layers treat a batch-1 row of sum(lengths) tokens as these samples."""
    token = _SAMPLE_LENGTHS.set(lengths)
    try:
        yield
    finally:
        _SAMPLE_LENGTHS.reset(token)


def _segmented_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Gated DeltaNet forward run per packed sample (zero conv history and state for each), else unchanged."""
    base = super(type(self), self).forward
    lengths = _SAMPLE_LENGTHS.get()
    if lengths is None or cache is not None or hidden_states.shape[0] != 1 or sum(lengths) != hidden_states.shape[1]:
        return base(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    parts = hidden_states.split(lengths, dim=1)
    return torch.cat([base(part, cache=None, attention_mask=None, **kwargs) for part in parts], dim=1)


def _layer_call(self, *args, **kwargs):
    """A decoder layer's call with the sample lengths as an argument: gradient checkpointing keeps the arguments
    and recomputes the layer in backward, after the forward's context is gone."""
    lengths = _SAMPLE_LENGTHS.get()
    if lengths is not None:
        kwargs["packed_lengths"] = lengths
    return super(type(self), self).__call__(*args, **kwargs)


def _layer_forward(self, *args, packed_lengths=None, **kwargs):
    base = super(type(self), self).forward
    if packed_lengths is None:
        return base(*args, **kwargs)
    with packed_sample_lengths(packed_lengths):
        return base(*args, **kwargs)


_PACKED_CLASSES: dict[type, type] = {}
_METHODS = {"linear": {"forward": _segmented_forward}, "layer": {"__call__": _layer_call, "forward": _layer_forward}}


def _packed_class(cls: type, kind: str) -> type:
    if cls not in _PACKED_CLASSES:
        _PACKED_CLASSES[cls] = type(f"Packed{cls.__name__}", (cls,), dict(_METHODS[kind]))
    return _PACKED_CLASSES[cls]


class Qwen3_5(Family):
    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_moe")
    patch_size = 16
    template_kwargs = {"enable_thinking": False}
    lora_targets = [
        *Family.lora_targets[:3],
        r"language_model\.layers\.\d+\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)",
        r"visual\.merger\.linear_fc(1|2)",
    ]
    lora_required = ["visual.merger", "attn.qkv", "linear_attn"]
    grounding = "relative_1000"
    explicit_head_dim = True
    prunable = False  # distill: student.init random or model (pruning these layouts is not written yet)
    processor_class, video_processor_class = "Qwen3VLProcessor", "Qwen3VLVideoProcessor"  # Qwen3.5 reuses Qwen3-VL's
    image_mean = image_std = (0.5, 0.5, 0.5)
    vocabulary = "qwen3_5"
    extra_tokens = ("<think>", "</think>")
    needs_sample_lengths = True
    parity_tolerance = {"fp32": 1e-4, "bf16": 0.1}  # recurrent decode vs chunked full forward: twice the others' bf16

    def packed_samples(self, lengths: list[int] | None):
        return packed_sample_lengths(lengths)

    def cut_vision_depth(self, vision, depth: int) -> None:
        vision.depth = depth

    def rotary_half(self, text, head_dim: int) -> int:
        return int(head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0)) // 2

    def student_layer_types(self, text, layers: int) -> list[str]:
        """The hybrid pattern (3 linear, 1 full), ending on a full-attention layer however few layers remain."""
        types = [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention" for i in range(layers)
        ]
        types[-1] = "full_attention"
        return types

    def config_class(self):
        from transformers import Qwen3_5Config

        return Qwen3_5Config

    def tiny_vision(self, *, depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
        return {
            **self._vision_sizes(depth, hidden, heads, intermediate, out_hidden),
            "num_position_embeddings": 64,
        }

    def tiny_text(self, text: dict) -> dict:
        section = text["rope_parameters"]["mrope_section"]
        head_dim = 8 * sum(section)  # rotary on a quarter of each head, as in the real checkpoints (factor 0.25)
        rope = {**text["rope_parameters"], "mrope_interleaved": True, "partial_rotary_factor": 0.25}
        layers = text["num_hidden_layers"]
        return {
            **text,
            "head_dim": head_dim,
            "rope_parameters": rope,
            "layer_types": self.student_layer_types(None, layers),
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": head_dim // 2,
            "linear_value_head_dim": head_dim // 2,
            "linear_num_key_heads": text["num_key_value_heads"],
            "linear_num_value_heads": text["num_attention_heads"],
        }

    def vision_tower_class(self):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel

    def prepare_packing(self, qwen) -> None:
        packed = set(_PACKED_CLASSES.values())
        for layer in qwen.language_model.layers:
            module = getattr(layer, "linear_attn", None)
            if module is None or type(module) in packed:
                continue
            module.__class__ = _packed_class(type(module), "linear")
            layer.__class__ = _packed_class(type(layer), "layer")

    def zero3_external_parameters(self, qwen) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        """Gated DeltaNet passes `conv1d.weight` to its convolution function and never calls `conv1d`."""
        linear = [getattr(layer, "linear_attn", None) for layer in qwen.language_model.layers]
        return [(attn, param) for attn in linear if attn is not None for param in attn.conv1d.parameters()]
