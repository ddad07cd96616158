"""The Qwen4 preview (`qwen4_exp`, Qwen3.8-Flash-Next: 125B total, 6B active): a multimodal MoE whose 48 layers are
12 x (3 Gated DeltaNet + 1 indexed attention: a QSA indexer picks the key blocks each query attends to), with
hyper-connections (several residual streams per token), per-layer embeddings (PLE: hashed token n-grams and a
dilated convolution, on some linear-attention layers) and 512 experts (top-10 + 1 shared). The ViT is Qwen3.5's
(patch 16, learned position table) with axial rotary positions. Vocabulary and chat template are Qwen3.5's
(248,320 tokens; the preview's processor is `Qwen3VLProcessor`, its token ids Qwen3.5's).

Packing is exact by piece: the indexed attention and its indexer read only the keys the block-causal mask of the
packed row leaves visible (the indexer pools its blocks from them), so the LM runs plain sdpa with that mask
(`splits_packed_rows = False`); the Gated DeltaNet layers run per sample from a zero state as Qwen3.5's do; the
PLE layers run per sample, so their n-grams and convolution restart at each sample, not only at the
end-of-sequence token (segmented.py); hyper-connections and the MoE act per token. Tested: packed = padded
logits, and the gradients of a packed row equal the samples' one by one.
"""

from __future__ import annotations

from typing import ClassVar

from components._shared.model.families.qwen3_5 import Qwen3_5
from components._shared.model.families.segmented import make_layer_carry_lengths, make_segmented


class Qwen4Exp(Qwen3_5):
    name = "qwen4_exp"
    model_types: ClassVar[tuple[str, ...]] = ("qwen4_exp",)
    # LoRA: the indexed layers' attention, the linear-attention projections, the shared expert (the routed experts
    # are fused 3-D parameters, not linear modules), the ViT's qkv and the merger.
    lora_targets = [
        r"language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
        r"language_model\.layers\.\d+\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)",
        r"language_model\.layers\.\d+\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)",
        r"visual\.blocks\.\d+\.attn\.qkv",
        r"visual\.merger\.linear_fc(1|2)",
    ]
    lora_required = ["visual.merger", "attn.qkv", "linear_attn", "self_attn"]
    splits_packed_rows = False  # the indexer reads the block-causal mask (its L x L cost: docs/models.md)

    def config_class(self):
        from transformers import Qwen4ExpConfig

        return Qwen4ExpConfig

    def vision_tower_class(self):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

        return Qwen4ExpVisionModel

    def hidden_state_width(self, text, layer: int) -> int:
        """The streams side by side between layers; the last layer's output is mixed back to one."""
        last = layer == int(text.num_hidden_layers) - 1
        return int(text.hidden_size) * (1 if last else int(text.hc_count))

    def student_layer_types(self, text, layers: int) -> list[str]:
        """The hybrid pattern (3 linear, 1 indexed), ending on an indexed-attention layer however few remain."""
        return [
            "indexed_attention" if kind == "full_attention" else kind
            for kind in super().student_layer_types(text, layers)
        ]

    def map_layer_ids(self, text, full_depth: int) -> None:
        """The one-indexed PLE layers onto the nearest linear-attention layer of the cut depth (PLE runs on linear
        layers only); none where the cut keeps no linear layer (a one-layer student)."""
        linear = [i + 1 for i, kind in enumerate(text.layer_types) if kind == "linear_attention"]
        depth = len(text.layer_types)
        ids = text.ple_layer_ids if linear else []
        text.ple_layer_ids = sorted({min(linear, key=lambda k: abs(k - i * depth / full_depth)) for i in ids})

    def rehearsal_cuts(self, text) -> dict[str, tuple[int, int, str]]:
        """The expert count (512 x 1.6B parameters a layer) and the PLE n-gram table's rows (41B parameters at
        20M rows a head) cut; every width, top-k and the n-gram heads kept."""
        cuts = {}
        experts = max(16, int(text.num_experts_per_tok) + 1)
        if int(text.num_experts) > experts:
            cuts["num_experts"] = (int(text.num_experts), experts, "the routed experts; each one's width kept")
        if text.ple_layer_ids and int(text.ngram_vocab_size_base) > 20_000:
            why = "the PLE n-gram table's rows per head; its heads and width kept"
            cuts["ngram_vocab_size_base"] = (int(text.ngram_vocab_size_base), 20_000, why)
        return cuts

    def tiny_vision(self, *, depth: int, hidden: int, heads: int, intermediate: int, out_hidden: int) -> dict:
        return {
            **super().tiny_vision(
                depth=depth, hidden=hidden, heads=heads, intermediate=intermediate, out_hidden=out_hidden
            ),
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        }

    def tiny_text(self, text: dict) -> dict:
        """Qwen3.5's small text config plus every piece of the preview: 4 experts (top 2) and a shared one, two
        hyper-connection streams, PLE on the first layer, the QSA indexer on the indexed-attention layer."""
        small = {key: value for key, value in super().tiny_text(text).items() if key != "intermediate_size"}
        hidden = small["hidden_size"]
        return {
            **small,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": text.get("intermediate_size", 2 * hidden) // 2,
            "shared_expert_intermediate_size": text.get("intermediate_size", 2 * hidden) // 2,
            "hc_count": 2,
            "hc_lowrank": 8,
            "ple_layer_ids": [1],
            "ple_embed_dim": hidden // 2,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 1000,
            "make_ngram_vocab_size_divisible_by": 8,
            "split_ngram_parts": 1,
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": small["head_dim"] // 2,
            "indexer_budget": 8,
            "indexer_compress_ratio": 4,
        }

    def prepare_packing(self, qwen) -> None:
        for layer in qwen.language_model.layers:
            linear, ple = getattr(layer, "linear_attn", None), getattr(layer, "ple", None)
            if linear is not None:
                make_segmented(linear)
            if ple is not None:
                make_segmented(ple, takes_tokens=True)
            if linear is not None or ple is not None:
                make_layer_carry_lengths(layer)
