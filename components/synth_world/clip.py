"""The builtin tiny CLIP: training, scoring and calibration (`builtin_models.TINY_CLIP` holds its recipe).

clean_data rejects pairs whose cosine falls under the threshold calibrated here, so training and calibration
use lake-like pairs and the lake's own kind of mismatched caption (components/synth_world/lake.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from components._shared.platform import progress


def clip_processor(tokenizer, recipe):
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
def clip_cosine(model, processor, images: Sequence, captions: Sequence[str], *, batch_size: int = 256) -> np.ndarray:
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
    auc = (ranks.sum() + len(matched) - len(matched) * (len(matched) + 1) / 2) / (len(matched) * len(mismatched))
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
            raise ValueError("Every held-out caption names the same content; the world produced no variety to measure.")
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


def shape_swapped(caption: str, rng: np.random.Generator) -> str | None:
    """The caption with every named object's shape changed and its colour kept, so that it names no (colour,
    shape) object of the original (None when it names none). Shape is what a tiny ViT learns last: colour
    alone separates most in-batch negatives, so these negatives carry the shape signal."""
    from components.synth_world.world import _OBJECT_RE, SHAPES

    taken = set(_OBJECT_RE.findall(caption.lower()))
    if not taken:
        return None
    used = set(taken)

    def swap(match) -> str:
        color, shape = match.group(1), match.group(2)
        options = [s for s in SHAPES if s != shape and (color, s) not in used]
        new = options[int(rng.integers(len(options)))] if options else shape
        used.add((color, new))
        return f"{color} {new}"

    swapped = _OBJECT_RE.sub(swap, caption)
    return swapped if swapped != caption else None


def train_clip(
    recipe, tokenizer, train_pairs: Sequence[tuple], *, seed: int = 0, log_every: int = 0
) -> tuple[Any, Any, dict]:
    """Train a tiny CLIPModel contrastively on (image, caption) pairs; returns (model, processor, train stats).

    Identical captions in a batch are positives of each other (soft targets). With `hard_negatives`,
    each image also scores against a caption that differs from its own in one word. Each picture's altered
    captions (the pair's own, plus `shape_swaps_per_image` from `shape_swapped`) join the batch's negatives,
    a per-picture softmax (`altered_loss_weight`) and a sigmoid pair loss (`pair_loss_weight`).
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
    swap_rng = np.random.default_rng([seed, 7])
    for alts, pair in zip(altered, train_pairs, strict=True):
        for _ in range(recipe.shape_swaps_per_image):
            swapped = shape_swapped(pair[1], swap_rng)
            if swapped is not None:
                alts.append(swapped)
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

    pair_bias = torch.nn.Parameter(torch.tensor(0.5))  # the pair loss's decision cosine (not saved: calibrated later)
    optimizer = torch.optim.AdamW([*model.parameters(), pair_bias], lr=recipe.lr, weight_decay=0.05)

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
            loss = loss + recipe.altered_loss_weight * torch.nn.functional.cross_entropy(hard_logits[rows], hard_target)
        if recipe.pair_loss_weight > 0 and (batch_altered >= 0).any():
            # absolute agreement, the way clean_data uses the score: own caption above a learned bias, the
            # altered ones below it (sigmoid, SigLIP-style), so one cosine threshold separates them
            cos = logits / model.logit_scale.exp().clamp(max=100)
            own_cos = cos.gather(1, target[:, None])
            alt_cos = cos.gather(1, torch.searchsorted(text_set, batch_altered.clamp(min=0)))
            valid = (batch_altered >= 0).float()
            scale = 10.0
            pos = torch.nn.functional.softplus(-(scale * (own_cos - pair_bias)))
            neg = torch.nn.functional.softplus(scale * (alt_cos - pair_bias)) * valid
            loss = loss + recipe.pair_loss_weight * (pos.mean() + neg.sum() / valid.sum().clamp(min=1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        progress.update("build tiny-clip", step + 1, recipe.steps, "steps", loss=losses[-1])
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
