"""The builtin tiny models of the presets, built offline from recipes (no downloads).

    tiny-qwen2_5-vl   GUIDE section 5 recipe: LM hidden 64, 2 layers, 4 heads / 2 KV heads, ViT depth 2 hidden 64
    demo-qwen2_5-vl   LM hidden 128, 4 layers; ViT depth 4 hidden 128 (see DEMO_QWEN2_5_VL)
    tiny-qwen2-vl     the same scale with the Qwen2-VL classes (2-D RoPE ViT, LayerNorm, no window attention)
    tiny-clip         a CLIPModel trained contrastively on the shapes world; the clean_data caption check

Every model is a Hugging Face directory (config.json, model.safetensors, processor files) plus
`builtin.json` (name, recipe, recipe version, parameter count, build seconds; for CLIP its held-out
metrics and the recommended cosine threshold). Qwen weights are a seeded random init; the tokenizer
is trained on the world's text (components/synth_world/tokenizer.py). Use through
`components._shared.models.resolve_model("builtin:NAME")`, which caches and builds atomically.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from components.synth_world import tokenizer as world_tokenizer


@dataclass(frozen=True)
class QwenRecipe:
    """Sizes of a builtin Qwen-VL model. head_dim = hidden / heads; sum(mrope_section) must be head_dim / 2."""

    family: str  # "qwen2_5_vl" or "qwen2_vl"
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
    """Sizes and training budget of the builtin CLIP (budget in steps, not seconds: GUIDE section 5)."""

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
# The demo doubles width and depth of both towers. GUIDE section 5 measured that size alone does not buy
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
# 3: lake-like sizes, no centre crop, the lake's mismatches as negatives. 4: four altered captions per picture
# plus a per-picture softmax against them (held-out lake-mismatch recall 0.745 at precision 0.987, v3 0.68).
TINY_CLIP = ClipRecipe(version="4", altered_per_image=4, altered_loss_weight=1.0)

RECIPES: dict[str, QwenRecipe | ClipRecipe] = {
    "tiny-qwen2_5-vl": TINY_QWEN2_5_VL,
    "demo-qwen2_5-vl": DEMO_QWEN2_5_VL,
    "tiny-qwen2-vl": TINY_QWEN2_VL,
    "tiny-clip": TINY_CLIP,
}
BUILTIN_NAMES: tuple[str, ...] = tuple(RECIPES)


def recipe_version(name: str) -> str:
    """The cache key version of a builtin: "<recipe version>.<hash of world.py + lake.py + tokenizer.py>".

    Bump the recipe version when a recipe changes; a change of the world or the tokenizer code (which
    changes the vocabulary and CLIP's training data) gives a new key by itself, so no cache goes stale.
    """
    import hashlib

    from components.synth_world import lake, world

    digest = hashlib.sha256()
    for module in (world, lake, world_tokenizer):
        digest.update(Path(module.__file__).read_bytes())
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


def build_world_tokenizer(vocab_size: int = 512, *, seed: int = 0):
    """The world tokenizer every builtin shares (Qwen2Tokenizer + Qwen2-VL specials + chat template)."""
    return world_tokenizer.train_tokenizer(world_tokenizer.world_corpus(seed=seed), vocab_size=vocab_size)


def qwen_config(recipe: QwenRecipe, tokenizer):
    """A Qwen2.5-VL / Qwen2-VL config for `recipe`, with token ids taken from `tokenizer`."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    head_dim = recipe.hidden // recipe.heads
    if recipe.hidden % recipe.heads or sum(recipe.mrope_section) * 2 != head_dim:
        raise ValueError(
            f"Recipe {recipe}: hidden must divide by heads and sum(mrope_section) must be head_dim/2={head_dim // 2}."
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
    vision_common = {
        "depth": recipe.vision_depth,
        "num_heads": recipe.vision_heads,
        "patch_size": world_tokenizer.PATCH_SIZE,
        "spatial_merge_size": world_tokenizer.MERGE_SIZE,
        "temporal_patch_size": 2,
    }
    if recipe.family == "qwen2_5_vl":
        vision = dict(
            vision_common,
            hidden_size=recipe.vision_hidden,
            intermediate_size=recipe.vision_intermediate,
            out_hidden_size=recipe.hidden,
            window_size=112,
            fullatt_block_indexes=list(range(1, recipe.vision_depth, 2)),
        )
        config_cls = Qwen2_5_VLConfig
    elif recipe.family == "qwen2_vl":
        vision = dict(
            vision_common,
            embed_dim=recipe.vision_hidden,
            hidden_size=recipe.hidden,
            mlp_ratio=recipe.vision_intermediate // recipe.vision_hidden,
        )
        config_cls = Qwen2VLConfig
    else:
        raise ValueError(f"Unknown Qwen family {recipe.family!r}; use qwen2_5_vl or qwen2_vl.")
    return config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _build_qwen(recipe: QwenRecipe, dest_dir: Path, *, seed: int) -> dict:
    from transformers import AutoModelForImageTextToText, GenerationConfig

    tokenizer = build_world_tokenizer(recipe.tokenizer_vocab, seed=seed)
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
    processor = world_tokenizer.build_processor(
        tokenizer, family=recipe.family, min_pixels=recipe.image_pixels, max_pixels=recipe.image_pixels
    )
    processor.save_pretrained(dest_dir)
    return {
        "kind": "qwen-vl",
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "visual_tokens_per_image": world_tokenizer.visual_tokens(
            112, 112, min_pixels=recipe.image_pixels, max_pixels=recipe.image_pixels
        ),
    }


# ---------------------------------------------------------------------------------------------- CLIP


def clip_processor(tokenizer, recipe: ClipRecipe = TINY_CLIP):
    """CLIPProcessor: CLIP image preprocessing at recipe.image_size + the world tokenizer ending each text in EOS.

    CLIP pools the text at the first EOS token, so the tokenizer appends `<|endoftext|>` to every text.
    """
    from tokenizers import Tokenizer, processors
    from transformers import CLIPImageProcessor, CLIPProcessor, PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
    )
    text_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        pad_token=eos,
        bos_token=None,
        unk_token=None,
        model_max_length=recipe.max_text_tokens,
    )
    size = recipe.image_size
    # Resize the whole picture to size x size (no centre crop): lake images are up to 2:1, and a crop would
    # cut away objects the caption names, which reads as a mismatch.
    images = CLIPImageProcessor(size={"height": size, "width": size}, do_center_crop=False)
    return CLIPProcessor(image_processor=images, tokenizer=text_tokenizer)


@torch.no_grad()
def clip_cosine(
    model, processor, images: Sequence, captions: Sequence[str], *, batch_size: int = 256
) -> np.ndarray:
    """Cosine similarity of each (image, caption) pair under a CLIPModel; shape [len(images)]."""
    if len(images) != len(captions):
        raise ValueError(f"clip_cosine got {len(images)} images but {len(captions)} captions; pass pairs.")
    model.eval()
    scores = []
    for start in range(0, len(images), batch_size):
        batch = processor(
            images=list(images[start : start + batch_size]),
            text=list(captions[start : start + batch_size]),
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        out = model(**batch)
        scores.append((out.image_embeds * out.text_embeds).sum(-1))  # both L2-normalized by CLIPModel
    return torch.cat(scores).float().numpy()


def choose_threshold(matched: np.ndarray, mismatched: np.ndarray, *, min_precision: float = 0.98) -> float:
    """Reject pairs with cosine < threshold: the threshold with the best mismatched recall whose rejection
    precision (on equally many matched and mismatched pairs) is >= min_precision."""
    scores = np.concatenate([matched, mismatched])
    is_bad = np.concatenate([np.zeros(len(matched), bool), np.ones(len(mismatched), bool)])
    order = np.argsort(scores, kind="stable")
    bad_sorted = is_bad[order]
    flagged_bad = np.cumsum(bad_sorted)  # rejecting the k+1 lowest scores
    precision = flagged_bad / np.arange(1, len(scores) + 1)
    ok = np.flatnonzero(precision >= min_precision)
    if len(ok) == 0:
        return float(scores[order[0]])  # nothing can be rejected at that precision: reject (almost) nothing
    k = ok[-1]
    upper = scores[order[k + 1]] if k + 1 < len(scores) else scores[order[k]] + 1e-6
    return float((scores[order[k]] + upper) / 2)


def separation_metrics(matched: np.ndarray, mismatched: np.ndarray, threshold: float) -> dict[str, float]:
    """Rejection quality at `threshold` (reject when cosine < threshold) plus the two cosine distributions."""
    rejected_bad = int((mismatched < threshold).sum())
    rejected_good = int((matched < threshold).sum())
    both = np.concatenate([matched, mismatched])
    ranks = both.argsort().argsort()[: len(matched)]  # AUC via the rank-sum of the matched scores
    auc = (ranks.sum() + len(matched) - len(matched) * (len(matched) + 1) / 2) / (
        len(matched) * len(mismatched)
    )
    return {
        "threshold": float(threshold),
        "mismatched_recall": rejected_bad / len(mismatched),
        "precision": rejected_bad / max(1, rejected_bad + rejected_good),
        "matched_kept": 1 - rejected_good / len(matched),
        "auc": float(auc),
        "matched_mean": float(matched.mean()),
        "matched_std": float(matched.std()),
        "matched_p02": float(np.quantile(matched, 0.02)),
        "mismatched_mean": float(mismatched.mean()),
        "mismatched_std": float(mismatched.std()),
        "mismatched_p98": float(np.quantile(mismatched, 0.98)),
    }


def mismatched_captions(captions: Sequence[str], *, shift: int = 1) -> list[str]:
    """For each pair, the caption of another scene with different content (the lake's mismatched_caption defect).

    Content = the (colour, shape) objects and quoted words a caption names; a paraphrase is not a mismatch."""
    from components.synth_world.world import mentioned_objects, mentioned_words

    content = [(frozenset(mentioned_objects(c)), frozenset(mentioned_words(c)), c.lower()) for c in captions]
    n = len(captions)
    out = []
    for i in range(n):
        for offset in range(shift, shift + n):
            j = (i + offset) % n
            if content[j][:2] != content[i][:2] or (not content[i][0] and content[j][2] != content[i][2]):
                out.append(captions[j])
                break
        else:
            raise ValueError(
                "Every held-out caption names the same content; the world produced no variety to measure."
            )
    return out


def one_word_neighbours(captions: Sequence[str]) -> dict[str, list[str]]:
    """Captions that differ from each caption in exactly one word (hard negatives: one attribute changed)."""
    by_key: dict[tuple, list[str]] = {}
    unique = sorted(set(captions))
    for caption in unique:
        words = caption.split()
        for k in range(len(words)):
            by_key.setdefault((len(words), k, tuple(words[:k]), tuple(words[k + 1 :])), []).append(caption)
    neighbours: dict[str, set[str]] = {c: set() for c in unique}
    for group in by_key.values():
        for caption in group:
            neighbours[caption].update(g for g in group if g != caption)
    return {c: sorted(n) for c, n in neighbours.items()}


def train_clip(
    recipe: ClipRecipe, tokenizer, train_pairs: Sequence[tuple], *, seed: int = 0, log_every: int = 0
) -> tuple[object, object, dict]:
    """Train a tiny CLIPModel contrastively on (image, caption) pairs; returns (model, processor, train stats).

    Identical captions in a batch are positives of each other (soft targets). With `hard_negatives`,
    each image also scores against a caption that differs from its own in one word.
    """
    from transformers import CLIPConfig, CLIPModel

    processor = clip_processor(tokenizer, recipe)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": recipe.text_hidden,
            "intermediate_size": 4 * recipe.text_hidden,
            "num_hidden_layers": recipe.text_layers,
            "num_attention_heads": recipe.heads,
            "max_position_embeddings": recipe.max_text_tokens,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "bos_token_id": None,
        },
        vision_config={
            "image_size": recipe.image_size,
            "patch_size": recipe.patch_size,
            "hidden_size": recipe.vision_hidden,
            "intermediate_size": 4 * recipe.vision_hidden,
            "num_hidden_layers": recipe.vision_layers,
            "num_attention_heads": recipe.heads,
        },
        projection_dim=recipe.projection_dim,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config)

    images = [pair[0] for pair in train_pairs]
    captions = [pair[1] for pair in train_pairs]
    altered = [list(pair[2:]) for pair in train_pairs]  # the pair's own mismatched captions (lake-style)
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    unique = sorted(set(captions) | {a for alts in altered for a in alts})
    caption_index = {c: i for i, c in enumerate(unique)}
    text = processor.tokenizer(unique, padding=True, truncation=True, return_tensors="pt")
    cap_ids = torch.tensor([caption_index[c] for c in captions])
    width = max((len(alts) for alts in altered), default=0)
    altered_ids = torch.full((len(train_pairs), max(1, width)), -1, dtype=torch.long)
    for i, alts in enumerate(altered):
        altered_ids[i, : len(alts)] = torch.tensor([caption_index[a] for a in alts], dtype=torch.long)
    neighbours = one_word_neighbours(unique) if recipe.hard_negatives else {}
    hard = [[caption_index[n] for n in neighbours.get(c, [])] for c in unique]

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.05)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    rng = np.random.default_rng(seed)
    model.train()
    started, losses = time.perf_counter(), []
    for step in range(recipe.steps):
        batch = torch.from_numpy(
            rng.choice(len(train_pairs), size=min(recipe.batch_size, len(train_pairs)), replace=False)
        )
        ids = cap_ids[batch]
        negs = [rng.choice(hard[i]) for i in ids.tolist() if hard[i]]
        batch_altered = altered_ids[batch]  # [B, K], -1 = none
        negs += [a for a in batch_altered.flatten().tolist() if a >= 0]
        text_set = torch.unique(torch.cat([ids, torch.tensor(negs, dtype=torch.long)]))
        image_emb = model.get_image_features(pixel_values=pixels[batch]).pooler_output
        text_emb = model.get_text_features(
            input_ids=text["input_ids"][text_set], attention_mask=text["attention_mask"][text_set]
        ).pooler_output
        image_emb = torch.nn.functional.normalize(image_emb, dim=-1)
        text_emb = torch.nn.functional.normalize(text_emb, dim=-1)
        logits = model.logit_scale.exp().clamp(max=100) * image_emb @ text_emb.T  # [B, U]
        target = torch.searchsorted(text_set, ids)
        loss_i2t = torch.nn.functional.cross_entropy(logits, target)
        positives = (text_set[:, None] == ids[None, :]).float()  # [U, B]
        has_pos = positives.sum(1) > 0
        soft = positives[has_pos] / positives[has_pos].sum(1, keepdim=True)
        loss_t2i = -(soft * torch.log_softmax(logits.T[has_pos], dim=-1)).sum(1).mean()
        loss = (loss_i2t + loss_t2i) / 2
        if recipe.altered_loss_weight > 0 and (batch_altered >= 0).any():
            # each picture against only its own altered captions: the lake's mismatch, sharpened
            own = torch.searchsorted(text_set, batch_altered.clamp(min=0))
            hard_logits = torch.cat([logits.gather(1, target[:, None]), logits.gather(1, own)], dim=1)
            hard_logits[:, 1:] = hard_logits[:, 1:].masked_fill(batch_altered < 0, float("-inf"))
            rows = (batch_altered >= 0).any(1)
            hard_target = torch.zeros(int(rows.sum()), dtype=torch.long)
            loss = loss + recipe.altered_loss_weight * torch.nn.functional.cross_entropy(
                hard_logits[rows], hard_target
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(f"clip step {step} loss {loss.item():.3f} {time.perf_counter() - started:.1f}s", flush=True)
    model.eval()
    stats = {
        "train_seconds": round(time.perf_counter() - started, 2),
        "train_steps": recipe.steps,
        "train_pairs": len(train_pairs),
        "unique_train_captions": len(unique),
        "final_loss": float(np.mean(losses[-20:])),
        "first_loss": float(losses[0]),
    }
    return model, processor, stats


def evaluate_clip(
    model, processor, pairs: Sequence[tuple], threshold: float | None = None, *, min_precision: float = 0.98
):
    """Held-out separation of matched vs mismatched (another scene's caption) pairs.

    Without `threshold`, one is chosen on these pairs (use a calibration split for that)."""
    images = [pair[0] for pair in pairs]
    captions = [pair[1] for pair in pairs]
    matched = clip_cosine(model, processor, images, captions)
    shifted = clip_cosine(model, processor, images, mismatched_captions(captions))
    # Triples carry the lake's kind of mismatch (every object altered): calibrate on that, the harder kind.
    altered = [pair[2] for pair in pairs if len(pair) > 2]
    mismatched = clip_cosine(model, processor, images, altered) if len(altered) == len(pairs) else shifted
    if threshold is None:
        threshold = choose_threshold(matched, mismatched, min_precision=min_precision)
    metrics = separation_metrics(matched, mismatched, threshold)
    metrics["other_scene_caption_recall"] = float((shifted < threshold).mean())
    neighbours = one_word_neighbours(captions)
    hard_idx = [i for i, c in enumerate(captions) if neighbours[c]]
    if hard_idx:
        hard_scores = clip_cosine(
            model, processor, [images[i] for i in hard_idx], [neighbours[captions[i]][0] for i in hard_idx]
        )
        metrics["hard_negative_recall"] = float((hard_scores < threshold).mean())
        metrics["hard_negative_mean"] = float(hard_scores.mean())
    return metrics


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
