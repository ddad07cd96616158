"""Qwen3.5 (0.8B-27B dense, MoE as `qwen3_5_moe`; Qwen3.6 / 3.8 reuse the classes): natively multimodal, a hybrid
LM of Gated DeltaNet linear-attention layers and gated full-attention layers (every 4th), head_dim 256 with
partial rotary, vocabulary 248,320; the ViT is Qwen3-VL's without DeepStack (patch 16, learned position table).

Packing: the full-attention layers split at the text-position restarts like every family, but a linear-attention
layer's causal convolution and recurrent state would run on from one packed sample into the next. The layers
are given the packed row's sample lengths and run each sample from a zero state (segmented.py), the way the
varlen kernels do with `cu_seqlens`; without them the samples leak into each other (tests show it), and with
gradient checkpointing the same gradients (tested).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from components._shared.model.families.base import Family
from components._shared.model.families.segmented import (
    make_layer_carry_lengths,
    make_segmented,
    packed_sample_lengths,
)

FULL_ATTENTION_INTERVAL = 4


class Qwen3_5(Family):
    name = "qwen3_5"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5", "qwen3_5_moe")
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
        for layer in qwen.language_model.layers:
            if getattr(layer, "linear_attn", None) is not None:
                make_segmented(layer.linear_attn)
                make_layer_carry_lengths(layer)

    def zero3_external_parameters(self, qwen) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        """Gated DeltaNet passes `conv1d.weight` to its convolution function and never calls `conv1d`."""
        linear = [getattr(layer, "linear_attn", None) for layer in qwen.language_model.layers]
        return [(attn, param) for attn in linear if attn is not None for param in attn.conv1d.parameters()]
