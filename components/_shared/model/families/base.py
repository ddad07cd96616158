"""What every Qwen vision-language family shares, and the hooks where one family differs from another.

A `Family` answers the questions stage code would otherwise answer with `if model_type == ...`: which config
fields hold the vision widths, which modules are mergers, what a feature cache stores, how the visual tokens of
cached features are made, what packing must hand to the language model's kernels, which chat conventions the
checkpoints follow. The defaults are Qwen2.5-VL's; each family module overrides what differs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

Grounding = Literal["absolute", "relative_1000"]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's normalisation, Qwen2-VL's and Qwen2.5-VL's
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VisualTokens:
    """The visual rows a family's language model takes at its image tokens: `embeds` (n_image_tokens, hidden),
    plus one tensor of the same shape per DeepStack level (Qwen3-VL; empty for the other families)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    def split(self, sizes: list[int]) -> list[VisualTokens]:
        """One VisualTokens per image, `sizes` visual tokens each."""
        levels = [level.split(sizes) for level in self.deepstack]
        return [VisualTokens(part, [level[i] for level in levels]) for i, part in enumerate(self.embeds.split(sizes))]

    @staticmethod
    def cat(parts: list[VisualTokens]) -> VisualTokens:
        levels = len(parts[0].deepstack)
        return VisualTokens(
            torch.cat([p.embeds for p in parts]),
            [torch.cat([p.deepstack[k] for p in parts]) for k in range(levels)],
        )


class Family:
    """Qwen2.5-VL's conventions; subclasses override what their generation changes."""

    name: ClassVar[str] = "qwen2_5_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl",)
    patch_size: ClassVar[int] = 14  # the ViT patch; images resize to multiples of patch * spatial_merge_size
    # LoRA defaults (regexes, full match on module names): LM attention + MLP, the ViT's fused qkv and every merger;
    # the mergers are listed explicitly, LoRA that silently leaves the projector frozen is a known pain.
    lora_targets: ClassVar[list[str]] = [
        r"language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
        r"language_model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)",
        r"visual\.blocks\.\d+\.attn\.qkv",
        r"visual\.merger\.mlp\.(0|2)",
    ]
    lora_required: ClassVar[list[str]] = ["visual.merger", "attn.qkv"]  # fragments that must get adapters
    # extra variables for the checkpoint's own chat template (Qwen3.5: answer without a thinking block)
    template_kwargs: ClassVar[dict[str, object]] = {}
    grounding: ClassVar[Grounding] = "absolute"  # box coordinates in resized-image pixels
    merger_modules: ClassVar[tuple[str, ...]] = ("merger",)  # modules under `visual.` that project into the LM
    vision_mlp_is_ratio: ClassVar[bool] = False  # the ViT MLP width is a multiple of its width (Qwen2-VL)
    explicit_head_dim: ClassVar[bool] = False  # attention width = heads x config.head_dim, apart from hidden (Qwen3)
    prunable: ClassVar[bool] = True  # distill's structured pruning knows this layout (distill/prune.py)
    # The checkpoints' processor (transformers class names) and their image normalisation
    processor_class: ClassVar[str] = "Qwen2_5_VLProcessor"
    video_processor_class: ClassVar[str] = "Qwen2VLVideoProcessor"
    image_mean: ClassVar[tuple[float, ...]] = CLIP_MEAN
    image_std: ClassVar[tuple[float, ...]] = CLIP_STD
    vocabulary: ClassVar[str] = "qwen2"  # the BPE its checkpoints use (the Qwen2 151k one; Qwen3.5: its 248k one)
    extra_tokens: ClassVar[tuple[str, ...]] = ()  # ordinary added tokens of the real vocabulary beyond Qwen2-VL's
    needs_sample_lengths: ClassVar[bool] = False  # packed rows must hand the LM each sample's length (Qwen3.5)
    # The LM runs `sdpa_packed` (attention.py: packed rows split at the position restarts, no mask built); False:
    # plain sdpa with transformers' block-causal mask, for layers that read the mask themselves (the Qwen4 preview's
    # QSA indexer picks its key blocks from it)
    splits_packed_rows: ClassVar[bool] = True
    # RL's first-step check: mean |sampling - trainer| token log-probability accepted per precision (docs/stages/rl.md)
    parity_tolerance: ClassVar[dict[str, float]] = {"fp32": 1e-4, "bf16": 0.05}

    # ---------------------------------------------------------------- config fields

    def vision_width(self, vision) -> int:
        return int(vision.hidden_size)

    def vision_intermediate(self, vision) -> int:
        return int(vision.intermediate_size)

    def set_vision_sizes(self, vision, *, hidden: int, heads: int, intermediate: int | None) -> None:
        vision.hidden_size, vision.num_heads = hidden, heads
        if intermediate:
            vision.intermediate_size = intermediate

    def set_merger_output(self, config, hidden: int) -> None:
        """Make the merger project to the LM width `hidden`."""
        config.vision_config.out_hidden_size = hidden

    def cut_vision_depth(self, vision, depth: int) -> None:
        """Keep the first `depth` ViT blocks; block-index lists (window/full attention) follow."""
        vision.depth = depth
        vision.fullatt_block_indexes = [i for i in vision.fullatt_block_indexes if i < depth] or [depth - 1]

    def lm_mlp_width(self, text) -> int:
        """The MLP width one token passes through: the dense intermediate size, or for a mixture of experts its top-k
        experts' and the shared expert's together (what the memory plan counts activations by)."""
        if getattr(text, "num_experts", None) and getattr(text, "moe_intermediate_size", None):
            shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
            return int(text.num_experts_per_tok) * int(text.moe_intermediate_size) + int(shared)
        return int(text.intermediate_size)

    def hidden_state_width(self, text, layer: int) -> int:
        """The width of decoder layer `layer`'s output (`output_hidden_states[layer + 1]`): the hidden size, times
        the residual streams between layers where the LM has several (the Qwen4 preview's hyper-connections)."""
        return int(text.hidden_size)

    def rotary_half(self, text, head_dim: int) -> int:
        """How many frequency pairs M-RoPE splits into its (temporal, height, width) sections."""
        return head_dim // 2

    def student_layer_types(self, text, layers: int) -> list[str]:
        return ["full_attention"] * layers

    def map_layer_ids(self, text, full_depth: int) -> None:
        """Per-layer id lists of the LM mapped onto its cut depth, once `layer_types` is the cut one; none here."""

    def rehearsal_cuts(self, text) -> dict[str, tuple[int, int, str]]:
        """Counts a real-width rehearsal checkpoint cuts beyond its depth so that it fits one machine, widths
        kept: {text field: (real, kept, why)}. None for the dense families."""
        return {}

    def config_class(self):
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig

    def tiny_vision(self, *, depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
        """A small vision config of this family's real structure (used by the builtins)."""
        return {
            **self._vision_sizes(depth, hidden, heads, intermediate, out_hidden),
            "window_size": 112,
            "fullatt_block_indexes": list(range(1, depth, 2)),
        }

    def _vision_sizes(self, depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
        return {
            "depth": depth,
            "hidden_size": hidden,
            "num_heads": heads,
            "intermediate_size": intermediate,
            "out_hidden_size": out_hidden,
            "patch_size": self.patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }

    def tiny_text(self, text: dict) -> dict:
        """Family-specific fields added to a small text config (`text` holds the common ones)."""
        return text

    # ---------------------------------------------------------------- modules

    def vision_tower_class(self):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel

    def cached_levels(self, vision) -> list[int]:
        """ViT blocks whose outputs a feature cache stores besides the last one (DeepStack's inputs)."""
        return []

    def visual_tokens(self, visual, features: torch.Tensor) -> VisualTokens:
        """The LM's visual rows from cached pre-merger features (`features`: rows in processor order, the
        cached levels side by side in the last dimension)."""
        dtype = next(visual.merger.parameters()).dtype
        return VisualTokens(visual.merger(features.to(dtype)))

    def pixel_tokens(self, qwen, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisualTokens:
        """The LM's visual rows computed by the model's own vision tower."""
        out = qwen.get_image_features(pixel_values, grid_thw)
        deepstack = getattr(out, "deepstack_features", None) or []
        return VisualTokens(torch.cat(list(out.pooler_output)), [torch.cat(list(level)) for level in deepstack])

    def encoder_output(self, tokens: VisualTokens):
        """`tokens` as the `mm_encoder_outputs["image"]` the model's forward takes instead of pixels."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=(tokens.embeds,))

    def build_processor(self, tokenizer, *, min_pixels: int, max_pixels: int, chat_template: str):
        """This family's processor over `tokenizer` (patch, merge 2, normalisation, processor classes), resizing
        images within [min_pixels, max_pixels]."""
        import transformers

        unit = (self.patch_size * 2) ** 2
        if min_pixels < unit or max_pixels < min_pixels:
            raise ValueError(
                f"min_pixels={min_pixels}, max_pixels={max_pixels}: need {unit} <= min_pixels <= max_pixels "
                f"(one merged {self.patch_size * 2}x{self.patch_size * 2} patch at least)."
            )
        common = {
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            "patch_size": self.patch_size,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }
        return getattr(transformers, self.processor_class)(
            image_processor=transformers.Qwen2VLImageProcessor(**common),
            tokenizer=tokenizer,
            video_processor=getattr(transformers, self.video_processor_class)(**common),
            chat_template=chat_template,
        )

    def packed_samples(self, lengths: list[int] | None):
        """The context a packed row's forward runs in: the LM treats the row as samples of these lengths (only
        families with `needs_sample_lengths`; attention already splits at the position restarts)."""
        return contextlib.nullcontext()

    def prepare_packing(self, qwen) -> None:
        """Make the language model keep packed samples apart (attention already splits at position restarts)."""

    def zero3_external_parameters(self, qwen) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        """(module, parameter) pairs where a module's forward reads a child's parameter without calling the child.
        ZeRO-3 gathers a parameter only around its owner's forward; these are registered with the reader instead."""
        return []
