"""`qvl runs`: the local runs under a directory with their status, time and headline metrics, and two runs compared.

    qvl runs [ROOT]                    # every ROOT/**/run_summary.json, newest first
    qvl runs --compare RUN_A RUN_B     # each stage's metrics side by side, with B - A

A run is a directory holding `run_summary.json` (pipelines/qvl/local_run.py). The headline metric of a stage is the
first of HEADLINES[stage] its metrics hold; the comparison lists every numeric metric either run has, in DAG order.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components._shared.launch.result import SUMMARY_FILE
from components.stages import DAG_ORDER

HEADLINES = {
    "clean_data": ("records_kept",),
    "extract_features": ("images", "features_written"),
    "pretrain": ("retrieval_r1", "heldout_caption_loss_final"),
    "sft_data": ("kept",),
    "sft": ("vqa_exact_match",),
    "reward_model": ("pair_accuracy",),
    "rl": ("efficacy_gain", "efficacy_final"),
    "distill": ("student_score_ratio",),
    "select_checkpoint": ("selected_stage",),
    "promote": ("model_version", "promoted_weight_bytes"),
}
SHORT = {
    "clean_data": "kept",
    "extract_features": "features",
    "pretrain": "R@1",
    "sft_data": "built",
    "sft": "VQA",
    "reward_model": "pairs",
    "rl": "RL gain",
    "distill": "student",
    "select_checkpoint": "champion",
    "promote": "promoted",
}


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    finished: float  # mtime of its run_summary.json

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        """The summary's stage entries; one that is not a JSON object is shown as unreadable, not a crash."""
        stages = self.summary.get("stages")
        if not isinstance(stages, dict):
            return {}
        unreadable = {"status": "unreadable (not a JSON object)", "metrics": {}}
        return {name: entry if isinstance(entry, dict) else unreadable for name, entry in stages.items()}


def read_run(location: str | Path) -> Run:
    """The run at a run directory or its run_summary.json; a clear error when it is neither."""
    path = Path(location)
    summary_file = path if path.name == SUMMARY_FILE else path / SUMMARY_FILE
    if not summary_file.is_file():
        if (path / "logs").is_dir() and (path / "progress").is_dir():
            raise ValueError(
                f"{location}: a run without a {SUMMARY_FILE} (still running, or stopped before it finished): nothing "
                f"to compare yet; its logs are in {path / 'logs'}."
            )
        raise ValueError(f"{location}: no {SUMMARY_FILE} there; pass a run directory (the --out of `qvl run`).")
    try:
        summary = json.loads(summary_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{summary_file}: not a run summary ({error}); was the run interrupted?") from None
    except RecursionError:  # nested past the parser's depth: no summary qvl writes
        raise ValueError(f"{summary_file}: not a run summary (JSON nested too deep to read).") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{summary_file}: not a run summary (a JSON object with 'stages').")
    if "stages" in summary and not isinstance(summary["stages"], dict):  # would read as a run of no stages
        kind = type(summary["stages"]).__name__
        raise ValueError(f"{summary_file}: not a run summary ('stages' is a {kind}, not an object of stages).")
    return Run(summary_file.parent, summary, summary_file.stat().st_mtime)


def find_runs(root: str | Path) -> list[Run]:
    """Every run under `root` (recursively), newest first; unreadable summaries are listed as such, not skipped, and
    a run directory without a summary (its progress/ and logs/ written, the run still going or killed) as
    `no summary`."""
    runs = []
    for summary_file in Path(root).rglob(SUMMARY_FILE):
        try:
            runs.append(read_run(summary_file))
        except ValueError as error:
            runs.append(Run(summary_file.parent, {"status": "unreadable", "error": str(error)}, 0.0))
    for progress in Path(root).rglob("progress"):
        run_dir = progress.parent
        if progress.is_dir() and (run_dir / "logs").is_dir() and not (run_dir / SUMMARY_FILE).exists():
            status = "no summary (running, or stopped before it finished)"
            runs.append(Run(run_dir, {"status": status}, progress.stat().st_mtime))
    return sorted(runs, key=lambda r: (-r.finished, str(r.path)))


def headline(stage: str, metrics: dict[str, Any] | None) -> str:
    for key in HEADLINES.get(stage, ()):
        if metrics and key in metrics and metrics[key] is not None:
            return _show(metrics[key])
    return "-"


def labelled_headline(stage: str, metrics: dict[str, Any] | None) -> str:
    """`VQA 0.459`: the stage's short label and headline metric, or '' when its metrics hold none."""
    value = headline(stage, metrics)
    return "" if value == "-" else f"{SHORT.get(stage, stage)} {value}"


def _show(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def runs_table(runs: list[Run], root: Path) -> str:
    """One line per run: directory, status, preset, minutes, when it finished, each stage's headline metric."""
    stages = [s for s in DAG_ORDER if any(s in r.stages for r in runs)]
    header = ["run", "status", "preset", "min", "finished", *(SHORT.get(s, s) for s in stages)]
    rows = []
    for r in runs:
        seconds = r.summary.get("seconds")
        rows.append(
            [
                str(r.path.relative_to(root)) if r.path.is_relative_to(root) else str(r.path),
                _cell(r.summary.get("status", "?")),
                _cell(r.summary.get("preset", "?")),
                f"{seconds / 60:.1f}" if isinstance(seconds, (int, float)) else "-",
                time.strftime("%Y-%m-%d %H:%M", time.localtime(r.finished)) if r.finished else "-",
                *(headline(s, r.stages.get(s, {}).get("metrics")) if s in r.stages else "" for s in stages),
            ]
        )
    return _columns([header, *rows])


def _cell(value: Any, width: int = 60) -> str:
    """A summary's own text in a table cell: one line, at most `width` characters (a damaged summary's 100,000-
    character preset would widen every row)."""
    text = " ".join(str(value).split())
    return text if len(text) <= width else f"{text[: width - 3]}..."


def compare(a: Run, b: Run) -> str:
    """Every numeric metric of either run per stage (DAG order): A, B and B - A; status and seconds first."""
    lines = [["stage", "metric", str(a.path), str(b.path), "B - A"]]
    lines.append(["(run)", "status", str(a.summary.get("status")), str(b.summary.get("status")), ""])
    for stage in [s for s in ["preflight", *DAG_ORDER] if s in a.stages or s in b.stages]:
        ra, rb = a.stages.get(stage, {}), b.stages.get(stage, {})
        lines.append([stage, "status", str(ra.get("status", "absent")), str(rb.get("status", "absent")), ""])
        seconds = (ra.get("seconds"), rb.get("seconds"))
        lines.append([stage, "seconds", *(_show(v) if v is not None else "-" for v in seconds), _delta(*seconds)])
        ma, mb = ra.get("metrics") or {}, rb.get("metrics") or {}
        for key in sorted(set(ma) | set(mb)):
            va, vb = ma.get(key), mb.get(key)
            if not any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb)):
                if va != vb and all(isinstance(v, (str, type(None))) for v in (va, vb)):
                    lines.append([stage, key, str(va), str(vb), "changed"])
                continue
            lines.append([stage, key, _show(va) if va is not None else "-", _show(vb) if vb is not None else "-",
                          _delta(va, vb)])  # fmt: skip
    return _columns(lines)


def _delta(va: Any, vb: Any) -> str:
    numbers = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb)]
    if not all(numbers):
        return ""
    return f"{vb - va:+.4g}"


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
