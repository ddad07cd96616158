"""Qwen3-VL (2B-32B dense; 30B-A3B / 235B-A22B MoE as `qwen3_vl_moe`): patch 16 (images resize to multiples of
32 px), a learned position table resampled per image (`visual.pos_embed`), interleaved M-RoPE, and DeepStack:
one extra merger per `deepstack_visual_indexes` block, whose outputs are added to the LM hidden states at the
image tokens after the first decoder layers. A feature cache therefore stores those blocks' outputs too, and
the DeepStack mergers are trained and frozen with the main merger. Grounding boxes are relative (0-1000)."""

from __future__ import annotations

import torch

from components._shared.model.families.base import Family, VisualTokens


class Qwen3_VL(Family):
    name = "qwen3_vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    patch_size = 16
    grounding = "relative_1000"
    explicit_head_dim = True
    prunable = False  # distill: student.init random or model (pruning these layouts is not written yet)
    processor_class, video_processor_class = "Qwen3VLProcessor", "Qwen3VLVideoProcessor"
    image_mean = image_std = (0.5, 0.5, 0.5)
    merger_modules = ("merger", "deepstack_merger_list")
    lora_targets = [
        *Family.lora_targets[:3],
        r"visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc(1|2)",
    ]
    lora_required = ["visual.merger", "visual.deepstack_merger_list", "attn.qkv"]

    def cut_vision_depth(self, vision, depth: int) -> None:
        vision.depth = depth
        vision.deepstack_visual_indexes = [i for i in vision.deepstack_visual_indexes if i < depth]

    def config_class(self):
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig

    def tiny_vision(self, *, depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
        return {
            **self._vision_sizes(depth, hidden, heads, intermediate, out_hidden),
            "num_position_embeddings": 64,  # an 8x8 learned grid (2304 = 48x48 in the real checkpoints)
            # three levels spread over the blocks like the real [5, 11, 17] of 24: [0, 1, 2] of 4
            "deepstack_visual_indexes": sorted({max(0, depth * (k + 1) // 4 - 1) for k in range(3)}),
        }

    def tiny_text(self, text: dict) -> dict:
        rope = {**text["rope_parameters"], "mrope_interleaved": True}
        return {**text, "head_dim": text["hidden_size"] // text["num_attention_heads"], "rope_parameters": rope}

    def vision_tower_class(self):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    def cached_levels(self, vision) -> list[int]:
        return list(vision.deepstack_visual_indexes)

    def visual_tokens(self, visual, features: torch.Tensor) -> VisualTokens:
        dtype = next(visual.merger.parameters()).dtype
        levels = [level.contiguous() for level in features.to(dtype).chunk(1 + len(visual.deepstack_merger_list), -1)]
        deepstack = [merger(level) for merger, level in zip(visual.deepstack_merger_list, levels[1:], strict=True)]
        return VisualTokens(visual.merger(levels[0]), deepstack)

    def encoder_output(self, tokens: VisualTokens):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        return BaseModelOutputWithDeepstackFeatures(
            pooler_output=(tokens.embeds,), deepstack_features=[(level,) for level in tokens.deepstack]
        )
