"""One shard of the lake: reader problems, caption checks, safe decode, size/aspect, dedup, then the model levels
(CLIP score, NSFW, OCR text the caption never mentions); writes kept.parquet, rejected.parquet and
shard_report.json."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components._shared.data.lake import Record, ShardError, read_shard, shard_name
from components._shared.platform import progress
from components._shared.platform.image_decode import ImageRejected, decode_image, visual_tokens
from components._shared.platform.tracking import Tracker
from components.clean_data import filters
from components.clean_data.config import CleanDataConfig
from components.clean_data.records import (
    REJECTED_SCHEMA,
    SHARD_KEPT_SCHEMA,
    Candidate,
    Timer,
    dedup,
    model_image,
    reason_counts,
    rejection,
    sample_values,
)


def _cheap_checks(rec: Record, cfg: CleanDataConfig, timer: Timer) -> Candidate | dict[str, Any]:
    image_hash = hashlib.sha256(rec.image).hexdigest() if rec.image is not None else rec.image_sha256
    if rec.reject is not None:
        return rejection(rec.key, rec.shard, *rec.reject, image_hash)
    if not rec.image:
        return rejection(rec.key, rec.shard, "empty_file", f"image member {rec.image_member!r} has 0 bytes", image_hash)
    if "metadata_error" in rec.metadata:  # a .json that is not a JSON object: its regions and fields are lost
        return rejection(rec.key, rec.shard, "bad_metadata", str(rec.metadata["metadata_error"]), image_hash)
    assert image_hash is not None  # rec.image is non-empty bytes here
    with timer("caption"):
        caption, problem = filters.check_caption(rec.caption or b"", cfg)
    if problem is not None:
        return rejection(rec.key, rec.shard, *problem, image_hash)
    assert caption is not None  # check_caption returns a caption or a problem
    try:
        with timer("decode"):
            decoded = decode_image(
                rec.image, max_image_pixels=cfg.max_image_pixels, allowed_formats=tuple(cfg.allowed_formats)
            )
    except ImageRejected as rejected:
        return rejection(rec.key, rec.shard, rejected.reason, rejected.detail, image_hash)
    problem = filters.check_size(decoded.width, decoded.height, cfg)
    if problem:
        return rejection(rec.key, rec.shard, *problem, image_hash)
    with timer("phash"):
        phash, thumb = filters.phash64(decoded.image), filters.thumbnail(decoded.image)
    return Candidate(
        key=rec.key,
        shard=rec.shard,
        image=rec.image,
        image_hash=image_hash,
        image_format=decoded.format,
        caption=caption,
        width=decoded.width,
        height=decoded.height,
        visual_tokens=visual_tokens(
            decoded.height,
            decoded.width,
            min_pixels=cfg.min_pixels,
            max_pixels=cfg.max_pixels,
            patch_size=cfg.patch_size,
        ),
        phash=phash,
        thumb=thumb,
        metadata=json.dumps(rec.metadata, sort_keys=True, ensure_ascii=False, default=str),
    )


def _json_caption_differs(given: Any, caption: str) -> bool:
    """Whether a record's .json `caption` (img2dataset writes one equal to the .txt) says something else than the .txt
    caption the cleaner reads: a list, a number, or other words (white space aside)."""
    if given is None:
        return False
    return not isinstance(given, str) or " ".join(given.split()) != " ".join(caption.split())


def clip_threshold(cfg: CleanDataConfig, clip) -> float:
    """clip_min_score, or the model's recommended threshold when clip_threshold_from_model is set."""
    if not cfg.clip_threshold_from_model:
        return cfg.clip_min_score
    if clip.recommended_threshold is None:
        raise ValueError(
            f"clip_threshold_from_model=true but clip_model={cfg.clip_model!r} has no builtin.json "
            "recommended_threshold; set clip_min_score and clip_threshold_from_model=false."
        )
    return float(clip.recommended_threshold)


def _model_levels(
    candidates: list[Candidate],
    cfg: CleanDataConfig,
    timer: Timer,
    rejected: list[dict[str, Any]],
    scores: dict[str, list[float]],
    thresholds: dict[str, float],
) -> list[Candidate]:
    """CLIP score, NSFW, OCR-vs-caption on batches of candidates (models load once per process)."""
    if not (cfg.clip_enabled or cfg.nsfw_enabled or cfg.ocr_enabled):
        return candidates
    clip = None  # loaded on first use, so a shard without candidates loads no model
    kept: list[Candidate] = []
    for start in range(0, len(candidates), cfg.clip_batch_size):
        batch = candidates[start : start + cfg.clip_batch_size]
        with timer("model_decode", len(batch)):
            images = [model_image(c.image, cfg) for c in batch]
        alive = list(range(len(batch)))
        if cfg.clip_enabled:
            clip = clip or filters.load_clip(cfg.clip_model)
            threshold = thresholds["clip_score"] = clip_threshold(cfg, clip)
            with timer("clip", len(batch)):
                cosine, embeddings = clip.score(images, [c.caption for c in batch])
            clip_scores = [float(value) for value in cosine]
            for i, c in enumerate(batch):
                c.clip_score, c.embedding = clip_scores[i], embeddings[i].tolist()
                scores["clip_score"].append(clip_scores[i])
            alive = [
                i
                for i in alive
                if not _reject_if(
                    clip_scores[i] < threshold,
                    batch[i],
                    rejected,
                    "low_clip_score",
                    f"CLIP cosine {clip_scores[i]:.3f} < threshold {threshold:.3f}",
                )
            ]
        if cfg.nsfw_enabled and alive:
            nsfw = filters.load_nsfw(cfg.onnx_threads)
            nsfw_scores: dict[int, float] = {}
            with timer("nsfw", len(alive)):
                for i in alive:
                    batch[i].nsfw_score = nsfw_scores[i] = nsfw.score(images[i])
                    scores["nsfw_score"].append(nsfw_scores[i])
            alive = [
                i
                for i in alive
                if not _reject_if(
                    nsfw_scores[i] > cfg.nsfw_threshold,
                    batch[i],
                    rejected,
                    "nsfw",
                    f"exposed-class score {nsfw_scores[i]:.3f} > nsfw_threshold={cfg.nsfw_threshold}",
                )
            ]
        if cfg.ocr_enabled and alive:
            alive = _ocr_level(batch, images, alive, cfg, timer, rejected, scores)
        kept += [batch[i] for i in alive]
        progress.update("score", start + len(batch), len(candidates), "records")
    return kept


def _ocr_level(
    batch: list[Candidate],
    images: list,
    alive: list[int],
    cfg: CleanDataConfig,
    timer: Timer,
    rejected: list[dict[str, Any]],
    scores: dict[str, list[float]],
) -> list[int]:
    """OCR vs caption: reject a candidate whose image shows more words the caption never mentions than allowed;
    returns the indices that survive."""
    ocr = filters.load_ocr(cfg.ocr_detect_side, cfg.onnx_threads)
    survivors = []
    with timer("ocr", len(alive)):
        for i in alive:
            words = ocr.words(
                images[i],
                min_confidence=cfg.ocr_min_confidence,
                min_chars=cfg.ocr_min_word_chars,
                min_box_aspect=cfg.ocr_min_box_aspect,
            )
            batch[i].ocr_text = " ".join(words)
            missing = filters.unmentioned_words(words, batch[i].caption)
            scores["ocr_unmentioned_words"].append(float(len(missing)))
            if not _reject_if(
                len(missing) > cfg.ocr_max_unmentioned_words,
                batch[i],
                rejected,
                "ocr_caption_mismatch",
                f"image text {missing[:5]} not in the caption",
            ):
                survivors.append(i)
    return survivors


def _reject_if(condition: bool, c: Candidate, rejected: list[dict[str, Any]], reason: str, detail: str) -> bool:
    if condition:
        rejected.append(rejection(c.key, c.shard, reason, detail, c.image_hash))
    return condition


def _kept_rows(candidates: list[Candidate]) -> dict[str, list]:
    return {
        "image_hash": [c.image_hash for c in candidates],
        "key": [c.key for c in candidates],
        "shard": [c.shard for c in candidates],
        "image": [c.image for c in candidates],
        "image_format": [c.image_format for c in candidates],
        "caption": [c.caption for c in candidates],
        "width": [c.width for c in candidates],
        "height": [c.height for c in candidates],
        "visual_tokens": [c.visual_tokens for c in candidates],
        "clip_score": [c.clip_score for c in candidates],
        "nsfw_score": [c.nsfw_score for c in candidates],
        "ocr_text": [c.ocr_text for c in candidates],
        "phash": [f"{c.phash:016x}" for c in candidates],
        "metadata": [c.metadata for c in candidates],
        "thumb": [c.thumb for c in candidates],
        "clip_embedding": [c.embedding for c in candidates],
    }


def clean_shard(cfg: CleanDataConfig, *, shard_uri: str, output_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """Per-record filters of one shard -> kept.parquet, rejected.parquet, shard_report.json in output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    shard = shard_name(shard_uri)
    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    timer = Timer()
    errors: list[ShardError] = []
    rejected: list[dict[str, Any]] = []
    candidates: list[Candidate] = []
    records = read_shard(shard_uri, max_member_bytes=cfg.max_file_bytes, errors=errors)
    records_in = 0
    differs: list[str] = []  # keys whose .json holds a caption other than the .txt one (used)
    while True:
        with timer("read"):
            rec = next(records, None)
        if rec is None:
            break
        records_in += 1
        progress.update("read", records_in, None, "records")
        result = _cheap_checks(rec, cfg, timer)
        if isinstance(result, Candidate):
            candidates.append(result)
            if _json_caption_differs(rec.metadata.get("caption"), result.caption):
                differs.append(rec.key)
        else:
            rejected.append(result)
    scores: dict[str, list[float]] = defaultdict(list)
    thresholds: dict[str, float] = {}
    kept = _model_levels(dedup(candidates, cfg, timer, rejected), cfg, timer, rejected, scores, thresholds)

    kept.sort(key=lambda c: (c.key, c.image_hash))
    pq.write_table(pa.Table.from_pydict(_kept_rows(kept), schema=SHARD_KEPT_SCHEMA), output_dir / "kept.parquet")
    rejected.sort(key=lambda r: r["key"])
    pq.write_table(pa.Table.from_pylist(rejected, schema=REJECTED_SCHEMA), output_dir / "rejected.parquet")
    if records_in != len(kept) + len(rejected):
        raise RuntimeError(
            f"accounting bug in shard {shard}: {records_in} in, {len(kept)} kept, {len(rejected)} rejected"
        )
    report = {
        "shard": shard,
        "shard_uri": shard_uri,
        "records_in": records_in,
        "records_kept": len(kept),
        "records_rejected": len(rejected),
        "rejected_by_reason": reason_counts(r["reason"] for r in rejected),
        "shard_error": _error_dict(errors[0]) if errors else None,
        "scores": {name: sample_values(values, cfg.score_samples, cfg.seed) for name, values in scores.items()},
        "thresholds": thresholds,
        "timings": timer.as_dict(),
        "json_caption_differs": {"count": len(differs), "example": differs[0] if differs else None},
    }
    (output_dir / "shard_report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    metrics = {k: report[k] for k in ("records_in", "records_kept", "records_rejected", "rejected_by_reason")}
    metrics["shard_errors"] = len(errors)
    tracker.log_metrics({f"shard/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
    return metrics


def _error_dict(error: ShardError) -> dict[str, Any]:
    return {"error": error.error, "records_read": error.records_read, "offset": error.offset}
