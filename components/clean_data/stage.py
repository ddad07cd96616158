"""clean_data: drop bad image-caption pairs from a lake; every record is kept or rejected with one reason.

1 process:        python -m components.clean_data --config pipelines/presets/tiny.yaml --lake-uri DIR/lake \
                      --output-dir OUT
In the pipeline:  list_shards_op -> clean_shard_op per shard (ParallelFor) -> merge_shards_op (fan-in),
                  the same three functions `run` calls in one process.

Per shard (cheapest first): reader problems (unsafe_member, file_too_large, missing_image/caption, shard_error),
caption checks, safe decode, size/aspect, exact and near dedup, then the model levels of seed 001 on what is
left: CLIP score, NSFW, OCR text the caption never mentions. The merge repeats exact/near dedup across shards
(the smallest key wins), drops kNN outliers in CLIP image space and, if a judge model is set, the worst
fraction by its caption loss; then writes kept/ and rejected/ Parquet parts, manifest.json and report.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from components._shared.platform.imaging import ImageRejected, decode_image, visual_tokens
from components._shared.platform.tracking import Tracker
from components.clean_data import filters
from components.clean_data.config import CleanDataConfig
from components.clean_data.readers import Record, ShardError, read_shard, shard_name
from components.clean_data.report import write_report

REASONS = (
    "unsafe_member",
    "file_too_large",
    "missing_image",
    "missing_caption",
    "shard_error",
    "empty_file",
    "caption_not_utf8",
    "empty_caption",
    "caption_too_long",
    "garbage_caption",
    "decompression_bomb",
    "unsupported_format",
    "undecodable",
    "truncated_image",
    "too_small",
    "too_large",
    "extreme_aspect",
    "exact_duplicate",
    "near_duplicate",
    "low_clip_score",
    "nsfw",
    "ocr_caption_mismatch",
    "embedding_outlier",
    "self_judge",
)
MODEL_SIDE = 1024  # images are shrunk to this longer side before the model levels (all resize further)

REJECTED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("image_hash", pa.string()),
    ]
)
KEPT_FIELDS = [
    ("image_hash", pa.string()),
    ("key", pa.string()),
    ("shard", pa.string()),
    ("image", pa.binary()),
    ("image_format", pa.string()),
    ("caption", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("visual_tokens", pa.int32()),
    ("clip_score", pa.float32()),
    ("nsfw_score", pa.float32()),
    ("ocr_text", pa.string()),
    ("phash", pa.string()),
    ("metadata", pa.string()),
]
SHARD_KEPT_SCHEMA = pa.schema(KEPT_FIELDS + [("thumb", pa.binary()), ("clip_embedding", pa.list_(pa.float32()))])
FINAL_KEPT_SCHEMA = pa.schema(KEPT_FIELDS + [("outlier_score", pa.float32()), ("judge_loss", pa.float32())])


@dataclass
class Candidate:
    """A record that passed the cheap checks (the decoded pixels are not kept: memory stays ~ shard bytes)."""

    key: str
    shard: str
    image: bytes
    image_hash: str
    image_format: str
    caption: str
    width: int
    height: int
    visual_tokens: int
    phash: int
    thumb: bytes
    metadata: str
    clip_score: float | None = None
    nsfw_score: float | None = None
    ocr_text: str | None = None
    embedding: list[float] | None = None


class Timer:
    """Seconds and records per filter, for records/second in the report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.records: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str, records: int = 1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.records[name] += records

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: {"seconds": round(self.seconds[name], 4), "records": self.records[name]} for name in self.seconds}


def _rejection(key: str, shard: str, reason: str, detail: str, image_hash: str | None) -> dict[str, Any]:
    assert reason in REASONS, reason
    return {"key": key, "shard": shard, "reason": reason, "detail": detail, "image_hash": image_hash}


def _reason_counts(reasons) -> dict[str, int]:
    counts = Counter(reasons)
    return {reason: counts.get(reason, 0) for reason in REASONS}


# ---------------------------------------------------------------- listing


def list_shards(lake_uri: str) -> list[str]:
    """The lake's shard URIs (`*.tar`, `*.parquet`), local or s3://, sorted."""
    from components._shared.platform.storage import list_lake_shards

    return list_lake_shards(str(lake_uri))


# ---------------------------------------------------------------- one shard


def _cheap_checks(rec: Record, cfg: CleanDataConfig, timer: Timer) -> Candidate | dict[str, Any]:
    image_hash = hashlib.sha256(rec.image).hexdigest() if rec.image is not None else None
    if rec.reject is not None:
        return _rejection(rec.key, rec.shard, *rec.reject, image_hash)
    if not rec.image:
        return _rejection(
            rec.key, rec.shard, "empty_file", f"image member {rec.image_member!r} has 0 bytes", image_hash
        )
    assert image_hash is not None  # rec.image is non-empty bytes here
    with timer("caption"):
        caption, problem = filters.check_caption(rec.caption or b"", cfg)
    if problem is not None:
        return _rejection(rec.key, rec.shard, *problem, image_hash)
    assert caption is not None  # check_caption returns a caption or a problem
    try:
        with timer("decode"):
            decoded = decode_image(
                rec.image, max_image_pixels=cfg.max_image_pixels, allowed_formats=tuple(cfg.allowed_formats)
            )
    except ImageRejected as rejected:
        return _rejection(rec.key, rec.shard, rejected.reason, rejected.detail, image_hash)
    problem = filters.check_size(decoded.width, decoded.height, cfg)
    if problem:
        return _rejection(rec.key, rec.shard, *problem, image_hash)
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
            decoded.height, decoded.width, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
        ),
        phash=phash,
        thumb=thumb,
        metadata=json.dumps(rec.metadata, sort_keys=True, ensure_ascii=False, default=str),
    )


def dedup(items: list, cfg: CleanDataConfig, timer: Timer, rejected: list[dict[str, Any]]) -> list:
    """Exact (sha256) then near (pHash) duplicates; items are visited by (key, shard), so the smallest key wins.

    `items` need .key .shard .image_hash .phash (int) .thumb; the rejected ones are appended to `rejected`.
    """
    max_diff = cfg.near_dedup_max_thumb_diff
    seen: dict[str, Any] = {}
    index = filters.PhashIndex(cfg.near_dedup_max_distance)
    kept = []
    with timer("dedup", len(items)):
        for item in sorted(items, key=lambda c: (c.key, c.shard)):
            first = seen.get(item.image_hash)
            if first is not None:
                rejected.append(
                    _rejection(
                        item.key,
                        item.shard,
                        "exact_duplicate",
                        f"same sha256 as {first.key} ({first.shard})",
                        item.image_hash,
                    )
                )
                continue
            if cfg.near_dedup_enabled:
                match = index.find(
                    item.phash,
                    None
                    if max_diff is None
                    else lambda other, item=item: filters.thumb_difference(item.thumb, other.thumb) <= max_diff,
                )
                if match is not None:
                    original, distance = match
                    rejected.append(
                        _rejection(
                            item.key,
                            item.shard,
                            "near_duplicate",
                            f"pHash distance {distance} to {original.key} ({original.shard})",
                            item.image_hash,
                        )
                    )
                    continue
                index.add(item.phash, item)
            seen[item.image_hash] = item
            kept.append(item)
    return kept


def _model_image(data: bytes, cfg: CleanDataConfig):
    image = decode_image(data, max_image_pixels=cfg.max_image_pixels, allowed_formats=tuple(cfg.allowed_formats)).image
    if max(image.size) > MODEL_SIDE:
        image.thumbnail((MODEL_SIDE, MODEL_SIDE))
    return image


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
            images = [_model_image(c.image, cfg) for c in batch]
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
            alive = survivors
        kept += [batch[i] for i in alive]
    return kept


def _reject_if(condition: bool, c: Candidate, rejected: list[dict[str, Any]], reason: str, detail: str) -> bool:
    if condition:
        rejected.append(_rejection(c.key, c.shard, reason, detail, c.image_hash))
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


def _sample(values: list[float], n: int, seed: int) -> list[float]:
    if len(values) <= n:
        return [round(v, 5) for v in values]
    picks = np.random.default_rng(seed).choice(len(values), size=n, replace=False)
    return [round(values[i], 5) for i in sorted(picks)]


def clean_shard(cfg: CleanDataConfig, *, shard_uri: str, output_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """Per-record filters of one shard -> kept.parquet, rejected.parquet, shard_report.json in output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    shard = shard_name(shard_uri)
    timer = Timer()
    errors: list[ShardError] = []
    rejected: list[dict[str, Any]] = []
    candidates: list[Candidate] = []
    records = read_shard(shard_uri, max_member_bytes=cfg.max_file_bytes, errors=errors)
    records_in = 0
    while True:
        with timer("read"):
            rec = next(records, None)
        if rec is None:
            break
        records_in += 1
        result = _cheap_checks(rec, cfg, timer)
        if isinstance(result, Candidate):
            candidates.append(result)
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
        "rejected_by_reason": _reason_counts(r["reason"] for r in rejected),
        "shard_error": _error_dict(errors[0]) if errors else None,
        "scores": {name: _sample(values, cfg.score_samples, cfg.seed) for name, values in scores.items()},
        "thresholds": thresholds,
        "timings": timer.as_dict(),
    }
    (output_dir / "shard_report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    metrics = {k: report[k] for k in ("records_in", "records_kept", "records_rejected", "rejected_by_reason")}
    metrics["shard_errors"] = len(errors)
    tracker.log_metrics({f"shard/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
    return metrics


def _error_dict(error: ShardError) -> dict[str, Any]:
    return {"error": error.error, "records_read": error.records_read, "offset": error.offset}


# ---------------------------------------------------------------- merge


@dataclass
class _Row:
    """Light view of a kept row for the global decisions (no image bytes)."""

    index: int
    key: str
    shard: str
    image_hash: str
    phash: int
    thumb: bytes


def _read_shard_dir(shard_dir: Path) -> tuple[dict[str, Any], pa.Table, pa.Table]:
    shard_dir = Path(shard_dir)
    paths = [shard_dir / name for name in ("shard_report.json", "kept.parquet", "rejected.parquet")]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"shard dir {shard_dir} lacks {missing}; it must be the output_dir of a finished clean_shard.")
    return json.loads(paths[0].read_text()), pq.read_table(paths[1]), pq.read_table(paths[2])


def _outliers(
    table: pa.Table,
    alive: list[int],
    cfg: CleanDataConfig,
    timer: Timer,
    rejected: list[dict[str, Any]],
    info: dict[str, Any],
) -> tuple[list[int], dict[int, float]]:
    embeddings = table.column("clip_embedding").to_pylist()
    usable = [i for i in alive if embeddings[i] is not None]
    if not cfg.outlier_enabled or len(usable) < cfg.outlier_min_records:
        info["outlier"] = {
            "skipped": f"{len(usable)} records with CLIP embeddings (< outlier_min_records="
            f"{cfg.outlier_min_records}) or outlier_enabled=false"
        }
        return alive, {}
    with timer("outlier", len(usable)):
        matrix = np.asarray([embeddings[i] for i in usable], dtype=np.float32)
        scores = filters.knn_outlier_scores(
            matrix, k=cfg.outlier_k, reference_size=cfg.outlier_reference_size, seed=cfg.seed
        )
        threshold = filters.robust_threshold(scores, cfg.outlier_mad_z)
    info["outlier"] = {
        "threshold": round(threshold, 5),
        "median": round(float(np.median(scores)), 5),
        "scores": _sample(scores.tolist(), cfg.score_samples, cfg.seed),
    }
    by_index = {i: float(s) for i, s in zip(usable, scores, strict=True)}
    keys, shards, hashes = (table.column(c).to_pylist() for c in ("key", "shard", "image_hash"))
    survivors = []
    for i in alive:
        score = by_index.get(i)
        if score is not None and score > threshold:
            rejected.append(
                _rejection(
                    keys[i],
                    shards[i],
                    "embedding_outlier",
                    f"kNN cosine distance {score:.3f} > {threshold:.3f} (median + {cfg.outlier_mad_z} MAD)",
                    hashes[i],
                )
            )
        else:
            survivors.append(i)
    return survivors, by_index


def _self_judge(
    table: pa.Table,
    alive: list[int],
    cfg: CleanDataConfig,
    timer: Timer,
    rejected: list[dict[str, Any]],
    info: dict[str, Any],
) -> tuple[list[int], dict[int, float]]:
    if cfg.judge_model is None or not alive:
        return alive, {}
    judge = filters.load_judge(cfg.judge_model, cfg.judge_prompt)
    images, captions = table.column("image"), table.column("caption")
    losses: dict[int, float] = {}
    with timer("self_judge", len(alive)):
        for start in range(0, len(alive), cfg.judge_batch_size):
            batch = alive[start : start + cfg.judge_batch_size]
            pictures = [_model_image(images[i].as_py(), cfg) for i in batch]
            values = judge.losses(pictures, [captions[i].as_py() for i in batch])
            losses.update({i: float(v) for i, v in zip(batch, values, strict=True)})
    n_drop = int(cfg.judge_drop_fraction * len(alive))
    worst = set(sorted(alive, key=lambda i: (-losses[i], i))[:n_drop])
    cutoff = min((losses[i] for i in worst), default=None)
    info["self_judge"] = {
        "dropped": n_drop,
        "loss_cutoff": cutoff,
        "scores": _sample(list(losses.values()), cfg.score_samples, cfg.seed),
    }
    keys, shards, hashes = (table.column(c).to_pylist() for c in ("key", "shard", "image_hash"))
    for i in sorted(worst):
        rejected.append(
            _rejection(
                keys[i],
                shards[i],
                "self_judge",
                f"judge caption loss {losses[i]:.3f} in the worst {cfg.judge_drop_fraction:.0%}",
                hashes[i],
            )
        )
    return [i for i in alive if i not in worst], losses


def _write_parts(table: pa.Table, directory: Path, rows_per_part: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for part, start in enumerate(range(0, max(1, table.num_rows), rows_per_part)):
        name = f"part-{part:05d}.parquet"
        pq.write_table(table.slice(start, rows_per_part), directory / name)
        names.append(f"{directory.name}/{name}")
    return names


def merge_shards(cfg: CleanDataConfig, *, shard_dirs: list[Path], output_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """Cross-shard dedup, outliers, optional self-judge; final Parquet parts, manifest.json and report.md."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not shard_dirs:
        raise ValueError("merge_shards got no shard_dirs; pass the output_dir of every clean_shard task.")
    reports, kept_tables, rejected_tables = [], [], []
    for shard_dir in sorted(shard_dirs, key=str):
        report, kept, rejected = _read_shard_dir(shard_dir)
        reports.append(report)
        kept_tables.append(kept.cast(SHARD_KEPT_SCHEMA))
        rejected_tables.append(rejected.cast(REJECTED_SCHEMA))
    names = [r["shard"] for r in reports]
    if len(set(names)) != len(names):
        raise ValueError(f"two shard dirs report the same shard name: {sorted(n for n in names if names.count(n) > 1)}")
    table = pa.concat_tables(kept_tables)
    timer = Timer()
    info: dict[str, Any] = {}
    merge_rejected: list[dict[str, Any]] = []

    rows = [
        _Row(i, k, s, h, int(p, 16), t)
        for i, (k, s, h, p, t) in enumerate(
            zip(*(table.column(c).to_pylist() for c in ("key", "shard", "image_hash", "phash", "thumb")), strict=True)
        )
    ]
    alive = sorted(row.index for row in dedup(rows, cfg, timer, merge_rejected))
    alive, outlier_scores = _outliers(table, alive, cfg, timer, merge_rejected, info)
    alive, judge_losses = _self_judge(table, alive, cfg, timer, merge_rejected, info)

    final = table.take(pa.array(alive, type=pa.int64())).drop_columns(["thumb", "clip_embedding"])
    final = final.append_column("outlier_score", pa.array([outlier_scores.get(i) for i in alive], pa.float32()))
    final = final.append_column("judge_loss", pa.array([judge_losses.get(i) for i in alive], pa.float32()))
    final = final.cast(FINAL_KEPT_SCHEMA).sort_by([("image_hash", "ascending"), ("key", "ascending")])
    all_rejected = pa.concat_tables(rejected_tables + [pa.Table.from_pylist(merge_rejected, schema=REJECTED_SCHEMA)])
    all_rejected = all_rejected.sort_by([("shard", "ascending"), ("key", "ascending")])
    for old in ("kept", "rejected"):
        shutil.rmtree(output_dir / old, ignore_errors=True)
    files = _write_parts(final, output_dir / "kept", cfg.output_shard_records)
    files += _write_parts(all_rejected, output_dir / "rejected", cfg.output_shard_records)

    manifest = _manifest(reports, final, all_rejected)
    manifest["files"] = files
    for report in reports:
        for name, t in report.get("timings", {}).items():
            timer.seconds[name] += t["seconds"]
            timer.records[name] += t["records"]
    manifest["timings"] = timer.as_dict()
    manifest["filters"] = {k: {kk: vv for kk, vv in v.items() if kk != "scores"} for k, v in info.items()}
    manifest["files"] += write_report(output_dir, cfg, manifest, reports, info, tracker)
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))

    metrics = {k: manifest[k] for k in ("records_in", "records_kept", "records_rejected", "rejected_by_reason")}
    metrics["kept_fraction"] = manifest["records_kept"] / max(1, manifest["records_in"])
    metrics["shard_errors"] = len(manifest["shard_errors"])
    # Seconds spent in the filters of every shard and the merge (the task's own wall time covers only the merge).
    metrics["filter_seconds_total"] = round(sum(t["seconds"] for t in manifest["timings"].values()), 2)
    metrics["records_per_second"] = {
        name: round(t["records"] / t["seconds"], 2) for name, t in manifest["timings"].items() if t["seconds"] > 0
    }
    return metrics


def _manifest(reports: list[dict[str, Any]], kept: pa.Table, rejected: pa.Table) -> dict[str, Any]:
    kept_by_shard = Counter(kept.column("shard").to_pylist())
    rejected_by_shard: dict[str, list[str]] = defaultdict(list)
    for shard, reason in zip(rejected.column("shard").to_pylist(), rejected.column("reason").to_pylist(), strict=True):
        rejected_by_shard[shard].append(reason)
    per_shard = {}
    for report in reports:
        shard = report["shard"]
        entry = {
            "records_in": report["records_in"],
            "records_kept": kept_by_shard.get(shard, 0),
            "records_rejected": len(rejected_by_shard[shard]),
            "rejected_by_reason": _reason_counts(rejected_by_shard[shard]),
            "shard_error": report["shard_error"],
        }
        if entry["records_in"] != entry["records_kept"] + entry["records_rejected"]:
            raise RuntimeError(f"accounting bug in shard {shard}: {entry}")
        per_shard[shard] = entry
    reasons = rejected.column("reason").to_pylist()
    return {
        "records_in": sum(r["records_in"] for r in reports),
        "records_kept": kept.num_rows,
        "records_rejected": rejected.num_rows,
        "rejected_by_reason": _reason_counts(reasons),
        "per_shard": per_shard,
        "shard_errors": [{"shard": r["shard"], **r["shard_error"]} for r in reports if r["shard_error"]],
    }


# ---------------------------------------------------------------- one process


def run(cfg: CleanDataConfig, *, lake_uri: str, output_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """list_shards -> clean_shard for each -> merge_shards, in one process (models load once)."""
    output_dir = Path(output_dir)
    work = output_dir / "_shards"
    shutil.rmtree(work, ignore_errors=True)
    shard_dirs = []
    for number, uri in enumerate(list_shards(str(lake_uri))):
        shard_dir = work / f"{number:05d}"
        clean_shard(cfg, shard_uri=uri, output_dir=shard_dir, tracker=tracker)
        shard_dirs.append(shard_dir)
    metrics = merge_shards(cfg, shard_dirs=shard_dirs, output_dir=output_dir, tracker=tracker)
    shutil.rmtree(work)
    return metrics


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(CleanDataConfig, run, section="clean_data", inputs=("lake_uri",), argv=argv)
