"""Qwen2-VL (2B/7B/72B): a 2-D RoPE ViT without window attention, LayerNorm + GELU MLP blocks whose widths are
`embed_dim` and `mlp_ratio`, and a merger that projects to `vision_config.hidden_size` (the LM width)."""

from __future__ import annotations

from components._shared.model.families.base import Family


class Qwen2_VL(Family):
    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    vision_mlp_is_ratio = True
    grounding = "relative_1000"  # <|box_start|>(x1,y1),(x2,y2)<|box_end|> in thousandths of each side
    processor_class = "Qwen2VLProcessor"

    def vision_width(self, vision) -> int:
        return int(vision.embed_dim)

    def vision_intermediate(self, vision) -> int:
        return int(vision.embed_dim * vision.mlp_ratio)

    def set_vision_sizes(self, vision, *, hidden: int, heads: int, intermediate: int | None) -> None:
        if intermediate and intermediate % hidden:
            raise ValueError(
                f"student vision_intermediate={intermediate}: Qwen2-VL sets the ViT MLP width as an integer "
                f"multiple (mlp_ratio) of vision_hidden={hidden}; use a multiple of it."
            )
        vision.embed_dim, vision.num_heads = hidden, heads
        if intermediate:
            vision.mlp_ratio = intermediate // hidden

    def set_merger_output(self, config, hidden: int) -> None:
        config.vision_config.hidden_size = hidden

    def cut_vision_depth(self, vision, depth: int) -> None:
        vision.depth = depth

    def config_class(self):
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig

    def tiny_vision(self, *, depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
        return {
            "depth": depth,
            "embed_dim": hidden,
            "num_heads": heads,
            "mlp_ratio": intermediate // hidden,
            "hidden_size": out_hidden,
            "patch_size": self.patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }

    def vision_tower_class(self):
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
