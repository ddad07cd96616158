"""The fan-in: cross-shard dedup (the smallest key wins), kNN outliers in CLIP image space and the optional
self-judge; writes kept/ and rejected/ Parquet parts, manifest.json and report.md."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from components._shared.data.lake import shard_names
from components._shared.platform.tracking import Tracker
from components.clean_data import filters
from components.clean_data.config import CleanDataConfig
from components.clean_data.records import (
    FINAL_KEPT_SCHEMA,
    REJECTED_SCHEMA,
    SHARD_KEPT_SCHEMA,
    Timer,
    dedup,
    model_image,
    reason_counts,
    rejection,
    sample_values,
)
from components.clean_data.report import write_report

logger = logging.getLogger(__name__)


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


def _with_shard(table: pa.Table, name: str) -> pa.Table:
    index = table.schema.get_field_index("shard")
    return table.set_column(index, "shard", pa.array([name] * table.num_rows, pa.string()))


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
        "scores": sample_values(scores.tolist(), cfg.score_samples, cfg.seed),
    }
    by_index = {i: float(s) for i, s in zip(usable, scores, strict=True)}
    keys, shards, hashes = (table.column(c).to_pylist() for c in ("key", "shard", "image_hash"))
    survivors = []
    for i in alive:
        score = by_index.get(i)
        if score is not None and score > threshold:
            rejected.append(
                rejection(
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
    judge = filters.load_judge(cfg.judge_model, cfg.judge_prompt, cfg.min_pixels, cfg.max_pixels)
    images, captions = table.column("image"), table.column("caption")
    losses: dict[int, float] = {}
    with timer("self_judge", len(alive)):
        for start in range(0, len(alive), cfg.judge_batch_size):
            batch = alive[start : start + cfg.judge_batch_size]
            pictures = [model_image(images[i].as_py(), cfg) for i in batch]
            values = judge.losses(pictures, [captions[i].as_py() for i in batch])
            losses.update({i: float(v) for i, v in zip(batch, values, strict=True)})
    n_drop = int(cfg.judge_drop_fraction * len(alive))
    worst = set(sorted(alive, key=lambda i: (-losses[i], i))[:n_drop])
    cutoff = min((losses[i] for i in worst), default=None)
    info["self_judge"] = {
        "dropped": n_drop,
        "loss_cutoff": cutoff,
        "scores": sample_values(list(losses.values()), cfg.score_samples, cfg.seed),
    }
    keys, shards, hashes = (table.column(c).to_pylist() for c in ("key", "shard", "image_hash"))
    for i in sorted(worst):
        rejected.append(
            rejection(
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
    uris = [r.get("shard_uri") or r["shard"] for r in reports]
    if len(set(uris)) != len(uris):
        raise ValueError(
            f"two shard dirs report the same shard: {sorted({u for u in uris if uris.count(u) > 1})}; pass each "
            "clean_shard output once."
        )
    for i, name in enumerate(shard_names(uris)):  # `part1/00000.tar` and `part2/00000.tar` stay apart
        if name != reports[i]["shard"]:
            reports[i]["shard"] = name
            kept_tables[i] = _with_shard(kept_tables[i], name)
            rejected_tables[i] = _with_shard(rejected_tables[i], name)
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

    _check_result(manifest, all_rejected, output_dir)
    metrics = {k: manifest[k] for k in ("records_in", "records_kept", "records_rejected", "rejected_by_reason")}
    metrics["kept_fraction"] = manifest["records_kept"] / max(1, manifest["records_in"])
    metrics["shard_errors"] = len(manifest["shard_errors"])
    metrics["json_caption_differs"] = manifest["json_caption_differs"]["count"]
    # Seconds spent in the filters of every shard and the merge (the task's own wall time covers only the merge).
    metrics["filter_seconds_total"] = round(sum(t["seconds"] for t in manifest["timings"].values()), 2)
    metrics["records_per_second"] = {
        name: round(t["records"] / t["seconds"], 2) for name, t in manifest["timings"].items() if t["seconds"] > 0
    }
    return metrics


def _check_result(manifest: dict[str, Any], rejected: pa.Table, output_dir: Path) -> None:
    """Say each shard that could not be read whole (report.md counts it; the console should say it). A lake with no
    record kept is a mistake (wrong columns, wrong lake, thresholds that reject all), not a clean result: fail here,
    naming the counts per reason and one example of each, instead of in pretrain's data filter."""
    for error in manifest["shard_errors"]:
        logger.warning(
            "clean_data: shard %s could not be read whole (%s); %d record(s) read before it, the rest are lost: "
            "re-upload or drop the shard.",
            error["shard"],
            error.get("error", ""),
            error.get("records_read", 0),
        )
    differs = manifest.get("json_caption_differs", {})
    if differs.get("count"):
        logger.warning(
            "clean_data: %d record(s) hold a 'caption' in their .json other than their .txt caption (e.g. key %r in "
            "shard %s); the .txt caption is the one cleaned and trained on: fix whichever of the two is wrong.",
            differs["count"],
            differs["example"],
            differs["shard"],
        )
    if manifest["records_kept"] > 0:
        return
    examples: dict[str, str] = {}
    for key, reason, detail in zip(*(rejected.column(c).to_pylist() for c in ("key", "reason", "detail")), strict=True):
        examples.setdefault(reason, f"{key!r}: {detail}")
    reasons = "; ".join(
        f"{reason} {n} (e.g. {examples.get(reason, '')[:300]})"
        for reason, n in manifest["rejected_by_reason"].items()
        if n
    )
    errors = "; ".join(f"{e['shard']}: {e.get('error', '')[:200]}" for e in manifest["shard_errors"][:3])
    raise ValueError(
        f"clean_data kept no record of the lake's {manifest['records_in']} "
        + (f"(rejected by reason: {reasons})" if reasons else "(no record could be read)")
        + (f"; shard errors: {errors}" if errors else "")
        + f". Nothing is left to train on; see {output_dir / 'report.md'} and {output_dir / 'rejected'}, then fix the "
        "lake (columns, captions, images) or the clean_data thresholds that reject every record."
    )


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
            "rejected_by_reason": reason_counts(rejected_by_shard[shard]),
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
        "rejected_by_reason": reason_counts(reasons),
        "per_shard": per_shard,
        "shard_errors": [{"shard": r["shard"], **r["shard_error"]} for r in reports if r["shard_error"]],
        "json_caption_differs": _caption_differs(reports),
    }


def _caption_differs(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' counts of records whose .json caption is not their .txt caption, with the first example."""
    found = [(r["shard"], r["json_caption_differs"]) for r in reports if r.get("json_caption_differs", {}).get("count")]
    first = found[0] if found else (None, {"example": None})
    return {"count": sum(d["count"] for _, d in found), "example": first[1]["example"], "shard": first[0]}
