"""clean_data's report: report.md (counts per reason and shard, throughput per filter) and score histograms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from components._shared.platform.tracking import Tracker
from components.clean_data.config import CleanDataConfig


def _histograms(
    output_dir: Path, cfg: CleanDataConfig, reports: list[dict[str, Any]], info: dict[str, Any]
) -> list[str]:
    """One PNG per score (values of kept and rejected records), with the threshold drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        name: [v for r in reports for v in r.get("scores", {}).get(name, [])]
        for name in ("clip_score", "nsfw_score", "ocr_unmentioned_words")
    }
    series["outlier_score"] = info.get("outlier", {}).get("scores", [])
    series["judge_loss"] = info.get("self_judge", {}).get("scores", [])
    clip_used = [
        r["thresholds"]["clip_score"] for r in reports if r.get("thresholds", {}).get("clip_score") is not None
    ]
    thresholds = {
        "clip_score": clip_used[0] if clip_used else cfg.clip_min_score,
        "nsfw_score": cfg.nsfw_threshold,
        "ocr_unmentioned_words": cfg.ocr_max_unmentioned_words + 0.5,
        "outlier_score": info.get("outlier", {}).get("threshold"),
        "judge_loss": info.get("self_judge", {}).get("loss_cutoff"),
    }
    names = []
    for name, values in series.items():
        if not values:
            continue
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.hist(values, bins=40, color="#4472c4")
        if thresholds[name] is not None:
            ax.axvline(thresholds[name], color="#c00000", linestyle="--", label="threshold")
            ax.legend()
        ax.set_title(f"{name} (n={len(values)})")
        fig.tight_layout()
        fig.savefig(output_dir / f"hist_{name}.png", dpi=80)
        plt.close(fig)
        names.append(f"hist_{name}.png")
    return names


def write_report(
    output_dir: Path,
    cfg: CleanDataConfig,
    manifest: dict[str, Any],
    reports: list[dict[str, Any]],
    info: dict[str, Any],
    tracker: Tracker,
) -> list[str]:
    """report.md (counts per reason and shard, throughput per filter, histograms); returns the files written."""
    total = max(1, manifest["records_in"])
    lines = [
        "# clean_data report",
        "",
        (
            f"records in {manifest['records_in']}, kept {manifest['records_kept']} "
            f"({manifest['records_kept'] / total:.1%}), rejected {manifest['records_rejected']}"
        ),
        "",
        "| reason | records | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {reason} | {n} | {n / total:.1%} |" for reason, n in manifest["rejected_by_reason"].items() if n]
    lines += ["", "| shard | in | kept | rejected | error |", "|---|---:|---:|---:|---|"]
    for shard, entry in manifest["per_shard"].items():
        error = (entry["shard_error"] or {}).get("error", "")
        lines.append(
            f"| {shard} | {entry['records_in']} | {entry['records_kept']} | {entry['records_rejected']} | {error} |"
        )
    lines += ["", "| filter | records | seconds | records/s |", "|---|---:|---:|---:|"]
    for name, t in sorted(manifest["timings"].items(), key=lambda kv: -kv[1]["seconds"]):
        rate = t["records"] / t["seconds"] if t["seconds"] > 0 else float("inf")
        lines.append(f"| {name} | {t['records']} | {t['seconds']:.2f} | {rate:.1f} |")
    for name, detail in manifest["filters"].items():
        lines += ["", f"{name}: {json.dumps(detail, sort_keys=True)}"]
    pictures = _histograms(output_dir, cfg, reports, info)
    lines += [""] + [f"![{p}]({p})" for p in pictures]
    text = "\n".join(lines) + "\n"
    (output_dir / "report.md").write_text(text)
    tracker.log_text(text, "clean_data/report.md")
    for picture in pictures:
        tracker.log_artifact(output_dir / picture, artifact_path="clean_data")
    return ["report.md", *pictures]
