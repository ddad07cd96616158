"""The builtin tiny models of the presets, built offline from recipes (no downloads).

    tiny-qwen2_5-vl   the measured tiny recipe (docs/references.md): LM hidden 64, 2 layers, 4 heads / 2 KV heads,
                      ViT depth 2 hidden 64
    demo-qwen2_5-vl   LM hidden 128, 4 layers; ViT depth 4 hidden 128 (see DEMO_QWEN2_5_VL)
    tiny-qwen2-vl     the same scale with the Qwen2-VL classes (2-D RoPE ViT, LayerNorm, no window attention)
    tiny-qwen3-vl     the same scale with Qwen3-VL's structure (patch 16, DeepStack levels 0-2 of 4 ViT blocks)
    tiny-qwen3_5      the same scale with Qwen3.5's (3 Gated DeltaNet layers + 1 gated full-attention layer)
    tiny-qwen4_exp    the Qwen4 preview's pieces at that scale: 3 Gated DeltaNet + 1 indexed-attention layer, 4
                      experts (top 2) + a shared one, 2 hyper-connection streams, PLE on the first layer
    tiny-clip         a CLIPModel trained contrastively on the shapes world (clip.py); the clean_data caption check

Every model is a Hugging Face directory (config.json, model.safetensors, processor files) plus
`builtin.json` (name, recipe, recipe version, parameter count, build seconds; for CLIP its held-out
metrics and the recommended cosine threshold). Qwen weights are a seeded random init; the tokenizer
is trained on the world's text (components/synth_world/tokenizer.py). Use through
`components._shared.model.sources.resolve_model("builtin:NAME")`, which caches and builds atomically; tiny-clip
ships with the package instead (shipped.py: ~20 min to train, and not bit-identical across machines).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from components._shared.model.families import FAMILIES
from components.synth_world import family_processors
from components.synth_world import tokenizer as world_tokenizer
from components.synth_world.clip import (  # noqa: F401 - re-exported: the CLIP half of the builtins
    choose_threshold,
    clip_cosine,
    clip_processor,
    evaluate_clip,
    mismatched_captions,
    one_word_neighbours,
    separation_metrics,
    train_clip,
)


@dataclass(frozen=True)
class QwenRecipe:
    """Sizes of a builtin Qwen-VL model. head_dim = hidden / heads; sum(mrope_section) must be head_dim / 2."""

    family: str  # a key of components._shared.model.families.FAMILIES
    version: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    tokenizer_vocab: int = 512
    image_pixels: int = world_tokenizer.TINY_IMAGE_PIXELS


@dataclass(frozen=True)
class ClipRecipe:
    """Sizes and training budget of the builtin CLIP (in steps, not seconds: wall time varies with the load)."""

    version: str
    image_size: int = 112
    patch_size: int = 16
    vision_hidden: int = 64
    vision_layers: int = 2
    text_hidden: int = 64
    text_layers: int = 2
    heads: int = 4
    projection_dim: int = 64
    max_text_tokens: int = 64
    tokenizer_vocab: int = 512
    train_pairs: int = 4000
    steps: int = 800
    batch_size: int = 128
    lr: float = 2e-3
    warmup_steps: int = 40
    hard_negatives: bool = True
    altered_per_image: int = 1  # lake-style mismatched captions drawn per training picture (all scored each step)
    altered_loss_weight: float = 0.0  # weight of a per-image softmax: own caption vs only its altered captions
    shape_swaps_per_image: int = 0  # extra negatives per picture: its caption with only the shapes changed
    pair_loss_weight: float = 0.0  # weight of a sigmoid loss: own caption above a learned cosine, altered below
    calibration_pairs: int = 1000
    test_pairs: int = 1000
    min_precision: float = 0.99  # chosen on calibration with a margin over the 0.98 goal on held-out pairs


TINY_QWEN2_5_VL = QwenRecipe(
    family="qwen2_5_vl",
    version="1",
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    mrope_section=(2, 3, 3),
    vision_depth=2,
    vision_hidden=64,
    vision_heads=4,
    vision_intermediate=128,
)
# The demo doubles width and depth of both towers. Measured on the CPU: size alone does not buy
# accuracy per step, so the demo is not "better", it is the smallest model whose ViT can mix the whole
# 8x8 patch grid several times (4 blocks, full attention in blocks 1 and 3) - what counting and
# left/right relations need once the world has bigger shapes - while a step stays well under a
# second on a CPU core, so a demo run trains in minutes.
DEMO_QWEN2_5_VL = QwenRecipe(
    family="qwen2_5_vl",
    version="1",
    hidden=128,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=384,
    mrope_section=(4, 6, 6),
    vision_depth=4,
    vision_hidden=128,
    vision_heads=4,
    vision_intermediate=256,
)
TINY_QWEN2_VL = QwenRecipe(
    family="qwen2_vl",
    version="1",
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    mrope_section=(2, 3, 3),
    vision_depth=2,
    vision_hidden=64,
    vision_heads=4,
    vision_intermediate=256,
)
# Qwen3-VL and Qwen3.5 at the tiny scale, each with its family's structure: patch 16 (128 px -> 8x8 patches,
# 16 visual tokens like the 112 px of patch 14), a learned position table, interleaved M-RoPE; Qwen3-VL with
# three DeepStack levels over 4 ViT blocks, Qwen3.5 with 3 linear-attention layers and 1 full-attention layer,
# head_dim 64 with rotary on a quarter of it (head_dim 256, factor 0.25 in the real checkpoints).
TINY_QWEN3_VL = QwenRecipe(
    family="qwen3_vl",
    version="1",
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    mrope_section=(3, 3, 2),
    vision_depth=4,
    vision_hidden=64,
    vision_heads=4,
    vision_intermediate=128,
    image_pixels=128 * 128,
)
TINY_QWEN3_5 = QwenRecipe(
    family="qwen3_5",
    version="1",
    hidden=64,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=128,
    mrope_section=(3, 3, 2),
    vision_depth=2,
    vision_hidden=64,
    vision_heads=4,
    vision_intermediate=128,
    image_pixels=128 * 128,
)
TINY_QWEN4_EXP = replace(TINY_QWEN3_5, family="qwen4_exp")  # Qwen3.5's sizes; the family adds the preview's pieces
# 3: lake-like sizes, no centre crop, the lake's mismatches as negatives. 4: four altered captions per picture
# plus a per-picture softmax against them (held-out lake-mismatch recall 0.70). 5: what v4 missed were shape
# changes (a red circle captioned as a red square): 8-pixel patches at 96x96 (0.80), three shape-only swaps per
# picture as extra negatives, a sigmoid pair loss that puts own captions above one cosine and altered ones below
# it (the way clean_data thresholds), and 12,000 training pictures (docs/stages/clean_data.md).
TINY_CLIP = ClipRecipe(
    version="5",
    image_size=96,
    patch_size=8,
    train_pairs=12000,
    altered_per_image=4,
    altered_loss_weight=1.0,
    shape_swaps_per_image=3,
    pair_loss_weight=1.0,
)

RECIPES: dict[str, QwenRecipe | ClipRecipe] = {
    "tiny-qwen2_5-vl": TINY_QWEN2_5_VL,
    "demo-qwen2_5-vl": DEMO_QWEN2_5_VL,
    "tiny-qwen2-vl": TINY_QWEN2_VL,
    "tiny-qwen3-vl": TINY_QWEN3_VL,
    "tiny-qwen3_5": TINY_QWEN3_5,
    "tiny-qwen4_exp": TINY_QWEN4_EXP,
    "tiny-clip": TINY_CLIP,
}
BUILTIN_NAMES: tuple[str, ...] = tuple(RECIPES)


def recipe_version(name: str) -> str:
    """The cache key version of a builtin: "<recipe version>.<hash of the code of world.py, lake.py, tokenizer.py>".

    Bump the recipe version when a recipe changes; a change of the world or the tokenizer code (which
    changes the vocabulary and CLIP's training data) gives a new key by itself, so no cache goes stale. The
    hash is of the parsed code (its AST), so reformatting or editing comments keeps the key (and the cache).
    """
    import ast
    import hashlib

    from components.synth_world import lake, world

    digest = hashlib.sha256()
    for module in (world, lake, world_tokenizer):
        tree = ast.parse(Path(str(module.__file__)).read_text())
        digest.update(ast.dump(tree, include_attributes=False).encode())
    return f"{_recipe(name).version}.{digest.hexdigest()[:8]}"


def build(name: str, dest_dir: Path, *, seed: int = 0) -> Path:
    """Build builtin `name` into `dest_dir` (created; must be empty) and return it."""
    recipe = _recipe(name)
    dest_dir = Path(dest_dir)
    if dest_dir.exists() and any(dest_dir.iterdir()):
        raise ValueError(f"Builtin destination {dest_dir} is not empty; pass a fresh directory.")
    dest_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if isinstance(recipe, ClipRecipe):
        info = _build_clip(recipe, dest_dir, seed=seed)
    else:
        info = _build_qwen(recipe, dest_dir, seed=seed)
    meta = {
        "name": name,
        "recipe_version": recipe.version,
        "recipe": asdict(recipe),
        "seed": seed,
        "build_seconds": round(time.perf_counter() - started, 2),
        "transformers_version": _transformers_version(),
        **info,
    }
    (dest_dir / "builtin.json").write_text(json.dumps(meta, indent=2) + "\n")
    return dest_dir


def provide(name: str, dest_dir: Path) -> Path:
    """Builtin `name` into the empty `dest_dir`: the package's shipped copy when it is this recipe's (shipped.py),
    else built by the recipe."""
    from components.synth_world import shipped

    if shipped.materialize(name, recipe_version(name), Path(dest_dir)):
        return Path(dest_dir)
    return build(name, dest_dir)


def build_world_tokenizer(vocab_size: int = 512, *, seed: int = 0):
    """The world tokenizer every builtin shares (Qwen2Tokenizer + Qwen2-VL specials + chat template)."""
    return world_tokenizer.train_tokenizer(world_tokenizer.world_corpus(seed=seed), vocab_size=vocab_size)


def qwen_config(recipe: QwenRecipe, tokenizer):
    """A config of `recipe.family` at the recipe's sizes, with token ids taken from `tokenizer`; the family gives
    its own structure (window / full attention blocks, DeepStack levels, the hybrid layer pattern)."""
    family = FAMILIES[recipe.family]
    head_dim = recipe.hidden // recipe.heads
    if recipe.hidden % recipe.heads or sum(recipe.mrope_section) * 2 != head_dim:
        raise ValueError(
            f"Recipe {recipe}: hidden must divide by heads and sum(mrope_section) must be (hidden/heads)/2="
            f"{head_dim // 2}."
        )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in world_tokenizer.SPECIAL_TOKENS}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": recipe.hidden,
        "intermediate_size": recipe.intermediate,
        "num_hidden_layers": recipe.layers,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.kv_heads,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": list(recipe.mrope_section),
        },
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = family.tiny_vision(
        depth=recipe.vision_depth,
        hidden=recipe.vision_hidden,
        heads=recipe.vision_heads,
        intermediate=recipe.vision_intermediate,
        out_hidden=recipe.hidden,
    )
    return family.config_class()(
        text_config=family.tiny_text(text),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _build_qwen(recipe: QwenRecipe, dest_dir: Path, *, seed: int) -> dict:
    from transformers import AutoModelForImageTextToText, GenerationConfig

    tokenizer = family_processors.family_tokenizer(
        build_world_tokenizer(recipe.tokenizer_vocab, seed=seed), recipe.family
    )
    config = qwen_config(recipe, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ],
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        do_sample=False,
        max_new_tokens=32,
    )
    model.save_pretrained(dest_dir)
    processor = family_processors.build_processor(
        tokenizer, family=recipe.family, min_pixels=recipe.image_pixels, max_pixels=recipe.image_pixels
    )
    processor.save_pretrained(dest_dir)
    return {
        "kind": "qwen-vl",
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "visual_tokens_per_image": family_processors.visual_tokens(
            processor, 112, 112, min_pixels=recipe.image_pixels, max_pixels=recipe.image_pixels
        ),
    }


# ---------------------------------------------------------------------------------------------- CLIP


def _build_clip(recipe: ClipRecipe, dest_dir: Path, *, seed: int) -> dict:
    from components.synth_world.lake import lake_like_pairs

    tokenizer = build_world_tokenizer(recipe.tokenizer_vocab, seed=seed)
    train = lake_like_pairs(recipe.train_pairs, seed=seed * 1000 + 1, altered=recipe.altered_per_image)
    calibration = lake_like_pairs(recipe.calibration_pairs, seed=seed * 1000 + 2)
    test = lake_like_pairs(recipe.test_pairs, seed=seed * 1000 + 3)
    model, processor, stats = train_clip(recipe, tokenizer, train, seed=seed)
    calibration_metrics = evaluate_clip(model, processor, calibration, min_precision=recipe.min_precision)
    threshold = calibration_metrics["threshold"]
    test_metrics = evaluate_clip(model, processor, test, threshold)
    model.save_pretrained(dest_dir)
    processor.save_pretrained(dest_dir)
    return {
        "kind": "clip",
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "score": "cosine of CLIPModel(...).image_embeds and .text_embeds (see clip_cosine); reject when < threshold",
        "recommended_threshold": threshold,
        "training": stats,
        "calibration": calibration_metrics,
        "heldout": test_metrics,
    }


def _recipe(name: str) -> QwenRecipe | ClipRecipe:
    if name not in RECIPES:
        raise ValueError(f"Unknown builtin model {name!r}; builtin names: {', '.join(BUILTIN_NAMES)}.")
    return RECIPES[name]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
